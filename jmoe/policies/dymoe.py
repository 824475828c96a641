"""DyMoE: per step, each layer's most important routed experts run at a high tier, the rest low.

Importance is decided inside the step (jmoe/layers/experts.py): in prefill, a token's importance
is the mean over heads of the attention it receives; the top `heavy_hitters` fraction of a row's
real tokens are heavy hitters, and an expert's importance is how many heavy hitters it was routed
(ties broken by how many tokens it was routed); in decode it is the gate score the expert received,
summed over the batch. In layer l, with M_l the number of distinct experts routed by this step's
real tokens, the t_l = ceil(r(l) * M_l) most important ones are critical and run at `hi`; the
others run at `lo`, or are skipped when `lo` is None ("4/0"). Skipped experts' gate weights are
not renormalised: their contribution is dropped, the kept experts keep their router weights.

The depth schedule keeps more experts critical in early layers:
r(l) = (1 - lam) (cos(pi l / (L - 1)) + 1) / 2 + lam, whose mean over layers is (1 + lam) / 2, so
a target mean r gives lam = 2 r - 1 (r = 1: every routed expert at `hi`).

Where the budget holds every expert at both tiers (no budget, as on a CPU whose memory holds the
model twice over), nothing is offloaded: load keeps both tiers whole and each step picks among them
inside itself (jmoe/runtime/residency.py: AllResident with the plan), reading the low tier's fewer
bytes for the experts that matter least. Otherwise the pools cache what the budget allows.

Prefetch is phase-adaptive (jmoe/runtime/layerwise.py): while layer l computes, layer l + 1's
router applied to layer l's state ranks experts by predicted tokens (prefill) or predicted gate
(decode); the top ones are fetched at the tier the schedule would give them.
"""

from __future__ import annotations

import math

import numpy as np

from jmoe import validate
from jmoe.errors import InputError
from jmoe.policies.base import Plan, Policy, StepView
from jmoe.tiers import TIER_BITS, TIER_CODES, TIER_NAMES


def depth_schedule(num_layers: int, lam: float) -> np.ndarray:
    """r(l) for l in 0..L-1 (see the module docstring)."""
    if num_layers == 1:
        return np.ones(1, np.float32)
    l = np.arange(num_layers)
    return ((1 - lam) * (np.cos(np.pi * l / (num_layers - 1)) + 1) / 2 + lam).astype(np.float32)


def critical_share(num_layers: int, top_k: int, lam: float) -> float:
    """The share of a batch-1 decode token's routed experts that run at `hi`: ceil(r(l) k) of the k
    in layer l (the step's rule; the small margin keeps float32 rounding from adding one)."""
    r = depth_schedule(num_layers, lam)
    return sum(math.ceil(float(x) * top_k - 1e-6) for x in r) / (top_k * num_layers)


DEFAULT_R = 0.75  # the mean share of a step's routed experts at hi when neither r nor lam is given


class DyMoE(Policy):
    def __init__(self, hi: str = "int4", lo: str | None = "int2", r: float | None = DEFAULT_R, lam: float | None = None,
                 heavy_hitters: float = 0.1, pool_shares: dict[str, float] | None = None, name: str = "dymoe"):
        validate.choice("hi", hi, TIER_NAMES)
        if lo is not None:
            validate.choice("lo", lo, TIER_NAMES)
            if TIER_CODES[lo] >= TIER_CODES[hi]:
                raise InputError(f"lo ({lo}) must be a lower tier than hi ({hi})")
        if lam is None:
            r = validate.real("r", DEFAULT_R if r is None else r, minimum=0.5, maximum=1.0)
            lam = 2 * r - 1
        elif r is not None:
            raise InputError("give r or lam, not both")
        self.lam = validate.real("lam", lam, minimum=0.0, maximum=1.0)
        self.r = (1 + self.lam) / 2
        self.hi, self.lo = hi, lo
        self.heavy_hitters = validate.real("heavy_hitters", heavy_hitters, above=0.0, maximum=1.0)
        if pool_shares is None:  # split by how many bytes each tier is expected to run
            if lo is None:
                pool_shares = {hi: 1.0}
            else:
                hi_bytes, lo_bytes = self.r * TIER_BITS[hi], (1 - self.r) * TIER_BITS[lo]
                lo_share = max(0.1, lo_bytes / (hi_bytes + lo_bytes))
                pool_shares = {hi: 1.0 - lo_share, lo: lo_share}
        # Decode degrades (DyMoE's semantics: a missing expert runs at the resident lower version, or
        # is skipped, and is fetched for the steps to come); the prompt is exact.
        super().__init__(name=name, tier=hi, prefetch=True, wants_importance=True, pool_shares=pool_shares,
                         degrade_phases=("decode", "verify"), fixed_plan=True)

    def plan(self, view: StepView) -> Plan:
        key = (view.num_layers, view.num_experts)
        if key not in self._plans:
            shape = (view.num_layers, view.num_experts)
            lo_code = 0 if self.lo is None else TIER_CODES[self.lo]
            self._plans[key] = Plan(np.full(shape, TIER_CODES[self.hi], np.int32), np.full(shape, lo_code, np.int32),
                                    depth_schedule(view.num_layers, self.lam), heavy_hitters=self.heavy_hitters)
        return self._plans[key]

    def __repr__(self) -> str:
        return f"DyMoE(hi={self.hi!r}, lo={self.lo!r}, r={self.r:g}, heavy_hitters={self.heavy_hitters:g})"


__all__ = ["DEFAULT_R", "DyMoE", "critical_share", "depth_schedule"]
