"""Rotary position embeddings: the tables for a step's positions, and applying them to q/k.

The frequencies come from the config's RoPE (`ModelConfig.rope_type`, `rope_params`, `rope_theta`);
`rotary_dim` may be smaller than the head (partial rotary: the rest of each head passes through),
and `interleaved` rotates adjacent pairs (DeepSeek) instead of the two halves (rotate-half).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jmoe.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, seq_len=None) -> tuple[jax.Array, float]:
    """inv_freq [rotary_dim / 2] float32 and the factor cos/sin are scaled by.

    `seq_len` (a traced scalar inside jit; None = at most the trained length) is the step's largest
    position + 1: dynamic NTK and LongRoPE pick their frequencies by it, as transformers does.
    Each type follows transformers' modeling_rope_utils in float32, operation for operation.
    """
    dim = cfg.rotary_dim
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim  # [dim / 2]
    return _FREQUENCIES[cfg.rope_type](cfg.rope_theta, exponents, cfg.rope_param, dim, seq_len)


def _default(theta, exponents, p, dim, seq_len):
    return 1.0 / (theta**exponents), 1.0


def _linear(theta, exponents, p, dim, seq_len):
    return 1.0 / (theta**exponents) / p["factor"], 1.0


def _dynamic(theta, exponents, p, dim, seq_len):
    """NTK-aware: past max_position_embeddings the base grows with the sequence, recomputed every step."""
    if seq_len is None:
        return _default(theta, exponents, p, dim, seq_len)
    trained, factor = p["max_position_embeddings"], p["factor"]
    seq = jnp.maximum(jnp.asarray(seq_len), trained).astype(jnp.float32)
    grown = theta * ((factor * seq / trained) - (factor - 1)) ** (dim / (dim - 2))
    base = jnp.where(seq > trained, grown, jnp.float32(theta))  # within the trained length: plain RoPE
    return 1.0 / (base**exponents), 1.0


def _yarn(theta, exponents, p, dim, seq_len):
    """Interpolate low frequencies by 1/factor, keep high ones, blend linearly between beta_fast and
    beta_slow rotations over the original context; cos/sin scaled by the attention factor."""
    pos_freqs = theta**exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (p["factor"] * pos_freqs)
    low, high = _yarn_correction_range(p["beta_fast"], p["beta_slow"], dim, theta,
                                       p["original_max_position_embeddings"], p["truncate"])
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, p["attention_factor"]


def _yarn_correction_range(beta_fast, beta_slow, dim, theta, original, truncate):
    """Dimensions (fractional unless truncated) that turn beta_fast / beta_slow times over `original` tokens."""
    def dim_for(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _longrope(theta, exponents, p, dim, seq_len):
    """Per-frequency divisors: short_factor within original_max_position_embeddings, long_factor past it."""
    short, long = jnp.asarray(p["short_factor"], jnp.float32), jnp.asarray(p["long_factor"], jnp.float32)
    past = False if seq_len is None else jnp.asarray(seq_len) > p["original_max_position_embeddings"]
    ext = short if seq_len is None else jnp.where(past, long, short)
    scale = p["attention_factor"]
    if "short_mscale" in p:  # a scale per side instead (Phi-3.5-MoE)
        scale = p["short_mscale"] if seq_len is None else jnp.where(past, p["long_mscale"], p["short_mscale"])
    return 1.0 / (ext * theta**exponents), scale


def _llama3(theta, exponents, p, dim, seq_len):
    """Llama 3.1: wavelengths beyond original/low_freq_factor divided by factor, those below
    original/high_freq_factor kept, a smooth blend between."""
    inv_freq = 1.0 / (theta**exponents)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return jnp.where(medium, smoothed, scaled), 1.0


_FREQUENCIES = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn,
                "longrope": _longrope, "llama3": _llama3}


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
