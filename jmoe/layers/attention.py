"""What every attention module shares: the per-layer cache, where the current tokens sit in it,
the causal (and sliding-window) mask, and the attention each cached token received.

An attention module (jmoe/layers/gqa.py, jmoe/layers/mla.py) declares its own cache layout with
`cache_spec(cfg, layer_idx)`: one (heads, width) pair per cached array, each stored heads-major as
[B, heads, S, width]. The engine, the budget's KV reservation and calibration all size caches
from that spec (jmoe/layers/modules.py), so a module that caches a compressed latent is charged
for the latent, not for the keys and values it expands into.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import cpu_kernels

CacheSpec = tuple[tuple[int, int], ...]  # per cached array: (heads, width)


class KVCache(NamedTuple):
    """Per-layer caches: layers[i] is that layer's tuple of [B, heads, S, width] arrays (compute dtype)."""

    layers: tuple[tuple[jax.Array, ...], ...]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2]


class AttentionMeta(NamedTuple):
    """Where the current tokens sit in the cache; rows may sit at different positions.

    start:     [B] int32, cache slot of each row's first current token (its T tokens follow it).
    key_start: [B] int32, first slot holding a real token of each row (prompts are left-padded).
    cos, sin:  [B, T, rotary_dim] float32 RoPE tables for the current tokens.
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
    """cache [B, H, S, w] with new [B, H, T, w] written from slot start[b] in each row b.

    On the CPU the native kernel writes the new rows into the donated cache in place. XLA's own
    update (vmapped: a bounds-checked scatter) is fused into each of its readers, the attention
    and the step's output, and every fused copy copies the whole cache first: a decode step at
    1024 slots spent more time copying caches than in its attention."""
    return cpu_kernels.write_rows(cache, new, start)


def allowed_keys(meta: AttentionMeta, num_slots: int, window: int | None) -> jax.Array:
    """[B, T, S] bool: which cache slots each current token may attend to (causal, after the row's
    left padding, within the sliding window if any)."""
    q_slot = meta.query_slots()[:, :, None]  # [B, T, 1]
    k_slot = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    allowed = (k_slot <= q_slot) & (k_slot >= meta.key_start[:, None, None])
    if window is not None:
        allowed &= q_slot - k_slot < window
    return allowed


def masked_softmax(scores, allowed, sink=None):
    """scores [B, ..., T, S] float32, allowed [B, T, S] -> probabilities over S.

    sink [...] (per head, broadcast over rows and tokens): a learned logit that joins the softmax's
    normaliser without a value (GPT-OSS attention sinks), so a token may attend to nothing."""
    extra = (1,) * (scores.ndim - allowed.ndim)
    scores = jnp.where(allowed.reshape(allowed.shape[0], *extra, *allowed.shape[1:]), scores,
                       jnp.finfo(jnp.float32).min)
    if sink is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sink.astype(jnp.float32)[..., None, None], (*scores.shape[:-1], 1))
    top = jnp.maximum(scores.max(-1, keepdims=True), sink)
    e = jnp.exp(scores - top)
    return e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))


def received_importance(probs, meta: AttentionMeta, num_heads: int):
    """DyMoE heavy hitters: mean attention each cached slot receives from valid queries.

    probs [B, ..., T, S] (every head axis between B and T) -> [B, S]."""
    q_valid = meta.token_valid().astype(jnp.float32)  # [B, T]
    per_row = probs.reshape(probs.shape[0], -1, *probs.shape[-2:]).sum(1)  # [B, T, S]
    received = jnp.einsum("bts,bt->bs", per_row, q_valid)
    return received / (num_heads * jnp.maximum(q_valid.sum(-1, keepdims=True), 1.0))
