"""One expert's weights as a pytree, and the conversions between layouts.

Every expert version is an ExpertWeights pytree in the K-major layout the kernels read: plain
bf16 arrays for the bf16 tier, QArrays (kernel_formats/qarray.py: packed codes + scales +
offsets, group-wise along K) for int8/int4/int2. What each tier is lives in jmoe/tiers.py.
Families with expert biases (ModelConfig.expert_bias, GPT-OSS) carry them in every version as
small float32 arrays that no quantizer touches; without them the bias fields are None (no leaves,
so records, pools and kernels are exactly what they are without the feature).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kernel_formats.qarray import QArray, QuantFormat, dequantize, untiled


class ExpertWeights(NamedTuple):
    """One expert's weights: x @ gate_up (+ gate_up_bias) -> [gate | up], act(gate, up) @ down (+ down_bias).

    gate_up: [..., D, 2F], down: [..., F, D]; biases (None when the family has none) float32
    gate_up_bias [..., 2F] and down_bias [..., D]; a pool adds a leading slots dimension.
    act is the model's gated activation (kernel_formats/glu.py; SwiGLU unless the config says otherwise).
    """

    gate_up: Any
    down: Any
    gate_up_bias: Any = None
    down_bias: Any = None

    def with_biases_of(self, other: "ExpertWeights") -> "ExpertWeights":
        """These weights with `other`'s biases (a quantized version of `other` carries them unchanged)."""
        return self._replace(gate_up_bias=other.gate_up_bias, down_bias=other.down_bias)


def _f32(a):
    return None if a is None else np.ascontiguousarray(np.asarray(a, np.float32))


def hf_to_kmajor(gate, up, down, gate_bias=None, up_bias=None, down_bias=None) -> ExpertWeights:
    """HF orientation (gate/up [F, D], down [D, F], biases [F], [F], [D]) -> K-major float32
    gate_up [D, 2F] and down [F, D], with gate_up_bias [2F] = [gate | up] and down_bias [D]."""
    gate_up = np.concatenate([np.asarray(gate, np.float32).T, np.asarray(up, np.float32).T], axis=1)
    if (gate_bias is None) != (up_bias is None) or (gate_bias is None) != (down_bias is None):
        raise ValueError("an expert has either all of its biases (gate, up, down) or none")
    gate_up_bias = None if gate_bias is None else np.concatenate([_f32(gate_bias), _f32(up_bias)])
    return ExpertWeights(gate_up, np.ascontiguousarray(np.asarray(down, np.float32).T), gate_up_bias, _f32(down_bias))


def bf16_expert(weights: ExpertWeights) -> ExpertWeights:
    """The bf16 tier of one expert from its K-major float32 weights (biases stay float32)."""
    bf16 = lambda w: np.asarray(w).astype(ml_dtypes.bfloat16)  # noqa: E731
    return ExpertWeights(bf16(weights.gate_up), bf16(weights.down), _f32(weights.gate_up_bias),
                         _f32(weights.down_bias))


def dequantize_expert(weights: ExpertWeights, dtype=jnp.float32) -> ExpertWeights:
    """Any tier's expert version back to plain K-major arrays (reference path, tests); biases stay float32."""
    deq = lambda w: dequantize(w, dtype) if isinstance(w, QArray) else jnp.asarray(untiled(w), dtype)  # noqa: E731
    bias = lambda b: None if b is None else jnp.asarray(b, jnp.float32)  # noqa: E731
    return ExpertWeights(deq(weights.gate_up), deq(weights.down), bias(weights.gate_up_bias), bias(weights.down_bias))


__all__ = ["ExpertWeights", "QArray", "QuantFormat", "hf_to_kmajor", "bf16_expert", "dequantize_expert"]
