"""A waiting prompt on its way into the batch: prefilled alone, in chunks, into pages of the
engine's pool (jmoe/serving/kv_pages.py) that its row then keeps, sharing those of the kept
prompt blocks it starts with (jmoe/serving/kv_prefixes.py)."""

from __future__ import annotations

import numpy as np

from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, bucket
from jmoe.runtime.stats import RequestClock
from jmoe.serving.requests import Stream


def prompt_geometry(prompt_tokens: int, context: int) -> tuple[int, int]:
    """(slots a prompt of this many tokens is prefilled into, its first real slot): its length
    bucketed (left padding) so that few prefill shapes compile, unbucketed where that leaves no room."""
    prompt_len = bucket(prompt_tokens, MIN_PROMPT_BUCKET, context)
    if prompt_len + 1 > context:  # no room after bucket padding: no padding then
        prompt_len = prompt_tokens
    return prompt_len, prompt_len - prompt_tokens


class Prefill:
    """A waiting request's prompt on its way in: prefilled alone, a chunk per advance() (the chunks
    Decoder.prefill takes), so a long prompt shares the engine's time with the running rows. Its
    keys and values go straight into pages of the engine's pool (`table`), which the row keeps when
    it starts. Admission promised it `reserved` pages (those of its real tokens, padded placement);
    the first advance() takes the pages it needs and gives the promise back.

    With the engine's prefix store (`prefixes`, jmoe/serving/kv_prefixes.py), the first advance()
    looks the prompt up: where it starts with kept blocks, the prompt is placed from slot 0 on
    their pages and only the rest is prefilled. Looking up there, not at admission, lets a prompt
    admitted while its prefix is still being prefilled find it. Once all in, the prompt's blocks
    are kept for later prompts. `resumed`: a row taken off its slot to free pages, whose prompt is
    its request's and the tokens it had generated (all but the last, which its next step takes)."""

    def __init__(self, model, stream: Stream, context: int, pool, table: np.ndarray, prompt: list[int],
                 resumed=None, prefixes=None, reserved: int = 0):
        self.stream, self.table, self.resumed = stream, table, resumed
        self.model, self.context, self.pool = model, context, pool
        self.prompt = prompt
        self.clock = RequestClock() if resumed is None else resumed.clock  # time to first token counts the prefill
        self.prefixes, self.reserved = prefixes, reserved
        self.decoder = None  # made by the first advance(), once the prompt's pages are known
        self._chunks = None
        self.logits = None

    @property
    def done(self) -> bool:
        return self.decoder is not None and self.decoder.pos[0] >= self.decoder.prompt_len

    def advance(self) -> int:
        """Prefill the next chunk: its tokens."""
        if self._chunks is None:
            self._chunks = self.decoder_chunks()
        taken, self.logits = next(self._chunks)
        if self.done and self.prefixes is not None:
            self.prefixes.keep(self.prompt, self.table[0], int(self.decoder.key_start[0]))
        return taken

    def decoder_chunks(self):
        """Take the prompt's pages (sharing kept ones) for the promised ones, and start its prefill."""
        self.pool.unreserve(self.reserved)
        self.reserved = 0
        first = self.prefixes.place(self.prompt, self.table[0]) if self.prefixes is not None else 0
        if first:  # placed from slot 0, on kept pages: no padding
            prompt_len = len(self.prompt)
        else:
            prompt_len, key_start = prompt_geometry(len(self.prompt), self.context)
            if not self.pool.take(self.table[0], key_start, prompt_len):
                raise RuntimeError("a prompt found fewer pages than it was promised")
        self.decoder = Decoder(self.model, [self.prompt], prompt_len, self.context, self.pool, self.table)
        return self.decoder.prefill_chunks(first)

    def release(self) -> None:
        """Its pages, and its promise, back to the pool."""
        self.pool.release(self.table[0])
        self.pool.unreserve(self.reserved)
        self.reserved = 0
