"""Experts fetched inside the step: from the host store, by ids the step itself computes.

An offloaded step receives, besides the handle tables and pools, each (MoE layer, tier)'s host
store: one array [E, record bytes] in host memory (pinned on an accelerator; on the CPU the
memory-mapped expert file itself). Per MoE layer and tier, the step fetches up to three kinds of
experts, each by one dynamic slice of the store moved to device memory and written into a pool slot:

- requests: experts the host asked for, into slots the host chose (published by the host at once:
  any later step reads the pools this one wrote); every layer's are written as the step starts;
- look-ahead: the experts the previous layer predicted for this one (its state through this
  layer's router) that are not resident, most confident first (prefetching policies), or those a
  speculative draft routed to (its hint); only as many as land (a prefetch never needs scratch);
- misses: routed experts with no resident version at their wanted tier, highest gate first (in
  degrade mode only those with no resident version at all: the others run at the best lower
  resident tier, and the host fetches their wanted version for later steps).

A look-ahead or missed expert lands in the next of the step's landing candidates (free slots, then
the versions the policy would evict first, in that order, which the host locks until it reads the
step), skipping those this layer routes to now; an evicted version of a later layer is taken out
of the step's tables (should that layer route to it, it is a miss, as with any eviction). When no
candidate is left it goes to one of the tier's scratch slots, for this layer only. Either way it
runs in this step from where it was written, and the step reports which expert landed in which
candidate; the host evicts what was there and publishes it when it reads the step's summary. The
next step overlays this step's landings on its tables (retracting what they overwrote), so
consecutive steps share what was fetched before the host has read anything.

On the CPU (`native`) the native kernels copy each fetched expert straight from the store into its
slot and skip unused fetches; with `guarded` alone each fetch sits in a conditional instead (XLA:CPU
without the kernels; such a conditional makes XLA copy a whole pool when the step writes several
tiers). On an accelerator a layer's misses and look-ahead are each fetched by a chain of
conditionals (`chained`): slot j's fetch sits in the branch that slot j-1's fetch took, so a layer
that lacks nothing reads one predicate back (XLA's conditional, inside the step) and moves nothing,
and each fetch costs one more predicate read beside its record; the chain gives records, written as
fixed slots' are. A conditional around a pool write instead makes XLA copy the pool. Requests are
fixed slots there: each moves a record every step, unused ones into the tier's sink slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jmoe.format import RecordLayout
from jmoe.layers.experts import NO_SLOT, LayerExperts, Routing, expert_importance, wanted_by_importance
from jmoe.layers.records import write_records
from jmoe.tiers import TIER_CODES

# Codes of how a routed expert was served, in the step's summary.
SERVED_RESIDENT, SERVED_PREFETCHED, SERVED_FETCHED = 1, 2, 3


@dataclass(frozen=True)
class FetchSpec:
    """How a step fetches experts (static: part of the compiled step)."""

    tiers: tuple[str, ...]  # pool tiers, in pool order
    layouts: tuple[RecordLayout, ...]  # each tier's record layout
    cache_slots: tuple[int, ...]  # each tier's cache slots; scratch slots follow them, then the sink slot
    num_experts: int
    misses: int  # missing experts fetched per (layer, tier)
    lookahead: int  # predicted experts fetched per (layer, tier)
    requests: int  # host-requested experts per (layer, tier)
    landing: int  # landing slots per tier and step
    guarded: bool  # unused fetches skipped (XLA:CPU) rather than moving a record into the sink
    chained: bool = False  # an accelerator's misses and look-ahead fetched by chains of conditionals
    land: bool = True  # look-ahead and missed experts stay resident (False: run once, as on demand)
    degrade: bool = False  # a missing expert with a lower resident version runs at it (not fetched)
    predict: bool = False  # each layer's look-ahead is the previous layer's prediction (else only a draft's hint)
    native: bool = False  # the CPU kernels copy fetched experts from the store (unused fetches skipped)

    @property
    def scratch(self) -> int:
        """Scratch slots per tier: every miss fetch of one layer (they run whether they land or not)."""
        return self.misses

    def sink(self, tier: str) -> int:
        return self.cache_slots[self.tiers.index(tier)] + self.scratch

    def extra_slots(self) -> int:
        """Pool slots per tier beyond the cache: scratch and sink."""
        return self.scratch + 1

    def pack(self, tables, request_ids, request_slots, candidate_slots, candidate_keys, previous_slots) -> np.ndarray:
        """FetchInputs.packed from host arrays: tables (T arrays [L, E], one per tier, in order), request
        ids and slots [T, L, requests], landing candidates' slots and keys and the previous step's
        candidate slots [T, landing]."""
        return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in
                               (*tables, request_ids, request_slots, candidate_slots, candidate_keys, previous_slots)])

    def unpack(self, packed, num_layers: int) -> StepPlan:
        T, L, E, Q, N = len(self.tiers), num_layers, self.num_experts, self.requests, self.landing
        shapes = [(T, L, E), (T, L, Q), (T, L, Q), (T, N), (T, N), (T, N)]
        offsets = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes])
        return StepPlan(*(packed[offsets[i]:offsets[i + 1]].reshape(shape) for i, shape in enumerate(shapes)))

    def tier_codes(self) -> np.ndarray:
        """[tiers, 1] each pool's tier code (to compare with per-expert codes [E])."""
        return np.array([[TIER_CODES[t]] for t in self.tiers], np.int32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FetchInputs:
    """A step's fetch arrays: the host stores, the previous step's landed keys (its output, never
    read by the host first) and one packed int32 vector of what the host decided for this step
    (one transfer): the handle tables and the requests, landing slots and the previous step's
    landing slots (FetchSpec.unpack)."""

    stores: dict  # tier -> tuple of [E, record bytes] uint8 per MoE layer, in host memory
    packed: jax.Array  # int32 [n]
    previous_keys: jax.Array  # [tiers, landing] int32 layer * E + expert the previous step landed (-1: none)
    hint: jax.Array | None = None  # [L, E] float32: what a speculative draft routed (gate weight), or None


@dataclass(frozen=True)
class StepPlan:
    """FetchInputs.packed, unpacked, every array stacked over the tiers (pool order): tables
    [T, L, E], request ids and slots [T, L, requests], landing candidates' slots and keys (layer * E
    + expert, -1: free) [T, landing], the previous step's candidate slots [T, landing]."""

    tables: jax.Array
    request_ids: jax.Array
    request_slots: jax.Array
    candidate_slots: jax.Array
    candidate_keys: jax.Array
    previous_slots: jax.Array


def overlay(plan: StepPlan, previous_keys, spec: "FetchSpec") -> jax.Array:
    """Handle tables [T, L, E] with the previous step's landings published and whatever they
    overwrote retracted."""
    tables, keys, slots = plan.tables, previous_keys, plan.previous_slots  # keys, slots [T, landing]
    T, L, E = tables.shape
    P = max(spec.cache_slots) + spec.extra_slots()  # the largest pool's slots; P itself: none
    overwritten = mark(jnp.zeros((T, P + 1), bool), jnp.where(keys >= 0, slots, -1), True)
    gone = jnp.take_along_axis(overwritten, jnp.clip(tables, 0, P).reshape(T, -1), axis=-1).reshape(T, L, E)
    tables = jnp.where((tables >= 0) & gone, NO_SLOT, tables)
    return set_entries(tables, jnp.where(keys >= 0, keys, -1), slots)


def set_entries(tables, keys, values):
    """tables [T, L, E] with entry keys[t, i] (layer * E + expert; < 0: none) of tier t set to
    values[t, i]: one scatter for every tier."""
    T, L, E = tables.shape
    return mark(tables.reshape(T, L * E), keys, values).reshape(T, L, E)


def mark(rows, index, values):
    """rows [T, S] with rows[t, index[t, i]] = values[t, i] (index < 0: none): one scatter."""
    T, S = rows.shape
    flat = jnp.where(index >= 0, jnp.arange(T, dtype=jnp.int32)[:, None] * S + index, T * S)
    values = jnp.broadcast_to(jnp.asarray(values, rows.dtype), index.shape)
    return rows.reshape(-1).at[flat.reshape(-1)].set(values.reshape(-1), mode="drop").reshape(T, S)


def fetch_record(store, expert):
    """One expert's record [1, R] from the host store, in device memory (one dynamic slice)."""
    record = jax.lax.dynamic_slice(store, (jnp.maximum(expert, 0), 0), (1, store.shape[1]))
    return jax.device_put(record, jax.memory.Space.Device)


def fetch_chain(store, ids, valid):
    """[n, R] the records of experts ids[j] (zeros past the last valid slot): slot j's fetch sits in
    the conditional branch that slot j-1's took, entered while any slot from j on is valid, so an
    unused chain reads one predicate and moves nothing."""
    n, R = ids.shape[0], store.shape[1]

    def from_slot(j):
        if j == n:
            return jnp.zeros((0, R), store.dtype)
        return jax.lax.cond(valid[j:].any(), lambda: jnp.concatenate([fetch_record(store, ids[j]), from_slot(j + 1)]),
                            lambda: jnp.zeros((n - j, R), store.dtype))

    return from_slot(0)


def write_fetched(pool, store, ids, dests, valid, layout: RecordLayout, sink: int, guarded: bool,
                  native: bool = False, chained: bool = False):
    """pool with the records of experts ids[i] written into slots dests[i] where valid[i]."""
    if native:  # no record materialised, no conditional: each leaf's rows copied from the store
        leaves, treedef = jax.tree.flatten(pool)
        offsets = [spec.offset for spec in layout.leaves]
        if len(offsets) != len(leaves):
            raise ValueError(f"a pool of {len(leaves)} leaves, a record layout of {len(offsets)}")
        return treedef.unflatten(cpu_kernels.copy_records(leaves, store, ids, jnp.where(valid, dests, NO_SLOT), offsets))
    if guarded:  # the CPU: its native kernels write where they are built
        for i in range(ids.shape[0]):
            pool = jax.lax.cond(
                valid[i], lambda p, i=i: write_records(p, dests[i][None], fetch_record(store, ids[i]), layout),
                lambda p: p, pool)
        return pool
    if chained:
        records = fetch_chain(store, ids, valid)
    else:
        records = jnp.concatenate([fetch_record(store, ids[i]) for i in range(ids.shape[0])])
    return write_records(pool, jnp.where(valid, dests, sink), records, layout, False)


def top_by(score, candidates, n: int):
    """The ids of up to n candidates by descending score along the last axis: (ids [..., n], valid [..., n])."""
    ranked = jnp.where(candidates, score, -jnp.inf)
    best, ids = jax.lax.top_k(ranked, n)
    valid = best > -jnp.inf
    return jnp.where(valid, ids, -1).astype(jnp.int32), valid


def per_expert_wanted(ids, wanted, valid, num_experts: int):
    """[E] the wanted tier code of each expert routed by a valid token (0 where none)."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32) * valid[:, None, None]
    return (one_hot * wanted[..., None]).max((0, 1))


def adequate(rows, tier_codes, code):
    """[E] whether some resident version is at least as precise as code [E]: rows [T, E] the handle
    rows of the pools, tier_codes [T, 1] their tiers' codes."""
    return ((rows != NO_SLOT) & (tier_codes >= code)).any(0)


@dataclass
class LayerReport:
    """What one MoE layer fetched: per expert how (kind [E]: SERVED_PREFETCHED for a request or the
    look-ahead, SERVED_FETCHED for a miss, 0 none), per tier the look-ahead and missed experts it
    fetched (fetched [tiers, 2]), and counts [3]: missing experts left out (beyond the miss slots),
    prefetched experts the layer routed to, routed experts the previous layer had predicted."""

    kind: jax.Array
    fetched: jax.Array
    counts: jax.Array


@dataclass
class StepFetcher:
    """The in-step fetch of one traced step: its inputs, what it carries from layer to layer
    (landing cursors, landed keys, the look-ahead of the next layer) and what it reports. Every
    tier's bookkeeping runs at once, on arrays stacked over the tiers (few, larger operations: each
    operation of a step costs a launch on an accelerator and a dispatch on the CPU); only the
    writes into the pools are per tier."""

    spec: FetchSpec
    inputs: FetchInputs
    plan: StepPlan
    stacked: jax.Array  # [T, L, E] this step's handle tables, changing as it fetches and evicts
    landed: jax.Array | None = None  # [T, landing] int32 keys landed in each candidate (-1: free so far)
    lookahead: jax.Array | None = None  # [T, lookahead] int32 ids for the next MoE layer (-1: none)
    predicted: jax.Array | None = None  # [E] bool: what the previous layer predicted for this one
    requested: jax.Array | None = None  # [L, E] bool: what the host asked the step to fetch
    reports: list = field(default_factory=list)

    def __post_init__(self):
        self.landed = jnp.full((len(self.spec.tiers), self.spec.landing), -1, jnp.int32)
        self.codes = self.spec.tier_codes()

    @property
    def tables(self) -> dict:
        """tier -> [L, E] handle table."""
        return {tier: self.stacked[i] for i, tier in enumerate(self.spec.tiers)}

    def serve(self, layer: int, routing: Routing, wanted, token_valid, experts: LayerExperts) -> LayerExperts:
        """Fetch what layer `layer` asks for; the layer's experts with its new pools and rows."""
        spec, E = self.spec, self.spec.num_experts
        pools = dict(experts.pools)
        kind = jnp.zeros((E,), jnp.int32)
        if self.requested is not None:
            kind = jnp.where(self.requested[layer], SERVED_PREFETCHED, kind)
        score, routed = expert_importance(routing, token_valid, None, experts.heavy_hitters, E)  # gate mass
        if self.inputs.hint is not None:  # a draft's routing: this layer's look-ahead
            hint = self.inputs.hint[layer]
            self.predict(layer, (hint > 0).astype(jnp.int32), hint,
                         jnp.where(hint > 0, wanted_by_importance(hint, hint > 0, experts), 0))
        zero = jnp.zeros((len(spec.tiers),), jnp.int32)
        prefetched, missed = zero, zero
        if self.lookahead is not None:  # before the misses: it may make some unnecessary
            ids, self.lookahead = self.lookahead, None
            pools, kind, lands = self._device_chosen(layer, ids, ids >= 0, routed, pools, kind, SERVED_PREFETCHED,
                                                     must_run=False)
            prefetched = lands.sum(-1, dtype=jnp.int32)
        left_out = jnp.int32(0)
        if spec.misses:
            code = per_expert_wanted(routing.ids, wanted, token_valid, E)
            rows = self.stacked[:, layer]
            missing = routed & (code > 0) & ~adequate(rows, self.codes, code)
            if spec.degrade:  # a lower resident version runs instead
                missing = missing & ~adequate(rows, self.codes, jnp.ones_like(code))
            ids, valid = top_by(score, missing & (code == self.codes), min(spec.misses, E))  # [T, misses]
            pools, kind, _ = self._device_chosen(layer, ids, valid, routed, pools, kind, SERVED_FETCHED,
                                                 must_run=True)
            missed = valid.sum(-1, dtype=jnp.int32)
            # ran below its tier, or not at all
            left_out = (missing & ~adequate(self.stacked[:, layer], self.codes, code)).sum(dtype=jnp.int32)
        used = (routed & (kind == SERVED_PREFETCHED)).sum(dtype=jnp.int32)
        recalled = jnp.int32(0) if self.predicted is None else (routed & self.predicted).sum(dtype=jnp.int32)
        self.reports.append(LayerReport(kind, jnp.stack([prefetched, missed], -1), jnp.stack([left_out, used, recalled])))
        self.predicted = None
        rows = {tier: self.stacked[i, layer] for i, tier in enumerate(spec.tiers)}
        return LayerExperts(rows, pools, experts.hi, experts.lo, experts.ratio, experts.heavy_hitters, experts.backend,
                            experts.group_rows, experts.int8_dot, experts.ep)

    def write_requests(self, pools: dict) -> dict:
        """pools with every layer's requests written and published, before any layer runs. Written
        where each layer runs instead, a request (host-chosen, depending on nothing the step
        computes) would be unordered with the earlier layers' reads of the same pool, and XLA would
        copy the pool."""
        if not self.spec.requests:
            return pools
        pools = dict(pools)
        plan, E = self.plan, self.spec.num_experts
        T, L, _ = plan.request_ids.shape
        for i, tier in enumerate(self.spec.tiers):
            for layer in range(L):
                ids, dests = plan.request_ids[i, layer], plan.request_slots[i, layer]
                pools[tier] = self._write(layer, tier, pools[tier], ids, dests, ids >= 0, chained=False)
        layer = jnp.arange(L, dtype=jnp.int32)[None, :, None]
        keys = jnp.where(plan.request_ids >= 0, layer * E + plan.request_ids, -1).reshape(T, -1)
        self.stacked = set_entries(self.stacked, keys, plan.request_slots.reshape(T, -1))
        self.requested = mark(jnp.zeros((1, L * E), bool), keys.reshape(1, -1), True).reshape(L, E)
        return pools

    def _device_chosen(self, layer, ids, valid, routed, pools, kind, served: int, must_run: bool):
        """Fetch experts the step chose, ids/valid [T, n]: each into the next usable landing
        candidate of its tier (free, of an earlier layer, or of this layer and not routed to now),
        else (`must_run`: misses) into scratch, else not at all. Returns (pools, kind, which landed)."""
        spec, E = self.spec, self.spec.num_experts
        n = ids.shape[1]
        scratch = np.asarray(spec.cache_slots, np.int32)[:, None] + np.arange(n, dtype=np.int32)[None]
        lands = jnp.zeros_like(valid)
        evicted = None
        if spec.land and spec.landing:
            keys, slots = self.plan.candidate_keys, self.plan.candidate_slots  # [T, landing]
            busy = (keys // E == layer) & routed[jnp.clip(keys % E, 0, E - 1)]  # this layer runs it now
            usable = (self.landed < 0) & (slots >= 0) & ((keys < 0) | ~busy)
            order = jnp.argsort(~usable, axis=-1, stable=True)  # usable candidates first, in the host's order
            rank = jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1
            lands = valid & (rank < usable.sum(-1, keepdims=True))
            pick = jnp.take_along_axis(order, jnp.clip(rank, 0, spec.landing - 1), axis=-1)  # [T, n]
            dests = jnp.where(lands, jnp.take_along_axis(slots, pick, axis=-1), scratch)
            self.landed = mark(self.landed, jnp.where(lands, pick, -1), layer * E + ids)
            evicted = jnp.take_along_axis(keys, pick, axis=-1)
            evicted = jnp.where(lands, evicted, -1)  # their versions leave the tables (a later layer may miss them)
        else:
            dests = jnp.broadcast_to(scratch, ids.shape)
        if not must_run:
            valid = lands
        for i, tier in enumerate(spec.tiers):
            pools[tier] = self._write(layer, tier, pools[tier], ids[i], dests[i], valid[i])
        if evicted is not None:
            self.stacked = set_entries(self.stacked, evicted, NO_SLOT)
        self.stacked = set_entries(self.stacked, jnp.where(valid, layer * E + ids, -1), dests)
        kind = mark(kind[None], jnp.where(valid, ids, -1).reshape(1, -1), served)[0]
        return pools, kind, lands

    def _write(self, layer, tier, pool, ids, dests, valid, chained: bool | None = None):
        spec = self.spec
        store = self.inputs.stores[tier][layer]
        return write_fetched(pool, store, ids, dests, valid, spec.layouts[spec.tiers.index(tier)], spec.sink(tier),
                             spec.guarded, spec.native, spec.chained if chained is None else chained)

    def predict(self, layer: int, counts, gate, predicted_wanted) -> None:
        """MoE layer `layer`'s look-ahead from its predicted routing: per expert token counts [E],
        gate mass [E] and wanted tier code [E]; its non-resident experts, most confident first."""
        self.predicted = counts > 0
        if not self.spec.lookahead:
            return
        missing = self.predicted & ~adequate(self.stacked[:, layer], self.codes, predicted_wanted)
        self.lookahead, _ = top_by(gate, missing & (predicted_wanted == self.codes),
                                   min(self.spec.lookahead, self.spec.num_experts))

    def summary_parts(self) -> tuple:
        """(kind [L, E], fetched [L, tiers, 2], counts [L, 3], landed keys [tiers, landing])."""
        kind = jnp.stack([r.kind for r in self.reports])
        fetched = jnp.stack([r.fetched for r in self.reports])
        counts = jnp.stack([r.counts for r in self.reports])
        return kind, fetched, counts, self.landed


__all__ = ["FetchSpec", "FetchInputs", "StepFetcher", "LayerReport", "overlay", "SERVED_RESIDENT",
           "SERVED_PREFETCHED", "SERVED_FETCHED"]
