"""Routers: hidden states [N, D] -> top-k expert ids and combine weights (float32).

Each router owns its projection as `kernel` [D, E] (plus whatever the family adds, such as a
score-correction bias), so the checkpoint maps it onto the family's `gate` tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.errors import ConfigError
from jmoe.layers.experts import Routing
from jmoe.layers.linear import initial_value, matmul


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(initial_value(init, rngs, (cfg.hidden_size, cfg.num_experts), param_dtype))
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.dtype = dtype

    def project(self, h):
        """h [N, D] @ kernel -> [N, E] in the compute dtype (as the reference's linear layer)."""
        return matmul(h.astype(self.dtype), self.kernel[...]).astype(self.dtype)

    def logits(self, h):
        """h [N, D] -> router logits [N, E] float32."""
        return self.project(h).astype(jnp.float32)

    def eligible(self, group_scores):
        """Group-limited selection: [N, G] per-group scores -> a mask over [N, E] of the experts in
        each token's top `topk_groups` groups (everything when there is one group)."""
        if self.groups == 1:
            return None
        _, top = jax.lax.top_k(group_scores, self.topk_groups)
        keep = jnp.zeros_like(group_scores, bool).at[jnp.arange(group_scores.shape[0])[:, None], top].set(True)
        return jnp.repeat(keep, self.num_experts // self.groups, axis=-1)

    def grouped(self, scores):
        """scores [N, E] -> [N, G, E / G]."""
        return scores.reshape(scores.shape[0], self.groups, -1)

    def finish(self, ids, weights) -> Routing:
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * self.scaling
        return Routing(ids.astype(jnp.int32), weights.astype(self.dtype).astype(jnp.float32))


class SoftmaxRouter(Router):
    """Softmax over every expert, then the top k (Qwen, Mixtral, OLMoE); DeepSeek-V2's
    group-limited form keeps the experts of the groups with the highest single score."""

    def __call__(self, h) -> Routing:
        scores = jax.nn.softmax(self.logits(h), axis=-1)
        mask = self.eligible(self.grouped(scores).max(-1))
        weights, ids = jax.lax.top_k(scores if mask is None else jnp.where(mask, scores, 0.0), self.top_k)
        return self.finish(ids, weights)


class SigmoidRouter(Router):
    """DeepSeek-V3 / GLM-4.5: sigmoid scores; a per-expert correction bias steers which experts are
    chosen (groups ranked by the sum of their two best biased scores) but not their weights."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))

    def __call__(self, h) -> Routing:
        scores = jax.nn.sigmoid(self.logits(h))
        biased = scores + self.e_score_correction_bias[...].astype(jnp.float32)
        mask = self.eligible(jax.lax.top_k(self.grouped(biased), 2)[0].sum(-1))
        _, ids = jax.lax.top_k(biased if mask is None else jnp.where(mask, biased, -jnp.inf), self.top_k)
        return self.finish(ids, jnp.take_along_axis(scores, ids, axis=-1))


def sparsemixer_top2(scores, eps: float):
    """SparseMixer's inference routing (Phi-3.5-MoE), scores [N, E] float32 -> (ids [N, 2], weights [N, 2]).

    The best expert, weighted by its softmax over the experts within a relative 2 * eps of it; then
    the best of the rest, weighted the same way among the rest (the first pick masked out). The two
    weights are not renormalised.
    """
    def pick(masked):
        threshold = masked.max(-1, keepdims=True)  # [N, 1]
        ids = jnp.argmax(masked, axis=-1)[:, None]  # [N, 1]
        factor = jnp.maximum(jnp.abs(scores), threshold)
        gates = jnp.where((threshold - scores) / factor > 2 * eps, -jnp.inf, masked)
        return ids, jnp.take_along_axis(jax.nn.softmax(gates, axis=-1), ids, axis=-1)

    first, w_first = pick(scores)
    second, w_second = pick(jnp.where(jnp.arange(scores.shape[-1]) == first, -jnp.inf, scores))
    return jnp.concatenate([first, second], axis=-1), jnp.concatenate([w_first, w_second], axis=-1)


class SparseMixerRouter(Router):
    """Phi-3.5-MoE: SparseMixer top-2 in its inference form (no sampling, no jitter noise)."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        if cfg.top_k != 2:
            raise ConfigError(f"the sparsemixer router picks exactly 2 experts, not num_experts_per_tok={cfg.top_k}")
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.jitter_eps = cfg.router_jitter_eps

    def __call__(self, h) -> Routing:
        ids, weights = sparsemixer_top2(self.logits(h), self.jitter_eps)
        return self.finish(ids, weights)


class TopKSoftmaxRouter(Router):
    """GPT-OSS: biased logits, the top k of them, then a softmax over those k only."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((cfg.num_experts,), param_dtype))

    def logits(self, h):
        """h @ kernel + bias in the compute dtype, then float32."""
        return (self.project(h) + self.bias[...].astype(self.dtype)).astype(jnp.float32)

    def __call__(self, h) -> Routing:
        top, ids = jax.lax.top_k(self.logits(h), self.top_k)
        return self.finish(ids, jax.nn.softmax(top, axis=-1))
