"""Numerics shared by every layer: matmul precision, RMSNorm / LayerNorm (Hugging Face numerics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def matmul_precision(dtype) -> jax.lax.Precision:
    # float32 compute means "match the reference": no TF32 shortcuts on GPU.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (Phi-3.5-MoE), statistics in float32."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        x32 = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        out = x32 * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return out.astype(self.dtype)

