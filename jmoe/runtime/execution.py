"""How a step runs over a residency object; the paths share the engine's layer code.

- all resident: one jitted step (Engine.forward); the signals stay on the device.
- "resident" (offloaded, one jit per step): Engine.forward over what is resident, the selection
  choosing each routed expert's tier inside the step. The host reads the step's routing back; if
  an expert ran below its wanted tier it is fetched and the step replayed (exact), or, in the
  phases the policy lists in degrade_phases, the step is kept and the shortfall counted. A step
  whose experts cannot all be resident at once runs layer-wise.
- "layerwise": the host between each layer's routing and its experts (jmoe/runtime/layerwise.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jmoe.decoding.engine import Engine, attention_meta_jit
from jmoe.runtime.layerwise import LayerPieces, run_layerwise
from jmoe.runtime.residency import AllResident, Offloaded

PATHS = ("layerwise", "resident")


def valid_tokens(start: np.ndarray, key_start: np.ndarray, num_tokens: int) -> np.ndarray:
    """[B * T] bool: which current tokens are real (not left padding)."""
    return ((start[:, None] + np.arange(num_tokens)[None, :]) >= key_start[:, None]).reshape(-1)


class Executor:
    """Runs steps of one loaded model over its residency object."""

    def __init__(self, engine: Engine, graphdef, dense, residency, path: str = "layerwise"):
        self.engine, self.dense, self.residency, self.path = engine, dense, residency, path
        self.pieces = LayerPieces(graphdef, dense) if residency.offloading else None

    def step(self, tokens, cache, start: np.ndarray, key_start: np.ndarray, *, last_only: bool, phase: str,
             residency=None):
        """One forward step over tokens [B, T], row b written from cache slot start[b]: (logits, cache).

        `residency` overrides the model's (a draft running on the same dense weights and cache)."""
        res = residency or self.residency
        start, key_start = np.asarray(start, np.int32), np.asarray(key_start, np.int32)
        res.begin_step(phase)
        try:
            if not res.offloading:
                logits, cache, signals = self.engine.forward(self.dense, res.expert_state(), tokens, cache, start,
                                                             key_start, last_only=last_only, want_importance=False)
                res.observe(signals)
                return logits, cache
            valid = valid_tokens(start, key_start, tokens.shape[1])
            if self.path == "resident":
                return self._one_jit(res, tokens, cache, start, key_start, valid, last_only, phase)
            return self._layerwise(res, tokens, cache, start, key_start, valid, last_only, phase)
        finally:
            res.end_step()

    def _layerwise(self, res: Offloaded, tokens, cache, start, key_start, valid, last_only, phase):
        meta = attention_meta_jit(self.pieces.cfg, tokens.shape[1], jnp.asarray(start), jnp.asarray(key_start))
        return run_layerwise(self.pieces, res, tokens, cache, meta, valid, last_only=last_only, phase=phase)

    def _one_jit(self, res: Offloaded, tokens, cache, start, key_start, valid, last_only, phase):
        want_importance = phase == "prefill" and res.policy.wants_importance
        fetched: set = set()
        # Each replay makes at least one more layer exact (its experts stay pinned), so L + 1 runs
        # suffice for a policy whose wants follow the routing.
        for _ in range(res.cfg.num_moe_layers + 1):
            logits, cache, signals = self.engine.forward(self.dense, res.expert_state(), tokens, cache, start, key_start,
                                                         last_only=last_only, want_importance=want_importance)
            routings = res.read(signals, valid, phase)
            wanted, missing = res.shortfall(routings)
            if not missing:
                res.accept(routings, fetched)
                return logits, cache
            if phase in res.policy.degrade_phases:
                res.accept(routings, fetched, missing)
                return logits, cache
            if not res.fits(wanted):  # this step's experts cannot all be resident together
                return self._layerwise(res, tokens, cache, start, key_start, valid, last_only, phase)
            res.fetch(wanted, missing)
            fetched.update(missing)
            res.stats.replays += 1
        # The wants kept moving (a policy that answers differently each time it is asked): stop
        # chasing them and run the step layer by layer, which fetches as it goes.
        return self._layerwise(res, tokens, cache, start, key_start, valid, last_only, phase)


__all__ = ["PATHS", "Executor", "AllResident", "Offloaded", "valid_tokens"]
