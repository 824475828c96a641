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
tiers). On an accelerator every fetch slot moves a record every step (a conditional would read its
predicate back to the host inside the step), unused ones into the tier's sink slot.
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
        """FetchInputs.packed from host arrays: tables [T, L, E], request ids and slots [T, L, requests],
        landing candidates' slots and keys and the previous step's candidate slots [T, landing]."""
        return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in
                               (tables, request_ids, request_slots, candidate_slots, candidate_keys, previous_slots)])

    def unpack(self, packed, num_layers: int) -> StepPlan:
        T, L, E, Q, N = len(self.tiers), num_layers, self.num_experts, self.requests, self.landing
        shapes = [(T, L, E), (T, L, Q), (T, L, Q), (T, N), (T, N), (T, N)]
        offsets = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes])
        arrays = [packed[offsets[i]:offsets[i + 1]].reshape(shape) for i, shape in enumerate(shapes)]
        return StepPlan(*({t: a[i] for i, t in enumerate(self.tiers)} for a in arrays))


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
    """FetchInputs.packed, unpacked: tier -> tables [L, E], request ids and slots [L, requests],
    landing candidates' slots and keys (layer * E + expert, -1: free) [landing], the previous
    step's candidate slots [landing]."""

    tables: dict
    request_ids: dict
    request_slots: dict
    candidate_slots: dict
    candidate_keys: dict
    previous_slots: dict


def overlay(plan: StepPlan, previous_keys, spec: "FetchSpec") -> dict:
    """Handle tables [L, E] with the previous step's landings published and whatever they
    overwrote retracted."""
    out = {}
    for i, tier in enumerate(spec.tiers):
        table, keys, slots = plan.tables[tier], previous_keys[i], plan.previous_slots[tier]
        pool_slots = spec.cache_slots[i] + spec.extra_slots()
        overwritten = jnp.zeros((pool_slots + 1,), bool).at[jnp.where(keys >= 0, slots, pool_slots)].set(True)
        table = jnp.where((table >= 0) & overwritten[jnp.clip(table, 0, pool_slots)], NO_SLOT, table)
        flat = table.reshape(-1)
        flat = flat.at[jnp.where(keys >= 0, keys, flat.shape[0])].set(slots, mode="drop")
        out[tier] = flat.reshape(table.shape)
    return out


def fetch_record(store, expert):
    """One expert's record [1, R] from the host store, in device memory (one dynamic slice)."""
    record = jax.lax.dynamic_slice(store, (jnp.maximum(expert, 0), 0), (1, store.shape[1]))
    return jax.device_put(record, jax.memory.Space.Device)


def write_fetched(pool, store, ids, dests, valid, layout: RecordLayout, sink: int, guarded: bool,
                  native: bool = False):
    """pool with the records of experts ids[i] written into slots dests[i] where valid[i]."""
    if native:  # no record materialised, no conditional: each leaf's rows copied from the store
        leaves, treedef = jax.tree.flatten(pool)
        dests = jnp.where(valid, dests, NO_SLOT)
        return treedef.unflatten([cpu_kernels.copy_slots(leaf, store, ids, dests, spec.offset)
                                  for leaf, spec in zip(leaves, layout.leaves, strict=True)])
    if guarded:  # the CPU: its native kernels write where they are built
        for i in range(ids.shape[0]):
            pool = jax.lax.cond(
                valid[i], lambda p, i=i: write_records(p, dests[i][None], fetch_record(store, ids[i]), layout),
                lambda p: p, pool)
        return pool
    records = jnp.concatenate([fetch_record(store, ids[i]) for i in range(ids.shape[0])])
    return write_records(pool, jnp.where(valid, dests, sink), records, layout, False)


def publish_row(row, ids, dests, valid):
    """A handle-table row [E] with experts ids[i] at dests[i] where valid[i]."""
    return row.at[jnp.where(valid, ids, row.shape[0])].set(dests, mode="drop")


def top_by(score, candidates, n: int):
    """The ids of up to n candidates by descending score: (ids [n], valid [n])."""
    ranked = jnp.where(candidates, score, -jnp.inf)
    best, ids = jax.lax.top_k(ranked, n)
    valid = best > -jnp.inf
    return jnp.where(valid, ids, -1).astype(jnp.int32), valid


def per_expert_wanted(ids, wanted, valid, num_experts: int):
    """[E] the wanted tier code of each expert routed by a valid token (0 where none)."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32) * valid[:, None, None]
    return (one_hot * wanted[..., None]).max((0, 1))


def adequate(rows: dict, code):
    """[E] whether some resident version is at least as precise as code [E]."""
    ok = jnp.zeros(code.shape, bool)
    for tier, row in rows.items():
        ok = ok | ((row != NO_SLOT) & (TIER_CODES[tier] >= code))
    return ok


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
    (landing cursors, landed keys, the look-ahead of the next layer) and what it reports."""

    spec: FetchSpec
    inputs: FetchInputs
    plan: StepPlan
    tables: dict  # tier -> [L, E] this step's handle tables, changing as it fetches and evicts
    taken: dict = field(default_factory=dict)  # tier -> [landing] bool: candidates used so far
    landed: dict = field(default_factory=dict)  # tier -> [landing] int32 keys
    lookahead: dict = field(default_factory=dict)  # tier -> [lookahead] int32 ids for the next MoE layer
    predicted: jax.Array | None = None  # [E] bool: what the previous layer predicted for this one
    reports: list = field(default_factory=list)

    def __post_init__(self):
        for tier in self.spec.tiers:
            self.taken[tier] = jnp.zeros((self.spec.landing,), bool)
            self.landed[tier] = jnp.full((self.spec.landing,), -1, jnp.int32)

    def serve(self, layer: int, routing: Routing, wanted, token_valid, experts: LayerExperts) -> LayerExperts:
        """Fetch what layer `layer` asks for; the layer's experts with its new pools and rows."""
        spec, E = self.spec, self.spec.num_experts
        rows, pools = {t: self.tables[t][layer] for t in spec.tiers}, dict(experts.pools)
        kind = jnp.zeros((E,), jnp.int32)
        score, routed = expert_importance(routing, token_valid, None, experts.heavy_hitters, E)  # gate mass
        fetched = {tier: [jnp.int32(0), jnp.int32(0)] for tier in spec.tiers}
        if self.inputs.hint is not None:  # a draft's routing: this layer's look-ahead
            hint = self.inputs.hint[layer]
            self.predict(experts, (hint > 0).astype(jnp.int32), hint,
                         jnp.where(hint > 0, wanted_by_importance(hint, hint > 0, experts), 0))
        for tier in spec.tiers:  # requests and look-ahead first: they may make misses unnecessary
            rows, pools, kind = self._requests(layer, tier, rows, pools, kind)
            ids = self.lookahead.pop(tier, None)
            if ids is not None:
                rows, pools, kind, lands = self._device_chosen(layer, tier, ids, ids >= 0, routed, rows, pools, kind,
                                                               SERVED_PREFETCHED, must_run=False)
                fetched[tier][0] = lands.sum(dtype=jnp.int32)
        left_out = jnp.int32(0)
        if spec.misses:
            code = per_expert_wanted(routing.ids, wanted, token_valid, E)
            missing = routed & (code > 0) & ~adequate(rows, code)
            if spec.degrade:  # a lower resident version runs instead
                missing = missing & ~adequate(rows, jnp.ones_like(code))
            for tier in spec.tiers:
                ids, valid = top_by(score, missing & (code == TIER_CODES[tier]), min(spec.misses, E))
                rows, pools, kind, _ = self._device_chosen(layer, tier, ids, valid, routed, rows, pools, kind,
                                                           SERVED_FETCHED, must_run=True)
                fetched[tier][1] = valid.sum(dtype=jnp.int32)
            left_out = (missing & ~adequate(rows, code)).sum(dtype=jnp.int32)  # ran below its tier, or not at all
        used = (routed & (kind == SERVED_PREFETCHED)).sum(dtype=jnp.int32)
        recalled = jnp.int32(0) if self.predicted is None else (routed & self.predicted).sum(dtype=jnp.int32)
        self.reports.append(LayerReport(kind, jnp.array([fetched[t] for t in spec.tiers], jnp.int32),
                                        jnp.stack([left_out, used, recalled])))
        for tier in spec.tiers:
            self.tables[tier] = self.tables[tier].at[layer].set(rows[tier])
        self.predicted = None
        return LayerExperts(rows, pools, experts.hi, experts.lo, experts.ratio, experts.heavy_hitters, experts.backend,
                            experts.group_rows, experts.int8_dot, experts.ep)

    def write_requests(self, pools: dict) -> dict:
        """pools with every layer's requests written, before any layer runs. Written where each
        layer runs instead, a request (host-chosen, depending on nothing the step computes) would
        be unordered with the earlier layers' reads of the same pool, and XLA would copy the pool."""
        if not self.spec.requests:
            return pools
        pools = dict(pools)
        for tier in self.spec.tiers:
            for layer in range(self.plan.request_ids[tier].shape[0]):
                ids, dests = self.plan.request_ids[tier][layer], self.plan.request_slots[tier][layer]
                pools[tier] = self._write(layer, tier, pools[tier], ids, dests, ids >= 0)
        return pools

    def _requests(self, layer, tier, rows, pools, kind):
        """Publish layer `layer`'s requests (written by write_requests) in its rows."""
        if not self.spec.requests:
            return rows, pools, kind
        ids, dests = self.plan.request_ids[tier][layer], self.plan.request_slots[tier][layer]
        valid = ids >= 0
        rows[tier] = publish_row(rows[tier], ids, dests, valid)
        return rows, pools, kind.at[jnp.where(valid, ids, kind.shape[0])].set(SERVED_PREFETCHED, mode="drop")

    def _device_chosen(self, layer, tier, ids, valid, routed, rows, pools, kind, served: int, must_run: bool):
        """Fetch experts the step chose: each into the next usable landing candidate (free, of an
        earlier layer, or of this layer and not routed to now), else (`must_run`: misses) into
        scratch, else not at all. Returns (rows, pools, kind, which landed)."""
        spec, E = self.spec, self.spec.num_experts
        scratch = spec.cache_slots[spec.tiers.index(tier)] + jnp.arange(ids.shape[0], dtype=jnp.int32)
        lands = jnp.zeros_like(valid)
        if spec.land and spec.landing:
            keys = self.plan.candidate_keys[tier]
            owner_layer, owner = keys // E, keys % E
            busy = (owner_layer == layer) & routed[jnp.clip(owner, 0, E - 1)]  # this layer runs it now
            usable = ~self.taken[tier] & (self.plan.candidate_slots[tier] >= 0) & ((keys < 0) | ~busy)
            order = jnp.argsort(~usable, stable=True)  # usable candidates first, in the host's order
            rank = jnp.cumsum(valid.astype(jnp.int32)) - 1
            lands = valid & (rank < usable.sum())
            pick = order[jnp.clip(rank, 0, spec.landing - 1)]
            dests = jnp.where(lands, self.plan.candidate_slots[tier][pick], scratch)
            picked = jnp.where(lands, pick, spec.landing)
            self.taken[tier] = self.taken[tier].at[picked].set(True, mode="drop")
            self.landed[tier] = self.landed[tier].at[picked].set(layer * E + ids, mode="drop")
            evicted = jnp.where(lands & (keys[pick] >= 0), keys[pick], self.tables[tier].size)
            rows = dict(rows)  # evicted versions leave the step's tables (a later layer may miss them)
            for t in spec.tiers:
                if t == tier:
                    flat = self.tables[t].reshape(-1).at[evicted].set(NO_SLOT, mode="drop")
                    self.tables[t] = flat.reshape(self.tables[t].shape)
                    rows[t] = rows[t].at[jnp.where(evicted // E == layer, evicted % E, E)].set(NO_SLOT, mode="drop")
        else:
            dests = scratch
        if not must_run:
            valid = lands
        pools[tier] = self._write(layer, tier, pools[tier], ids, dests, valid)
        rows[tier] = publish_row(rows[tier], ids, dests, valid)
        return rows, pools, kind.at[jnp.where(valid, ids, kind.shape[0])].set(served, mode="drop"), lands

    def _write(self, layer, tier, pool, ids, dests, valid):
        spec = self.spec
        store = self.inputs.stores[tier][layer]
        return write_fetched(pool, store, ids, dests, valid, spec.layouts[spec.tiers.index(tier)], spec.sink(tier),
                             spec.guarded, spec.native)

    def predict(self, next_experts: LayerExperts, counts, gate, predicted_wanted) -> None:
        """The next MoE layer's look-ahead from its predicted routing: per expert token counts [E],
        gate mass [E] and wanted tier code [E]; its non-resident experts, most confident first."""
        self.predicted = counts > 0
        if not self.spec.lookahead:
            return
        missing = self.predicted & ~adequate(next_experts.slots, predicted_wanted)
        for tier in self.spec.tiers:
            ids, _ = top_by(gate, missing & (predicted_wanted == TIER_CODES[tier]), min(self.spec.lookahead,
                                                                                      self.spec.num_experts))
            self.lookahead[tier] = ids

    def summary_parts(self) -> tuple:
        """(kind [L, E], fetched [L, tiers, 2], counts [L, 3], landed keys [tiers, landing])."""
        kind = jnp.stack([r.kind for r in self.reports])
        fetched = jnp.stack([r.fetched for r in self.reports])
        counts = jnp.stack([r.counts for r in self.reports])
        landed = jnp.stack([self.landed[t] for t in self.spec.tiers])
        return kind, fetched, counts, landed


__all__ = ["FetchSpec", "FetchInputs", "StepFetcher", "LayerReport", "overlay", "SERVED_RESIDENT",
           "SERVED_PREFETCHED", "SERVED_FETCHED"]
