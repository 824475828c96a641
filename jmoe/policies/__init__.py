"""Expert residency policies over one Policy interface."""

from jmoe.policies.base import POLICY_NAMES, ExpertCounters, LayerRouting, Policy, make_policy

__all__ = ["POLICY_NAMES", "ExpertCounters", "LayerRouting", "Policy", "make_policy"]
