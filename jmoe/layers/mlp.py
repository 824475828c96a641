"""The SwiGLU MLP of dense layers and shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from jmoe.layers.norms import linear


class DenseMLP(nnx.Module):
    """SwiGLU MLP (dense layers and Qwen2-MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, param_dtype, rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(hidden, intermediate, **kw)
        self.up_proj = linear(hidden, intermediate, **kw)
        self.down_proj = linear(intermediate, hidden, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
