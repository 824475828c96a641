"""Pallas (Triton) attention over a paged KV cache, reading each key and value where its page lies:
decode and verification (a few current tokens) and prompt chunks (any number of them, in tiles).

Computes what cpu_kernels.attention computes: the current tokens of each row attend to the cached
slots each may reach, with an online softmax, and the result comes back normalised with the
softmax's maximum and normaliser.

Layout: q [B, K, groups * T, w] (the query heads of each cache head, then tokens: row m of a cache
head is head m // T's token m % T); keys [P, K, page, w] and values [P, K, page, wv], pools of pages,
each float32, bfloat16, float8_e4m3fn, or int8 with float32 scales [P, K, page, 1] (`.values`, `.scales`); table
[B, n] int32: row b's logical slot s lies at pool[table[b, s // page], :, s % page] (a table entry
outside [0, P) is no page). Token t of row b sits at slot start[b] + t and attends to slots
[key_start[b], start[b] + t], the last `window` of them if set; sink [K, groups] or None: a logit per
query head that joins the normaliser without a value (GPT-OSS).

Grid (B, K, tiles x splits): one program per (row, cache head), tile of current tokens and share of
the tile's reach. A tile is Tq current tokens of every query head of the cache head (all T of them
for decode and verification; for a prompt chunk as many as MAX_QUERY_ROWS rows hold), run as the
rows of one [Mp, w] query tile (Mp: groups * Tq rounded up to a power of two, at least 16, since
tl.dot needs M >= 16), so each key and value is read once for all of them. A tile reaches only up
to its own last token, so a prompt chunk's early tiles skip the keys after them (causal), and its
reach is read inside the kernel: a chunk at position p of a long cache visits p slots, where the
XLA loop on a GPU visits the whole cache (a trip count known when compiled).

  per block of BLOCK_KEYS slots   page = table[b, slot // page] for each slot (one row of the
                                  table: a few KiB, cached); keys [BK, w] and values [BK, wv]
                                  loaded from pool[page, k, slot % page] directly: no gathered
                                  copy of the cache is made outside the kernel
                                  scores = q @ keys^T * scale (* each int8 key's scale), masked per
                                  query to its reach; running maximum, normaliser and the [Mp, wv]
                                  float32 accumulator updated as flash attention does
                                  (probabilities times each int8 value's scale, then @ values)

Each program visits only the blocks that hold a slot some token of its tile reaches ([key_start or
the window's first slot, the tile's last token's slot]), a trip count read inside the kernel, so a
short row costs little however long the cache is.

Flash-decoding: one (row, cache head) of a long context is too little work for a GPU (decode of
one row of Qwen3-30B-A3B is 4 programs for 132 multiprocessors), so a tile's blocks are cut into
`splits` shares, each a program writing its unnormalised partial softmax (maximum, normaliser,
accumulator); the partials and the sink are merged after the kernel, as the CPU kernel merges its
chunks. Splits: enough programs to fill the device (pallas_kernels/device_config.py), no share
shorter than MIN_SPLIT_KEYS slots of the cache (of the window, with a sliding window).

Slots of no page, slots outside a row's reach and padded query rows are masked: their keys and
values are replaced by zeros before use, so whatever those slots hold (a page of another row, a
freed page) never reaches a result. A query with no key and no sink gets a maximum of -inf, a
normaliser of 0 and zeros.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import device_config
from pallas_kernels.expert_ffn_pallas import offsets_fit

BLOCK_KEYS = 64  # cache slots per loop step
MIN_SPLIT_KEYS = 512  # a share shorter than this costs more to merge than it saves
MIN_DOT_DIM = 16  # tl.dot needs M, N, K >= 16
MAX_QUERY_ROWS = 64  # query heads x tokens of one cache head: 8 x 8 (verifying 7 drafts) compiled for an H100
# Warps per program: 4, or 8 where the [Mp, wv] float32 accumulator would take more than this many
# registers per thread at 4.
ACC_PER_THREAD = 32
NUM_STAGES = 2  # each step's key and value loads issued while the step before computes

_QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
FLOAT8 = jnp.dtype(jnp.float8_e4m3fn)
_CACHE_DTYPES = _QUERY_DTYPES + (jnp.dtype(jnp.int8), FLOAT8)


@dataclass(frozen=True)
class _Plan:
    """Static description of one launch."""

    rows: int  # Mp: query rows of a program (groups * tile_tokens padded)
    queries: int  # groups * tile_tokens: the query rows of a tile that hold a query
    tokens: int  # T
    tile_tokens: int  # Tq: current tokens of one tile
    tiles: int  # ceil(T / Tq)
    page: int
    pages: int  # P
    slots: int  # S = n * page
    splits: int
    scale: float
    window: int | None
    quantized: bool  # int8 keys and values with scales
    fp8: bool  # float8_e4m3fn keys and values, widened as loaded
    value_dtype: str  # what the probabilities are cast to before @ values
    value_width: int  # wv
    # both dots': None is JAX's GPU default (TF32 for float32 operands), HIGHEST exact float32 (IEEE)
    precision: jax.lax.Precision | None = None

    @property
    def num_warps(self) -> int:
        # fp8's widening takes registers of its own: at Mixtral-8x7B's heads 4 warps spilled 8 bytes
        return 4 if self.rows * self.value_width <= 4 * 32 * ACC_PER_THREAD and not self.fp8 else 8


def _array(cache):
    return getattr(cache, "values", cache)


def _kind(cache):
    return jnp.dtype(_array(cache).dtype), hasattr(cache, "scales")


def _query_rows(queries: int) -> int:
    return max(MIN_DOT_DIM, pl.next_power_of_2(queries))


def _pow2(n: int) -> bool:
    return n >= MIN_DOT_DIM and n & (n - 1) == 0


def supports(q, keys, values, groups: int | None = None) -> bool:
    """Whether `decode_attention` takes these inputs: q [B, K, groups * T, w] float32 or bfloat16
    with at most MAX_QUERY_ROWS query heads per cache head (any number of tokens: more than a tile's
    run as several tiles; without `groups`, at most MAX_QUERY_ROWS rows in all); keys and values of
    one kind (float32, bfloat16, float8_e4m3fn widened as loaded, or int8 with scales);
    widths w and wv powers of two >= 16 (the Triton lowering loads power-of-two tiles, tl.dot
    needs 16); every pool indexed without 32-bit offset overflow (expert_ffn_pallas.offsets_fit)."""
    if q.ndim != 4 or jnp.dtype(q.dtype) not in _QUERY_DTYPES:
        return False
    if groups is None and q.shape[2] > MAX_QUERY_ROWS:
        return False
    if groups is not None and (groups > MAX_QUERY_ROWS or q.shape[2] % groups):
        return False
    if _kind(keys) != _kind(values) or _kind(keys)[0] not in _CACHE_DTYPES:
        return False
    if (_kind(keys)[0] == jnp.dtype(jnp.int8)) != _kind(keys)[1]:
        return False  # int8 comes with scales, floats without
    k, v = _array(keys), _array(values)
    if k.ndim != 4 or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3] or v.shape[:3] != k.shape[:3]:
        return False
    if not (_pow2(q.shape[3]) and _pow2(v.shape[3])):
        return False
    arrays = [keys, values] if not _kind(keys)[1] else [keys.values, keys.scales, values.values, values.scales]
    return all(offsets_fit(a) for a in arrays)


def _splits(rows: int, heads: int, slots: int) -> int:
    """Shares of each tile's reach: about the device's target_programs programs in all, none shorter
    than MIN_SPLIT_KEYS of `slots` (the whole cache, or a sliding window's span: a row's reach is
    only known inside the kernel)."""
    want = -(-device_config.current().target_programs // (rows * heads))
    return max(1, min(want, slots // MIN_SPLIT_KEYS))


def _kernel(q_ref, k_ref, v_ref, *refs, plan: _Plan):
    """One program: cache head k of row b, tile `tile` of its current tokens, share `split` of the
    blocks that tile's reach covers."""
    if plan.quantized:
        ks_ref, vs_ref, *refs = refs
    start_ref, key_start_ref, table_ref, acc_ref, top_ref, norm_ref = refs
    b, tile, split = pl.program_id(0), pl.program_id(2) // plan.splits, pl.program_id(2) % plan.splits
    first_token = tile * plan.tile_tokens
    start = start_ref[b]
    # the tile's reach [lo, hi): every slot some current token of it attends to
    lo = jnp.maximum(key_start_ref[b], 0)
    if plan.window is not None:
        lo = jnp.maximum(lo, start + first_token - plan.window + 1)
    hi = jnp.minimum(start + jnp.minimum(first_token + plan.tile_tokens, plan.tokens), plan.slots)
    first = lo // BLOCK_KEYS
    blocks = jnp.maximum(pl.cdiv(hi, BLOCK_KEYS) - first, 0)
    begin = first + blocks * split // plan.splits
    end = first + blocks * (split + 1) // plan.splits

    # each query row's own reach [row_lo, row_hi); padded rows and tokens past T reach nothing
    row = jax.lax.broadcasted_iota(jnp.int32, (plan.rows,), 0)
    token = first_token + row % plan.tile_tokens
    q_slot = start + token
    row_lo = jnp.broadcast_to(lo, (plan.rows,)) if plan.window is None else jnp.maximum(lo, q_slot - plan.window + 1)
    row_hi = jnp.where((row < plan.queries) & (token < plan.tokens), jnp.minimum(q_slot + 1, hi), 0)
    q = q_ref[...]  # [Mp, w]
    n = table_ref.shape[0]

    def step(i, carry):
        top, norm, acc = carry
        slots = (begin + i) * BLOCK_KEYS + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_KEYS,), 0)
        pages = table_ref[jnp.minimum(slots // plan.page, n - 1)]
        held = (pages >= 0) & (pages < plan.pages) & (slots >= lo) & (slots < hi)
        pages, offsets = jnp.where(held, pages, 0), slots % plan.page
        keys = jnp.where(held[:, None], k_ref[pages, offsets, :].astype(q.dtype), 0)  # fp8 widened as loaded
        scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=plan.precision,
                                     preferred_element_type=jnp.float32)
        scores = scores * plan.scale
        if plan.quantized:  # an int8 key's scale multiplies its score
            scores = scores * jnp.where(held, ks_ref[pages, offsets], 0.0)[None, :]
        allowed = held[None, :] & (slots[None, :] >= row_lo[:, None]) & (slots[None, :] < row_hi[:, None])
        scores = jnp.where(allowed, scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=1))
        safe_top = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no key allowed yet: keep exp() finite
        probs = jnp.exp(scores - safe_top[:, None])
        rescale = jnp.exp(top - safe_top)
        values = jnp.where(held[:, None], v_ref[pages, offsets, :].astype(plan.value_dtype), 0)
        weights = probs
        if plan.quantized:  # an int8 value's scale weights its probability
            weights = probs * jnp.where(held, vs_ref[pages, offsets], 0.0)[None, :]
        value_dtype = jnp.dtype(plan.value_dtype)
        weighted = jnp.dot(weights.astype(value_dtype), values.astype(value_dtype), precision=plan.precision,
                           preferred_element_type=jnp.float32)
        return new_top, norm * rescale + probs.sum(axis=1), acc * rescale[:, None] + weighted

    init = (jnp.full((plan.rows,), -jnp.inf, jnp.float32), jnp.zeros((plan.rows,), jnp.float32),
            jnp.zeros(acc_ref.shape, jnp.float32))
    top, norm, acc = jax.lax.fori_loop(0, end - begin, step, init)
    acc_ref[...] = acc
    top_ref[...] = top
    norm_ref[...] = norm


def _merge(acc, top, norm, sink, plan: _Plan, groups: int):
    """The shares' partial softmaxes [splits, B, K, tiles, Mp, ...] (and the sink) as one, back in the
    caller's layout: (out [B, K, groups * T, wv] normalised, top, norm [B, K, groups, T])."""
    Tq, T = plan.tile_tokens, plan.tokens
    M = plan.queries  # a tile's rows: head-major, then its tokens
    acc, top, norm = acc[..., :M, :], top[..., :M], norm[..., :M]
    best = top.max(axis=0)
    if sink is not None:  # a tile's query row m is head m // Tq's
        sink = jnp.repeat(sink.astype(jnp.float32).reshape(-1, groups), Tq, axis=1)[None, :, None]  # [1, K, 1, M]
        best = jnp.maximum(best, sink)
    safe = jnp.where(best == -jnp.inf, 0.0, best)
    weight = jnp.exp(top - safe)  # a share with no key (top -inf) adds nothing
    total = (norm * weight).sum(axis=0)
    if sink is not None:
        total = total + jnp.exp(sink - safe)
    out = (acc * weight[..., None]).sum(axis=0)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]  # no key and no sink: zeros
    B, K, wv = out.shape[0], out.shape[1], out.shape[-1]

    def untiled(x):  # [B, K, tiles, groups * Tq, ...] -> [B, K, groups, T, ...]
        x = x.reshape(B, K, plan.tiles, groups, Tq, *x.shape[4:])
        x = jnp.moveaxis(x, 3, 2).reshape(B, K, groups, plan.tiles * Tq, *x.shape[5:])
        return x[:, :, :, :T]

    return untiled(out).reshape(B, K, groups * T, wv), untiled(best), untiled(total)


def _tiled(q, groups: int, plan: _Plan):
    """q [B, K, groups * T, w] (head-major, then token) as [B, K, tiles, Mp, w]: each tile's Tq tokens
    of every head (head-major within the tile), tokens past T and rows past groups * Tq zeros."""
    B, K, _, w = q.shape
    q = q.reshape(B, K, groups, plan.tokens, w)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, plan.tiles * plan.tile_tokens - plan.tokens), (0, 0)))
    q = jnp.moveaxis(q.reshape(B, K, groups, plan.tiles, plan.tile_tokens, w), 3, 2)
    q = q.reshape(B, K, plan.tiles, groups * plan.tile_tokens, w)
    return jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, plan.rows - plan.queries), (0, 0)))


def tile_tokens(groups: int, tokens: int) -> int:
    """Current tokens per tile: all of them where every head's fit in MAX_QUERY_ROWS query rows,
    else as many as fit (a prompt chunk)."""
    return min(tokens, max(1, MAX_QUERY_ROWS // groups))


def decode_attention(q, keys, values, start, key_start, table, *, groups: int, scale: float,
                     window: int | None = None, sink=None, splits: int | None = None, precision=None,
                     interpret: bool = False):
    """Softmax attention of current tokens over a paged cache (cpu_kernels.attention's contract): a
    few (decode, verification) in one tile, a prompt chunk in tiles of tile_tokens() tokens.

    Args:
      q: [B, K, groups * T, w] float32 or bfloat16, query heads of each cache head, then tokens.
      keys, values: pools [P, K, page, w] and [P, K, page, wv]: arrays, or int8 `.values` with
        float32 `.scales` [P, K, page, 1].
      start, key_start: [B] int32; table: [B, n] int32 (see the module docstring).
      groups: query heads per cache head; scale: multiplies every score; window: the last `window`
        slots only; sink: [K, groups] or None.
      splits: shares of each tile's reach (default: enough to fill the device).
      precision: of both dots, as the XLA formulation's (jax.lax.Precision): None multiplies float32
        operands in TF32 on the GPU, as XLA does by default; HIGHEST in float32.
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      (out [B, K, groups * T, wv] float32, top, norm [B, K, groups, T]): the normalised attention,
      and the softmax's maximum and normaliser (-inf and 0 for a query with no key and no sink,
      whose output is 0).
    """
    if not supports(q, keys, values, groups):  # (refused before anything is traced)
        raise NotImplementedError("decode_attention does not take these shapes or dtypes; see supports()")
    B, K, M, w = q.shape
    k_pool, v_pool = _array(keys), _array(values)
    P, _, page, _ = k_pool.shape
    wv = v_pool.shape[-1]
    S = table.shape[1] * page
    quantized = _kind(keys)[1]
    if quantized or k_pool.dtype == FLOAT8:  # int8 and fp8 multiply the compute dtype's queries, widened
        compute_dtype = value_dtype = q.dtype
    else:
        compute_dtype = jnp.promote_types(q.dtype, k_pool.dtype)
        value_dtype = v_pool.dtype
    T = M // groups
    Tq = tile_tokens(groups, T)
    tiles = -(-T // Tq)
    plan = _Plan(rows=_query_rows(groups * Tq), queries=groups * Tq, tokens=T, tile_tokens=Tq, tiles=tiles,
                 page=page, pages=P, slots=S, splits=splits or _splits(B * tiles, K, S if window is None else min(S, window + Tq)), scale=float(scale),
                 window=window, quantized=quantized,
                 fp8=k_pool.dtype == FLOAT8,
                 value_dtype=jnp.dtype(value_dtype).name, value_width=wv,
                 precision=None if precision is None else jax.lax.Precision(precision))
    q = _tiled(q.astype(compute_dtype), groups, plan)

    whole = lambda shape: pl.BlockSpec(shape, lambda b, k, s: (0,) * len(shape))  # noqa: E731
    head = lambda shape: pl.BlockSpec((shape[0], None, *shape[2:]),  # noqa: E731
                                      lambda b, k, s: (0, k) + (0,) * (len(shape) - 2))
    operands = [q, k_pool, v_pool]
    in_specs = [pl.BlockSpec((None, None, None, plan.rows, w), lambda b, k, s: (b, k, s // plan.splits, 0, 0)),
                head(k_pool.shape),
                head(v_pool.shape)]
    if quantized:  # scales [P, K, page]: one per slot
        scales = [c.scales.reshape(P, K, page).astype(jnp.float32) for c in (keys, values)]
        operands += scales
        in_specs += [head(s.shape) for s in scales]
    operands += [start.astype(jnp.int32), key_start.astype(jnp.int32), table.astype(jnp.int32)]
    in_specs += [whole((B,)), whole((B,)), pl.BlockSpec((None, table.shape[1]), lambda b, k, s: (b, 0))]
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    share = (plan.splits, B, K, tiles, plan.rows)
    at = lambda b, k, s: (s % plan.splits, b, k, s // plan.splits, 0)  # noqa: E731  (share, row, head, tile)
    acc, top, norm = pl.pallas_call(
        functools.partial(_kernel, plan=plan),
        grid=(B, K, tiles * plan.splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, None, plan.rows, wv), lambda b, k, s: (*at(b, k, s), 0)),
                   pl.BlockSpec((None, None, None, None, plan.rows), at),
                   pl.BlockSpec((None, None, None, None, plan.rows), at)],
        out_shape=[f32(*share, wv), f32(*share), f32(*share)],
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=NUM_STAGES),
        interpret=interpret,
        name="decode_attention",
    )(*operands)
    return _merge(acc, top, norm, sink, plan, groups)
