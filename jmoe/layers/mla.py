"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the cache holds the compressed latent.

Keys and values are never expanded. Per layer the cache keeps, per token, the normalised key/value
latent [kv_lora_rank] and the shared rotary key [rope_dim]; the up-projection of keys is folded into
the queries (q_nope @ W_uk gives a query in latent space) and the one of values is applied after
the weighted sum of latents, so attention reads kv_lora_rank + rope_dim numbers per cached token
instead of heads * (2 * head widths).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.attention import (
    AttentionMeta,
    CacheSpec,
    blocked_attention,
    current_importance,
    write_cache,
)
from jmoe.layers.linear import Linear
from jmoe.layers.norms import RMSNorm, matmul_precision
from jmoe.layers.rope import apply_rope

LATENT_NORM_EPS = 1e-6  # transformers builds the q/kv latent norms with their default eps


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(q/k head width), times YaRN's mscale(factor, mscale_all_dim)^2 when the RoPE asks for it."""
    scale = cfg.head_dim**-0.5
    params = cfg.rope_param
    if cfg.rope_type != "default" and params.get("mscale_all_dim"):
        factor = params.get("factor", 1.0)
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nnx.Module):
    @staticmethod
    def cache_spec(cfg: ModelConfig, layer_idx: int) -> CacheSpec:
        """The key/value latent [P, 1, page, kv_lora_rank] and the rotary key [P, 1, page, rope_dim]."""
        return ((1, cfg.kv_lora_rank), (1, cfg.rotary_dim))

    @staticmethod
    def head_widths(cfg: ModelConfig) -> tuple[tuple[int, ...], int]:
        """Numbers per query head and token: the absorbed query's score terms (latent and rotary),
        and the output as the loop sums it (a weighted sum of latents, up-projected after)."""
        return (cfg.kv_lora_rank, cfg.rotary_dim), cfg.kv_lora_rank

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs, quant=None):
        H, D, r = cfg.num_heads, cfg.hidden_size, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.rotary_dim, cfg.v_head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        norm_kw = dict(eps=LATENT_NORM_EPS, dtype=dtype, param_dtype=param_dtype)
        q_width = H * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=cfg.qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, **norm_kw)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_width, bias=False, **kw)
        else:
            self.q_proj = Linear(D, q_width, bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(D, r + self.rope, bias=cfg.qkv_bias, **kw)
        self.kv_a_layernorm = RMSNorm(r, **norm_kw)
        self.kv_b_proj = Linear(r, H * (self.nope + self.v_dim), bias=False, **kw)
        self.o_proj = Linear(H * self.v_dim, D, bias=cfg.o_bias, **kw)
        self.num_heads, self.kv_lora_rank = H, r
        self.scale = softmax_scale(cfg)
        self.window = cfg.sliding_windows[layer_idx]
        self.rope_interleaved = cfg.rope_interleaved
        self.cache_layout = self.cache_spec(cfg, layer_idx)
        self.dtype = dtype

    def _query(self, x):
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(self, x, cache, meta: AttentionMeta, *, want_importance: bool = False):
        """x [B, T, D], cache (latent, rotary key) -> (out [B, T, D], cache, importance [B, T] or None)."""
        B, T, _ = x.shape
        H, r, prec = self.num_heads, self.kv_lora_rank, matmul_precision(self.dtype)
        q = self._query(x).reshape(B, T, H, self.nope + self.rope)
        q_nope, q_rot = q[..., : self.nope], q[..., self.nope :]
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_rot = self.kv_a_layernorm(kv[..., :r]), kv[..., r:]
        q_rot = apply_rope(q_rot, meta.cos, meta.sin, interleaved=self.rope_interleaved)
        k_rot = apply_rope(k_rot[:, :, None, :], meta.cos, meta.sin, interleaved=self.rope_interleaved)
        latent_cache, new_latent = write_cache(cache[0], latent[:, None], meta)  # [P, 1, page, r]
        rot_cache, new_rot = write_cache(cache[1], k_rot.transpose(0, 2, 1, 3), meta)  # [P, 1, page, rope]
        # Absorbed attention needs kv_b's weight itself (r x H * (nope + v): small, unlike the projections).
        w = self.kv_b_proj.weight(self.dtype).reshape(r, H, self.nope + self.v_dim)
        w_k, w_v = w[..., : self.nope], w[..., self.nope :]
        q_latent = jnp.einsum("bthn,rhn->bhtr", q_nope, w_k, precision=prec)  # keys' up-projection, absorbed
        # one cache head shared by every query head: the latent query head-major [B, 1, H*T, r], the
        # rotary one token-major [B, T, 1, H, rope], as the projection gives it
        queries = (q_latent.reshape(B, 1, H * T, r), q_rot.reshape(B, T, 1, H, self.rope))
        kw = dict(groups=H, scale=self.scale, window=self.window, precision=prec)
        context, softmax = blocked_attention(queries, (latent_cache, rot_cache), latent_cache, meta, **kw)
        context = context.astype(self.dtype).reshape(B, H, T, r)
        out = jnp.einsum("bhtr,rhv->bthv", context, w_v, precision=prec).reshape(B, T, H * self.v_dim)
        importance = None
        if want_importance:
            importance = current_importance(queries, (new_latent, new_rot), meta, softmax, **kw)
        return self.o_proj(out), (latent_cache, rot_cache), importance
