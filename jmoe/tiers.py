"""Expert precision tiers: the one place that knows them.

Names, handle-table codes, bits, each tier's default quantization format and the shapes of one
expert version at a tier. Codes grow with precision so "best resident tier" is a max; code 0
means the expert has no resident version for this step (it is skipped: DyMoE's "0-bit").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.quant import ExpertWeights
from kernel_formats.qarray import TILE, PlainTiles, QuantFormat, template

TIER_NAMES = ("int2", "int3", "int4", "int8", "bf16")  # ascending precision
SKIP = 0
TIER_CODES = {name: i + 1 for i, name in enumerate(TIER_NAMES)}
TIER_BITS = {"int2": 2, "int3": 3, "int4": 4, "int8": 8, "bf16": 16}


def tier_name(code: int) -> str | None:
    return None if code == SKIP else TIER_NAMES[code - 1]


# Defaults per tier: int8 symmetric in groups of 128; int4 asymmetric in groups of 64; int2
# asymmetric in groups of 32 with 8-bit scales and offsets (kernel_formats/qarray.py), the bytes of
# float16 ones in groups of 64 (2.5 bits per weight) for about half a point less perplexity on the
# tiny model (GPTQ: +3.5% over bf16 where groups of 64 gave +4.0%, bench/results/quality). int3 the
# same way (3.5 bits per weight): of the 3-bit grids bench/grid_bits.py scored, the one nearest bf16
# at that size (GPTQ: +0.5% prose, +0.5% code, +0.1% math, where float16 scales in groups of 64
# gave +0.9%, +0.7%, +0.1%).
DEFAULT_FORMATS = {
    "int8": QuantFormat(bits=8, group_size=128, symmetric=True),
    "int4": QuantFormat(bits=4, group_size=64, symmetric=False),
    "int3": QuantFormat(bits=3, group_size=32, symmetric=False, scale_bits=8),
    "int2": QuantFormat(bits=2, group_size=32, symmetric=False, scale_bits=8),
}


def tier_format(tier: str, *, group_size: int | None = None, symmetric: bool | None = None,
                w8a8: bool = False, smooth: bool = False, scale_bits: int | None = None) -> QuantFormat | None:
    """The format of a tier (None for bf16), with optional overrides of the defaults. scale_bits
    (8 or 16) sets how an asymmetric tier stores its scales and offsets; symmetric tiers keep float16."""
    if tier == "bf16":
        return None
    if tier not in DEFAULT_FORMATS:
        raise InputError(f"unknown tier {tier!r}")
    base = DEFAULT_FORMATS[tier]
    act_bits = 8 if (w8a8 and tier == "int8") else None
    sym = True if act_bits else (base.symmetric if symmetric is None else symmetric)
    scale_bits = 16 if sym else (scale_bits or base.scale_bits)  # 8-bit scales code asymmetric grids only
    try:
        return QuantFormat(base.bits, group_size or base.group_size, sym, act_bits, smooth, scale_bits=scale_bits)
    except ValueError as e:
        raise InputError(str(e)) from None


def expert_widths(cfg: ModelConfig) -> tuple[int, int]:
    """The widths (N) of an expert's two weights: gate_up's 2F and down's D."""
    return 2 * cfg.moe_intermediate_size, cfg.hidden_size


def tiles_fit(cfg: ModelConfig) -> bool:
    """Whether both expert weights are a whole number of the CPU layout's column tiles wide."""
    return not any(w % TILE for w in expert_widths(cfg))


def expert_template(cfg: ModelConfig, tier: str, fmt: QuantFormat | None = None,
                    plain_tiled: bool = False) -> ExpertWeights:
    """Shapes and dtypes of one expert version at `tier` (quantized tiers need their format, which
    says whether they are stored in the CPU layout; plain_tiled says it of the bf16 tier: its weights
    are then PlainTiles).

    With expert biases (cfg.expert_bias) every tier's version also holds them, float32."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    biases = {}
    if cfg.expert_bias:
        biases = dict(gate_up_bias=jax.ShapeDtypeStruct((2 * F,), jnp.float32),
                      down_bias=jax.ShapeDtypeStruct((D,), jnp.float32))
    if tier == "bf16":
        wrap = PlainTiles if plain_tiled else (lambda w: w)
        return ExpertWeights(
            gate_up=wrap(jax.ShapeDtypeStruct((D, 2 * F), jnp.bfloat16)),
            down=wrap(jax.ShapeDtypeStruct((F, D), jnp.bfloat16)),
            **biases,
        )
    if plain_tiled:
        raise ValueError("plain_tiled applies to the bf16 tier; a quantized tier's format says whether it is tiled")
    if fmt is None:
        raise InputError(f"tier {tier!r} needs a quantization format")
    # Smoothing (HAQ) scales gate_up's input at run time; down's is folded into up's columns.
    return ExpertWeights(gate_up=template(fmt, D, 2 * F), down=template(dataclasses.replace(fmt, smooth=False), F, D),
                         **biases)
