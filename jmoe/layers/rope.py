"""Rotary position embeddings: the tables for a step's positions, and applying them to q/k.

The frequencies come from the config's RoPE (`ModelConfig.rope_type`, `rope_params`, `rope_theta`);
`rotary_dim` may be smaller than the head (partial rotary: the rest of each head passes through),
and `interleaved` rotates adjacent pairs (DeepSeek) instead of the two halves (rotate-half).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, seq_len=None) -> tuple[jax.Array, float]:
    """inv_freq [rotary_dim / 2] float32 and the factor cos/sin are scaled by."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    return inv_freq, 1.0


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, rotary_dim] float32 for integer positions [B, T]."""
    inv_freq, scale = inverse_frequencies(cfg, seq_len=positions.max() + 1)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim / 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x, cos, sin, *, interleaved: bool = False):
    """x [B, T, H, hd], cos/sin [B, T, r] with r <= hd: rotate the first r dims of every head."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    if interleaved:
        # pairs (x0, x1), (x2, x3), ...: de-interleave into halves, rotate-half is then the same rotation
        rot = jnp.concatenate([rot[..., 0::2], rot[..., 1::2]], axis=-1)
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos + rotated * sin
    return out if r == x.shape[-1] else jnp.concatenate([out, rest], axis=-1)
