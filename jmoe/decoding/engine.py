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
from jmoe.layers.modules import cache_bytes_per_token, cache_spec
from jmoe.layers.rope import rope_tables

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 64
PREFILL_CHUNK = 512  # longest block of prompt tokens one step processes


def bucket(n: int, minimum: int, limit: int) -> int:
    """Smallest power of two >= n (at least `minimum`), capped at `limit`."""
    size = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return min(size, limit)


def new_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
    """Zeroed caches in each layer's attention module's own layout (its cache_spec)."""
    return KVCache(tuple(tuple(jnp.zeros((batch, heads, length, width), dtype) for heads, width in cache_spec(cfg, i))
                         for i in range(cfg.num_layers)))


def cache_nbytes(cfg: ModelConfig, batch: int, length: int, dtype) -> int:
    return batch * length * cache_bytes_per_token(cfg, dtype)


def attention_meta(cfg: ModelConfig, num_tokens: int, start, key_start) -> AttentionMeta:
    """Cache placement and RoPE tables of `num_tokens` tokens per row, row b written from slot start[b]."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), key_start.shape)
    slots = start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    positions = jnp.maximum(slots - key_start[:, None], 0)
    cos, sin = rope_tables(positions, cfg)
    return AttentionMeta(start, key_start, cos, sin)


attention_meta_jit = jax.jit(attention_meta, static_argnums=(0, 1))


def _forward(graphdef, dense, experts: ExpertState, tokens, cache: KVCache, start, key_start, *, last_only,
             want_importance):
    """tokens [B, T] -> logits [B, T or 1 (last_only), V]; tokens [B] (one per row) -> logits [B, V]."""
    model = nnx.merge(graphdef, dense if isinstance(dense, nnx.State) else nnx.State(dense))
    one = tokens.ndim == 1
    tokens = tokens[:, None] if one else tokens
    meta = attention_meta(model.config, tokens.shape[1], start, key_start)
    x, cache, signals = model(tokens, cache, meta, experts, want_importance=want_importance)
    if last_only:
        x = x[:, -1:]
    logits = model.logits(x)
    return (logits[:, 0] if one else logits), cache, signals


def _sample(logits, seen, rng, temperature, top_k, one_minus_top_p, penalty, *, greedy):
    """logits [B, V] -> (next tokens [B], seen with them marked, the key for the next draw)."""
    rng, key = jax.random.split(rng)
    tokens = sample_tokens(logits, seen, key, temperature, top_k, one_minus_top_p, penalty, greedy=greedy)
    seen = seen.at[jnp.arange(tokens.shape[0]), tokens].set(True)
    return tokens, seen, rng


_JITS: dict = {}


def jit_for(fn, graphdef, **jit_kwargs):
    """jax.jit of fn(graphdef, ...) with graphdef bound, one per (fn, graphdef): loads of models of
    the same structure share compiled steps, and no call pays for hashing the graphdef again."""
    key = (fn, graphdef)
    if key not in _JITS:
        _JITS[key] = jax.jit(partial(fn, graphdef), **jit_kwargs)
    return _JITS[key]


def clear_compiled() -> None:
    """Forget every compiled step (they recompile on next use). XLA:CPU maps each executable's code
    into memory, so a process that loads many differently shaped models over its life (a test
    suite, a server cycling models) calls this to stay under the kernel's limit on mappings."""
    _JITS.clear()
    jax.clear_caches()


_sample_jit = jax.jit(_sample, static_argnames=("greedy",))


class Engine:
    """Compiled step functions for one loaded model; each compiles once per shape bucket."""

    def __init__(self, graphdef):
        self.forward = jit_for(_forward, graphdef, static_argnames=("last_only", "want_importance"),
                               donate_argnames=("cache",))
        self.sample = _sample_jit
