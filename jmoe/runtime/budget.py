"""Device-memory sizes: parsing "12GiB"-style budgets and counting bytes of pytrees."""

from __future__ import annotations

import re

import jax
import numpy as np

from jmoe.errors import BudgetError, InputError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | float | str, name: str = "size") -> int:
    """Bytes from an int or a string like '12GiB', '512 MiB', '2.5GB'; `name` is the option's name."""
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, float, str, np.integer, np.floating)):
        raise InputError(f"{name} must be a number of bytes or a string like '12GiB', got {size!r}")
    if isinstance(size, (int, np.integer)):
        if size <= 0:
            raise InputError(f"{name} must be positive, got {size}")
        return int(size)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
        raise InputError(f"{name}: cannot read size {size!r}; write it like '12GiB', '512MiB' or a number of bytes")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 1 <= value < 2**63:
        raise InputError(f"{name} must be between 1 byte and 8 EiB, got {size!r}")
    return int(value)


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def tree_nbytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


class BudgetTracker:
    """Device bytes reserved per purpose; a reservation that would exceed the budget is refused.

    Everything that lives on the device is reserved here before it is allocated (dense weights,
    KV cache, workspace, expert pools) and every in-flight expert transfer reserves its staging
    bytes until its copy into a pool slot has completed.
    """

    def __init__(self, budget: int | None):
        self.budget = budget
        self.reserved: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.reserved.values())

    def try_reserve(self, purpose: str, nbytes: int) -> bool:
        if self.budget is not None and self.total + nbytes > self.budget:
            return False
        self.reserved[purpose] = self.reserved.get(purpose, 0) + nbytes
        return True

    def reserve(self, purpose: str, nbytes: int) -> None:
        if not self.try_reserve(purpose, nbytes):
            raise BudgetError(
                f"reserving {format_size(nbytes)} for {purpose} would exceed the device budget of "
                f"{format_size(self.budget)} ({format_size(self.total)} already reserved)"
            )

    def release(self, purpose: str, nbytes: int) -> None:
        left = self.reserved.get(purpose, 0) - nbytes
        if left < 0:
            raise ValueError(f"released more {purpose} bytes than were reserved")
        self.reserved[purpose] = left
