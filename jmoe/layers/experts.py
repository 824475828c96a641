"""Routed experts through the handle table.

Experts are not model parameters: each tier has one device pool [slots, ...] and the handle table
[L, E] -> (tier code, slot) says which version the forward pass reads. This module turns a layer's
routing (top-k ids and weights) into per-tier grouped expert FFN calls and combines the results.
Changing residency changes pool contents and the table, never shapes: nothing recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.quant import ExpertWeights
from jmoe.tiers import TIER_CODES
from pallas_kernels import expert_ffn

# Up to this many (token, expert) assignments per layer, every assignment gets its own weight
# read (decode); above it, assignments are sorted by slot into row blocks (prefill).
GATHER_MAX_ASSIGNMENTS = 64
PREFILL_BLOCK_ROWS = 32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerExperts:
    tier: jax.Array  # [E] int32 tier code per expert (0 = skipped)
    slot: jax.Array  # [E] int32 slot in that tier's pool
    pools: dict[str, ExpertWeights]
    backend: str | None = field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertState:
    """What the jitted forward reads to reach experts: the handle table, the pools, and (static)
    which kernel backend multiplies them (None = the platform default)."""

    tier: jax.Array  # [L_moe, E] int32
    slot: jax.Array  # [L_moe, E] int32
    pools: dict[str, ExpertWeights]
    backend: str | None = field(default=None, metadata=dict(static=True))

    def layer(self, moe_index: int) -> LayerExperts:
        return LayerExperts(self.tier[moe_index], self.slot[moe_index], self.pools, self.backend)


class BlockLayout(NamedTuple):
    """Assignments grouped by slot into blocks of equal rows (each block reads one expert).

    row_source:  [R] index of the assignment feeding each row (A = empty row).
    block_slot:  [R / block_rows] slot each block reads (-1 = empty block).
    dest:        [A] row holding each assignment's result (R = inactive assignment).
    """

    row_source: jax.Array
    block_slot: jax.Array
    dest: jax.Array


def padded_rows(num_assignments: int, max_groups: int, block_rows: int) -> int:
    groups = min(num_assignments, max_groups)
    rows = num_assignments + groups * (block_rows - 1)
    return -(-rows // block_rows) * block_rows


def block_layout(slots: jax.Array, active: jax.Array, block_rows: int, max_groups: int) -> BlockLayout:
    """Sort assignments by slot and pad every slot's group to a multiple of block_rows (static shapes)."""
    A = slots.shape[0]
    R = padded_rows(A, max_groups, block_rows)
    inactive_key = jnp.iinfo(jnp.int32).max
    key = jnp.where(active, slots, inactive_key)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    sorted_active = sorted_key != inactive_key
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
    group = jnp.cumsum(starts) - 1  # [A] group id in sorted order
    num_groups = min(A, max_groups) + 1  # + the trailing inactive group
    size_all = jax.ops.segment_sum(jnp.ones((A,), jnp.int32), group, num_segments=num_groups)
    size = jax.ops.segment_sum(sorted_active.astype(jnp.int32), group, num_segments=num_groups)
    padded = -(-size // block_rows) * block_rows
    first_row = jnp.cumsum(padded) - padded
    first_sorted = jnp.cumsum(size_all) - size_all
    position = jnp.arange(A, dtype=jnp.int32) - first_sorted[group]
    dest_sorted = jnp.where(sorted_active, first_row[group] + position, R).astype(jnp.int32)
    dest = jnp.zeros((A,), jnp.int32).at[order].set(dest_sorted)
    row_source = jnp.full((R + 1,), A, jnp.int32).at[dest].set(jnp.arange(A, dtype=jnp.int32))[:R]
    nb = R // block_rows
    block_slot = (
        jnp.full((nb + 1,), -1, jnp.int32).at[dest // block_rows].set(jnp.where(active, slots, -1))[:nb]
    )
    return BlockLayout(row_source, block_slot, dest)


def grouped_expert_ffn(
    h: jax.Array, slots: jax.Array, active: jax.Array, pool: ExpertWeights, max_groups: int, backend: str | None = None
) -> jax.Array:
    """SwiGLU expert FFN of every active (token, expert) assignment, reading weights by slot.

    h [N, D], slots/active [N, k] -> [N, k, D] (zeros where inactive). max_groups bounds the
    number of distinct slots (the layer's expert count).
    """
    N, k = slots.shape
    A = N * k
    token = jnp.arange(A, dtype=jnp.int32) // k
    slots, active = slots.reshape(A), active.reshape(A)
    if A <= GATHER_MAX_ASSIGNMENTS:
        y = expert_ffn(h[token], jnp.where(active, slots, -1), pool.gate_up, pool.down, block_rows=1, backend=backend)
        return y.reshape(N, k, -1)
    layout = block_layout(slots, active, PREFILL_BLOCK_ROWS, max_groups)
    token_of_row = jnp.concatenate([token, jnp.array([N], jnp.int32)])[layout.row_source]
    rows = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])[token_of_row]
    y_rows = expert_ffn(
        rows, layout.block_slot, pool.gate_up, pool.down, block_rows=PREFILL_BLOCK_ROWS, backend=backend
    )
    y_rows = jnp.concatenate([y_rows, jnp.zeros((1, y_rows.shape[1]), y_rows.dtype)])
    return y_rows[layout.dest].reshape(N, k, -1)


def routed_experts(h: jax.Array, routing, token_valid: jax.Array, layer: LayerExperts) -> jax.Array:
    """Weighted sum of each token's top-k experts at whatever tier the handle table points to.

    h [N, D], routing.ids/weights [N, k], token_valid [N] -> [N, D] in h's dtype.
    """
    num_experts = layer.tier.shape[0]
    tiers = layer.tier[routing.ids]  # [N, k]
    slots = layer.slot[routing.ids]
    out = jnp.zeros(h.shape, jnp.float32)
    for name, pool in layer.pools.items():
        active = (tiers == TIER_CODES[name]) & token_valid[:, None]
        y = grouped_expert_ffn(h, slots, active, pool, num_experts, layer.backend)  # [N, k, D]
        w = jnp.where(active, routing.weights, 0.0)
        out = out + (w[..., None] * y.astype(jnp.float32)).sum(axis=1)
    return out.astype(h.dtype)
