"""The SwiGLU MLP of dense layers and shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from jmoe.layers.linear import Linear, project_together


class DenseMLP(nnx.Module):
    """SwiGLU MLP (dense layers and Qwen2-MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, param_dtype, rngs, quant=None):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.gate_proj = Linear(hidden, intermediate, **kw)
        self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)

    def __call__(self, x):
        gate, up = project_together(x, [self.gate_proj, self.up_proj])
        return self.down_proj(jax.nn.silu(gate) * up)
