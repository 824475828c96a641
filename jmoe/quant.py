"""Expert weight formats per tier.

Every expert version is an ExpertWeights pytree in the K-major layout the kernels read: plain
bf16 arrays for the bf16 tier, QArrays (pallas_kernels/qarray.py: packed codes + scales +
offsets, group-wise along K) for int8/int4/int2. The tier's format fixes the record layout in the
expert store and the slab layout of the device pools.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from pallas_kernels.qarray import QArray, QuantFormat, dequantize, template

# Defaults per tier: int8 symmetric in groups of 128; int4 and int2 asymmetric in groups of 64.
DEFAULT_FORMATS = {
    "int8": QuantFormat(bits=8, group_size=128, symmetric=True),
    "int4": QuantFormat(bits=4, group_size=64, symmetric=False),
    "int2": QuantFormat(bits=2, group_size=64, symmetric=False),
}


class ExpertWeights(NamedTuple):
    """One expert's weights: x @ gate_up -> [gate | up], silu(gate) * up @ down.

    gate_up: [..., D, 2F], down: [..., F, D]; a pool adds a leading slots dimension.
    """

    gate_up: Any
    down: Any


def tier_format(tier: str, *, group_size: int | None = None, symmetric: bool | None = None,
                w8a8: bool = False, smooth: bool = False) -> QuantFormat | None:
    """The format of a tier (None for bf16), with optional overrides of the defaults."""
    if tier == "bf16":
        return None
    if tier not in DEFAULT_FORMATS:
        raise InputError(f"unknown tier {tier!r}")
    base = DEFAULT_FORMATS[tier]
    act_bits = 8 if (w8a8 and tier == "int8") else None
    sym = True if act_bits else (base.symmetric if symmetric is None else symmetric)
    try:
        return QuantFormat(base.bits, group_size or base.group_size, sym, act_bits, smooth)
    except ValueError as e:
        raise InputError(str(e)) from None


def expert_template(cfg: ModelConfig, tier: str, fmt: QuantFormat | None = None) -> ExpertWeights:
    """Shapes and dtypes of one expert version at `tier` (quantized tiers need their format)."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    if tier == "bf16":
        return ExpertWeights(
            gate_up=jax.ShapeDtypeStruct((D, 2 * F), jnp.bfloat16),
            down=jax.ShapeDtypeStruct((F, D), jnp.bfloat16),
        )
    if fmt is None:
        raise InputError(f"tier {tier!r} needs a quantization format")
    # Smoothing (HAQ) scales gate_up's input at run time; down's is folded into up's columns.
    return ExpertWeights(gate_up=template(fmt, D, 2 * F), down=template(dataclasses.replace(fmt, smooth=False), F, D))


def hf_to_kmajor(gate, up, down) -> tuple[np.ndarray, np.ndarray]:
    """HF orientation (gate/up [F, D], down [D, F]) -> K-major gate_up [D, 2F] and down [F, D] (float32)."""
    gate_up = np.concatenate([np.asarray(gate, np.float32).T, np.asarray(up, np.float32).T], axis=1)
    return gate_up, np.ascontiguousarray(np.asarray(down, np.float32).T)


def bf16_expert(gate_up, down) -> ExpertWeights:
    """The bf16 tier of one expert from its K-major weights."""
    return ExpertWeights(np.asarray(gate_up).astype(ml_dtypes.bfloat16), np.asarray(down).astype(ml_dtypes.bfloat16))


def dequantize_expert(weights: ExpertWeights, dtype=jnp.float32) -> ExpertWeights:
    """Any tier's expert version back to plain K-major arrays (reference path, tests)."""
    deq = lambda w: dequantize(w, dtype) if isinstance(w, QArray) else jnp.asarray(w, dtype)  # noqa: E731
    return ExpertWeights(deq(weights.gate_up), deq(weights.down))


__all__ = ["ExpertWeights", "QArray", "QuantFormat", "DEFAULT_FORMATS", "tier_format", "expert_template",
           "hf_to_kmajor", "bf16_expert", "dequantize_expert"]
