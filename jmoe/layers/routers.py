"""Routers: hidden states [N, D] -> top-k expert ids and combine weights (float32).

Each router owns its projection as `kernel` [D, E] (plus whatever the family adds, such as a
score-correction bias), so the checkpoint maps it onto the family's `gate` tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.experts import Routing
from jmoe.layers.norms import matmul_precision


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.num_experts), param_dtype))
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.dtype = dtype

    def logits(self, h):
        """h [N, D] -> router logits [N, E] float32 (the product runs in the compute dtype)."""
        kernel = self.kernel[...].astype(self.dtype)
        out = jnp.dot(h.astype(self.dtype), kernel, precision=matmul_precision(self.dtype))
        return out.astype(jnp.float32)

    def finish(self, ids, weights) -> Routing:
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return Routing(ids.astype(jnp.int32), weights.astype(self.dtype).astype(jnp.float32))


class SoftmaxRouter(Router):
    """Softmax over every expert, then the top k (Qwen, Mixtral, OLMoE)."""

    def __call__(self, h) -> Routing:
        weights, ids = jax.lax.top_k(jax.nn.softmax(self.logits(h), axis=-1), self.top_k)
        return self.finish(ids, weights)
