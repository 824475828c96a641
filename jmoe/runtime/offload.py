"""The offload runtime: experts live on the host; budget-sized device pools, one per tier, cache them.

Two execution paths share the layer code (DESIGN.md section 2):
- "layerwise" (default, exact): per-layer jitted pieces; the host sees each layer's routing and
  fetches, prefetches or runs on the CPU before the layer's experts run.
- "resident": one jitted forward per step over whatever is resident (a routed expert runs at its
  resident tier, or is left out if none is); the host reads the step's routing afterwards. If a
  routed expert was below its wanted tier, it is fetched and the step replayed, or, in the phases
  the policy lists in degrade_phases, the step is kept and the miss counted as degraded or skipped.
  A step whose experts cannot all be resident at once runs layer-wise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import jax
import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import BudgetError, InputError
from jmoe.layers.experts import ExpertState
from jmoe.policies import ExpertCounters, LayerRouting, Policy
from jmoe.runtime.budget import BudgetTracker, format_size
from jmoe.runtime.cache import CacheManager
from jmoe.runtime.cpu_exec import CpuExecutor
from jmoe.runtime.handles import HandleTable
from jmoe.runtime.host_store import HostStore
from jmoe.runtime.layerwise import LayerwiseStep, token_importance
from jmoe.runtime.pools import TierPool, slot_nbytes
from jmoe.runtime.stats import Stats
from jmoe.runtime.store import ExpertStore
from jmoe.tiers import SKIP, TIER_CODES, tier_name

PATHS = ("layerwise", "resident")


@dataclass(frozen=True)
class PoolPlan:
    slots: dict[str, int]  # tier -> slots of its pool
    slot_nbytes: dict[str, int]
    staging_nbytes: int

    @property
    def nbytes(self) -> int:
        return sum(self.slots[t] * self.slot_nbytes[t] for t in self.slots)


def plan_pools(store: ExpertStore, shares: dict[str, float], fixed: int, budget: int | None,
               staging_transfers: int) -> PoolPlan:
    """Size one pool per tier from what the budget leaves after the fixed reservations.

    Each tier gets its share of that remainder. A pool must hold at least one token's experts of
    one layer (top_k slots); staging is sized for `staging_transfers` of the largest record. With
    no budget every pool can hold every expert.
    """
    cfg = store.config
    per_slot = {t: slot_nbytes(store, t) for t in shares}
    staging = staging_transfers * max(store.record_nbytes(t) for t in shares)
    total_experts = cfg.num_moe_layers * cfg.num_experts
    if budget is None:
        return PoolPlan({t: total_experts for t in shares}, per_slot, staging)
    left = budget - fixed - staging
    slots = {t: int(min(total_experts, max(0, left) * share // per_slot[t])) for t, share in shares.items()}
    if any(n < cfg.top_k for n in slots.values()):
        need = max(-(-cfg.top_k * per_slot[t] // share) for t, share in shares.items())
        pools = ", ".join(f"{cfg.top_k} experts x {format_size(per_slot[t])} at {t}" for t in shares)
        raise BudgetError(
            f"device budget {format_size(budget)} cannot hold the dense weights, KV cache and one layer's "
            f"working set: needs at least {format_size(fixed + staging + int(need))} ({format_size(fixed)} fixed + "
            f"{format_size(staging)} transfer staging + {pools})"
        )
    return PoolPlan(slots, per_slot, staging)


class OffloadRuntime:
    def __init__(self, cfg: ModelConfig, store: ExpertStore, policy: Policy, tracker: BudgetTracker, plan: PoolPlan,
                 graphdef, dense, device, compute_dtype, *, path: str = "layerwise", backend: str | None = None,
                 cpu_critical_tokens: int | None = None, progress: bool | None = None):
        if path not in PATHS:
            raise InputError(f"unknown execution path {path!r}; choose from {', '.join(PATHS)}")
        self.cfg, self.policy, self.path, self.backend, self.device = cfg, policy, path, backend, device
        self.tier = policy.tier
        self.stats = Stats()
        self.counters = ExpertCounters(cfg.num_moe_layers, cfg.num_experts)
        self.step_index = 0
        tracker.reserve("experts", plan.nbytes)
        tracker.reserve("staging", plan.staging_nbytes)
        self.tracker = tracker
        self.host = HostStore(store, tuple(plan.slots), device, progress=progress)
        self.pools = {tier: TierPool(store, tier, slots, device) for tier, slots in plan.slots.items()}
        self.handles = HandleTable(cfg.num_moe_layers, cfg.num_experts, device)
        self.cache = CacheManager(self.host, self.pools, self.handles, BudgetTracker(plan.staging_nbytes), self.stats,
                                  device)
        self.layerwise = LayerwiseStep(self, graphdef, dense)
        self.cpu = None
        self.critical_tokens = 0
        if policy.cpu_execution:
            self.cpu = CpuExecutor(self.host, device, compute_dtype)
            cost = self.cpu.calibrate(self.tier)
            self.critical_tokens = cost.critical_tokens if cpu_critical_tokens is None else cpu_critical_tokens

    def reset_stats(self) -> None:
        """Start counting afresh (the cache keeps its contents; earlier prefetches are not credited)."""
        self.stats = self.cache.stats = Stats()
        self.cache.prefetched.clear()

    # -- what the forward reads

    @property
    def slots(self) -> int:
        """Slots of the run tier's pool."""
        return self.pools[self.tier].slots

    def pool_arrays(self) -> dict:
        return {tier: pool.arrays for tier, pool in self.pools.items()}

    def expert_state(self) -> ExpertState:
        tier, slot = self.handles.on_device()
        return ExpertState(tier, slot, self.pool_arrays(), self.backend)

    def handle_rows(self, layer: int, experts) -> tuple[jax.Array, jax.Array]:
        """One layer's handle rows with only `experts` visible (a pass of the layer-wise path)."""
        tier_row = np.zeros(self.cfg.num_experts, np.int32)
        chosen = np.asarray(list(experts), np.int64)
        tier_row[chosen] = self.handles.tier[layer, chosen]
        return jax.device_put(tier_row, self.device), jax.device_put(self.handles.slot[layer], self.device)

    # -- layer-wise path

    def wanted(self, r: LayerRouting) -> dict[int, int]:
        """The policy's tier code per routed expert, checked against the pools."""
        wanted = self.policy.wanted_tiers(r, self.counters)
        for expert, code in wanted.items():
            if code != SKIP and tier_name(code) not in self.pools:
                raise InputError(f"policy {self.policy.name!r} asked for {tier_name(code)} (layer {r.layer}, expert "
                                 f"{expert}) but has no {tier_name(code)} pool; add it to the policy's pool_shares")
        return wanted

    def landing_tier(self, key, code: int) -> str:
        """The pool an expert occupies when it runs: its resident tier if that is good enough."""
        if self.cache.code_in_flight(key) >= code:
            return self.cache.inflight[key].tier
        resident = self.cache.code_of(key)
        return tier_name(resident if resident >= code else code)

    def plan_layer(self, r: LayerRouting) -> tuple[dict[int, str], list[tuple[int, str]]]:
        """Count uses and sort the layer's routed experts into (expert -> tier to run on the device,
        [(expert, tier)] to run on the CPU)."""
        self.cache.poll()  # publish prefetches that landed while earlier layers computed
        wanted = self.wanted(r)
        self.counters.update(r)
        counts = r.token_counts(self.cfg.num_experts)
        device, cpu = {}, []
        for expert, code in wanted.items():
            key = (r.layer, expert)
            self.stats.uses += 1
            if code == SKIP:
                self.stats.skipped += 1
                continue
            if self.cache.code_of(key) >= code:
                self.stats.hits += 1
                self.cache.touch(key)
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
        """Groups whose experts fit the pools together (each pool counted apart); resident experts
        first so they run before anything is evicted."""
        ordered = sorted(wanted, key=lambda e: self.cache.code_of((layer, e)) == SKIP)
        passes: list[dict[int, str]] = []
        used: dict[str, int] = {}
        for expert in ordered:
            pool = self.landing_tier((layer, expert), TIER_CODES[wanted[expert]])
            if not passes or used.get(pool, 0) == self.pools[pool].slots:
                passes.append({})
                used = {}
            passes[-1][expert] = wanted[expert]
            used[pool] = used.get(pool, 0) + 1
        return passes

    def fetch_group(self, layer: int, group: dict[int, str]) -> list[tuple[int, int]]:
        keys = [(layer, e) for e in group]
        self.cache.pinned = set(keys)
        for key in keys:
            if self.cache.request(key, group[key[1]], "demand") == "full":
                raise RuntimeError(f"no slot for expert {key} although the pass fits the pools")
        return keys

    def finish_group(self, keys) -> None:
        self.cache.pinned = set()
        if not self.policy.cache:
            for key in keys:
                self.cache.drop(key)

    def prefetch_limit(self) -> int:
        return max(1, self.slots // max(1, self.cfg.num_moe_layers))

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start fetching `experts` (ranked, already cut to prefetch_limit) until the pool is full."""
        for expert in experts:
            if self.cache.request((layer, expert), self.tier, "prefetch") == "full":
                break

    # -- stepping

    def step(self, engine, dense, tokens, cache, write_start, key_start, *, last_only: bool, phase: str):
        """One forward step (any number of tokens); returns (logits, cache).

        Whatever happens inside (a policy raising, an interrupt), the step's pins are dropped on
        the way out, so the cache stays usable and consistent for the next call.
        """
        try:
            self.cache.poll()
            self.stats.steps += 1
            self.step_index += 1
            if self.path == "resident":
                return self._resident_step(engine, dense, tokens, cache, write_start, key_start, last_only, phase)
            return self.layerwise.run(tokens, cache, write_start, key_start, last_only=last_only, phase=phase)
        finally:
            self.cache.pinned = set()

    def _routings(self, signals, valid, phase, write_start: int) -> list[LayerRouting]:
        ids, weights = np.asarray(signals.ids), np.asarray(signals.weights)  # [L, B, T, k]
        L, T = self.cfg.num_moe_layers, ids.shape[2]
        importance = [None] * L if signals.importance is None else signals.importance
        return [LayerRouting(self.step_index, phase, layer, L, ids[layer].reshape(len(valid), -1),
                             weights[layer].reshape(len(valid), -1), valid,
                             token_importance(importance[layer], write_start, T)) for layer in range(L)]

    def _resident_step(self, engine, dense, tokens, cache, write_start, key_start, last_only, phase):
        B, T = tokens.shape
        valid = ((write_start + np.arange(T))[None, :] >= np.asarray(key_start)[:, None]).reshape(-1)
        fetched: set = set()
        # Each replay makes at least one more layer exact (its experts stay pinned), so L + 1 runs
        # always suffice for a policy whose wants follow the routing.
        for _ in range(self.cfg.num_moe_layers + 1):
            want_importance = phase == "prefill" and self.policy.wants_importance
            logits, cache, signals = engine.forward(dense, self.expert_state(), tokens, cache, write_start, key_start,
                                                    last_only=last_only, want_importance=want_importance)
            routings = self._routings(signals, valid, phase, write_start)
            needed = {(r.layer, e): code for r in routings for e, code in self.wanted(r).items() if code != SKIP}
            missing = [key for key, code in needed.items() if self.cache.code_of(key) < code]
            if not missing:
                self._accept(routings, needed, fetched)
                return logits, cache
            if phase in self.policy.degrade_phases:
                self._accept_degraded(routings, needed, missing)
                return logits, cache
            occupancy = Counter(self.landing_tier(key, code) for key, code in needed.items())
            if any(n > self.pools[tier].slots for tier, n in occupancy.items()):
                # This step's experts cannot all be resident together: run it layer by layer.
                return self.layerwise.run(tokens, cache, write_start, key_start, last_only=last_only, phase=phase)
            self.cache.pinned = set(needed)
            for key in missing:
                self.cache.request(key, tier_name(needed[key]), "demand")
            self.cache.wait(missing)
            self.cache.pinned = set()
            fetched.update(missing)
            self.stats.replays += 1
        # The wants kept moving (a policy that answers differently each time it is asked): stop
        # chasing them and run the step layer by layer, which fetches as it goes.
        return self.layerwise.run(tokens, cache, write_start, key_start, last_only=last_only, phase=phase)

    def _accept_degraded(self, routings: list[LayerRouting], needed: dict, missing: list) -> None:
        """Keep a resident-path step that ran some experts below their wanted tier or not at all;
        fetch those for the steps to come."""
        for key in missing:
            if self.cache.code_of(key) > SKIP:
                self.stats.degraded += 1  # ran at its best resident tier
            else:
                self.stats.skipped += 1  # nothing resident: its contribution was left out
        self.stats.hits += len(needed) - len(missing)
        self._kept(routings, needed)
        self.cache.pinned = set(needed)
        for key in missing:
            self.cache.request(key, tier_name(needed[key]), "demand")
        self.cache.pinned = set()

    def _accept(self, routings: list[LayerRouting], needed: dict, fetched: set) -> None:
        """Account for a resident-path step whose every expert was resident on its last run."""
        misses = sum(1 for key in needed if key in fetched)
        self.stats.misses += misses
        self.stats.hits += len(needed) - misses
        self._kept(routings, needed)
        if not self.policy.cache:
            for key in needed:
                self.cache.drop(key)

    def _kept(self, routings: list[LayerRouting], needed: dict) -> None:
        """Uses, long-horizon counters and LRU order of a step the resident path keeps."""
        self.stats.uses += len(needed)
        for r in routings:
            self.counters.update(r)
        for key in needed:
            self.cache.touch(key)
