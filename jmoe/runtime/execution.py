"""How a step runs over a residency object; the paths share the engine's layer code.

- all resident: one jitted step (Engine.forward); the signals stay on the device.
- "resident" (offloaded, one jit per step): Engine.forward over what is resident, the selection
  choosing each routed expert's tier inside the step. The host reads the step's routing back; if
  an expert ran below its wanted tier it is fetched and the step replayed (exact), or, in the
  phases the policy lists in degrade_phases, the step is kept and the shortfall counted. A step
  whose experts cannot all be resident at once runs layer-wise.
- "layerwise": the host between each layer's routing and its experts (jmoe/runtime/layerwise.py).
- "auto" (the default): the one-jit step while it finds what it needs; a step that lacked an
  expert is run again layer-wise (exact, fetching as it goes), and steps stay layer-wise until one
  finds every expert resident.

A one-jit step can be settled later (`defer`): the caller samples from its logits and does its
own host work while the device computes, then `settle` reads the routing back, keeps the books
and, if an expert was missing, runs the step again and returns the corrected logits. Generation
settles each decode step after handing out the previous token, so with every expert resident the
device never waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.decoding.engine import Engine, attention_meta_jit
from jmoe.layers.transformer import StepSignals
from jmoe.runtime.kernel_fallback import with_kernel_fallback
from jmoe.runtime.layerwise import LayerPieces, run_layerwise
from jmoe.runtime.residency import Offloaded

PATHS = ("auto", "layerwise", "resident")


def valid_tokens(start: np.ndarray, key_start: np.ndarray, num_tokens: int) -> np.ndarray:
    """[B * T] bool: which current tokens are real (not left padding)."""
    if num_tokens == 1:
        return start >= key_start
    return ((start[:, None] + np.arange(num_tokens)[None, :]) >= key_start[:, None]).reshape(-1)


@dataclass
class Pending:
    """A dispatched one-jit step whose routing has not been read back yet."""

    res: Offloaded
    tokens: object
    start: np.ndarray
    key_start: np.ndarray
    valid: np.ndarray
    last_only: bool
    phase: str
    signals: StepSignals


class Executor:
    """Runs steps of one loaded model over its residency object (see the module docstring)."""

    def __init__(self, engine: Engine, graphdef, dense, residency, path: str = "auto"):
        self.engine, self.residency, self.path = engine, residency, path
        self.dense = nnx.to_pure_dict(dense)  # a plain dict: cheaper to pass to the jitted step than nnx's State
        self.pieces = LayerPieces(graphdef, dense) if residency.offloading else None
        self.careful = False  # "auto": run layer-wise until a step finds every expert resident

    def step(self, tokens, cache, start, key_start, *, last_only: bool, phase: str, residency=None,
             defer: bool = False):
        """One forward step over tokens [B, T], row b written from cache slot start[b].

        Returns (logits, cache, pending): pending is None once the step is final, else a Pending
        to pass to settle() (only with defer=True). `residency` overrides the model's (a draft
        running on the same dense weights and cache)."""
        res = residency or self.residency
        start, key_start = np.asarray(start, np.int32), np.asarray(key_start, np.int32)
        res.begin_step(phase, tokens.size)
        try:
            if not res.offloading:
                logits, cache, signals = with_kernel_fallback(self.kernel_users(res), lambda: self.engine.forward(
                    self.dense, res.expert_state().for_phase(phase), tokens, cache, start, key_start,
                    last_only=last_only, want_importance=False))
                res.observe(signals, valid_tokens(start, key_start, 1 if tokens.ndim == 1 else tokens.shape[1]))
                return logits, cache, None
            valid = valid_tokens(start, key_start, 1 if tokens.ndim == 1 else tokens.shape[1])
            if self.path == "layerwise" or (self.path == "auto" and self.careful):
                res.catch_up()
                return (*self._layerwise(res, tokens, cache, start, key_start, valid, last_only, phase), None)
            logits, cache, signals = self._forward(res, tokens, cache, start, key_start, last_only, phase)
            pending = Pending(res, tokens, start, key_start, valid, last_only, phase, signals)
            if defer:
                return logits, cache, pending
            replayed, cache = self._settle(pending, cache, defer_books=False)
            return (logits if replayed is None else replayed), cache, None
        finally:
            res.end_step()

    def settle(self, pending: Pending, cache):
        """Read a deferred step's routing back: (None, cache) if it stands, else (its logits run
        again with what it lacked, cache)."""
        try:
            return self._settle(pending, cache)
        finally:
            pending.res.end_step()

    def _forward(self, res: Offloaded, tokens, cache, start, key_start, last_only, phase):
        want_importance = phase == "prefill" and res.policy.wants_importance
        return with_kernel_fallback(self.kernel_users(res), lambda: self.engine.forward(
            self.dense, res.expert_state().for_phase(phase), tokens, cache, start, key_start, last_only=last_only,
            want_importance=want_importance))

    def kernel_users(self, res) -> list:
        """The residencies whose kernels a failure to compile switches to the XLA path: the step's and the model's."""
        return [res] if res is self.residency else [res, self.residency]

    def _settle(self, p: Pending, cache, *, defer_books: bool = True):
        res = p.res
        res.synced()
        summary = np.asarray(p.signals.per_expert)  # [3, L, E]: tokens, wanted, chosen per expert; one small read
        res.last_routed = summary[0] > 0
        if not ((summary[0] > 0) & (summary[2] < summary[1])).any():  # the common case: nothing ran short
            if defer_books:
                res.defer_books(p.signals, summary, p.valid, p.phase)
            else:
                res.catch_up()
                res.accept(res.read(p.signals, p.valid, p.phase, sync=False), set())
            return None, cache
        res.catch_up()
        routings = res.read(p.signals, p.valid, p.phase, sync=False)
        wanted, missing = res.shortfall(routings)
        if not missing or p.phase in res.policy.degrade_phases:
            res.accept(routings, set(), missing)
            return None, cache
        if self.path == "auto":
            self.careful = True
            res.stats.replays += 1
            return self._layerwise(res, p.tokens, cache, p.start, p.key_start, p.valid, p.last_only, p.phase)
        return self._replay(p, cache, routings, wanted, missing)

    def _replay(self, p: Pending, cache, routings, wanted, missing):
        """Fetch what the step lacked and run it again until it lacks nothing. Each replay makes at
        least one more layer exact (its experts stay pinned), so L + 1 runs suffice for a policy
        whose wants follow the routing."""
        res, fetched = p.res, set()
        for _ in range(res.cfg.num_moe_layers):
            if not res.fits(wanted):  # this step's experts cannot all be resident together
                break
            res.fetch(wanted, missing)
            fetched.update(missing)
            res.stats.replays += 1
            logits, cache, signals = self._forward(res, p.tokens, cache, p.start, p.key_start, p.last_only, p.phase)
            routings = res.read(signals, p.valid, p.phase)
            wanted, missing = res.shortfall(routings)
            if not missing:
                res.accept(routings, fetched)
                return logits, cache
        # Too many experts for the pools at once, or wants that keep moving (a policy answering
        # differently each time it is asked): run the step layer by layer, which fetches as it goes.
        return self._layerwise(res, p.tokens, cache, p.start, p.key_start, p.valid, p.last_only, p.phase)

    def _layerwise(self, res: Offloaded, tokens, cache, start, key_start, valid, last_only, phase):
        before = res.stats.misses + res.stats.late + res.stats.cpu_runs
        one = tokens.ndim == 1  # one token per row: logits come back [B, V] as from the one-jit step
        tokens = tokens[:, None] if one else tokens
        meta = attention_meta_jit(self.pieces.cfg, tokens.shape[1], jnp.asarray(start), jnp.asarray(key_start))
        logits, cache = run_layerwise(self.pieces, res, tokens, cache, meta, valid, last_only=last_only, phase=phase)
        if res.stats.misses + res.stats.late + res.stats.cpu_runs == before:
            self.careful = False  # every expert was resident: the next step may run in one jit
        return (logits[:, 0] if one else logits), cache


__all__ = ["PATHS", "Executor", "Pending", "valid_tokens"]
