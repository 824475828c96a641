"""DynaExq: long-horizon hotness decides which experts run at a high tier; the rest stay low.

Each expert holds one version, `hi` or `lo` (the default, keep_lo=False): the budget must hold
every expert at `lo`, and what it leaves buys hi experts at what hi adds over lo each: n_l per
layer on average (or `hi_per_layer`), less two slots per pool (SWAP_SLOTS) kept free for the
copies in flight. With keep_lo=True every expert keeps its lo version under a hi copy, so a hi copy
costs its whole record: in DynaExq 8/32's budget on the tiny model (every expert at int2 and 8 int4
copies a layer) one version an expert holds 156 int4 experts of 256 where keep_lo holds 64
(bench/results/policies/dynaexq_one_version_emr_cpu.json).

Hotness is router counts per (layer, expert) over an interval of `interval` tokens (or, with
hotness="gate", the gate weight the expert received), as a share of the layer's total, folded into
an EMA (hot = alpha * hot + (1 - alpha) * share) when the interval ends. The hi set is the hottest
experts of the whole model, n_l x layers of them (allocation="model"): a layer whose routing is
concentrated holds more hi copies and one whose routing is spread out fewer, as a token's share of
work at hi is what the copies buy; with allocation="layer", each layer's top n_l. On a mesh the same
within each expert shard, each shard's hi set chosen among its own experts. Hysteresis: an outsider
enters only when it beats the weakest member by `margin`, and a member leaves only when an outsider
beats it by `margin`.

With `shift` (a number of standard deviations), a layer notices when its routing moves: a second,
fast EMA (`fast_alpha` per interval) follows the recent routing, and when its distance from the
hotness (total variation of the two shares) exceeds the layer's usual distance by `shift` of its
standard deviations, the layer takes the recent estimate as its hotness: its hi set follows a new
workload within a few intervals instead of the slow EMA's horizon. Off by default: on the tiny
model's shifting streams the long horizon did better (docs/benchmarks.md).

Promotions and demotions run in the background as plan transitions: the version an expert has
keeps serving while the other is copied in (steps never wait for it: the policy degrades in every
phase, so a step whose wanted hi version is still in flight runs the lo one), and it is published
only when complete; then the old version's slot is freed. So a promotion copies hi in and frees
the lo slot, a demotion copies lo in and frees the hi slot, and an expert always has a version.
Nothing is evicted: a transition that finds no free slot waits for a later step. With keep_lo, an
expert leaving the set just drops its hi copy (its lo version is resident all along), and a
promotion evicts only hi copies of experts outside the set.
"""

from __future__ import annotations

import numpy as np

from jmoe import validate
from jmoe.errors import InputError
from jmoe.policies.base import Key, Plan, Policy, StepView
from jmoe.tiers import TIER_CODES, TIER_NAMES


def _shares(x: np.ndarray) -> np.ndarray:
    """Each layer's row as shares of its total."""
    return x / np.maximum(x.sum(axis=1, keepdims=True), 1e-12)


def refill_hi_set(hot: np.ndarray, members: np.ndarray, room: int, margin: float) -> bool:
    """Fill `members` (bool, changed in place) up to `room` with the hottest outsiders, then swap the
    weakest member for the hottest outsider while it wins by more than `margin`; whether it changed.

    The swaps at once: members weakest first (m), outsiders hottest first (o); after i swaps the
    weakest member is min(m[i], o[i-1]) and no member swapped out can win back, so swap i happens
    when o[i] beats that and every swap before it happened."""
    outsiders = np.flatnonzero(~members)
    free = max(room - int(members.sum()), 0)  # fill free places with the hottest
    best = outsiders[np.argsort(-hot[outsiders], kind="stable")[:free]]
    best = best[hot[best] > 0]
    members[best] = True
    inside, outside = np.flatnonzero(members), np.flatnonzero(~members)
    weak = inside[np.argsort(hot[inside], kind="stable")]
    strong = outside[np.argsort(-hot[outside], kind="stable")]
    n = min(len(weak), len(strong))
    m, o = hot[weak[:n]], hot[strong[:n]]
    wins = o > np.minimum(m, np.concatenate([[np.inf], o[:-1]])) + margin
    swaps = n if wins.all() else int(np.argmin(wins))
    members[weak[:swaps]], members[strong[:swaps]] = False, True
    return len(best) + swaps > 0


class DynaExq(Policy):
    # Defaults from the tiny model's shifting streams (bench/policies.py --streams: the three orders
    # of its dev domains, 250 and 2,048 tokens a domain; int4/int2, 8 of 32 experts a layer at
    # int4): gate weight over router counts, an EMA keeping 0.9 of its past per 16 tokens (a
    # half-life of about 100 tokens), and no hysteresis margin (a margin held a stale set at each
    # shift; the lo copy serves while a promotion is in flight, so churn costs bytes, not waits).
    # Over the three streams together 0.9 closed 81% and 78% of the int2 -> int4 gap where 0.7
    # (a half-life of 31 tokens) closed 65% and 74%; a single stream's share moves more with the
    # stream than with the horizon. The model-wide hi set (allocation="model") took that to 83% and
    # 81% (bench/results/policies/dynaexq_allocation_zen4_cpu.json), and one version an expert
    # (keep_lo=False) in the same budget to 96% and 97% (dynaexq_one_version_emr_cpu.json).
    def __init__(self, hi: str = "int4", lo: str = "int2", interval: int = 16, alpha: float = 0.9,
                 margin: float = 0.0, hi_per_layer: int | None = None, hotness: str = "gate",
                 shift: float | None = None, fast_alpha: float = 0.5, allocation: str = "model",
                 keep_lo: bool = False, name: str = "dynaexq"):
        validate.choice("hi", hi, TIER_NAMES)
        validate.choice("lo", lo, TIER_NAMES)
        if TIER_CODES[lo] >= TIER_CODES[hi]:
            raise InputError(f"lo ({lo}) must be a lower tier than hi ({hi})")
        self.hi, self.lo = hi, lo
        self.interval = validate.integer("interval", interval, minimum=1)
        self.alpha = validate.real("alpha", alpha, minimum=0.0, maximum=1.0)
        self.margin = validate.real("margin", margin, minimum=0.0)
        self.hi_per_layer = None if hi_per_layer is None else validate.integer("hi_per_layer", hi_per_layer, minimum=0)
        self.hotness = validate.choice("hotness", hotness, ("count", "gate"))
        self.shift = None if shift is None else validate.real("shift", shift, minimum=0.0)
        self.fast_alpha = validate.real("fast_alpha", fast_alpha, minimum=0.0, maximum=1.0)
        self.allocation = validate.choice("allocation", allocation, ("model", "layer"))
        self.keep_lo = validate.boolean("keep_lo", keep_lo)
        super().__init__(name=name, tier=hi, keep_lower=self.keep_lo, degrade_phases=("prefill", "decode", "verify"),
                         pool_shares={hi: 0.5, lo: 0.5}, never_missing=True)
        self.hot: np.ndarray | None = None  # [L, E] EMA of routed share
        self.window: np.ndarray | None = None  # [L, E] counts of the current interval
        self.recent: np.ndarray | None = None  # [L, E] the fast EMA (with `shift`)
        self.drift: np.ndarray | None = None  # [2, L] the usual distance of recent from hot: mean, variance
        self.intervals = 0
        self.shifts = 0  # layers that took their recent routing as their hotness
        self.tokens = 0
        self.members: np.ndarray | None = None  # [L, E] bool: the hi set
        self.n_hi = 0  # hi copies per layer
        self._codes: np.ndarray | None = None

    # -- sizing and start

    SWAP_SLOTS = 2  # keep_lo=False: free slots per pool (and shard) beyond its share, for copies in flight

    def size_pools(self, left, slot_nbytes, num_layers, num_experts):
        total = num_layers * num_experts
        hi_bytes, lo_bytes = slot_nbytes[self.hi], slot_nbytes[self.lo]
        swap = 0 if self.keep_lo else self.SWAP_SLOTS * (hi_bytes + lo_bytes)
        if left is None:
            per_layer = num_experts
        elif total * lo_bytes + swap > left:
            raise InputError(f"policy {self.name!r} keeps every expert at {self.lo} ({total} x {lo_bytes} bytes"
                             f"{f', and {self.SWAP_SLOTS} slots of each tier for copies in flight' if swap else ''}), "
                             f"which needs more than the {left} bytes the budget leaves for experts")
        elif self.keep_lo:
            per_layer = (left - total * lo_bytes) // hi_bytes // num_layers
        else:  # a hi expert gives its lo slot back
            per_layer = (left - total * lo_bytes - swap) // max(hi_bytes - lo_bytes, 1) / num_layers
        if self.hi_per_layer is not None:
            per_layer = min(per_layer, self.hi_per_layer)
        per_layer = min(per_layer, num_experts)
        if self.keep_lo:
            self._start(num_layers, num_experts * self.shards, int(per_layer))
            return {self.lo: total, self.hi: max(self.n_hi, 1) * num_layers}
        # with one version an expert the model-wide set's size need not be a multiple of the layers
        n = int(per_layer * num_layers) if self.allocation == "model" else int(per_layer) * num_layers
        lo_least = num_experts  # the lo pool keeps a layer's experts' room (a step's working set) however many are hi
        if total - n + self.SWAP_SLOTS < lo_least:
            fits = n if left is None else (left - lo_least * lo_bytes) // hi_bytes - self.SWAP_SLOTS
            n = max(0, min(n, fits))
        self._start(num_layers, num_experts * self.shards, min(int(per_layer), n // num_layers), n)
        return {self.lo: max(total - n + self.SWAP_SLOTS, lo_least), self.hi: n + self.SWAP_SLOTS}

    def _start(self, num_layers: int, num_experts: int, n_hi: int, n_model: int | None = None) -> None:
        """Fresh books for hi sets of `n_hi` experts per layer (per shard), or `n_model` over the model."""
        shape = (num_layers, num_experts)
        self.hot, self.window, self.recent = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.drift, self.intervals, self.shifts = np.zeros((2, num_layers)), 0, 0
        self.n_hi, self.tokens, self._codes = n_hi, 0, None
        self.n_model = n_hi * num_layers if n_model is None else n_model
        # room for every expert of a shard: all of them from the start
        self.members = np.full(shape, n_hi >= num_experts // self.shards)
        if not self.keep_lo:  # the hi slots hold someone from the start, spread over the layers
            width = num_experts // self.shards
            rank = (np.arange(num_experts) % width)[None, :] * num_layers + np.arange(num_layers)[:, None]
            self.members |= rank < self.n_model

    def preload(self, num_layers: int, num_experts: int) -> list[tuple[Key, str]]:
        keys = [(layer, e) for layer in range(num_layers) for e in range(num_experts)]
        lo = keys if self.keep_lo else [key for key in keys if not self.members[key]]
        return [(key, self.lo) for key in lo] + [(key, self.hi) for key in keys if self.members[key]]

    # -- learning hotness

    def observe_experts(self, counts, gate, tokens: int) -> None:
        if self.hot is None:
            return
        self.window += gate if self.hotness == "gate" else counts
        self.tokens += tokens
        if self.tokens >= self.interval:
            share = self.window / np.maximum(self.window.sum(axis=1, keepdims=True), 1)
            self.hot = self.alpha * self.hot + (1 - self.alpha) * share
            if self.shift is not None:
                self._follow_shifts(share)
            self.window[:] = 0
            self.tokens = 0
            self._update_members()

    DRIFT_ALPHA = 0.9  # the EMA of each layer's usual drift
    WARMUP_INTERVALS = 8  # intervals before the usual drift is known

    def _follow_shifts(self, share: np.ndarray) -> None:
        """Layers whose recent routing departs from their hotness by more than usual take it as their hotness."""
        self.recent = self.fast_alpha * self.recent + (1 - self.fast_alpha) * share
        drift = 0.5 * np.abs(_shares(self.recent) - _shares(self.hot)).sum(axis=1)  # [L] total variation
        mean, var = self.drift
        self.intervals += 1
        shifted = np.zeros_like(drift, bool)
        if self.intervals > self.WARMUP_INTERVALS:
            shifted = drift > mean + self.shift * np.sqrt(var)
            self.hot[shifted] = self.recent[shifted]
            self.shifts += int(shifted.sum())
        usual = ~shifted  # a shift does not teach what is usual
        a = self.DRIFT_ALPHA if self.intervals > 1 else 0.0
        new_mean = a * mean + (1 - a) * drift
        var[usual] = (a * var + (1 - a) * (drift - mean) ** 2)[usual]
        mean[usual] = new_mean[usual]

    def _update_members(self) -> None:
        """The hi set: each group's top experts by hotness, with hysteresis (see the module docstring)."""
        changed = False
        for group, room in self._groups():
            view = self.members[group]
            members = view.ravel()  # a copy where the group spans layers: written back below
            changed |= refill_hi_set(self.hot[group].ravel(), members, room, self.margin)
            view[...] = members.reshape(view.shape)
        if changed:
            self._codes = None

    def _groups(self):
        """(index into [L, E], hi copies) of each set of experts that share hi slots: per expert shard,
        its experts of all layers (allocation="model") or of each layer."""
        L, E = self.hot.shape
        width = E // self.shards
        shards = [slice(s * width, (s + 1) * width) for s in range(self.shards)]
        if self.allocation == "model":
            return [((slice(None), cols), self.n_model) for cols in shards]
        return [((layer, cols), self.n_hi) for layer in range(L) for cols in shards]

    # -- planning

    def plan(self, view: StepView) -> Plan:
        if self.hot is None:  # not sized by a load (a plain call): every layer's experts all at lo
            self._start(view.num_layers, view.num_experts, 0)
        if self._codes is None:
            self._codes = np.where(self.members, TIER_CODES[self.hi], TIER_CODES[self.lo]).astype(np.int32)
        hi_resident, hi_moving = view.resident(self.hi), view.in_flight(self.hi)
        promote = np.argwhere(self.members & ~hi_resident & ~hi_moving)
        demote = np.argwhere(~self.members & hi_resident & ~view.in_flight(self.lo))
        transitions = [((int(layer), int(e)), self.lo) for layer, e in demote]  # free hi slots first
        transitions += [((int(layer), int(e)), self.hi) for layer, e in promote]
        return Plan.wanting(self._codes, transitions=transitions)

    def evictable(self, tier: str, key: Key) -> bool:
        # never a member's hi copy (a promotion that finds no other slot waits for a later step),
        # never a lo copy (every expert keeps its lo version); with one version an expert, nothing
        return self.evicts_from(tier) and (self.members is None or not self.members[key])

    def evicts_from(self, tier: str) -> bool:
        return self.keep_lo and tier == self.hi

    def report(self, view_cache) -> dict[str, int]:
        """How many experts are Resident-Lo, Promoting, Resident-Hi and Demoting now."""
        if self.members is None:
            return {}
        hi = view_cache.handles.resident(self.hi)
        moving = np.zeros_like(hi)
        for key, t in view_cache.inflight.items():
            moving[key] |= t.tier == self.hi
        return {"resident_lo": int((~hi & ~moving).sum()), "promoting": int(moving.sum()),
                "resident_hi": int((hi & self.members).sum()), "demoting": int((hi & ~self.members).sum())}

    def __repr__(self) -> str:
        return (f"DynaExq(hi={self.hi!r}, lo={self.lo!r}, interval={self.interval}, alpha={self.alpha:g}, "
                f"margin={self.margin:g}, hi_per_layer={self.hi_per_layer}, hotness={self.hotness!r}, "
                f"shift={self.shift}, fast_alpha={self.fast_alpha:g}, allocation={self.allocation!r}, "
                f"keep_lo={self.keep_lo})")
