"""Expert residency policies over one Policy / Plan interface (jmoe/policies/base.py)."""

from jmoe.policies.base import (
    POLICY_NAMES,
    ExpertCounters,
    Key,
    LayerRouting,
    Plan,
    Policy,
    StepView,
    check_plan,
    make_policy,
)

__all__ = ["POLICY_NAMES", "ExpertCounters", "Key", "LayerRouting", "Plan", "Policy", "StepView", "check_plan",
           "make_policy"]
