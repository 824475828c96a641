"""Expert precision tiers and their handle-table codes.

Codes grow with precision so "best resident tier" is a max; code 0 means the expert has no
resident version for this step (it is skipped: DyMoE's "0-bit").
"""

from __future__ import annotations

from jmoe.errors import InputError

TIER_NAMES = ("int2", "int4", "int8", "bf16")  # ascending precision
SKIP = 0
TIER_CODES = {name: i + 1 for i, name in enumerate(TIER_NAMES)}
TIER_BITS = {"int2": 2, "int4": 4, "int8": 8, "bf16": 16}


def tier_code(name: str) -> int:
    if name not in TIER_CODES:
        raise InputError(f"unknown tier {name!r}; tiers are {', '.join(TIER_NAMES)}")
    return TIER_CODES[name]


def tier_name(code: int) -> str | None:
    return None if code == SKIP else TIER_NAMES[code - 1]
