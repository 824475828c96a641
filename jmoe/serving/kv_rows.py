"""The batch KV cache's rows: a waiting prompt prefilled into a one-row cache of its own, copied into
a slot of the batch cache, rows moved between slots (their pages trade places in the page table),
and the first n rows taken out and put back (the pools stay whole)."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, bucket, prefill_chunk
from jmoe.decoding.prefixes import put_block, take_block
from jmoe.runtime.stats import RequestClock
from jmoe.serving.requests import Stream


class Prefill:
    """A waiting request's prompt on its way in: prefilled alone, a chunk per advance() (the chunks
    Decoder.prefill takes), so a long prompt shares the engine's time with the running rows.

    With the model's prefix store (jmoe/decoding/prefixes.py), the first advance() copies in the
    kept blocks the prompt starts with and prefills only the rest; once all in, the prompt's blocks
    are kept for later prompts."""

    def __init__(self, model, stream: Stream, context: int):
        prompt = stream.request.prompt
        prompt_len = bucket(len(prompt), MIN_PROMPT_BUCKET, context)
        if prompt_len + 1 > context:  # no room after bucket padding: no padding then
            prompt_len = len(prompt)
        self.stream = stream
        self.clock = RequestClock()  # time to first token counts the prefill
        self.decoder = Decoder(model, [prompt], prompt_len, context)
        self.prefixes = model.prefixes
        self._chunks = None  # started by the first advance(): a prefix kept meanwhile is found
        self.logits = None

    @property
    def done(self) -> bool:
        return self.decoder.pos[0] >= self.decoder.prompt_len

    def advance(self) -> int:
        """Prefill the next chunk: its tokens."""
        if self._chunks is None:
            self._chunks = self.decoder.prefill_chunks(self._reuse_prefix() if self.prefixes else 0)
        taken, self.logits = next(self._chunks)
        if self.done and self.prefixes:
            self._keep_prefix()
        return taken

    def _reuse_prefix(self) -> int:
        """Copy in the kept blocks the prompt starts with: the slot prefilling starts from. The
        rest is prefilled in the chunk shapes a prompt of its length gets (a few of the copied
        slots before it may be computed again)."""
        prompt, decoder, store = self.stream.request.prompt, self.decoder, self.prefixes
        blocks = store.lookup(prompt)
        pad, total = int(decoder.key_start[0]), decoder.prompt_len
        chunk = min(total, prefill_chunk(1))
        rest = total - (pad + len(blocks) * store.block)
        span = bucket(rest, MIN_PROMPT_BUCKET, chunk) if rest <= chunk else -(-rest // chunk) * chunk
        if not blocks or span > total:  # nothing kept, or the rest's chunks would not fit: no reuse
            store.count(len(prompt), 0)
            return 0
        for j, block in enumerate(blocks):
            decoder.cache = put_block(decoder.cache, block, np.int32(pad + j * store.block))
        store.count(len(prompt), len(blocks))
        return total - span

    def _keep_prefix(self) -> None:
        decoder, store = self.decoder, self.prefixes
        pad = int(decoder.key_start[0])
        store.keep(self.stream.request.prompt,
                   lambda j: take_block(decoder.cache, np.int32(pad + j * store.block), store.block))


@partial(jax.jit, donate_argnums=0)
def insert_row(cache, row_cache, slot):
    """The batch cache with row `slot`'s pages holding a one-row cache's (as many pages a row)."""
    pages, row_pages = cache.table[slot], row_cache.table[0]
    layers = jax.tree.map(lambda big, one: big.at[pages].set(one[row_pages]), cache.layers, row_cache.layers)
    return cache._replace(layers=layers)


@jax.jit
def move_row(cache, src, dst):
    """The batch cache with row `dst` seeing row `src`'s slots (compacting live rows to the front):
    the two rows' pages trade places in the page table; no slot moves."""
    table = cache.table
    return cache._replace(table=table.at[dst].set(table[src]).at[src].set(table[dst]))


def take_rows(cache, n: int):
    """The first n rows of the batch cache: its pools whole, the first n rows of its table (a step
    writes only its rows' pages)."""
    return cache._replace(table=cache.table[:n])


def put_rows(cache, rows):
    """The batch cache after a step over what take_rows took: that step's pools, the whole table."""
    return cache._replace(layers=rows.layers)
