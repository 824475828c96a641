"""The sparse block: router, routed experts (reached through the handle table), shared expert."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.experts import LayerExperts, routed_experts
from jmoe.layers.mlp import DenseMLP
from jmoe.layers.norms import linear


class Routing(NamedTuple):
    """Router output for N tokens: top-k expert ids [N, k] and their combine weights [N, k] (float32)."""

    ids: jax.Array
    weights: jax.Array


class MoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.router = linear(cfg.hidden_size, cfg.num_experts, bias=False, **kw)
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, **kw)
            self.shared_expert_gate = linear(cfg.hidden_size, 1, bias=False, **kw)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.dtype = dtype

    def route(self, h) -> Routing:
        """h [N, D] -> softmax top-k routing (renormalised when the family asks for it)."""
        probs = jax.nn.softmax(self.router(h).astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return Routing(ids.astype(jnp.int32), weights.astype(self.dtype).astype(jnp.float32))

    def shared_out(self, h):
        """Qwen2-MoE's shared expert behind its sigmoid gate (None for families without one)."""
        if self.shared_expert is None:
            return None
        return jax.nn.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)

    def combine(self, h, routing: Routing, token_valid, experts: LayerExperts):
        """Routed experts (through the handle table) plus the shared expert, h [N, D] -> [N, D]."""
        out = routed_experts(h, routing, token_valid, experts)
        shared = self.shared_out(h)
        return out if shared is None else out + shared
