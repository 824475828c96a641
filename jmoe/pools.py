"""Device pools of expert weights and the handle table that points into them.

Each tier has one slab [slots, ...] (the tier's ExpertWeights with a leading slots axis). The
handle table [L_moe, E] holds (tier code, slot) of the version the forward pass reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.expert_path import ExpertState
from jmoe.quant import ExpertWeights
from jmoe.store import ExpertStore
from jmoe.tiers import TIER_CODES


def pool_template(store: ExpertStore, tier: str, slots: int) -> ExpertWeights:
    """Shapes of a pool of `slots` expert versions at `tier`."""
    one = store.template(tier)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((slots, *s.shape), s.dtype), one)


class ResidentExperts:
    """Every expert resident on the device at one tier: no transfers after load."""

    def __init__(self, store: ExpertStore, tier: str, device=None):
        L, E = store.num_layers, store.num_experts
        host = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), pool_template(store, tier, L * E))
        for layer in range(L):
            for expert in range(E):
                record = store.record(tier, layer, expert)
                for dst, src in zip(jax.tree.leaves(host), jax.tree.leaves(record), strict=True):
                    dst[layer * E + expert] = src
        device = device or jax.devices()[0]
        self.tier = tier
        self.pool = jax.device_put(host, device)
        self._state = ExpertState(
            tier=jax.device_put(np.full((L, E), TIER_CODES[tier], np.int32), device),
            slot=jax.device_put(np.arange(L * E, dtype=np.int32).reshape(L, E), device),
            pools={tier: self.pool},
        )

    def begin_step(self) -> ExpertState:
        return self._state

    def end_step(self, signals) -> None:
        pass

    def device_nbytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.pool)))
