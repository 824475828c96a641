"""Device pools of expert weights.

Each tier has one preallocated slab [slots, ...] (the tier's ExpertWeights with a leading slots
axis). A slot is filled from one transferred record (the bytes of one expert version) by a jitted,
donated update that reinterprets the record's byte ranges as the slab's arrays, in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.errors import BudgetError
from jmoe.format import RecordLayout, np_dtype
from jmoe.quant import ExpertWeights
from jmoe.runtime.budget import format_size, tree_nbytes
from jmoe.runtime.host_memory import aligned_empty
from jmoe.runtime.store import ExpertStore


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
        # zeros made on the device and committed to it, as every later slot write leaves them: a
        # step compiled before the first write is then reused after it
        zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)  # noqa: E731
        self.arrays = jax.jit(zeros, out_shardings=jax.sharding.SingleDeviceSharding(device))()

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_nbytes

    def write(self, slot: int, record: jax.Array) -> jax.Array:
        """Copy a device record into `slot` (asynchronously); returns the write's completion marker."""
        self.arrays, done = write_slot(self.arrays, jnp.int32(slot), record, layout=self.layout)
        return done


def resident_pool(store: ExpertStore, tier: str, device) -> ExpertWeights:
    """A pool holding every expert at `tier`, expert (layer, e) in slot layer * E + e.

    Built one array at a time: each is read from the files straight into an aligned host buffer,
    which jax takes without a copy on the CPU (so the pool is the only copy of these weights) and
    copies out of on an accelerator (so the host holds at most one array of the pool at a time).
    """
    L, E = store.num_layers, store.num_experts
    leaves, treedef = jax.tree.flatten(pool_template(store, tier, L * E))
    arrays = []
    for index, spec in enumerate(leaves):
        host = aligned_empty(spec.shape, spec.dtype)
        for layer in range(L):
            store.read_leaf(tier, layer, index, host[layer * E : (layer + 1) * E])
        arrays.append(jax.device_put(host, device))
        del host  # on an accelerator, freed once copied out
    return treedef.unflatten(arrays)


STAGING_TRANSFERS_PER_TOP_K = 2  # transfers in flight at once: two tokens' worth of one layer's experts


def staging_nbytes(store: ExpertStore, tiers) -> int:
    """Device bytes reserved for transfers in flight when offloading with pools at `tiers`."""
    return STAGING_TRANSFERS_PER_TOP_K * store.config.top_k * max(store.record_nbytes(t) for t in tiers)


@dataclass(frozen=True)
class PoolPlan:
    slots: dict[str, int]  # tier -> slots of its pool
    slot_nbytes: dict[str, int]
    staging_nbytes: int

    @property
    def nbytes(self) -> int:
        return sum(self.slots[t] * self.slot_nbytes[t] for t in self.slots)


def plan_pools(store: ExpertStore, policy, fixed: int, budget: int | None,
               staging_transfers: int | None = None) -> PoolPlan:
    """Size one pool per tier from what the budget leaves after the fixed reservations.

    The policy may size its pools itself (Policy.size_pools); otherwise each tier gets its share of
    that remainder. A pool must hold at least one token's experts of one layer (top_k slots);
    staging is sized for `staging_transfers` of the largest record (default: staging_nbytes). With
    no budget every pool can hold every expert unless the policy says otherwise.
    """
    cfg = store.config
    shares = policy.pools()
    per_slot = {t: slot_nbytes(store, t) for t in shares}
    staging = staging_nbytes(store, shares) if staging_transfers is None else \
        staging_transfers * max(store.record_nbytes(t) for t in shares)
    total_experts = cfg.num_moe_layers * cfg.num_experts
    left = None if budget is None else max(0, budget - fixed - staging)
    slots = policy.size_pools(left, per_slot, cfg.num_moe_layers, cfg.num_experts)
    if slots is None:
        slots = {t: total_experts if left is None else int(left * share // per_slot[t]) for t, share in shares.items()}
    slots = {t: min(total_experts, n) for t, n in slots.items()}
    if budget is not None and sum(n * per_slot[t] for t, n in slots.items()) > left:
        raise BudgetError(f"policy {policy.name!r} sized its pools beyond the device budget")
    if any(n < cfg.top_k for n in slots.values()):
        need = max(-(-cfg.top_k * per_slot[t] // share) for t, share in shares.items())
        pools = ", ".join(f"{cfg.top_k} experts x {format_size(per_slot[t])} at {t}" for t in shares)
        raise BudgetError(
            f"device budget {format_size(budget)} cannot hold the dense weights, KV cache and one layer's "
            f"working set: needs at least {format_size(fixed + staging + int(need))} ({format_size(fixed)} fixed + "
            f"{format_size(staging)} transfer staging + {pools})"
        )
    return PoolPlan(slots, per_slot, staging)
