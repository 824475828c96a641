"""Routed experts over an `ep` mesh axis, inside the jitted step.

Every device routes every token (routing, selection and tier resolution are replicated and cheap);
each `ep` shard then runs only the assignments whose expert it owns, reading its own part of each
tier's pool, and one psum over `ep` per layer adds the shards' partial sums. Handle tables hold
global slots (shard * slots_per_shard + local); a shard subtracts its own offset.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmoe.distributed.mesh import EP, ExpertParallel

def shard_offset_slots(slots: jax.Array, shard, pool) -> jax.Array:
    """Global slot table -> this shard's local slots (a negative entry, not resident, stays; other
    shards' slots are masked by the caller)."""
    local_slots = jax.tree.leaves(pool)[0].shape[0]
    return jnp.where(slots < 0, slots, slots - shard * local_slots)


def expert_parallel_sum(ep: ExpertParallel, local_sum: Callable, h, ids, weights, chosen, token_valid,
                        slots: dict, pools: dict) -> jax.Array:
    """sum over shards of local_sum(h, ids, weights, chosen, token_valid, local slots, local pools)
    where each shard keeps only the assignments of its own experts (chosen = 0 elsewhere).

    local_sum returns float32 [N, D]; so does this (the psum adds float32 partials)."""
    num_experts = next(iter(slots.values())).shape[0]
    per_shard = num_experts // ep.shards

    def body(h, ids, weights, chosen, token_valid, slots, pools):
        shard = jax.lax.axis_index(EP)
        chosen = jnp.where(ids // per_shard == shard, chosen, 0)
        local = {t: shard_offset_slots(s, shard, pools[t]) for t, s in slots.items()}
        return jax.lax.psum(local_sum(h, ids, weights, chosen, token_valid, local, pools), EP)

    replicated = P()
    specs = (replicated,) * 5 + ({t: replicated for t in slots}, {t: P(EP) for t in pools})
    # check_vma off: the native CPU kernels are foreign calls whose replication jax cannot infer
    return jax.shard_map(body, mesh=ep.mesh, in_specs=specs, out_specs=replicated, check_vma=False)(
        h, ids, weights, chosen, token_valid, slots, pools)
