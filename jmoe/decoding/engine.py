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
from jmoe.decoding import acceptance, summary
from jmoe.decoding.sampling import ALL_FILTERS, record, sample_tokens
from jmoe.layers.attention import AttentionMeta, KVCache, QuantizedRows
from jmoe.layers.experts import ExpertState
from jmoe.layers.modules import cache_bytes_per_token, cache_spec
from jmoe.layers.rope import rope_tables
from jmoe.runtime import step_cache

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 64
KV_PAGE = 64  # slots a page of a shared KV pool (jmoe/serving/kv_pages.py): the unit rows grow by
PREFILL_CHUNK = 512  # most prompt tokens one prefill step processes, over all its rows


def bucket(n: int, minimum: int, limit: int) -> int:
    """Smallest power of two >= n (at least `minimum`), capped at `limit`."""
    size = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return min(size, limit)


def prefill_chunk(rows: int) -> int:
    """Prompt tokens per row of one prefill step: a power of two, at least MIN_PROMPT_BUCKET, with at
    most PREFILL_CHUNK tokens in all, so a batch's prefill needs the workspace of one long prompt's."""
    per_row = max(PREFILL_CHUNK // max(rows, 1), MIN_PROMPT_BUCKET)
    return 1 << (per_row.bit_length() - 1)


def new_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
    """A zeroed cache of `batch` rows of `length` slots, each row one page of its own (table [B, 1]
    = arange(B): the layout of a plain [B, heads, length, width] cache), in each layer's attention
    module's own layout (its cache_spec), made by one executable; dtype int8: an int8 cache
    (QuantizedRows, a float32 scale per slot and head)."""
    return _zero_cache(cfg, batch, length, jnp.dtype(dtype))


def new_pool(cfg: ModelConfig, pages: int, page: int, rows: int, row_pages: int, dtype) -> KVCache:
    """A zeroed pool of `pages` pages of `page` slots and a table of `rows` rows of `row_pages`
    pages, none taken (-1): the serving engine's shared cache (jmoe/serving/kv_pages.py)."""
    return _zero_pool(cfg, pages, page, jnp.dtype(dtype), rows, row_pages)


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _zero_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
    layers = _zero_layers(cfg, batch, length, dtype)
    return KVCache(layers, jnp.arange(batch, dtype=jnp.int32)[:, None])


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _zero_pool(cfg: ModelConfig, pages: int, page: int, dtype, rows: int, row_pages: int) -> KVCache:
    return KVCache(_zero_layers(cfg, pages, page, dtype), jnp.full((rows, row_pages), -1, jnp.int32))


def _zero_layers(cfg: ModelConfig, pages: int, page: int, dtype) -> tuple:
    def zeros(heads, width):
        if dtype == jnp.int8:
            return QuantizedRows(jnp.zeros((pages, heads, page, width), dtype),
                                 jnp.zeros((pages, heads, page, 1), jnp.float32))
        return jnp.zeros((pages, heads, page, width), dtype)

    return tuple(tuple(zeros(heads, width) for heads, width in cache_spec(cfg, i)) for i in range(cfg.num_layers))


def cache_nbytes(cfg: ModelConfig, batch: int, length: int, dtype) -> int:
    return batch * length * cache_bytes_per_token(cfg, dtype)


def attention_meta(cfg: ModelConfig, num_tokens: int, start, key_start, table) -> AttentionMeta:
    """Cache placement and RoPE tables of `num_tokens` tokens per row, row b written from slot start[b]
    through the page table."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), key_start.shape)
    slots = start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    positions = jnp.maximum(slots - key_start[:, None], 0)
    cos, sin = rope_tables(positions, cfg)
    return AttentionMeta(start, key_start, cos, sin, table)


attention_meta_jit = jax.jit(attention_meta, static_argnums=(0, 1))


def _run(graphdef, dense, experts: ExpertState, pools, tokens, cache: KVCache, start, key_start, *, last_only,
         want_importance):
    """(logits, cache, signals, pools): logits [B, T or 1 (last_only), V] of tokens [B, T], or [B, V]
    of tokens [B] (one per row); pools as the step left them (None: the state's, untouched)."""
    model = nnx.merge(graphdef, dense if isinstance(dense, nnx.State) else nnx.State(dense))
    one = tokens.ndim == 1
    tokens = tokens[:, None] if one else tokens
    meta = attention_meta(model.config, tokens.shape[1], start, key_start, cache.table)
    x, cache, signals, pools = model(tokens, cache, meta, experts, want_importance=want_importance, pools=pools)
    if last_only:
        x = x[:, -1:]
    logits = model.logits(x)
    return (logits[:, 0] if one else logits), cache, signals, pools


def _forward(graphdef, dense, experts: ExpertState, tokens, cache: KVCache, start, key_start, *, last_only,
             want_importance):
    """tokens [B, T] -> logits [B, T or 1 (last_only), V]; tokens [B] (one per row) -> logits [B, V]."""
    logits, cache, signals, _ = _run(graphdef, dense, experts, None, tokens, cache, start, key_start,
                                     last_only=last_only, want_importance=want_importance)
    return logits, cache, signals


def _fetching(graphdef, dense, experts: ExpertState, pools, tokens, cache: KVCache, start, key_start, *, last_only,
              want_importance):
    """_forward for a state that fetches experts in the step (pools donated and returned) and
    packs its summary: (logits, cache, signals, pools, summary)."""
    logits, cache, signals, pools = _run(graphdef, dense, experts, pools, tokens, cache, start, key_start,
                                         last_only=last_only, want_importance=want_importance)
    return logits, cache, signals, pools, summary.pack(signals)


def _decode(graphdef, dense, experts: ExpertState, pools, tokens, cache: KVCache, positions, seen, rng,
            temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency, *, greedy,
            filters=ALL_FILTERS):
    """One decode step and its sampling in one executable: tokens [B] -> (next tokens [B], seen, rng,
    cache, pools (None: not fetching), summary int32 [n] with the next tokens first, signals).
    positions: int32 [2, B], each row's cache slot (start) and first real slot (key_start): one transfer."""
    fetching = pools is not None
    start, key_start = positions[0], positions[1]
    logits, cache, signals, pools = _run(graphdef, dense, experts, pools, tokens, cache, start, key_start,
                                         last_only=True, want_importance=False)
    nxt, seen, rng = _sample(logits, seen, rng, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence,
                             frequency, greedy=greedy, filters=filters)
    packed = summary.pack(signals, nxt) if fetching else nxt.astype(jnp.int32)
    return nxt, seen, rng, cache, (pools if fetching else None), packed, signals


def _draft(graphdef, dense, experts: ExpertState, last, cache: KVCache, positions, seen, rng, temperature, top_k,
           one_minus_top_p, penalty, min_p, bias, presence, frequency, *, k, greedy, filters=ALL_FILTERS):
    """A speculative draft's k decode steps in one executable (jmoe/decoding/acceptance.py):
    (drafts [B, k], their probabilities [B, k, V], the draft's routing [L, E] (gate weight over
    its tokens: the verification's look-ahead), cache, rng)."""
    start, key_start = positions[0], positions[1]

    def step(cache, tokens, j):
        logits, cache, signals, _ = _run(graphdef, dense, experts, None, tokens, cache, start + j, key_start,
                                         last_only=True, want_importance=False)
        return logits, signals.gate, cache

    params = (temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency)
    return acceptance.draft_tokens(step, last, cache, seen, rng, params, k=k, greedy=greedy, filters=filters)


def _verify(graphdef, dense, experts: ExpertState, pools, last, drafts, cache: KVCache, positions, seen, rng, q,
            temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency, *, greedy,
            filters=ALL_FILTERS):
    """A speculative cycle's verification in one executable: the target over each row's last token
    and its drafts (fetching what it lacks itself when given pools) and the acceptance
    (jmoe/decoding/acceptance.py). Returns (accepted [B], next token [B], seen, rng, cache, pools,
    summary: accepted, next tokens and drafts first, signals)."""
    fetching = pools is not None
    start, key_start = positions[0], positions[1]
    block = jnp.concatenate([last[:, None], drafts], axis=1).astype(jnp.int32)
    logits, cache, signals, pools = _run(graphdef, dense, experts, pools, block, cache, start, key_start,
                                         last_only=False, want_importance=False)
    params = (temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency)
    accepted, nxt, seen, rng = acceptance.accept(logits, drafts, q, seen, rng, params, greedy=greedy, filters=filters)
    tokens = jnp.concatenate([accepted, nxt, drafts.reshape(-1)])
    packed = summary.pack(signals, tokens) if fetching else tokens.astype(jnp.int32)
    return accepted, nxt, seen, rng, cache, (pools if fetching else None), packed, signals


def _accept_again(logits, drafts, q, seen, rng, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence,
                  frequency, *, greedy, filters=ALL_FILTERS):
    """The acceptance of a verification run again (its step was not exact): as in _verify."""
    params = (temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency)
    return acceptance.accept(logits, drafts, q, seen, rng, params, greedy=greedy, filters=filters)


def _sample(logits, seen, rng, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency, *,
            greedy, filters=ALL_FILTERS):
    """logits [B, V] -> (next tokens [B], the history with them counted, the key for the next draw)."""
    rng, key = jax.random.split(rng)
    tokens = sample_tokens(logits, seen, key, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence,
                           frequency, greedy=greedy, filters=filters)
    seen = record(seen, jnp.arange(tokens.shape[0]), tokens)
    return tokens, seen, rng


_JITS: dict = {}


def jit_for(fn, graphdef, **jit_kwargs):
    """jax.jit of fn(graphdef, ...) with graphdef bound, one per (fn, graphdef): loads of models of
    the same structure share compiled steps, and no call pays for hashing the graphdef again. Where
    the step cache is on (the CPU), a CachedStep: its executables also outlive the process."""
    key = (fn, graphdef)
    if key not in _JITS:
        if step_cache.enabled():
            _JITS[key] = step_cache.CachedStep(partial(fn, graphdef), f"{fn.__module__}.{fn.__qualname__}",
                                               repr(graphdef), **jit_kwargs)
        else:
            _JITS[key] = jax.jit(partial(fn, graphdef), **jit_kwargs)
    return _JITS[key]


def clear_compiled() -> None:
    """Forget every compiled step (they recompile on next use). XLA:CPU maps each executable's code
    into memory, so a process that loads many differently shaped models over its life (a test
    suite, a server cycling models) calls this to stay under the kernel's limit on mappings."""
    _JITS.clear()
    jax.clear_caches()


def compiled_temp_bytes() -> dict[str, int]:
    """The temporary buffers (XLA's buffer assignment) of each step executable since clear_compiled,
    by step name and number: those the step cache keeps (the CPU), whose executables can be read."""
    temps = {}
    for step in _JITS.values():
        if isinstance(step, step_cache.CachedStep):
            for executable in step.executables():
                name = f"{step.name.rsplit('.', 1)[-1]} #{len(temps) + 1}"
                temps[name] = executable.memory_analysis().temp_size_in_bytes
    return temps


_sample_jit = jax.jit(_sample, static_argnames=("greedy", "filters"))
_accept_again_jit = jax.jit(_accept_again, static_argnames=("greedy", "filters"))


class Engine:
    """Compiled step functions for one loaded model; each compiles once per shape bucket.

    forward: a step (the experts' pools read as they are); fetching: a step that fetches experts
    into its donated pools and packs its summary; decode: a decode step with its sampling, one
    executable per token (fetching when given pools)."""

    def __init__(self, graphdef):
        self.forward = jit_for(_forward, graphdef, static_argnames=("last_only", "want_importance"),
                               donate_argnames=("cache",))
        self.fetching = jit_for(_fetching, graphdef, static_argnames=("last_only", "want_importance"),
                                donate_argnames=("cache", "pools"))
        self.decode = jit_for(_decode, graphdef, static_argnames=("greedy", "filters"),
                              donate_argnames=("cache", "pools"))
        self.draft = jit_for(_draft, graphdef, static_argnames=("k", "greedy", "filters"), donate_argnames=("cache",))
        self.verify = jit_for(_verify, graphdef, static_argnames=("greedy", "filters"),
                              donate_argnames=("cache", "pools"))
        self.accept_again = _accept_again_jit
        self.sample = _sample_jit
