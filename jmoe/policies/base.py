"""Expert residency policies.

A policy sees, per step and MoE layer, the router's top-k ids and scores (and in prefill a
per-token importance from attention), the layer's depth and long-horizon per-expert counters; it
answers with the tier it wants for each routed expert this step (0 = skip it). Whether experts
stay cached, whether the next layer is prefetched and whether cold experts may run on the CPU
are properties of the policy too. The cache manager turns its answers into fetches and evictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jmoe.errors import InputError
from jmoe.tiers import TIER_CODES


@dataclass
class LayerRouting:
    """What one MoE layer's router decided for this step's tokens."""

    step: int
    phase: str  # "prefill" | "decode"
    layer: int  # MoE layer index (handle-table row)
    num_layers: int
    ids: np.ndarray  # [N, k] top-k experts
    scores: np.ndarray  # [N, k] their combine weights
    valid: np.ndarray  # [N] False on padding
    importance: np.ndarray | None = None  # [N] prefill: mean attention each token received

    def experts(self) -> np.ndarray:
        """Distinct experts routed to by real tokens."""
        return np.unique(self.ids[self.valid])

    def token_counts(self, num_experts: int) -> np.ndarray:
        return np.bincount(self.ids[self.valid].ravel(), minlength=num_experts)


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


@dataclass
class Policy:
    name: str
    tier: str  # the tier experts run at (and are prefetched and calibrated at)
    cache: bool = True  # keep fetched experts resident (False: evict after use)
    prefetch: bool = False  # fetch the next layer's predicted experts while this layer computes
    cpu_execution: bool = False  # run cold experts with few tokens on the host CPU
    everything_resident: bool = False  # all experts preloaded; nothing is ever fetched
    wants_importance: bool = False  # prefill routing carries each token's received attention
    # Resident path: a step in which a routed expert was not resident at its wanted tier is
    # re-run after fetching it (exact), except in these phases ("prefill", "decode"), where the
    # step is kept (the expert ran at its best resident tier, or was left out: counted as degraded
    # or skipped) and the expert is fetched for later steps.
    degrade_phases: tuple[str, ...] = ()
    # Device pools, tier -> share of the expert budget. None: one pool, of the run tier. A policy
    # that asks for several tiers in wanted_tiers needs a pool for each of them.
    pool_shares: dict[str, float] | None = None

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
        if not set(self.degrade_phases) <= {"prefill", "decode"}:
            raise InputError(f"policy {self.name!r}: degrade_phases must name 'prefill' or 'decode', "
                             f"not {self.degrade_phases}")
        if sum(shares.values()) > 1 + 1e-9:
            raise InputError(f"policy {self.name!r}: pool shares add up to {sum(shares.values()):g}, more than 1")

    def wanted_tiers(self, routing: LayerRouting, counters: ExpertCounters) -> dict[int, int]:
        """Tier code wanted for each routed expert this step (0 = skip). Baselines never degrade."""
        code = TIER_CODES[self.tier]
        return {int(e): code for e in routing.experts()}


POLICY_NAMES = ("resident", "ondemand", "lru", "lru+prefetch", "lru+cpu", "lru+prefetch+cpu")


def make_policy(name: str, tier: str) -> Policy:
    if name not in POLICY_NAMES:
        raise InputError(f"unknown policy {name!r}; available: {', '.join(POLICY_NAMES)}")
    parts = set(name.split("+"))
    return Policy(
        name=name,
        tier=tier,
        cache="ondemand" not in parts,
        prefetch="prefetch" in parts,
        cpu_execution="cpu" in parts,
        everything_resident=name == "resident",
    )
