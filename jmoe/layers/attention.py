"""What every attention module shares: the per-layer cache, where the current tokens sit in it,
the causal (and sliding-window) mask, and the attention each cached token received.

An attention module (jmoe/layers/gqa.py, jmoe/layers/mla.py) declares its own cache layout with
`cache_spec(cfg, layer_idx)`: one (heads, width) pair per cached array. The engine, the budget's KV
reservation and calibration all size caches from that spec (jmoe/layers/modules.py), so a module
that caches a compressed latent is charged for the latent, not for the keys and values it expands
into.

The cache is paged: each cached array is a pool of pages [P, heads, page, width], and a page table
[B, n] (int32, one per cache, shared by every layer) says which page holds each row's slots: row
b's slot s lives at pool[table[b, s // page], :, s % page]. A row therefore sees n * page slots in
order, wherever its pages lie; rows may share pages (prompt prefixes) and take pages as they grow
(the serving engine, jmoe/serving/kv_pages.py). A cache with one page per row, table [B, 1] =
arange(B), is laid out exactly as a plain [B, heads, S, width] cache. A table entry outside
[0, P) is no page: writes to it are dropped, and its slots must be ones no token attends to.

A cached array is either an array of the compute dtype or, with an int8 KV cache, `QuantizedRows`:
int8 values and one float32 scale per (page, head, slot), as llama.cpp's q8_0 keeps one scale per
block (here a block is one head's width). Attention multiplies the int8 block directly and applies
the scales to the block's scores and probabilities, so no dequantised copy of the cache is made.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import cpu_kernels
from jmoe.kernels.attention import decode_attention

CacheSpec = tuple[tuple[int, int], ...]  # per cached array: (heads, width)


class QuantizedRows(NamedTuple):
    """One int8 cached array: values int8 [P, heads, page, width], scales float32 [P, heads, page, 1]
    (a slot's width of values times its scale is what was cached)."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


class KVCache(NamedTuple):
    """Per-layer pools and the page table: layers[i] is that layer's tuple of [P, heads, page, width]
    arrays (compute dtype) or QuantizedRows (an int8 KV cache); table [B, n] int32 the pages of each
    row's slots (see the module docstring)."""

    layers: tuple[tuple[jax.Array | QuantizedRows, ...], ...]
    table: jax.Array

    @property
    def page(self) -> int:
        return page_size(self.layers[0][0])

    @property
    def length(self) -> int:
        """Slots each row sees: its pages times the page size."""
        return self.table.shape[1] * self.page


def page_size(cached) -> int:
    """Slots per page of a cached array (a pool [P, heads, page, width] or QuantizedRows)."""
    return cached.shape[2]


def quantize_rows(x: jax.Array) -> QuantizedRows:
    """x [..., width] rounded to int8 with one symmetric scale per width (max |x| / 127)."""
    x = x.astype(jnp.float32)
    scale = jnp.abs(x).max(-1, keepdims=True) / 127.0
    values = jnp.round(x / jnp.where(scale > 0, scale, 1.0))
    return QuantizedRows(jnp.clip(values, -127, 127).astype(jnp.int8), scale)


def dequantize_rows(rows: QuantizedRows, dtype) -> jax.Array:
    return (rows.values.astype(jnp.float32) * rows.scales).astype(dtype)


FLOAT8 = jnp.dtype(jnp.float8_e4m3fn)


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """x as a cache of `dtype` holds it; float8_e4m3fn has no infinity (a value past its largest,
    448, would become NaN), so values are clipped to its range first, as fp8 caches saturate."""
    if jnp.dtype(dtype) == FLOAT8:
        limit = float(jnp.finfo(FLOAT8).max)
        return jnp.clip(x.astype(jnp.float32), -limit, limit).astype(FLOAT8)
    return x.astype(dtype)


class AttentionMeta(NamedTuple):
    """Where the current tokens sit in the cache; rows may sit at different positions.

    start:     [B] int32, cache slot of each row's first current token (its T tokens follow it).
    key_start: [B] int32, first slot holding a real token of each row (prompts are left-padded).
    cos, sin:  [B, T, rotary_dim] float32 RoPE tables for the current tokens.
    table:     [B, n] int32, the cache's page table (KVCache.table).
    """

    start: jax.Array
    key_start: jax.Array
    cos: jax.Array
    sin: jax.Array
    table: jax.Array

    @property
    def num_tokens(self) -> int:
        return self.cos.shape[1]

    def query_slots(self) -> jax.Array:  # [B, T]
        return self.start[:, None] + jnp.arange(self.num_tokens, dtype=jnp.int32)[None, :]

    def token_valid(self) -> jax.Array:  # [B, T]: False on left padding
        return self.query_slots() >= self.key_start[:, None]


def write_cache(cache, new, meta: "AttentionMeta"):
    """(cache with new [B, H, T, w] written from slot meta.start[b] in each row b, through the page
    table; new as the cache holds it: rounded to int8 and back for an int8 cache, to float8 and back
    for a float8 one, else in the cache's dtype)."""
    if isinstance(cache, QuantizedRows):
        rows = quantize_rows(new)
        written = QuantizedRows(write_rows(cache.values, rows.values, meta),
                                write_rows(cache.scales, rows.scales, meta))
        return written, dequantize_rows(rows, new.dtype)
    held = to_cache_dtype(new, cache.dtype)
    return write_rows(cache, held, meta), held.astype(new.dtype) if held.dtype == FLOAT8 else held


def write_rows(pool, new, meta: "AttentionMeta"):
    """pool [P, H, page, w] with new [B, H, T, w] written at row b's slots meta.start[b] + t.

    On the CPU the native kernel writes the new rows into the donated pool in place. XLA's own
    update (vmapped: a bounds-checked scatter) is fused into each of its readers, the attention
    and the step's output, and every fused copy copies the whole cache first: a decode step at
    1024 slots spent more time copying caches than in its attention."""
    return cpu_kernels.write_rows(pool, new, meta.start, meta.table)


def allowed_keys(meta: AttentionMeta, slots, window: int | None) -> jax.Array:
    """[B, T, K] bool: which of the cache slots `slots` ([K], or [B, K] per row) each current token
    may attend to (causal, after the row's left padding, within the sliding window if any)."""
    q_slot = meta.query_slots()[:, :, None]  # [B, T, 1]
    k_slot = slots[None, None, :] if slots.ndim == 1 else slots[:, None, :]  # [1 or B, 1, K]
    allowed = (k_slot <= q_slot) & (k_slot >= meta.key_start[:, None, None])
    if window is not None:
        allowed &= q_slot - k_slot < window
    return allowed


# The scores of one block of keys, per cache row: at most this many (heads x current tokens x keys).
# Attention never holds more: a 512-token prefill chunk of 32 heads reads 128 keys at a time, a
# decode token of 32 heads 32,768 (4 MiB of float32 scores per row either way). Blocks are as long
# as that allows: XLA:CPU runs short products several times slower per key (measured: a decode
# token over 16K keys took 0.7 ms in one block, 1.3-1.7 ms in two, 1.6-2.0 ms in eight).
BLOCK_SCORES = 1 << 20
MIN_KEY_BLOCK, MAX_KEY_BLOCK = 128, 32768


def key_block(num_heads: int, tokens: int, slots: int) -> int:
    """Keys per block: a power of two within [MIN_KEY_BLOCK, MAX_KEY_BLOCK] keeping a block's scores
    under BLOCK_SCORES per row (the whole cache when it is shorter)."""
    fits = max(1, BLOCK_SCORES // max(num_heads * tokens, 1))
    block = min(MAX_KEY_BLOCK, max(MIN_KEY_BLOCK, 1 << (fits.bit_length() - 1)))
    return min(block, slots)


def attention_scores_nbytes(num_heads: int, tokens: int, slots: int, terms: int = 1) -> int:
    """Float32 bytes of one block's scores (one array per score term) and probabilities, per cache
    row (the step's attention workspace)."""
    return (terms + 1) * num_heads * tokens * key_block(num_heads, tokens, slots) * 4


def _block_scores(queries, keys, start, size, scale, precision, groups, table=None):
    """Scaled float32 scores [B, K, G, T, size] of queries against each row's slots [start,
    start+size) of keys (cached arrays read through `table`, or [B, K, S, w] arrays when table is
    None): a query term is [B, K, G*T, w] (head-major) or [B, T, K, G, w] (token-major, as
    projections give it: XLA:GPU found no tiling for latent attention's rotary term transposed to
    head-major)."""
    total = None
    for q, k in zip(queries, keys):
        k, k_scale = _cache_block(k, start, size, q.dtype, table)
        if q.ndim == 5:
            part = jnp.einsum("btkgd,bksd->bkgts", q, k, precision=precision)
        else:
            B, K, M, w = q.shape
            part = jnp.einsum("bkgtd,bksd->bkgts", q.reshape(B, K, groups, M // groups, w), k, precision=precision)
        part = part.astype(jnp.float32)
        if k_scale is not None:  # an int8 key's scale multiplies its score
            part = part * k_scale
        total = part if total is None else total + part
    return total * scale


def _cache_block(cache, start, size, dtype, table=None):
    """(each row's slots [start, start+size) [B, K, size, w] in `dtype`, their int8 scales as
    [B, K, 1, 1, size] or None): read through the page table, or sliced from [B, K, S, w] arrays
    when table is None (the current tokens' own keys)."""
    read = (lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=2)) if table is None else \
        (lambda a: read_slots(a, table, start, size))
    if not isinstance(cache, QuantizedRows):
        block = read(cache)  # float8 takes no part in implicit promotion: widened here
        return (block.astype(dtype) if block.dtype == FLOAT8 else block), None
    return read(cache.values).astype(dtype), read(cache.scales)[..., 0][:, :, None, None, :]


def read_slots(pool, table, start, size: int):
    """Each row's slots [start, start + size) of a pool [P, H, page, w] through table [B, n]: [B, H,
    size, w], one gather of whole slots (a slot of no page reads some page's: it must be masked)."""
    page = pool.shape[2]
    slots = start + jnp.arange(size, dtype=jnp.int32)  # [size]
    pages = jnp.take(table, slots // page, axis=1, mode="clip")  # [B, size]
    rows = pool[jnp.clip(pages, 0, pool.shape[0] - 1), :, (slots % page)[None, :]]  # [B, size, H, w]
    return rows.transpose(0, 2, 1, 3)


def blocked_attention(queries, keys, values, meta: AttentionMeta, *, groups: int, scale: float,
                      window: int | None, precision, sink=None, block: int | None = None,
                      reachable_only: bool | None = None):
    """Softmax attention over the cache one block of keys at a time, with an online softmax: the
    [query, key] scores are never held for more than one block (flash attention's formulation).

    queries: per score term a [B, K, G*T, w] array (K cache heads, G query heads per cache head,
    head-major then token) or the same as [B, T, K, G, w]; keys: the matching cached arrays
    [P, K, page, w] (the scores are the sum of the terms); values [P, K, page, wv] (each cached
    array may be QuantizedRows), all read through meta.table (S = n * page slots a row); sink [K, G] or None:
    a logit per head that joins the normaliser without a value (GPT-OSS). Returns
    (out [B, K, G*T, wv] float32, (top, norm)): the softmax's running maximum and normaliser
    [B, K, G, T], for `current_importance`.

    On the CPU the loop visits only the blocks some row's queries may reach (a prompt chunk at
    position p reads p keys, not the whole cache); elsewhere its trip count is the number of
    blocks, known when compiled (a loop bound read back from the device would stall a GPU step per
    iteration). reachable_only forces one of the two (None: by the platform the step is lowered for).

    A few current tokens (decode, verification) go to a kernel where one takes them
    (jmoe/kernels/attention.py): on the CPU one native call, which streams each cache head's keys and
    values once with the same online softmax; on a GPU the Pallas kernel that does the same there,
    reading the pages where they lie. An explicit block or reachable_only asks for this
    formulation itself."""
    kw = dict(groups=groups, scale=scale, window=window, sink=sink)

    def formulation():
        return _online_softmax(queries, keys, values, meta, precision=precision, block=block,
                               reachable_only=reachable_only, **kw)

    if block is not None or reachable_only is not None:
        return formulation()
    return decode_attention(queries, keys, values, meta.start, meta.key_start, meta.table,
                            num_tokens=meta.num_tokens, reference=formulation, precision=precision, **kw)


def _online_softmax(queries, keys, values, meta: AttentionMeta, *, groups: int, scale: float, window: int | None,
                    precision, sink, block: int | None, reachable_only: bool | None):
    """blocked_attention's XLA formulation: a loop over blocks of keys, each read through the page table."""
    T, G, table = meta.num_tokens, groups, meta.table
    S = table.shape[1] * page_size(keys[0])
    B, K, M = table.shape[0], keys[0].shape[1], groups * T
    block = block or key_block(K * G, T, S)
    num_blocks = -(-S // block)
    if sink is None:  # nothing seen yet: a running maximum of -inf and an empty normaliser
        top = jnp.full((B, K, G, T), -jnp.inf, jnp.float32)
        norm = jnp.zeros((B, K, G, T), jnp.float32)
    else:  # the sink is a logit without a value: it starts the maximum and adds exp(0) to the normaliser
        top = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, :, None], (B, K, G, T))
        norm = jnp.ones((B, K, G, T), jnp.float32)
    out = jnp.zeros((B, K, M, values.shape[-1]), jnp.float32)
    widened = isinstance(values, QuantizedRows) or values.dtype == FLOAT8  # read in the queries' dtype
    value_dtype = queries[0].dtype if widened else values.dtype

    def step(j, carry):
        top, norm, out = carry
        first = j * block
        start = jnp.minimum(first, S - block)  # the last block ends at S (it may overlap the one before)
        slots = start + jnp.arange(block, dtype=jnp.int32)
        allowed = allowed_keys(meta, slots, window)
        if S % block:
            allowed &= slots[None, None, :] >= first  # keys of the overlap were seen in the block before
        scores = _block_scores(queries, keys, start, block, scale, precision, G, table)
        scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(-1))
        safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no key allowed yet: keep exp() finite
        probs = jnp.exp(scores - safe_top[..., None])
        rescale = jnp.exp(top - safe_top)
        v, v_scale = _cache_block(values, start, block, value_dtype, table)
        weights = probs if v_scale is None else probs * v_scale  # an int8 value's scale weights its probability
        weighted = jnp.einsum("bkgts,bksd->bkgtd", weights.astype(value_dtype), v, precision=precision,
                              preferred_element_type=jnp.float32)
        out = out * rescale.reshape(B, K, M)[..., None] + weighted.reshape(B, K, M, -1)
        return new_top, norm * rescale + probs.sum(-1), out

    # Each loop starts from its first block's result, never from the zeros above: XLA would share one
    # zero block between all layers' loops and copy it for each at the step's start, holding every
    # layer's accumulator at once (8 MiB a layer for a 512-token chunk of Qwen3-30B-A3B's heads).
    carry = (top, norm, out)
    if num_blocks == 1:
        carry = step(0, carry)
    else:
        def visited(carry):  # the blocks holding a slot some row's current tokens may attend to
            lowest = meta.key_start.min()
            if window is not None:
                lowest = jnp.maximum(lowest, meta.start.min() - window + 1)
            first = jnp.clip(lowest // block, 0, num_blocks - 1)
            last = jnp.clip(-(-(meta.start.max() + T) // block), first + 1, num_blocks)
            return jax.lax.fori_loop(first + 1, last, step, step(first, carry))

        def every(carry):
            return jax.lax.fori_loop(1, num_blocks, step, step(0, carry))

        if reachable_only is None:
            carry = jax.lax.platform_dependent(carry, cpu=visited, default=every)  # chosen when lowered
        else:
            carry = (visited if reachable_only else every)(carry)
    top, norm, out = carry
    # a query with no key to attend to (left padding) gets zeros, not 0/0
    out = out / jnp.where(norm > 0, norm, 1.0).reshape(B, K, M)[..., None]
    return out, (top, norm)


def current_importance(queries, new_keys, meta: AttentionMeta, softmax, *, groups: int, scale: float,
                       window: int | None, precision) -> jax.Array:
    """DyMoE heavy hitters: [B, T] the mean attention each current token received from the row's
    valid current queries, over every query head.

    Only current queries attend to current keys, and a key's probability is its score against the
    softmax's final maximum and normaliser (`softmax`, from blocked_attention), so this needs the
    current tokens' own keys (new_keys: per score term [B, K, T, w]), never the whole cache; they are
    taken a block at a time, as blocked_attention takes the cache's."""
    top, norm = softmax
    B, K, G, T = top.shape
    safe_top = jnp.where(top == -jnp.inf, 0.0, top)[..., None]
    norm = jnp.where(norm > 0, norm, 1.0)[..., None]
    q_slot = meta.query_slots()  # [B, T]: each row's current keys sit at its current queries' slots
    q_valid = meta.token_valid().astype(jnp.float32)  # [B, T]
    block = key_block(K * G, T, T)
    received = []
    for first in range(0, T, block):
        size = min(block, T - first)
        allowed = allowed_keys(meta, q_slot[:, first:first + size], window)
        scores = _block_scores(queries, new_keys, first, size, scale, precision, G)
        probs = jnp.where(allowed[:, None, None], jnp.exp(scores - safe_top) / norm, 0.0)
        received.append(jnp.einsum("bkgqs,bq->bs", probs, q_valid))
    received = jnp.concatenate(received, axis=1)
    return received / (K * G * jnp.maximum(q_valid.sum(-1, keepdims=True), 1.0))
