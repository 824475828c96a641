"""Residency objects: where experts live, handed to a step as an ExpertState, told what it routed.

A residency object does not run steps (jmoe/runtime/execution.py does). Before a step it plans
(`begin_step`) and hands out an ExpertState: per-tier handle tables, the pools and this step's
Selection. After the step it takes the step's routing back and keeps its books.

- AllResident: every expert on the device at one tier, or at each tier of a fixed plan (DyMoE's
  hi and lo: each step runs every routed expert at one of them, chosen inside the step). Nothing
  moves; the step's signals stay on the device (`signals`) until someone reads them, so a step
  costs no host sync.
- Offloaded: experts on the host, budget-sized pools per tier caching them, a policy planning each
  step, and the cache manager moving versions in and out.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import BudgetError
from jmoe.layers.experts import NO_SLOT, VERIFY_BLOCK_ROWS, ExpertState, LayerExperts, Selection
from jmoe.layers.transformer import StepSignals
from jmoe.policies.base import (
    ExpertCounters,
    Key,
    LayerRouting,
    Plan,
    Policy,
    StepView,
    check_plan,
)
from jmoe.runtime.budget import BudgetTracker, tree_nbytes
from jmoe.runtime.cache import CacheManager
from jmoe.runtime.cpu_exec import CpuExecutor
from jmoe.runtime.fetching import FetchSlots, InStepFetch
from jmoe.runtime.handles import HandleTable
from jmoe.distributed.mesh import Placement
from jmoe.runtime.host_memory import device_is_host
from jmoe.runtime.host_store import HostStore
from jmoe.runtime.pools import PoolPlan, TierPool, resident_pool, resident_slots
from jmoe.runtime.predictor import rank_predictions
from jmoe.runtime.stats import Stats
from jmoe.runtime.store import ExpertStore
from jmoe.runtime.trace import Trace
from jmoe.tiers import SKIP, TIER_CODES, tier_name

BOOK_BATCH = 32  # deferred steps whose books are kept together (LRU order and counters lag at most this)


def policy_eviction(policy: Policy) -> dict:
    """The cache's victim and evictable test: the policy's where it overrides them, else the cache's
    own (least recently used, everything evictable), which it runs without a call per expert."""
    out = {}
    if getattr(type(policy), "victim", None) is not Policy.victim:
        out["victim"] = policy.victim
    if getattr(type(policy), "evictable", None) is not Policy.evictable:
        out["evictable"] = policy.evictable
    if getattr(type(policy), "evicts_from", None) is not Policy.evicts_from:
        out["evicts_from"] = policy.evicts_from
    return out


class AllResident:
    """Every expert resident on the device at one tier, or at every tier of a fixed plan: no
    transfers after load."""

    offloading = False

    def __init__(self, store: ExpertStore, tier: str, device, backend: str | None = None, int8_dot: bool = False,
                 plan: Plan | None = None):
        """device: one device or a Placement (a mesh: each ep shard holds its own experts). plan: a
        policy's plan that never changes (Policy.fixed_plan): every tier it names is held whole, and
        each step picks among them inside itself (DyMoE's importance and depth schedule); None:
        every routed expert at `tier`."""
        L, E = store.num_layers, store.num_experts
        placement = Placement.of(device)
        placement.check_experts(E)
        if plan is None:
            plan = Plan.uniform(L, E, tier)
        self.tier = tier
        self.tiers = plan.tiers()
        self.stats = Stats()
        self.device = placement.replicated
        pools = {t: resident_pool(store, t, placement) for t in self.tiers}
        self.pool = pools[tier]
        slots = jax.device_put(resident_slots(L, E, placement.shards), placement.replicated)
        selection = Selection.of(plan.hi, plan.lo, plan.ratio, plan.heavy_hitters)
        self.backend, self.int8_dot = backend, int8_dot
        self.state = ExpertState({t: slots for t in self.tiers}, pools,
                                 jax.device_put(selection, placement.replicated), backend,
                                 int8_dot=int8_dot, ep=placement.expert_parallel)
        self.signals: StepSignals | None = None  # the last step's, on the device
        self.trace: Trace | None = None
        self.trace_source = "target"  # "draft" for a speculative draft writing into the target's trace
        self._slot_bytes = {TIER_CODES[t]: tree_nbytes(store.template(t)) for t in self.tiers}

    def use_backend(self, backend: str) -> None:
        """Multiply experts with another kernel backend from now on (see kernel_fallback.py)."""
        self.backend = backend
        self.state = dataclasses.replace(self.state, backend=backend)

    def begin_step(self, phase: str, tokens: int = 0) -> None:
        self.stats.steps += 1
        self.stats.phase = phase
        if phase == "prefill":
            self.stats.prefill_tokens += tokens
        if self.trace is not None:
            self.trace.begin(self.stats.steps, self.trace_source if self.trace_source == "draft" else phase, tokens,
                             self.trace_source)

    def expert_state(self) -> ExpertState:
        return self.state

    def pool_arrays(self) -> dict:
        """tier -> its pool's ExpertWeights (what the expert kernels multiply)."""
        return self.state.pools

    def observe(self, signals: StepSignals, valid=None) -> None:
        self.signals = signals
        if self.trace is not None:  # the trace needs the routing on the host: a sync per step
            counts, _, chosen = np.asarray(signals.per_expert)
            for layer in range(counts.shape[0]):
                read = sum(self._slot_bytes.get(int(c), 0) for c in chosen[layer][counts[layer] > 0])
                self.trace.expert_reads(self.stats.steps, layer, read, self.trace_source)
            self.trace.sync()

    @property
    def last_routed(self) -> np.ndarray | None:
        """[L, E] bool: the experts the last step's real tokens routed to (reads them back)."""
        return None if self.signals is None else np.asarray(self.signals.per_expert[0]) > 0

    def end_step(self) -> None:
        pass

    def reset_stats(self) -> None:
        self.stats = Stats()


def shortfall_of(routed: np.ndarray, wanted: np.ndarray, chosen: np.ndarray) -> tuple[dict[Key, int], dict[Key, int]]:
    """From [L, E] routed flags and wanted / chosen tier codes: (wanted code of every routed expert,
    those of them that ran below it)."""
    keys = [tuple(k) for k in np.argwhere(routed).tolist()]
    return ({k: int(wanted[k]) for k in keys}, {k: int(wanted[k]) for k in keys if chosen[k] < wanted[k]})


class Offloaded:
    offloading = True

    def __init__(self, cfg: ModelConfig, store: ExpertStore, policy: Policy, tracker: BudgetTracker, plan: PoolPlan,
                 device, compute_dtype, *, backend: str | None = None, cpu_critical_tokens: int | None = None,
                 progress: bool | None = None, cpu_dot: str = "float", fetch: FetchSlots | None = None,
                 fetch_on_accelerator: FetchSlots | None = None):
        """fetch: the fetch slots of steps that fetch their own experts (plan.extra holds their
        scratch), None where steps do not (jmoe/runtime/fetching.py); fetch_on_accelerator: the
        slots an accelerator would give them (what a trace records they would move there)."""
        placement = Placement.of(device)
        placement.check_experts(cfg.num_experts)
        self.cfg, self.policy, self.backend, self.placement = cfg, policy, backend, placement
        self.device = placement.replicated  # where the step's small arrays go (tables, selections)
        device = placement.device
        self.int8_dot = cpu_dot == "int8" and device_is_host(device)  # the step's, on a CPU device
        self.tier = policy.tier
        self.stats = Stats()
        self.counters = ExpertCounters(cfg.num_moe_layers, cfg.num_experts)
        self.step_index = 0
        tracker.reserve("experts", plan.nbytes)
        tracker.reserve("staging", plan.staging_nbytes)
        if plan.extra:
            tracker.reserve("fetch", plan.fetch_nbytes)
        self.tracker = tracker
        self.host = HostStore(store, tuple(plan.slots), device, progress=progress)
        self.pools = {tier: TierPool(store, tier, slots, placement, plan.extra) for tier, slots in plan.slots.items()}
        self.handles = HandleTable(cfg.num_moe_layers, cfg.num_experts, tuple(self.pools), placement.replicated)
        self.cache = CacheManager(self.host, self.pools, self.handles, BudgetTracker(plan.staging_nbytes), self.stats,
                                  device, **policy_eviction(policy), keep_lower=policy.keep_lower)
        self.plan: Plan | None = None
        self.trace: Trace | None = None
        self.last_routed = np.zeros((cfg.num_moe_layers, cfg.num_experts), bool)  # by the last step's real tokens
        self.stats.phase = "load"  # what filling the pools costs the host is load's, not a step's
        for key, tier in policy.preload(cfg.num_moe_layers, cfg.num_experts):  # e.g. every expert at a low tier
            if self.cache.request(key, tier, "demand") == "full":
                break
        self.cache.settle()
        self.stats.phase = "decode"
        self._unbooked: list = []  # settled steps whose books are not kept yet
        self._state = None  # (its parts, the ExpertState): reused while nothing changed
        self._selection: tuple[tuple, Selection] | None = None  # (host copies sent, on the device)
        self.in_step = InStepFetch(self, fetch, fetch_on_accelerator) if fetch is not None else None
        self.cpu = None
        self.critical_tokens = 0
        if policy.cpu_execution:
            self.cpu = CpuExecutor(self.host, device, compute_dtype, cpu_dot == "int8")
            cost = self.cpu.calibrate(self.tier)
            self.critical_tokens = cost.critical_tokens if cpu_critical_tokens is None else cpu_critical_tokens

    def use_backend(self, backend: str) -> None:
        """Multiply experts with another kernel backend from now on (see kernel_fallback.py)."""
        self.backend = backend
        self._state = None

    def reset_stats(self) -> None:
        """Start counting afresh (the cache keeps its contents; earlier prefetches are not credited)."""
        self.stats = self.cache.stats = Stats()
        self.cache.prefetched.clear()
        self._unbooked = []

    @property
    def slots(self) -> int:
        """Slots of the run tier's pool."""
        return self.pools[self.tier].slots

    # -- before and after a step

    def begin_step(self, phase: str, tokens: int = 0) -> None:
        """Publish finished transfers, ask the policy for this step's plan, start what it asks for."""
        plan = self.plan_step(phase, tokens)
        for key, tier in plan.prefetch:
            if self.cache.request(key, tier, "prefetch") == "full":
                break
        for key, tier in plan.transitions:
            self.cache.request(key, tier, "transition", exact=True)  # "full": deferred to a later plan

    def plan_step(self, phase: str, tokens: int = 0) -> Plan:
        """Publish finished transfers and ask the policy for this step's plan."""
        self.cache.poll()
        if type(self.policy).plan is not Policy.plan:
            self.catch_up()  # a policy that plans sees every kept step in its counters
        self.stats.steps += 1
        self.stats.phase = phase
        if phase == "prefill":
            self.stats.prefill_tokens += tokens
        self.step_index += 1
        self.last_routed = np.zeros_like(self.last_routed)
        if self.trace is not None:
            self.trace.begin(self.step_index, phase, tokens)
        view = StepView(self.step_index, phase, self.cfg.num_moe_layers, self.cfg.num_experts, self.counters, self.cache)
        plan = self.policy.plan(view)
        if self.plan is None or plan.hi is not self.plan.hi or plan.lo is not self.plan.lo:
            check_plan(plan, self.pools, self.cfg.num_moe_layers, self.cfg.num_experts, self.policy.name)
        self.plan = plan
        return plan

    def count_fetch(self, tier: str, kind: str, n: int = 1, moved: bool = True) -> None:
        """n expert versions fetched by a step itself (requests, look-ahead, misses); `moved`: count
        their transfers and bytes here (False: fixed slots, counted as they move, by count_moved)."""
        if n <= 0:
            return
        if moved:
            self.count_moved(tier, n)
        self.stats.in_step_fetches += n
        if kind == "prefetch":
            self.stats.prefetch_issued += n
        elif kind == "demand":
            self.stats.in_step_misses += n
        if self.trace is not None:
            for _ in range(n):
                self.trace.transfer(self.host.nbytes(tier), f"step-{kind}")

    def count_moved(self, tier: str, records: int) -> None:
        """records expert records of `tier` moved to the device by a step (fetched or in a fixed slot)."""
        nbytes = records * self.host.nbytes(tier)
        self.stats.transfers += records
        self.stats.bytes_h2d += nbytes
        self.stats.bytes_h2d_by_tier[tier] = self.stats.bytes_h2d_by_tier.get(tier, 0) + nbytes

    @property
    def observes_tokens(self) -> bool:
        """Whether the policy wants every token's routing (observe), not only per-expert totals."""
        return type(self.policy).observe is not Policy.observe

    def token_routing(self, flight) -> list:
        """Every MoE layer's routing of a fetching step, per token (reads it back)."""
        valid = np.ones(flight.signals.codes.shape[2] * flight.signals.codes.shape[3], bool)
        self.synced()
        return StepRouting(flight.index, flight.phase, valid, flight.signals,
                           np.asarray(flight.signals.per_expert)).layers()

    def end_step(self) -> None:
        """Whatever happened inside the step, its pins go."""
        self.cache.pinned = set()

    def selection(self) -> Selection:
        """The plan's tier arrays on the device; reused while the plan's arrays hold the same values
        (a policy may build new ones each step, or change its own in place: compared with the host
        copy last sent, which costs microseconds, a transfer more)."""
        p = self.plan
        key = (p.hi, p.lo, p.ratio, p.heavy_hitters)
        if self._selection is None or not all(np.array_equal(a, b) for a, b in zip(self._selection[0], key)):
            selection = Selection.of(*key)
            sent = tuple(np.array(a) for a in key)  # copies of what the plan gave, compared as they are
            self._selection = (sent, jax.device_put(selection, self.device))
            self.stats.count_io(transfers=len(jax.tree.leaves(selection)), nbytes=tree_nbytes(selection))
        return self._selection[1]

    def expert_state(self) -> ExpertState:
        tables, pools, selection = self.handles.on_device(), self.pool_arrays(), self.selection()
        # the cached state keeps these objects alive, so their ids cannot be reused meanwhile
        key = (id(tables), id(selection), *(id(a) for a in pools.values()))
        if self._state is None or self._state[0] != key:
            self._state = (key, ExpertState(tables, pools, selection, self.backend, int8_dot=self.int8_dot,
                                            ep=self.placement.expert_parallel))
        return self._state[1]

    def pool_arrays(self) -> dict:
        return {tier: pool.arrays for tier, pool in self.pools.items()}

    # -- the one-jit path: read the step's signals, fetch what it lacked, keep the books

    def read(self, signals: StepSignals, valid: np.ndarray, phase: str, *, sync: bool = True) -> "StepRouting":
        """A step's routing on the host: its per-expert summary now (one small read; `sync`: counted
        as a wait), the per-assignment arrays only if something asks for them."""
        if sync:
            self.synced()
        summary = np.asarray(signals.per_expert)
        self.last_routed = summary[0] > 0
        return StepRouting(self.step_index, phase, valid, signals, summary)

    def synced(self, n: int = 1) -> None:
        """The host just waited to read n arrays back from the device."""
        self.stats.host_syncs += n
        self.stats.count_io(reads=n)
        if self.trace is not None:
            self.trace.sync()

    def trace_reads(self, index: int, routed: np.ndarray, chosen: np.ndarray) -> None:
        """Expert bytes each layer read in step `index` (routed [L, E] at chosen tier codes [L, E])."""
        if self.trace is None:
            return
        code_bytes = np.zeros(len(TIER_CODES) + 1, np.int64)
        for tier, pool in self.pools.items():
            code_bytes[TIER_CODES[tier]] = pool.slot_nbytes
        for layer, nbytes in enumerate((routed * code_bytes[chosen]).sum(axis=1)):
            self.trace.expert_reads(index, layer, int(nbytes))

    def shortfall(self, step: "StepRouting") -> tuple[dict[Key, int], dict[Key, int]]:
        """(wanted code of every routed expert, those of them that ran below it)."""
        routed, wanted, chosen, _ = step.per_expert()
        return shortfall_of(routed, wanted, chosen)

    def ran_every(self, step: "StepRouting") -> bool:
        """Whether every routed expert the policy did not skip ran at some version (degrade mode
        runs a lower one where the wanted one is missing, never nothing)."""
        routed, wanted, chosen, _ = step.per_expert()
        return not (routed & (wanted != SKIP) & (chosen == SKIP)).any()

    def fits(self, wanted: dict[Key, int]) -> bool:
        """Whether every expert of `wanted` can be resident at its wanted tier at once."""
        need: dict[tuple[str, int], int] = {}  # (tier, shard) -> slots
        for key, code in wanted.items():
            if code != SKIP:
                tier = self.landing_tier(key, code)
                part = (tier, self.pools[tier].owner(key[1]))
                need[part] = need.get(part, 0) + 1
        return all(n <= self.pools[tier].shard_slots for (tier, _), n in need.items())

    def fetch(self, wanted: dict[Key, int], missing: dict[Key, int]) -> None:
        """Make `missing` resident at their wanted tiers (blocking), never evicting any of `wanted`."""
        self.cache.pinned = set(wanted)
        for key, code in missing.items():
            self.cache.request(key, tier_name(code), "demand")
        self.cache.wait(list(missing))
        self.cache.pinned = set()

    def accept(self, step: "StepRouting", fetched: set, missing: dict[Key, int] | None = None) -> None:
        """Books of a step that is kept: uses, hits, misses (fetched for it and replayed), degraded
        and skipped uses (`missing`, fetched now for the steps to come), counters, LRU order."""
        routed, wanted, chosen, counts = step.per_expert()
        short = routed & (chosen < wanted) if missing else np.zeros_like(routed)
        by_policy = routed & (wanted == SKIP)
        was_fetched = np.zeros_like(routed)
        for key in fetched:
            was_fetched[key] = True
        stats = self.stats
        stats.uses += int(routed.sum())
        stats.skipped += int((by_policy | (short & (chosen == SKIP))).sum())
        stats.degraded += int((short & (chosen != SKIP)).sum())
        stats.misses += int((routed & ~by_policy & ~short & was_fetched).sum())
        stats.hits += int((routed & ~by_policy & ~short & ~was_fetched).sum())
        stats.count_uses_of(chosen[routed])
        self.trace_reads(step.step, routed, chosen)
        self.counters.add(counts)
        if self._observing_experts:
            self.policy.observe_experts(counts, np.asarray(step.signals.gate), int(step.valid.sum()))
        if self._observing:  # building per-layer views costs; only if wanted
            self.policy.observe(step.layers(), self.counters)
        self.cache.touch_all(routed)
        keys = [tuple(k) for k in np.argwhere(routed).tolist()] if missing or not self.policy.cache else []
        if missing:  # fetched for the steps to come, never waited for now
            self.cache.pinned = set(keys)
            for key, code in missing.items():
                self.cache.request(key, tier_name(code), "demand", block=False)
            self.cache.pinned = set()
        if not self.policy.cache:
            for key in keys:
                self.cache.drop(key)

    def defer_books(self, signals: StepSignals, summary: np.ndarray, valid: np.ndarray, phase: str) -> None:
        """Keep the books of a settled step that lacked nothing later, with others in one batch
        (catch_up), off the critical path. A policy that observes routing gets each step's at once."""
        self._unbooked.append((self.step_index, phase, valid, signals, summary))
        if len(self._unbooked) >= (1 if self._observing or self._observing_experts else BOOK_BATCH):
            self.catch_up()

    def catch_up(self) -> None:
        """Keep the books of the deferred steps: uses and hits, counters, LRU order."""
        steps, self._unbooked = self._unbooked, []
        if not steps:
            return
        if self._observing or self._observing_experts:
            for index, phase, valid, signals, summary in steps:
                self.accept(StepRouting(index, phase, valid, signals, summary), set())
            return
        summary = np.stack([step[-1] for step in steps])  # [n, 3, L, E]
        counts, wanted = summary[:, 0], summary[:, 1]
        routed = counts > 0
        self.stats.count_uses_of(summary[:, 2][routed])
        for (index, *_), step_routed, chosen in zip(steps, routed, summary[:, 2]):
            self.trace_reads(index, step_routed, chosen)
        by_policy = int((routed & (wanted == SKIP)).sum())
        self.stats.uses += int(routed.sum())
        self.stats.skipped += by_policy
        self.stats.hits += int(routed.sum()) - by_policy
        self.counters.add(counts)
        self.cache.touch_steps(routed)

    @property
    def _observing(self) -> bool:
        return type(self.policy).observe is not Policy.observe

    @property
    def _observing_experts(self) -> bool:
        return type(self.policy).observe_experts is not Policy.observe_experts

    # -- the layer-wise path: one layer at a time

    def landing_tier(self, key: Key, code: int) -> str:
        """The pool an expert runs from at `code`: the version the step would choose, or the one landing."""
        if self.cache.code_in_flight(key) >= code:
            return self.cache.inflight[key].tier
        adequate = [TIER_CODES[t] for t in self.cache.resident.get(key, ()) if TIER_CODES[t] >= code]
        return tier_name(min(adequate) if adequate else code)

    def plan_layer(self, r: LayerRouting) -> tuple[dict[int, str], list[tuple[int, str]]]:
        """Count uses and sort a layer's routed experts into (expert -> tier to run on the device,
        [(expert, tier)] to run on the CPU)."""
        self.cache.poll()  # publish prefetches that landed while earlier layers computed
        self.counters.update(r)
        counts = r.token_counts(self.cfg.num_experts)
        self.last_routed[r.layer] = counts > 0
        device, cpu = self._sort_layer(r, counts)
        read = 0
        for expert, tier in device.items():
            landing = self.landing_tier((r.layer, expert), TIER_CODES[tier])
            self.stats.count_uses(landing)
            read += self.pools[landing].slot_nbytes
        for expert, tier in cpu:
            self.stats.count_uses(tier)
            if self.trace is not None:
                self.trace.cpu(int(counts[expert]))
        if self.trace is not None:
            self.trace.expert_reads(self.step_index, r.layer, read)
        return device, cpu

    def _sort_layer(self, r: LayerRouting, counts) -> tuple[dict[int, str], list[tuple[int, str]]]:
        device, cpu = {}, []
        for expert, code in r.wanted_by_expert().items():
            key = (r.layer, expert)
            self.stats.uses += 1
            if code == SKIP:
                self.stats.skipped += 1
                continue
            if self.cache.serves(key, code):
                self.stats.hits += 1
                self.cache.touch(key)
            elif r.phase in self.policy.degrade_phases and self.cache.code_of(key) > SKIP:
                self.stats.degraded += 1  # the resident lower version serves; the wanted one comes later
                self.cache.touch(key)
                self.cache.request(key, tier_name(code), "demand", block=False)
                device[expert] = tier_name(self.cache.code_of(key))
                continue
            elif self.cache.code_in_flight(key) >= code:
                self.stats.late += 1
            elif self.cpu is not None and counts[expert] <= self.critical_tokens:
                self.stats.cpu_runs += 1
                self.stats.cpu_tokens += int(counts[expert])
                cpu.append((expert, tier_name(code)))
                continue
            else:
                self.stats.misses += 1
            device[expert] = tier_name(code)
        return device, cpu

    def split_passes(self, layer: int, wanted: dict[int, str]) -> list[dict[int, str]]:
        """Groups of the layer's experts that fit the pools together: resident ones first (they need
        no slot, so they run before anything is evicted), then as many to fetch per pass as each
        pool can free (free slots and versions the policy lets go; after the first pass, the slots
        of the experts that ran in it too)."""
        resident = [e for e in wanted if self.cache.serves((layer, e), TIER_CODES[wanted[e]])]
        keys = {(layer, e) for e in wanted}
        to_fetch = {(layer, e) for e in wanted if e not in resident}
        first: dict[tuple[str, int], int] = {}  # (tier, shard) -> slots the resident ones' pass may fill
        later: dict[tuple[str, int], int] = {}  # the same for the passes after it, once those have run
        for tier, pool in self.pools.items():
            for shard in range(pool.shards):
                first[(tier, shard)] = self.cache.room(tier, keys, shard)
                later[(tier, shard)] = self.cache.room(tier, to_fetch, shard)
        passes: list[dict[int, str]] = [{e: wanted[e] for e in resident}] if resident else []
        used: dict[tuple[str, int], int] = {}
        room = first if resident else later
        for expert in (e for e in wanted if e not in resident):
            tier = self.landing_tier((layer, expert), TIER_CODES[wanted[expert]])
            pool = (tier, self.pools[tier].owner(expert))
            if later[pool] == 0:
                raise BudgetError(f"the {tier} pool has no slot the policy lets go for expert {(layer, expert)}")
            if not passes or used.get(pool, 0) >= room[pool]:
                passes.append({})
                used, room = {}, later
            passes[-1][expert] = wanted[expert]
            used[pool] = used.get(pool, 0) + 1
        return passes

    def fetch_pass(self, layer: int, group: dict[int, str]) -> list[Key]:
        keys = [(layer, e) for e in group]
        self.cache.pinned = set(keys)
        for key in keys:
            if self.cache.request(key, group[key[1]], "demand") == "full":
                raise RuntimeError(f"no slot for expert {key} although the pass fits the pools")
        return keys

    def layer_experts(self, layer: int, phase: str, visible=None) -> LayerExperts:
        """One MoE layer's experts for a piece of the layer-wise path, from the host's tables and
        plan in one transfer (indexing the step's device arrays would dispatch a gather per array,
        which a mesh makes slow). `visible`: only these experts' slots (one pass of several)."""
        slots = {}
        for tier, table in self.handles.slot.items():
            if visible is None:
                row = table[layer].copy()  # a copy: the host table changes in place later
            else:
                shown = np.asarray(list(visible), np.int64)
                row = np.full(self.cfg.num_experts, NO_SLOT, np.int32)
                row[shown] = table[layer, shown]
            slots[tier] = row
        p = self.plan
        ratio = 1.0 if p.ratio is None else p.ratio[layer]
        host = (slots, np.array(p.hi[layer], np.int32), np.array(p.lo[layer], np.int32), np.float32(ratio),
                np.float32(p.heavy_hitters))
        slots, hi, lo, ratio, heavy = jax.device_put(host, self.device)
        self.stats.count_io(transfers=len(jax.tree.leaves(host)), nbytes=tree_nbytes(host))
        group_rows = VERIFY_BLOCK_ROWS if phase == "verify" and visible is None else 0  # as for_phase
        return LayerExperts(slots, self.pool_arrays(), hi, lo, ratio, heavy, self.backend, group_rows, self.int8_dot,
                            self.placement.expert_parallel)

    def finish_pass(self, keys: list[Key]) -> None:
        self.cache.pinned = set()
        if not self.policy.cache:
            for key in keys:
                self.cache.drop(key)

    def prefetch_limit(self) -> int:
        return max(1, self.slots // max(1, self.cfg.num_moe_layers))

    def prefetch_predicted(self, layer: int, score: np.ndarray) -> None:
        """Start fetching the experts predicted for `layer`, highest score first, each at the tier
        this step's plan would give it, until the pool is full."""
        ranked = rank_predictions(score, self.prefetch_limit())
        for expert, code in self.plan.layer_tiers(layer, ranked):
            if code != SKIP and self.cache.request((layer, expert), tier_name(code), "prefetch") == "full":
                break

    def finish_layerwise(self, routings: list[LayerRouting]) -> None:
        """A layer-wise step is kept as run (its counters were updated layer by layer)."""
        if self._observing_experts and routings:
            E = self.cfg.num_experts
            counts = np.stack([r.token_counts(E) for r in routings])
            gate = np.stack([np.bincount(r.ids[r.valid].ravel(), weights=r.scores[r.valid].ravel(), minlength=E)
                             for r in routings])
            self.policy.observe_experts(counts, gate, int(routings[0].valid.sum()))
        if self._observing:
            self.policy.observe(routings, self.counters)


class StepRouting:
    """A step's routing on the host: the per-expert summary [3, L, E] (tokens routed, wanted and
    chosen tier code) at once; per-layer LayerRouting views (read from the device on first use)."""

    def __init__(self, step: int, phase: str, valid: np.ndarray, signals: StepSignals, summary: np.ndarray):
        self.step, self.phase, self.valid, self.signals = step, phase, valid, signals
        counts, wanted, chosen = summary
        self._per_expert = (counts > 0, wanted, chosen, counts)

    def per_expert(self):
        """[L, E] arrays: routed by a real token, wanted code, chosen code, token count."""
        return self._per_expert

    def layers(self) -> list[LayerRouting]:
        s = self.signals
        (ids, wanted, chosen), weights, importance = jax.device_get((s.codes, s.weights, s.importance))
        L, n = ids.shape[0], self.valid.shape[0]
        flat = lambda a, layer: a[layer].reshape(n, -1)  # noqa: E731
        return [LayerRouting(self.step, self.phase, layer, L, flat(ids, layer), flat(weights, layer), self.valid,
                             None if importance is None else importance[layer].reshape(n), flat(wanted, layer),
                             flat(chosen, layer)) for layer in range(L)]
