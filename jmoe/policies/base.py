"""The Policy interface: before each step a plan, after it the step's routing, and its eviction choice.

Before a step the runtime asks `plan(view)`. A Plan says, for every (MoE layer, expert), the tier
a routed expert should run at this step: the top `ratio` of a layer's routed experts by importance
(gate scores in decode, heavy-hitter tokens in prefill) want `hi`, the others `lo` (0 = skip it).
That choice is made inside the jitted step from these arrays, so it changes per step without
recompiling. A plan also lists experts to fetch now (prefetch, as (key, tier)) and background
transitions (load a version of an expert while the current one keeps serving; a lower target is
a demotion, which frees the higher version once the lower one is published). After the step the
runtime hands the policy every layer's routing (`observe`), and when a pool is full it asks the
policy which expert to evict (`victim`, least recently used first by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jmoe.errors import InputError
from jmoe.tiers import SKIP, TIER_CODES, tier_name

Key = tuple[int, int]  # (MoE layer, expert)


@dataclass
class LayerRouting:
    """What one MoE layer's router decided for a step's tokens, and which tiers ran."""

    step: int
    phase: str  # "prefill" | "decode" | "verify" (k + 1 tokens per row of speculative decoding)
    layer: int  # MoE layer index (handle-table row)
    num_layers: int
    ids: np.ndarray  # [N, k] top-k experts
    scores: np.ndarray  # [N, k] their combine weights
    valid: np.ndarray  # [N] False on padding
    importance: np.ndarray | None = None  # [N] prefill: mean attention each token received
    wanted: np.ndarray | None = None  # [N, k] tier code the plan wanted (0 = skip)
    chosen: np.ndarray | None = None  # [N, k] tier code that ran (0 = none)

    def experts(self) -> np.ndarray:
        """Distinct experts routed to by real tokens."""
        return np.unique(self.ids[self.valid])

    def token_counts(self, num_experts: int) -> np.ndarray:
        return np.bincount(self.ids[self.valid].ravel(), minlength=num_experts)

    def wanted_by_expert(self) -> dict[int, int]:
        """Wanted tier code of each routed expert (all of an expert's assignments agree)."""
        ids, wanted = self.ids[self.valid].ravel(), self.wanted[self.valid].ravel()
        return dict(zip(ids.tolist(), wanted.tolist()))


class ExpertCounters:
    """Long-horizon routing statistics per (layer, expert): totals and an EMA per step."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.9):
        self.total = np.zeros((num_layers, num_experts), np.int64)
        self.ema = np.zeros((num_layers, num_experts), np.float64)
        self.decay = decay

    def update(self, routing: LayerRouting) -> None:
        counts = routing.token_counts(self.total.shape[1])
        self.total[routing.layer] += counts
        self.ema[routing.layer] = self.decay * self.ema[routing.layer] + (1 - self.decay) * counts

    def add(self, counts: np.ndarray) -> None:
        """One step's token counts of every layer [L, E], or several steps' [n, L, E] in order."""
        if counts.shape == self.total.shape:  # one step (every decode step): no stacking, in place
            self.total += counts
            self.ema *= self.decay
            self.ema += (1 - self.decay) * counts
            return
        counts = counts.reshape(-1, *self.total.shape)
        n = counts.shape[0]
        self.total += counts.sum(axis=0)
        weights = (1 - self.decay) * self.decay ** np.arange(n - 1, -1, -1)  # the newest step weighs most
        self.ema = self.decay**n * self.ema + np.tensordot(weights, counts, axes=1)


@dataclass(frozen=True)
class StepView:
    """What a policy sees when planning a step (the cache is there to be read, not changed)."""

    step: int
    phase: str
    num_layers: int
    num_experts: int
    counters: ExpertCounters
    cache: object = None

    def resident(self, tier: str) -> np.ndarray:
        """[L, E] bool: which experts have a published version of `tier`."""
        if self.cache is None or tier not in self.cache.handles.slot:
            return np.zeros((self.num_layers, self.num_experts), bool)
        return self.cache.handles.resident(tier)

    def in_flight(self, tier: str) -> np.ndarray:
        """[L, E] bool: which experts have a version of `tier` being copied in."""
        out = np.zeros((self.num_layers, self.num_experts), bool)
        for key, t in (self.cache.inflight.items() if self.cache is not None else ()):
            out[key] |= t.tier == tier
        return out


@dataclass
class Plan:
    """A policy's answer for one step (see the module docstring). hi, lo: [L, E] tier codes; ratio: [L]."""

    hi: np.ndarray
    lo: np.ndarray
    ratio: np.ndarray
    heavy_hitters: float = 0.1
    prefetch: list[tuple[Key, str]] = field(default_factory=list)
    transitions: list[tuple[Key, str]] = field(default_factory=list)

    @classmethod
    def wanting(cls, codes: np.ndarray, **kw) -> "Plan":
        """Each routed expert at its own tier code ([L, E]; 0 = skip), whatever its importance."""
        codes = np.asarray(codes, np.int32)
        return cls(codes, codes, np.ones(codes.shape[0], np.float32), **kw)

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, tier: str, **kw) -> "Plan":
        return cls.wanting(np.full((num_layers, num_experts), TIER_CODES[tier], np.int32), **kw)

    def layer_tiers(self, layer: int, ranked: list[int]) -> list[tuple[int, int]]:
        """(expert, wanted code) for experts ranked by expected importance, as the step would choose."""
        critical = int(np.ceil(float(self.ratio[layer]) * len(ranked)))
        return [(e, int(self.hi[layer, e] if i < critical else self.lo[layer, e])) for i, e in enumerate(ranked)]

    def codes(self) -> set[int]:
        return set(np.unique(self.hi).tolist()) | set(np.unique(self.lo).tolist())

    def tiers(self) -> tuple[str, ...]:
        """The tiers the plan runs experts at, most precise first (skipping is not a tier)."""
        return tuple(tier_name(c) for c in sorted(self.codes() - {SKIP}, reverse=True))


@dataclass
class Policy:
    name: str
    tier: str  # the tier experts run at by default (and are prefetched and calibrated at)
    cache: bool = True  # keep fetched experts resident (False: evict after use)
    prefetch: bool = False  # fetch the next layer's predicted experts while this layer computes
    cpu_execution: bool = False  # run cold experts with few tokens on the host CPU
    everything_resident: bool = False  # all experts preloaded; nothing is ever fetched
    # The plan depends on nothing but the model's shape (DyMoE): where every expert of each pool tier
    # fits the budget, load holds them all and runs without a cache (AllResident at several tiers).
    fixed_plan: bool = False
    wants_importance: bool = False  # prefill routing carries each token's received attention
    # A step in which a routed expert ran below its wanted tier (or not at all) is re-run after
    # fetching it (exact), except in these phases ("prefill", "decode", "verify"), where the step is kept and
    # the expert is fetched for later steps (counted as degraded or skipped).
    degrade_phases: tuple[str, ...] = ()
    # Every expert keeps a published version from load on (DynaExq's lo floor): a step that degrades
    # never lacks one, so it gets no slots to fetch misses into (nor their scratch in the pools).
    never_missing: bool = False
    # Device pools, tier -> share of the expert budget. None: one pool, of the run tier. A policy
    # whose plans ask for several tiers needs a pool for each of them.
    pool_shares: dict[str, float] | None = None
    # Keep an expert's lower versions resident when a higher one lands (True), or let the higher
    # version replace them (False: DyMoE's no-duplication cache).
    keep_lower: bool = False
    # Expert shards of a mesh (load sets it): size_pools then sizes one shard's pools (of
    # num_experts / shards experts per layer) and a policy with its own residency sets keeps one per shard.
    shards: int = field(default=1, init=False, repr=False, compare=False)
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def pools(self) -> dict[str, float]:
        return dict(self.pool_shares) if self.pool_shares else {self.tier: 1.0}

    def check(self) -> None:
        """Raise InputError for pool shares that cannot work."""
        shares = self.pools()
        for tier, share in shares.items():
            if tier not in TIER_CODES:
                raise InputError(f"policy {self.name!r}: unknown pool tier {tier!r}")
            if not share > 0:
                raise InputError(f"policy {self.name!r}: the {tier} pool's share must be positive, not {share}")
        if self.tier not in shares:
            raise InputError(f"policy {self.name!r} runs at {self.tier} but has no {self.tier} pool")
        if not set(self.degrade_phases) <= {"prefill", "decode", "verify"}:
            raise InputError(f"policy {self.name!r}: degrade_phases must name 'prefill', 'decode' or 'verify', "
                             f"not {self.degrade_phases}")
        if sum(shares.values()) > 1 + 1e-9:
            raise InputError(f"policy {self.name!r}: pool shares add up to {sum(shares.values()):g}, more than 1")

    def plan(self, view: StepView) -> Plan:
        """This step's plan. Baselines: every routed expert at the policy's tier, nothing else."""
        key = (view.num_layers, view.num_experts)
        if key not in self._plans:  # the same object every step: the runtime reuses its device copy
            self._plans[key] = Plan.uniform(view.num_layers, view.num_experts, self.tier)
        return self._plans[key]

    def observe(self, routings: list[LayerRouting], counters: ExpertCounters) -> None:
        """Every MoE layer's routing of the step just kept (counters already include it). A policy
        that overrides it costs steps that fetch their own experts one more read each: prefer
        observe_experts where per-expert totals suffice."""

    def observe_experts(self, counts: np.ndarray, gate: np.ndarray, tokens: int) -> None:
        """The step just kept, per (MoE layer, expert) [L, E]: tokens routed to each and the gate
        weight it received, over `tokens` real tokens."""

    def evictable(self, tier: str, key: Key) -> bool:
        """Whether `key`'s version in `tier`'s pool may be evicted at all (pinned ones never are)."""
        return True

    def evicts_from(self, tier: str) -> bool:
        """False when no version in `tier`'s pool may ever be evicted (evictable is then not asked)."""
        return True

    def victim(self, tier: str, candidates: list[Key]) -> Key | None:
        """Which of `candidates` (evictable, resident in `tier`'s pool, least recently used first) to
        evict; None refuses (the request that needed the slot is then deferred or fails)."""
        return candidates[0]

    def size_pools(self, left: int | None, slot_nbytes: dict[str, int], num_layers: int,
                   num_experts: int) -> dict[str, int] | None:
        """Slots per pool for `left` expert bytes (None: no budget); None splits by pool_shares."""
        return None

    def report(self, cache) -> dict:
        """Policy-specific state for jmoe.stats (e.g. how many experts are in each state)."""
        return {}

    def preload(self, num_layers: int, num_experts: int) -> list[tuple[Key, str]]:
        """Expert versions to make resident at load, before the first step."""
        return []


def check_plan(plan: Plan, pools, num_layers: int, num_experts: int, name: str) -> None:
    """A plan's arrays have the right shapes and ask only for tiers that have a pool."""
    for label, arr, shape in (("hi", plan.hi, (num_layers, num_experts)), ("lo", plan.lo, (num_layers, num_experts)),
                              ("ratio", plan.ratio, (num_layers,))):
        if np.shape(arr) != shape:
            raise InputError(f"policy {name!r}: plan.{label} has shape {np.shape(arr)}, expected {shape}")
    codes = {c for c in plan.codes() if c != SKIP}
    names = {code: tier for tier, code in TIER_CODES.items()}
    for code in sorted(codes):
        if names.get(code) not in pools:
            tier = names.get(code, f"code {code}")
            raise InputError(f"policy {name!r} asked for {tier} (in its plan) but has no {tier} pool; add it to the policy's "
                             f"pool_shares")
