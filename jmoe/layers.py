"""Transformer layers shared by every family (Flax NNX).

Numerics follow Hugging Face transformers: RMSNorm in float32 then cast, RoPE tables in float32,
attention softmax in float32, router softmax in float32. Family differences arrive as ModelConfig
flags. Routed experts are not parameters here: they live in device pools and are reached through
the handle table (jmoe/expert_path.py), so residency changes pool contents, never the model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.expert_path import LayerExperts, routed_experts


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


def linear(in_features: int, out_features: int, *, bias: bool, dtype, param_dtype, rngs) -> nnx.Linear:
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=matmul_precision(dtype),
        rngs=rngs,
    )


class KVCache(NamedTuple):
    """Per-layer key/value caches, each [B, KV, S, hd] (heads-major) in the compute dtype."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


class AttentionMeta(NamedTuple):
    """Where the current tokens sit in the cache.

    write_start: scalar int32, cache slot of the first current token (same for every row).
    key_start:   [B] int32, first slot holding a real token of each row (rows are left-padded).
    cos, sin:    [B, T, hd] float32 RoPE tables for the current tokens.
    """

    write_start: jax.Array
    key_start: jax.Array
    cos: jax.Array
    sin: jax.Array

    @property
    def num_tokens(self) -> int:
        return self.cos.shape[1]

    def query_slots(self) -> jax.Array:  # [T]
        return self.write_start + jnp.arange(self.num_tokens, dtype=jnp.int32)

    def token_valid(self) -> jax.Array:  # [B, T]: False on left padding
        return self.query_slots()[None, :] >= self.key_start[:, None]


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, hd] for integer positions [B, T] (HF's default RoPE)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, H, hd]; rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs):
        H, KV, hd, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(D, H * hd, bias=cfg.qkv_bias, **kw)
        self.k_proj = linear(D, KV * hd, bias=cfg.qkv_bias, **kw)
        self.v_proj = linear(D, KV * hd, bias=cfg.qkv_bias, **kw)
        self.o_proj = linear(H * hd, D, bias=cfg.o_bias, **kw)
        norm_kw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, **norm_kw), RMSNorm(hd, **norm_kw)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * hd, **norm_kw), RMSNorm(KV * hd, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.window = cfg.sliding_windows[layer_idx]
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, hd
        self.dtype = dtype

    def _project(self, x):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def __call__(self, x, k_cache, v_cache, meta: AttentionMeta, *, want_importance: bool = False):
        """x [B, T, D] -> (out [B, T, D], k_cache, v_cache, importance [B, S] or None)."""
        B, T, _ = x.shape
        KV, G, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q, k, v = self._project(x)
        q = apply_rope(q, meta.cos, meta.sin)
        k = apply_rope(k, meta.cos, meta.sin)
        # Heads-major cache [B, KV, S, hd]: attention is a plain batched matmul per (row, kv head).
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype), (0, 0, meta.write_start, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).astype(v_cache.dtype), (0, 0, meta.write_start, 0))
        S = k_cache.shape[2]
        prec = matmul_precision(self.dtype)
        qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        scores = jnp.einsum("bkmd,bksd->bkms", qh, k_cache, precision=prec).reshape(B, KV, G, T, S)
        scores = scores.astype(jnp.float32) * (hd**-0.5)
        q_slot = meta.query_slots()[:, None]  # [T, 1]
        k_slot = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
        allowed = (k_slot <= q_slot)[None] & (k_slot[None] >= meta.key_start[:, None, None])  # [B, T, S]
        if self.window is not None:
            allowed &= (q_slot - k_slot < self.window)[None]
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)  # [B, KV, G, T, S]
        out = jnp.einsum("bkms,bksd->bkmd", probs.astype(self.dtype).reshape(B, KV, G * T, S), v_cache, precision=prec)
        out = out.reshape(B, KV, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, self.num_heads * hd)
        out = self.o_proj(out)
        importance = None
        if want_importance:
            # DyMoE heavy hitters: mean attention each cached token receives from valid queries.
            q_valid = meta.token_valid().astype(jnp.float32)  # [B, T]
            received = jnp.einsum("bkgts,bt->bs", probs, q_valid)
            importance = received / (self.num_heads * jnp.maximum(q_valid.sum(-1, keepdims=True), 1.0))
        return out, k_cache, v_cache, importance


class DenseMLP(nnx.Module):
    """SwiGLU MLP (dense layers and Qwen2-MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, param_dtype, rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(hidden, intermediate, **kw)
        self.up_proj = linear(hidden, intermediate, **kw)
        self.down_proj = linear(intermediate, hidden, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


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


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, layer_idx, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.is_moe = cfg.moe_layers[layer_idx]
        if self.is_moe:
            self.mlp = MoEBlock(cfg, rngs=rngs, **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, rngs=rngs, **kw)

    def attention_block(self, x, k_cache, v_cache, meta: AttentionMeta, *, want_importance=False):
        """Pre-norm attention with residual: returns (x, h = normed input of the MLP, caches, importance)."""
        attn, k_cache, v_cache, importance = self.self_attn(
            self.input_layernorm(x), k_cache, v_cache, meta, want_importance=want_importance
        )
        x = x + attn
        return x, self.post_attention_layernorm(x), k_cache, v_cache, importance
