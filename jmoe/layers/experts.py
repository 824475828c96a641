"""Routed experts through per-tier handle tables, with the precision chosen inside the step.

Experts are not model parameters: each tier has one device pool [slots, ...] and a handle table
[L, E] -> slot (-1: that tier's version is not resident) says where each expert's version of the
tier sits. Per step the host passes a Selection (arrays, so changing it never recompiles): for
each layer, the routed experts are ranked by importance and the top `ratio` of them are critical;
a critical expert wants its `hi` tier code, the others their `lo` code (0 = skip). Each wanted
tier then resolves against what is resident: the cheapest resident version at least as precise,
else the best lower one (degraded), else nothing (missing, contribution left out). The host reads
wanted and chosen codes back to account hits, degradations and misses, and to fetch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.config import ModelConfig
from jmoe.distributed.expert_parallel import expert_parallel_sum
from jmoe.distributed.mesh import ExpertParallel
from jmoe.quant import ExpertWeights
from jmoe.tiers import TIER_CODES
from jmoe.kernels import expert_ffn, expert_ffn_tiers, routed_expert_ffn, routed_expert_ffn_tiers, takes_assignments
from kernel_formats.glu import SILU, GatedActivation

if TYPE_CHECKING:  # fetch.py builds on this module
    from jmoe.layers.fetch import FetchInputs, FetchSpec

# Up to this many (token, expert) assignments per layer, every assignment gets its own weight
# read (decode); above it, assignments are sorted by slot into row blocks (prefill).
GATHER_MAX_ASSIGNMENTS = 64
PREFILL_BLOCK_ROWS = 32
# Verification (k + 1 tokens per row) always groups, in blocks this small: each expert's weights
# are read once however few tokens share it (16: the smallest block the Pallas dot path takes).
VERIFY_BLOCK_ROWS = 16
NO_SLOT = -1


def expert_activation(cfg: ModelConfig) -> GatedActivation:
    """How the config's routed experts combine gate and up (a static part of every expert path)."""
    if cfg.expert_activation == "silu":
        return SILU
    return GatedActivation(cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit)


class Routing(NamedTuple):
    """Router output for N tokens: top-k expert ids [N, k] and their combine weights [N, k] (float32)."""

    ids: jax.Array
    weights: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Selection:
    """Per-step precision of routed experts (see the module docstring).

    hi, lo: [L, E] int32 tier codes; ratio: [L] float32 in [0, 1]; heavy_hitters: scalar float32,
    the fraction of tokens (by attention received) whose routing decides importance in prefill.
    """

    hi: jax.Array
    lo: jax.Array
    ratio: jax.Array
    heavy_hitters: jax.Array

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, tier: str) -> "Selection":
        """Every routed expert at one tier (the baselines)."""
        codes = np.full((num_layers, num_experts), TIER_CODES[tier], np.int32)
        return cls.of(codes, codes)

    @classmethod
    def of(cls, hi, lo, ratio=None, heavy_hitters: float = 0.1) -> "Selection":
        """Host arrays (jax.device_put the result to place it: one transfer per array, no
        executable). Copies: on the CPU, jax may alias an aligned numpy buffer instead of copying
        it, and a policy may change its arrays in place later."""
        hi = np.array(hi, np.int32)
        ratio = np.ones(hi.shape[0], np.float32) if ratio is None else np.array(ratio, np.float32)
        return cls(hi, np.array(lo, np.int32), ratio, np.float32(heavy_hitters))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerExperts:
    slots: dict[str, jax.Array]  # tier -> [E] int32 slot in that tier's pool (NO_SLOT: not resident)
    pools: dict[str, ExpertWeights]
    hi: jax.Array  # [E]
    lo: jax.Array  # [E]
    ratio: jax.Array  # scalar
    heavy_hitters: jax.Array  # scalar
    backend: str | None = field(default=None, metadata=dict(static=True))
    group_rows: int = field(default=0, metadata=dict(static=True))  # > 0: always group, in blocks this size
    int8_dot: bool = field(default=False, metadata=dict(static=True))  # the CPU kernels' int8 dot
    ep: ExpertParallel | None = field(default=None, metadata=dict(static=True))  # experts over a mesh's ep axis


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertState:
    """What a step reads to reach experts: per-tier handle tables and pools, this step's Selection,
    and (static) which kernel backend multiplies them (None = the platform default) and whether the
    CPU kernels multiply quantized experts with the int8 dot (load's cpu_dot="int8")."""

    slots: dict[str, jax.Array]  # tier -> [L_moe, E] int32
    pools: dict[str, ExpertWeights]
    selection: Selection
    backend: str | None = field(default=None, metadata=dict(static=True))
    group_rows: int = field(default=0, metadata=dict(static=True))  # > 0: always group, in blocks this size
    int8_dot: bool = field(default=False, metadata=dict(static=True))
    ep: ExpertParallel | None = field(default=None, metadata=dict(static=True))  # experts over a mesh's ep axis
    # Experts fetched inside the step (jmoe/layers/fetch.py): its arrays and its static spec, or None
    fetch: "FetchInputs | None" = None
    fetch_spec: "FetchSpec | None" = field(default=None, metadata=dict(static=True))

    def for_phase(self, phase: str) -> "ExpertState":
        """Verification steps group every assignment by expert (each expert read once)."""
        return dataclasses.replace(self, group_rows=VERIFY_BLOCK_ROWS) if phase == "verify" else self

    @classmethod
    def from_codes(cls, codes, slots, pools: dict[str, ExpertWeights], backend: str | None = None) -> "ExpertState":
        """One version per expert: codes [L, E] tier code (0: none), slots [L, E] its slot; every
        routed expert wants the version it has (a fixed residency, as tests and benchmarks build)."""
        codes, slots = np.asarray(codes, np.int32), np.asarray(slots, np.int32)
        tables = {t: jnp.asarray(np.where(codes == TIER_CODES[t], slots, NO_SLOT)) for t in pools}
        return cls(tables, pools, Selection.of(codes, codes), backend)

    def layer(self, moe_index: int, slots: dict | None = None, pools: dict | None = None) -> LayerExperts:
        """MoE layer `moe_index`'s view; `slots` [L, E] tables and `pools` in place of the state's own."""
        sel = self.selection
        slots = self.slots if slots is None else slots
        return LayerExperts({t: s[moe_index] for t, s in slots.items()}, self.pools if pools is None else pools,
                            sel.hi[moe_index], sel.lo[moe_index], sel.ratio[moe_index], sel.heavy_hitters,
                            self.backend, self.group_rows, self.int8_dot, self.ep)


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


def routed_assignments(h, slots, active, pool: ExpertWeights, backend: str | None, activation: GatedActivation,
                       int8_dot: bool, weight=None) -> jax.Array:
    """Every active (token, expert) assignment of slots/active [N, k] on the backend's routed kernel
    (takes_assignments): [N * k, D] rows in h's dtype, or with combine weights [N * k] each token's
    weighted sum, float32 [N, D]."""
    N, k = slots.shape
    token = jnp.arange(N * k, dtype=jnp.int32) // k
    return routed_expert_ffn(h, token, jnp.where(active, slots, NO_SLOT).reshape(-1), pool.gate_up, pool.down,
                             backend=backend, gate_up_bias=pool.gate_up_bias, down_bias=pool.down_bias,
                             activation=activation, int8_dot=int8_dot, weight=weight)


def grouped_expert_ffn(
    h: jax.Array, slots: jax.Array, active: jax.Array, pool: ExpertWeights, max_groups: int, backend: str | None = None,
    group_rows: int = 0, activation: GatedActivation = SILU, int8_dot: bool = False,
) -> jax.Array:
    """Gated expert FFN (with the pool's biases, if any) of every active (token, expert) assignment,
    reading weights by slot.

    h [N, D], slots/active [N, k] -> [N, k, D] (zeros where inactive). max_groups bounds the
    number of distinct slots (the layer's expert count). group_rows > 0 groups whatever the count,
    in blocks of that many rows.
    """
    N, k = slots.shape
    if takes_assignments(backend):  # the kernel groups by expert itself, unpadded
        return routed_assignments(h, slots, active, pool, backend, activation, int8_dot).reshape(N, k, -1)
    A = N * k
    token = jnp.arange(A, dtype=jnp.int32) // k
    slots, active = slots.reshape(A), active.reshape(A)
    extra = dict(backend=backend, gate_up_bias=pool.gate_up_bias, down_bias=pool.down_bias, activation=activation,
                 int8_dot=int8_dot)
    if gathers(N, k, group_rows):
        y = expert_ffn(h[token], jnp.where(active, slots, -1), pool.gate_up, pool.down, block_rows=1, **extra)
        return y.reshape(N, k, -1)
    block_rows = group_rows or PREFILL_BLOCK_ROWS
    layout = block_layout(slots, active, block_rows, max_groups)
    token_of_row = jnp.concatenate([token, jnp.array([N], jnp.int32)])[layout.row_source]
    rows = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])[token_of_row]
    y_rows = expert_ffn(
        rows, layout.block_slot, pool.gate_up, pool.down, block_rows=block_rows, **extra
    )
    y_rows = jnp.concatenate([y_rows, jnp.zeros((1, y_rows.shape[1]), y_rows.dtype)])
    return y_rows[layout.dest].reshape(N, k, -1)


def expert_importance(routing: Routing, token_valid, token_importance, heavy_hitters, num_experts: int):
    """Importance of each expert this step [E] float32, and which experts real tokens routed to [E] bool.

    Without token importance (decode): the gate scores each expert received, summed over tokens.
    With it (prefill): the number of heavy-hitter tokens (the top `heavy_hitters` fraction of real
    tokens by attention received) routed to the expert, ties broken by all tokens routed to it.
    """
    ids, valid = routing.ids, token_valid[:, None]
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32) * valid[..., None]  # [N, k, E]
    count = one_hot.sum(axis=(0, 1))
    routed = count > 0
    if token_importance is None:
        score = (one_hot * routing.weights[..., None]).sum(axis=(0, 1))
    else:
        s = jnp.where(token_valid, token_importance, -jnp.inf)
        n_valid = token_valid.sum()
        keep = jnp.ceil(heavy_hitters * n_valid).astype(jnp.int32).clip(1, s.shape[0])
        threshold = jnp.sort(s)[::-1][keep - 1]
        heavy = (s >= threshold) & token_valid
        score = (one_hot * heavy[:, None, None]).sum(axis=(0, 1)) * (ids.shape[0] + 1) + count
    return score, routed


def wanted_tiers(routing: Routing, token_valid, token_importance, layer: LayerExperts):
    """The tier code this step wants for each routed assignment [N, k] (see the module docstring)."""
    E = layer.hi.shape[0]
    score, routed = expert_importance(routing, token_valid, token_importance, layer.heavy_hitters, E)
    return wanted_by_importance(score, routed, layer)[routing.ids]


def wanted_by_importance(score, routed, layer: LayerExperts):
    """[E] the tier code each expert wants: the top `ratio` of the routed ones by importance `score`
    [E] want `hi`, the rest `lo` (unrouted experts: `lo`, unused)."""
    E = layer.hi.shape[0]
    # each expert's rank among the routed ones by importance (ties: lower id first; unrouted ones
    # after every routed one), counted from pairwise comparisons: one fused loop over [E, E] where a
    # sort and a scatter were kernels of their own in every layer of every step
    s = jnp.where(routed, score, -jnp.inf)
    ids = jnp.arange(E)
    ahead = routed[None, :] & ((s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (ids[None, :] < ids[:, None])))
    rank = ahead.sum(axis=1, dtype=jnp.int32)
    critical = rank < jnp.ceil(layer.ratio * routed.sum()).astype(jnp.int32)
    return jnp.where(critical, layer.hi, layer.lo)


def resolve_tiers(wanted, ids, slots: dict[str, jax.Array]):
    """The tier code each assignment runs at [N, k]: the cheapest resident version at least as
    precise as wanted, else the best lower one, else 0 (also 0 where wanted is 0)."""
    big = len(TIER_CODES) + 1
    adequate = jnp.full(wanted.shape, big, jnp.int32)
    lower = jnp.zeros(wanted.shape, jnp.int32)
    for tier, table in slots.items():
        code = TIER_CODES[tier]
        resident = table[ids] != NO_SLOT
        adequate = jnp.minimum(adequate, jnp.where(resident & (code >= wanted), code, big))
        lower = jnp.maximum(lower, jnp.where(resident & (code < wanted), code, 0))
    return jnp.where(wanted == 0, 0, jnp.where(adequate < big, adequate, lower))


def missing_uses(wanted, chosen, token_valid):
    """Assignments of real tokens that ran below their wanted tier or not at all (scalar int32)."""
    return ((chosen < wanted) & token_valid[:, None]).sum().astype(jnp.int32)


def routed_experts(h: jax.Array, routing: Routing, chosen: jax.Array, token_valid: jax.Array,
                   layer: LayerExperts, activation: GatedActivation = SILU) -> jax.Array:
    """Weighted sum of each token's top-k experts, each at its chosen tier (0: left out).

    h [N, D], routing.ids/weights and chosen [N, k], token_valid [N] -> [N, D] in h's dtype.
    activation: the model's gated activation (`expert_activation(cfg)`). With layer.ep, each shard
    of the mesh's ep axis runs its own experts and the float32 partial sums are added (psum).
    """
    num_experts = layer.hi.shape[0]

    def local_sum(h, ids, weights, chosen, token_valid, slots, pools):
        local = dataclasses.replace(layer, slots=slots, pools=pools, ep=None)
        return _routed_sum(h, Routing(ids, weights), chosen, token_valid, local, activation, num_experts)

    if layer.ep is None:
        out = local_sum(h, routing.ids, routing.weights, chosen, token_valid, layer.slots, layer.pools)
    else:
        out = expert_parallel_sum(layer.ep, local_sum, h, routing.ids, routing.weights, chosen, token_valid,
                                  layer.slots, layer.pools)
    return out.astype(h.dtype)


def _routed_sum(h, routing: Routing, chosen, token_valid, layer: LayerExperts, activation: GatedActivation,
                num_experts: int) -> jax.Array:
    """routed_experts on one device, as float32 [N, D]."""
    routed = takes_assignments(layer.backend)
    if len(layer.pools) > 1 and not routed and gathers(*chosen.shape, layer.group_rows):
        return _gathered_across_tiers(h, routing, chosen, token_valid, layer, activation)
    if len(layer.pools) > 1 and routed:
        return _routed_across_tiers(h, routing, chosen, token_valid, layer, activation)
    out = jnp.zeros(h.shape, jnp.float32)
    for name, pool in layer.pools.items():
        active = (chosen == TIER_CODES[name]) & token_valid[:, None]
        slots = layer.slots[name][routing.ids]
        weights = jnp.where(active, routing.weights, 0.0)
        if routed:  # the kernel sums each token's rows with their weights itself
            out = out + routed_assignments(h, slots, active, pool, layer.backend, activation, layer.int8_dot,
                                           weight=weights.reshape(-1))
            continue
        y = grouped_expert_ffn(h, slots, active, pool, num_experts, layer.backend, layer.group_rows,
                               activation, layer.int8_dot)  # [N, k, D]
        out = out + weighted_sum(weights, y)
    return out


def weighted_sum(w, y) -> jax.Array:
    """w [N, k], y [N, k, D] -> sum over j of w[:, j] * y[:, j], float32 [N, D]: the combine of each
    token's k expert outputs, written as k multiply-adds that fuse into one loop. As a reduce over k,
    XLA:CPU (jax 0.10) hands it to a library fusion that took about 0.25 ms per MoE layer of a
    decode step at D = 2048, against 0.02 ms this way."""
    y = y.astype(jnp.float32)
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, w.shape[1]):
        out = out + w[:, j, None] * y[:, j]
    return out


def gathers(tokens: int, top_k: int, group_rows: int) -> bool:
    """Whether a device kernel path gives every assignment its own weight read (decode) rather than
    grouping them by slot into row blocks (the CPU kernels group by expert themselves)."""
    return tokens * top_k <= GATHER_MAX_ASSIGNMENTS and not (group_rows and tokens > 1)


def _tiers_and_slots(routing: Routing, chosen, token_valid, layer: LayerExperts):
    """[N, k] each assignment's pool (its index in layer.pools) and slot there (NO_SLOT: it runs nowhere)."""
    tier = jnp.zeros(chosen.shape, jnp.int32)
    slot = jnp.full(chosen.shape, NO_SLOT, jnp.int32)
    for i, name in enumerate(layer.pools):
        runs_here = (chosen == TIER_CODES[name]) & token_valid[:, None]
        tier = jnp.where(runs_here, i, tier)
        slot = jnp.where(runs_here, layer.slots[name][routing.ids], slot)
    return tier, slot


def _routed_across_tiers(h, routing: Routing, chosen, token_valid, layer: LayerExperts,
                         activation: GatedActivation) -> jax.Array:
    """routed_experts with several pools on a backend that takes routed assignments: every tier's
    experts in one call where its kernel takes them all (the CPU's: one set of thread-pool passes
    per layer, not one per tier)."""
    N, k = chosen.shape
    tier, slot = _tiers_and_slots(routing, chosen, token_valid, layer)
    token = jnp.arange(N * k, dtype=jnp.int32) // k
    pools = [(p.gate_up, p.down, p.gate_up_bias, p.down_bias) for p in layer.pools.values()]
    weights = jnp.where(slot != NO_SLOT, routing.weights, 0.0).reshape(-1)  # summed per token by the kernel
    return routed_expert_ffn_tiers(h, token, slot.reshape(-1), tier.reshape(-1), pools, backend=layer.backend,
                                   activation=activation, int8_dot=layer.int8_dot, weight=weights)


def _gathered_across_tiers(h, routing: Routing, chosen, token_valid, layer: LayerExperts,
                           activation: GatedActivation) -> jax.Array:
    """routed_experts for a decode step with several pools: one row per assignment, each reading
    its chosen tier's pool (a tier index per row), one kernel launch per stage for every tier."""
    N, k = chosen.shape
    tier, slot = _tiers_and_slots(routing, chosen, token_valid, layer)
    token = jnp.arange(N * k, dtype=jnp.int32) // k
    y = expert_ffn_tiers(h[token], tier.reshape(-1), slot.reshape(-1), list(layer.pools.values()), block_rows=1,
                         backend=layer.backend, activation=activation, int8_dot=layer.int8_dot)  # [N * k, D]
    return weighted_sum(jnp.where(slot != NO_SLOT, routing.weights, 0.0), y.reshape(N, k, -1))


def run_experts(h, routing: Routing, token_valid, layer: LayerExperts, token_importance=None,
                activation: GatedActivation = SILU):
    """Select each routed expert's tier and run them: h [N, D] -> [N, D] (no router, no shared expert)."""
    wanted = wanted_tiers(routing, token_valid, token_importance, layer)
    return routed_experts(h, routing, resolve_tiers(wanted, routing.ids, layer.slots), token_valid, layer, activation)
