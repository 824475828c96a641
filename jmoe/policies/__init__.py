"""Expert residency policies over one Policy / Plan interface (jmoe/policies/base.py), one file each."""

from __future__ import annotations

from jmoe.errors import InputError
from jmoe.policies.base import ExpertCounters, Key, LayerRouting, Plan, Policy, StepView, check_plan
from jmoe.policies.baselines import BASELINES, baseline
from jmoe.policies.dymoe import DyMoE
from jmoe.policies.dynaexq import DynaExq
from jmoe.policies.placement import STRATEGIES, StaticPlacement, choose_experts

POLICY_NAMES = (*BASELINES, "dymoe", "dynaexq")


def make_policy(name: str, tier: str | None, **options) -> Policy:
    """A policy by name: a baseline at `tier`, or DyMoE / DynaExq (hi defaults to `tier` when given,
    else int4; other options as their constructors take them)."""
    if name in BASELINES:
        if options:
            raise InputError(f"policy {name!r} takes no options, got {', '.join(options)}")
        return baseline(name, tier)
    if name == "dymoe":
        return DyMoE(**{"hi": tier or "int4", **options})
    if name == "dynaexq":
        return DynaExq(**{"hi": tier or "int4", **options})
    raise InputError(f"unknown policy {name!r}; available: {', '.join(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "BASELINES", "ExpertCounters", "Key", "LayerRouting", "Plan", "Policy", "StepView",
           "check_plan", "make_policy", "baseline", "DyMoE", "DynaExq", "StaticPlacement", "STRATEGIES",
           "choose_experts"]
