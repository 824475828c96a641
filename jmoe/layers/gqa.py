"""Grouped-query attention over a heads-major key/value cache (Qwen, Mixtral, OLMoE, ...)."""

from __future__ import annotations

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
from jmoe.layers.linear import Linear, project_together
from jmoe.layers.norms import RMSNorm, matmul_precision
from jmoe.layers.rope import apply_rope


class GroupedQueryAttention(nnx.Module):
    @staticmethod
    def cache_spec(cfg: ModelConfig, layer_idx: int) -> CacheSpec:
        """Keys and values, each [P, KV, page, head_dim]."""
        return ((cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim))

    @staticmethod
    def head_widths(cfg: ModelConfig) -> tuple[tuple[int, ...], int]:
        """Numbers per query head and token: its query's score terms, and its output as the loop sums it."""
        return (cfg.head_dim,), cfg.head_dim

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs, quant=None):
        H, KV, hd, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.q_proj = Linear(D, H * hd, bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(D, KV * hd, bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(D, KV * hd, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(H * hd, D, bias=cfg.o_bias, **kw)
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
        self.cache_layout = self.cache_spec(cfg, layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, hd
        self.rope_interleaved = cfg.rope_interleaved
        # GPT-OSS attention sinks: one learned logit per head that joins the softmax's normaliser.
        self.sinks = nnx.Param(jnp.zeros((H,), param_dtype)) if cfg.attention_sinks else None
        self.dtype = dtype

    def _project(self, x):
        B, T, _ = x.shape
        q, k, v = project_together(x, [self.q_proj, self.k_proj, self.v_proj])
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

    def __call__(self, x, cache, meta: AttentionMeta, *, want_importance: bool = False):
        """x [B, T, D], cache (k, v) -> (out [B, T, D], cache, importance [B, T] or None)."""
        B, T, _ = x.shape
        KV, G, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q, k, v = self._project(x)
        q = apply_rope(q, meta.cos, meta.sin, interleaved=self.rope_interleaved)
        k = apply_rope(k, meta.cos, meta.sin, interleaved=self.rope_interleaved)
        # Heads-major pages [P, KV, page, hd]: attention is a plain batched matmul per (row, kv head).
        k_cache, new_keys = write_cache(cache[0], k.transpose(0, 2, 1, 3), meta)
        v_cache, _ = write_cache(cache[1], v.transpose(0, 2, 1, 3), meta)
        prec = matmul_precision(self.dtype)
        qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        sink = None if self.sinks is None else self.sinks[...].reshape(KV, G)
        kw = dict(groups=G, scale=hd**-0.5, window=self.window, precision=prec)
        out, softmax = blocked_attention((qh,), (k_cache,), v_cache, meta, sink=sink, **kw)
        out = out.astype(self.dtype).reshape(B, KV, G, T, hd).transpose(0, 3, 1, 2, 4)
        out = self.o_proj(out.reshape(B, T, self.num_heads * hd))
        importance = None
        if want_importance:
            importance = current_importance((qh,), (new_keys,), meta, softmax, **kw)
        return out, (k_cache, v_cache), importance
