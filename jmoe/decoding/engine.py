"""Jitted step functions: one forward step over every layer (prefill or decode), sampling, NLL.

Shapes are bucketed so a new prompt length does not recompile: prompts are left-padded to a
power-of-two bucket and the KV cache length is a power of two too. The cache is donated.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.decoding.sampling import sample_tokens
from jmoe.layers.attention import AttentionMeta, KVCache
from jmoe.layers.experts import ExpertState
from jmoe.layers.rope import rope_tables

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 64
PREFILL_CHUNK = 512  # longest block of prompt tokens one step processes


def bucket(n: int, minimum: int, limit: int) -> int:
    """Smallest power of two >= n (at least `minimum`), capped at `limit`."""
    size = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return min(size, limit)


def new_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
    shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(tuple(zeros() for _ in range(cfg.num_layers)), tuple(zeros() for _ in range(cfg.num_layers)))


def cache_nbytes(cfg: ModelConfig, batch: int, length: int, dtype) -> int:
    return 2 * cfg.num_layers * batch * length * cfg.kv_dim * jnp.dtype(dtype).itemsize


def attention_meta(cfg: ModelConfig, num_tokens: int, start, key_start) -> AttentionMeta:
    """Cache placement and RoPE tables of `num_tokens` tokens per row, row b written from slot start[b]."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), key_start.shape)
    slots = start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    positions = jnp.maximum(slots - key_start[:, None], 0)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    return AttentionMeta(start, key_start, cos, sin)


attention_meta_jit = jax.jit(attention_meta, static_argnums=(0, 1))


def _forward(graphdef, dense, experts: ExpertState, tokens, cache: KVCache, start, key_start, *, last_only,
             want_importance):
    model = nnx.merge(graphdef, dense)
    meta = attention_meta(model.config, tokens.shape[1], start, key_start)
    x, cache, signals = model(tokens, cache, meta, experts, want_importance=want_importance)
    if last_only:
        x = x[:, -1:]
    return model.logits(x), cache, signals


def _sample(logits, seen, key, temperature, top_k, one_minus_top_p, penalty, *, greedy):
    """logits [B, V] -> (next tokens [B], seen with them marked)."""
    tokens = sample_tokens(logits, seen, key, temperature, top_k, one_minus_top_p, penalty, greedy=greedy)
    seen = seen.at[jnp.arange(tokens.shape[0]), tokens].set(True)
    return tokens, seen


# Module-level jits keyed on the (hashable) graphdef: loads of models with the same structure
# share compiled steps.
_forward_jit = jax.jit(_forward, static_argnums=0, static_argnames=("last_only", "want_importance"),
                       donate_argnames=("cache",))
_sample_jit = jax.jit(_sample, static_argnames=("greedy",))


class Engine:
    """Compiled step functions for one loaded model; each compiles once per shape bucket."""

    def __init__(self, graphdef):
        self.forward = partial(_forward_jit, graphdef)
        self.sample = _sample_jit
