"""A batch's KV cache and per-row cache positions, over a model's step: prefill, decode, verify.

Prompts are left-padded to a common length, so every row starts real tokens at its own slot
(`key_start`). After prefill each row has its own position: `decode` writes one token per row at
it and advances, `verify` writes T tokens per row in one pass and returns the logits of each
without advancing, and `advance(n)` moves rows by different amounts (a row that accepted fewer
speculative tokens simply advances less; what verify wrote beyond a row's position is masked
out of attention and overwritten by the next step). `residency` runs a step over other experts,
e.g. a low-precision draft sharing the dense weights and this cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.decoding.engine import new_cache, prefill_chunk
from jmoe.errors import InputError


class Decoder:
    """pool, table: run in a shared pool of pages (jmoe/serving/kv_pages.py) through `table`
    [B, row pages] (numpy; the pages the rows hold), instead of a cache of the decoder's own."""

    def __init__(self, model, prompts: list[list[int]], prompt_len: int, cache_len: int, pool=None, table=None):
        cfg = model.config
        self.model = model
        self.batch = len(prompts)
        self.prompt_len, self.cache_len = prompt_len, cache_len
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.prompt = np.full((self.batch, prompt_len), pad, np.int32)
        for b, p in enumerate(prompts):
            self.prompt[b, prompt_len - len(p):] = p
        self.key_start = np.asarray([prompt_len - len(p) for p in prompts], np.int32)
        self.pos = np.zeros(self.batch, np.int32)  # cache slot the next token of each row goes to
        self.pool = pool
        if pool is None:
            # committed where every later cache is (a jitted step's output), so a cache a shared prefix
            # was copied into (jmoe/serving/kv_rows.py) runs the executables a fresh one does
            self._cache = jax.device_put(new_cache(cfg, self.batch, cache_len, model.kv_dtype),
                                         model.placement.replicated)
            model.count(executions=1, phase="prefill")
        else:
            self._table = pool.put_table(table)
        self.unsettled: list = []  # deferred steps, oldest first (None: a step that needs no settling)

    @property
    def cache(self):
        return self._cache if self.pool is None else self.pool.view(self._table)

    @cache.setter
    def cache(self, cache) -> None:
        if self.pool is None:
            self._cache = cache
        else:  # a step's output: the pool's arrays and this decoder's table (a step takes both)
            self.pool.layers, self._table = cache.layers, cache.table

    def step(self, tokens, *, last_only: bool = False, phase: str = "decode", residency=None, defer: bool = False):
        """Run tokens [B, T] from each row's position (not advancing): logits [B, T or 1, V]. Tokens [B]
        (one per row) give logits [B, V].

        With `defer` the step is left unsettled (see jmoe/runtime/execution.py): settle() it, or
        take it back with rewind_last(), before relying on what it produced."""
        if not defer and self.unsettled:
            raise RuntimeError("settle() the deferred steps first")
        T = 1 if tokens.ndim == 1 else tokens.shape[1]
        if int(self.pos.max()) + T > self.cache_len:
            raise InputError(f"{T} more tokens do not fit the {self.cache_len}-slot cache (rows at {self.pos.tolist()})")
        logits, self.cache, pending = self.model.step(tokens, self.cache, self.pos, self.key_start,
                                                      last_only=last_only, phase=phase, residency=residency,
                                                      defer=True)
        if not defer:
            return self._settled(pending, logits)
        self.unsettled.append(pending)
        return logits

    def _settled(self, pending, logits):
        if pending is None:
            return logits
        corrected, self.cache = self.model.settle(pending, self.cache)
        return logits if corrected is None else corrected

    def settle(self):
        """Settle the oldest deferred step: None if its logits stand, else the corrected ones."""
        pending = self.unsettled.pop(0)
        return None if pending is None else self._settled(pending, None)

    def rewind_last(self, tokens: int = 1) -> None:
        """Take back the newest deferred step (its output is not to be used) and its advance."""
        self.model.discard(self.unsettled.pop())
        self.advance(-tokens)

    def decode_sampled(self, tokens, sampler):
        """One token per row [B] (on the device) at each row's position, drawing the next ones in
        the same step; then advance. Returns the next tokens [B] on the device; settle_sampled()
        reads them, a step later."""
        if int(self.pos.max()) + 1 > self.cache_len:
            raise InputError(f"1 more token does not fit the {self.cache_len}-slot cache (rows at {self.pos.tolist()})")
        nxt, self.cache, step = self.model.decode_sampled(tokens, self.cache, self.pos, self.key_start, sampler)
        self.unsettled.append(step)
        self.advance(1)
        return nxt

    def speculate(self, last, sampler, k: int, draft):
        """A speculative cycle from each row's last token [B] (on the device): `draft` decodes k
        tokens per row, the model verifies them (jmoe/decoding/speculative.py). Not advancing; settle
        it with settle_cycle()."""
        if int(self.pos.max()) + k + 1 > self.cache_len:
            raise InputError(f"{k + 1} more tokens do not fit the {self.cache_len}-slot cache")
        self.cache, cycle = self.model.speculate(last, self.cache, self.pos, self.key_start, sampler, k, draft)
        return cycle

    def settle_cycle(self, cycle, sampler):
        """(accepted drafts [B], the target's next tokens [B], the drafts [B, k], the next tokens on
        the device) of a speculative cycle."""
        accepted, nxt, drafts, on_device, self.cache = self.model.settle_cycle(cycle, self.cache, sampler)
        return accepted, nxt, drafts, on_device

    def settle_sampled(self, sampler) -> tuple[np.ndarray, bool]:
        """The oldest decode_sampled step's tokens [B] (numpy) and whether they were drawn again
        (the step was run again: its successor must be taken back)."""
        tokens, redrawn, self.cache = self.model.settle_sampled(self.unsettled.pop(0), self.cache, sampler)
        return tokens, redrawn

    def advance(self, n) -> None:
        """Move every row by n tokens (an int, or one count per row; negative rewinds)."""
        self.pos = self.pos + np.broadcast_to(np.asarray(n, np.int32), self.pos.shape)
        if (self.pos < self.key_start).any():
            raise InputError("a row cannot move back into its prompt padding")

    def prefill_chunks(self, first: int = 0):
        """The prompts, in chunks of prefill_chunk(rows) tokens per row, one per iteration: yields (tokens
        taken in, logits of each row's last token so far [B, V]); a caller may interleave other work.
        first: the slot to start from (the slots before it already hold the prompts' keys and values:
        a shared prefix copied in, jmoe/decoding/prefixes.py)."""
        self.pos = np.full_like(self.pos, first)
        chunk = min(self.prompt_len - first, prefill_chunk(self.prompt.shape[0]))
        for start in range(first, self.prompt_len, chunk):
            logits = self.step(self.model.put(self.prompt[:, start:start + chunk], "prefill"), last_only=True, phase="prefill")
            taken = min(chunk, self.prompt_len - start)
            # a new array, not advance(): a short row's prompt may start past this chunk; never in place:
            # the CPU's device_put may alias a numpy array that a dispatched step has yet to read
            self.pos = np.full_like(self.pos, start + taken)
            self.model.count(executions=1)
            yield taken, logits[:, -1]

    def prefill(self, first: int = 0) -> jnp.ndarray:
        """The whole prompts (from slot `first`, as prefill_chunks): logits of each row's last token [B, V]."""
        for _, logits in self.prefill_chunks(first):
            pass
        return logits

    def decode(self, tokens, *, residency=None, defer: bool = False) -> jnp.ndarray:
        """One token per row [B] at each row's position, then advance: logits [B, V]."""
        logits = self.step(tokens, last_only=True, residency=residency, defer=defer)
        self.advance(1)
        return logits

    def verify(self, tokens, *, residency=None) -> jnp.ndarray:
        """T tokens per row [B, T] in one pass, not advancing: the logits after each [B, T, V]. The
        step's phase is "verify": its experts are grouped, each read once (jmoe/layers/experts.py)."""
        return self.step(tokens, last_only=False, phase="verify", residency=residency)
