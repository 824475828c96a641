"""Grouped-query attention over a heads-major KV cache, and where the current tokens sit in it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.norms import RMSNorm, linear, matmul_precision
from jmoe.layers.rope import apply_rope


class KVCache(NamedTuple):
    """Per-layer key/value caches, each [B, KV, S, hd] (heads-major) in the compute dtype."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


class AttentionMeta(NamedTuple):
    """Where the current tokens sit in the cache; rows may sit at different positions.

    start:     [B] int32, cache slot of each row's first current token (its T tokens follow it).
    key_start: [B] int32, first slot holding a real token of each row (prompts are left-padded).
    cos, sin:  [B, T, hd] float32 RoPE tables for the current tokens.
    """

    start: jax.Array
    key_start: jax.Array
    cos: jax.Array
    sin: jax.Array

    @property
    def num_tokens(self) -> int:
        return self.cos.shape[1]

    def query_slots(self) -> jax.Array:  # [B, T]
        return self.start[:, None] + jnp.arange(self.num_tokens, dtype=jnp.int32)[None, :]

    def token_valid(self) -> jax.Array:  # [B, T]: False on left padding
        return self.query_slots() >= self.key_start[:, None]


def write_rows(cache, new, start):
    """cache [B, KV, S, hd] with new [B, KV, T, hd] written from slot start[b] in each row b."""
    put = lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (0, s, 0))  # noqa: E731
    return jax.vmap(put)(cache, new.astype(cache.dtype), start)


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
        k_cache = write_rows(k_cache, k.transpose(0, 2, 1, 3), meta.start)
        v_cache = write_rows(v_cache, v.transpose(0, 2, 1, 3), meta.start)
        S = k_cache.shape[2]
        prec = matmul_precision(self.dtype)
        qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        scores = jnp.einsum("bkmd,bksd->bkms", qh, k_cache, precision=prec).reshape(B, KV, G, T, S)
        scores = scores.astype(jnp.float32) * (hd**-0.5)
        q_slot = meta.query_slots()[:, :, None]  # [B, T, 1]
        k_slot = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
        allowed = (k_slot <= q_slot) & (k_slot >= meta.key_start[:, None, None])  # [B, T, S]
        if self.window is not None:
            allowed &= q_slot - k_slot < self.window
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
