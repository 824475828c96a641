"""The baseline policies: every routed expert at one tier, cached or not, prefetched or not."""

from __future__ import annotations

from jmoe.errors import InputError
from jmoe.policies.base import Policy

BASELINES = ("resident", "ondemand", "lru", "lru+prefetch", "lru+cpu", "lru+prefetch+cpu")


def baseline(name: str, tier: str) -> Policy:
    """resident (every expert preloaded), ondemand (fetch, use, drop), lru, and lru with look-ahead
    prefetch and/or CPU execution of cold experts."""
    if name not in BASELINES:
        raise InputError(f"unknown baseline policy {name!r}; available: {', '.join(BASELINES)}")
    parts = set(name.split("+"))
    return Policy(
        name=name,
        tier=tier,
        cache="ondemand" not in parts,
        prefetch="prefetch" in parts,
        cpu_execution="cpu" in parts,
        everything_resident=name == "resident",
    )
