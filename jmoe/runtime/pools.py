"""Device pools of expert weights.

Each tier has one preallocated slab [slots, ...] (the tier's ExpertWeights with a leading slots
axis). A slot is filled from one transferred record (the bytes of one expert version) by a jitted,
donated update that reinterprets the record's byte ranges as the slab's arrays, in place.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.format import RecordLayout, np_dtype
from jmoe.layers.experts import ExpertState
from jmoe.quant import ExpertWeights
from jmoe.runtime.budget import tree_nbytes
from jmoe.runtime.stats import Stats
from jmoe.runtime.store import ExpertStore
from jmoe.tiers import TIER_CODES


def pool_template(store: ExpertStore, tier: str, slots: int) -> ExpertWeights:
    """Shapes of a pool of `slots` expert versions at `tier`."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((slots, *s.shape), s.dtype), store.template(tier))


def slot_nbytes(store: ExpertStore, tier: str) -> int:
    """Device bytes one slot takes (the record minus its alignment padding)."""
    return tree_nbytes(store.template(tier))


def _from_bytes(segment, dtype, shape):
    """uint8 [n] -> array of `dtype` and `shape` with the same bytes."""
    itemsize = np.dtype(dtype).itemsize
    if itemsize > 1:
        segment = segment.reshape(-1, itemsize)
    return jax.lax.bitcast_convert_type(segment, dtype).reshape(shape)


@partial(jax.jit, static_argnames=("layout",), donate_argnums=(0,))
def write_slot(pool, slot, record, *, layout: RecordLayout):
    """pool with slot `slot` overwritten by `record` (uint8 [layout.nbytes]); also returns a scalar
    that is ready only once the write has happened."""
    leaves, treedef = jax.tree.flatten(pool)
    written = []
    for leaf, spec in zip(leaves, layout.leaves, strict=True):
        value = _from_bytes(record[spec.offset : spec.offset + spec.nbytes], np_dtype(spec.dtype), spec.shape)
        written.append(jax.lax.dynamic_update_index_in_dim(leaf, value.astype(leaf.dtype), slot, 0))
    done = written[0][slot].reshape(-1)[0].astype(jnp.float32)
    return treedef.unflatten(written), done


class TierPool:
    """One tier's device slab and what is needed to fill its slots from records."""

    def __init__(self, store: ExpertStore, tier: str, slots: int, device):
        self.tier = tier
        self.slots = slots
        self.layout = store.layouts[tier]
        self.slot_nbytes = slot_nbytes(store, tier)
        template = pool_template(store, tier, slots)
        with jax.default_device(device):
            self.arrays = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_nbytes

    def write(self, slot: int, record: jax.Array) -> jax.Array:
        """Copy a device record into `slot` (asynchronously); returns the write's completion marker."""
        self.arrays, done = write_slot(self.arrays, jnp.int32(slot), record, layout=self.layout)
        return done


class ResidentExperts:
    """Every expert resident on the device at one tier: no transfers after load."""

    def __init__(self, store: ExpertStore, tier: str, device=None, backend: str | None = None):
        L, E = store.num_layers, store.num_experts
        host = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), pool_template(store, tier, L * E))
        for layer in range(L):
            for expert in range(E):
                record = store.record(tier, layer, expert)
                for dst, src in zip(jax.tree.leaves(host), jax.tree.leaves(record), strict=True):
                    dst[layer * E + expert] = src
        device = device or jax.devices()[0]
        self.tier = tier
        self.stats = Stats()
        self.pool = jax.device_put(host, device)
        self._state = ExpertState(
            tier=jax.device_put(np.full((L, E), TIER_CODES[tier], np.int32), device),
            slot=jax.device_put(np.arange(L * E, dtype=np.int32).reshape(L, E), device),
            pools={tier: self.pool},
            backend=backend,
        )

    def step(self, engine, dense, tokens, cache, write_start, key_start, *, last_only: bool, phase: str):
        """Everything is resident: one jitted forward, nothing to fetch."""
        self.stats.steps += 1
        logits, cache, _ = engine.forward(dense, self._state, tokens, cache, write_start, key_start,
                                          last_only=last_only, want_importance=False)
        return logits, cache

    def expert_state(self) -> ExpertState:
        return self._state

    def reset_stats(self) -> None:
        self.stats = Stats()

    def device_nbytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.pool)))
