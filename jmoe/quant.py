"""One expert's weights as a pytree, and the conversions between layouts.

Every expert version is an ExpertWeights pytree in the K-major layout the kernels read: plain
bf16 arrays for the bf16 tier, QArrays (pallas_kernels/qarray.py: packed codes + scales +
offsets, group-wise along K) for int8/int4/int2. What each tier is lives in jmoe/tiers.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.qarray import QArray, QuantFormat, dequantize


class ExpertWeights(NamedTuple):
    """One expert's weights: x @ gate_up -> [gate | up], silu(gate) * up @ down.

    gate_up: [..., D, 2F], down: [..., F, D]; a pool adds a leading slots dimension.
    """

    gate_up: Any
    down: Any


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


__all__ = ["ExpertWeights", "QArray", "QuantFormat", "hf_to_kmajor", "bf16_expert", "dequantize_expert"]
