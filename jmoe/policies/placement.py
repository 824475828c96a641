"""HAQ's static placement: a device-resident expert set chosen once from routing traces.

From the experts calibration text routed to (`traces`: [tokens, layers, k] ids), the policy picks
which experts fill the device pool (loaded at start and never evicted); every other expert runs on
the host CPU when the cost model says so, or is fetched into the pool's few remaining slots.
Strategies for choosing the set of `n` experts:
- "frequency": the n experts routed most often overall;
- "paths": a token's activation path is its top-1 expert in every layer; the experts of the most
  frequent paths, hottest path first, until n are chosen;
- "two-stage": stage I takes the experts of the hottest paths, two per layer; stage II then adds,
  round after round, the two most frequent remaining experts of every layer until n are chosen.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from jmoe import validate
from jmoe.errors import InputError
from jmoe.policies.base import Key, Policy

STRATEGIES = ("frequency", "paths", "two-stage")


def routed_counts(traces: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] how often each expert was routed in `traces` [T, L, k]."""
    T, L, k = traces.shape
    flat = np.arange(L)[None, :, None] * num_experts + traces
    return np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts)


def hottest_paths(traces: np.ndarray) -> list[tuple[int, ...]]:
    """Distinct top-1 activation paths, most frequent first (ties: first seen)."""
    return [path for path, _ in Counter(map(tuple, traces[:, :, 0].tolist())).most_common()]


def choose_experts(traces: np.ndarray, num_experts: int, n: int, strategy: str) -> np.ndarray:
    """[L, E] bool: the n experts `strategy` places on the device (see the module docstring)."""
    validate.choice("strategy", strategy, STRATEGIES)
    L = traces.shape[1]
    n = min(n, L * num_experts)
    counts = routed_counts(traces, num_experts)
    chosen = np.zeros((L, num_experts), bool)

    def by_frequency(limit_per_layer: int | None = None):
        order = np.argsort(-counts, axis=None, kind="stable")
        added = np.zeros(L, int)
        for flat in order:
            if chosen.sum() >= n:
                return
            layer, e = divmod(int(flat), num_experts)
            if chosen[layer, e] or (limit_per_layer is not None and added[layer] >= limit_per_layer):
                continue
            chosen[layer, e] = True
            added[layer] += 1

    if strategy == "frequency":
        by_frequency()
    elif strategy == "paths":
        for path in hottest_paths(traces):
            for layer, e in enumerate(path):
                if chosen.sum() < n:
                    chosen[layer, e] = True
        by_frequency()  # fewer distinct path experts than room: fill by frequency
    else:  # two-stage
        for path in hottest_paths(traces):
            for layer, e in enumerate(path):
                if chosen[layer].sum() < 2 and chosen.sum() < n:
                    chosen[layer, e] = True
            if (chosen.sum(axis=1) >= 2).all():
                break
        while chosen.sum() < n:
            before = chosen.sum()
            by_frequency(limit_per_layer=2)
            if chosen.sum() == before:
                break
    return chosen


class StaticPlacement(Policy):
    def __init__(self, traces: np.ndarray, strategy: str = "two-stage", tier: str = "int4", cpu_execution: bool = True,
                 reserve_per_layer: int | None = None, name: str | None = None):
        """traces: [tokens, layers, k] routed expert ids of calibration text (jmoe.decoding.evaluate.window_routing gives them).
        reserve_per_layer: pool slots kept free for experts fetched on demand (default: top-k)."""
        validate.choice("strategy", strategy, STRATEGIES)
        self.traces, self.strategy = np.asarray(traces, np.int64), strategy
        self.reserve = reserve_per_layer
        self.placed: np.ndarray | None = None
        super().__init__(name=name or f"placement-{strategy}", tier=tier, cpu_execution=cpu_execution)

    def size_pools(self, left, slot_nbytes, num_layers, num_experts):
        if self.shards > 1:
            raise InputError(f"policy {self.name!r} places experts for one device; on a mesh use another policy")
        total = num_layers * num_experts
        slots = total if left is None else min(total, left // slot_nbytes[self.tier])
        reserve = self.traces.shape[2] if self.reserve is None else self.reserve
        self.placed = choose_experts(self.traces, num_experts, max(0, slots - reserve), self.strategy)
        return {self.tier: slots}

    def preload(self, num_layers: int, num_experts: int) -> list[tuple[Key, str]]:
        return [((int(layer), int(e)), self.tier) for layer, e in np.argwhere(self.placed)]

    def evictable(self, tier: str, key: Key) -> bool:
        return self.placed is None or not self.placed[key]  # the placed set never leaves

