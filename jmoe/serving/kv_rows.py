"""The batch KV cache's rows: a waiting prompt prefilled into a one-row cache of its own, copied into
a slot of the batch cache, rows moved between slots, and the first n rows taken out and put back."""

from __future__ import annotations

from functools import partial

import jax

from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, bucket
from jmoe.runtime.stats import RequestClock
from jmoe.serving.requests import Stream


class Prefill:
    """A waiting request's prompt on its way in: prefilled alone, a chunk per advance() (the chunks
    Decoder.prefill takes), so a long prompt shares the engine's time with the running rows."""

    def __init__(self, model, stream: Stream, context: int):
        prompt = stream.request.prompt
        prompt_len = bucket(len(prompt), MIN_PROMPT_BUCKET, context)
        if prompt_len + 1 > context:  # no room after bucket padding: no padding then
            prompt_len = len(prompt)
        self.stream = stream
        self.clock = RequestClock()  # time to first token counts the prefill
        self.decoder = Decoder(model, [prompt], prompt_len, context)
        self._chunks = self.decoder.prefill_chunks()
        self.logits = None

    @property
    def done(self) -> bool:
        return self.decoder.pos[0] >= self.decoder.prompt_len

    def advance(self) -> int:
        """Prefill the next chunk: its tokens."""
        taken, self.logits = next(self._chunks)
        return taken


@partial(jax.jit, donate_argnums=0)
def insert_row(cache, row_cache, slot):
    """The batch cache with row `slot` replaced by a one-row cache's row."""
    return jax.tree.map(lambda big, one: jax.lax.dynamic_update_index_in_dim(big, one[0], slot, 0), cache, row_cache)


@partial(jax.jit, donate_argnums=0)
def move_row(cache, src, dst):
    """The batch cache with row `dst` replaced by row `src` (compacting live rows to the front)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_update_index_in_dim(
        a, jax.lax.dynamic_index_in_dim(a, src, 0, keepdims=False), dst, 0), cache)


@partial(jax.jit, static_argnums=1)
def take_rows(cache, n):
    """The first n rows of the batch cache."""
    return jax.tree.map(lambda a: a[:n], cache)


@partial(jax.jit, donate_argnums=0)
def put_rows(cache, rows):
    """The batch cache with its first rows replaced by `rows` (what take_rows took, stepped)."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, 0, 0), cache, rows)
