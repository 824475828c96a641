"""Entry points of the CPU kernels, with the XLA reference as the fallback.

Weights reach the native kernels in their stored layout (kernel_formats/qarray.py): plain
bf16/float32 [.., K, N] or QArray codes, scales and offsets, in [K, N] order or the CPU layout's
column tiles. What the kernels do not do themselves
is done here, on the small activations: HAQ's input smoothing (x * act_scale) and W8A8's per-token
activation quantization, exactly as the XLA reference does them.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import native
from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import (TILE, PlainTiles, QArray, QPlanes, bf16_dot_applies, dequantize, int8_dot_applies,
                                   prepare_input, quantize_groups, round_to_bf16, untile_plain)


# Float weights with fewer columns than this (a router of 8 or 32 experts, a shared expert's [D, 1]
# gate: narrower than the native kernel's 64-column tile) are multiplied by XLA's dot.
XLA_DOT_COLUMNS = TILE

# Set while tracing a computation placed on the host CPU device beside an accelerator (the CPU
# executor's own jit on a GPU machine): the native kernels apply there too.
_HOST_TRACE = contextvars.ContextVar("jmoe_host_trace", default=False)


@contextlib.contextmanager
def host_computation():
    """Trace the enclosed ops for a computation that runs on the host CPU device, whatever the
    default backend (its inputs committed to jax.devices("cpu"))."""
    token = _HOST_TRACE.set(True)
    try:
        yield
    finally:
        _HOST_TRACE.reset(token)


def available() -> bool:
    """Whether the native library is loaded and the computation being traced runs on the CPU: the
    default backend is the CPU, or it is traced inside `host_computation`."""
    return native.loaded() and (jax.default_backend() == "cpu" or _HOST_TRACE.get())


def _weight_operands(w, tiled: bool = False):
    """(values, scales, offsets, bases) operands and (bits, group, symmetric, tiled) of a weight or a
    pool of them; tiled: a plain weight stored in the CPU layout (kernel_formats.qarray.tile_plain),
    as a PlainTiles pool always is."""
    if isinstance(w, QArray):
        fmt = w.fmt
        offsets = native.empty(np.float16) if w.offsets is None else w.offsets
        bases = native.empty(np.float32) if w.bases is None else w.bases
        return (w.values, w.scales, offsets, bases), dict(bits=np.int64(fmt.bits), group=np.int64(fmt.group_size),
                                                          symmetric=bool(fmt.symmetric), tiled=fmt.tiles(w.n))
    if isinstance(w, PlainTiles):
        w, tiled = w.values, True
    dtype = jnp.dtype(w.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        w = w.astype(jnp.float32)
        dtype = jnp.dtype(jnp.float32)
    bits = 16 if dtype == jnp.dtype(jnp.bfloat16) else 32
    no_scales = native.empty(np.float16)
    return (w, no_scales, no_scales, native.empty(np.float32)), dict(bits=np.int64(bits), group=np.int64(64),
                                                                     symmetric=True, tiled=tiled)


def matmul(x: jax.Array, w, *, int8_dot: bool = False, tiled: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] -> float32 [..., N]; w a plain array, a QArray (smoothing and W8A8 applied)
    or a six-bit QPlanes. int8_dot: a quantized w multiplies x on its per-group int8 grid
    (quantize_groups), in integers where the CPU has VNNI. tiled: a plain w stored in the CPU layout
    (tile_plain; N a multiple of TILE)."""
    if isinstance(w, QPlanes):
        return _matmul_planes(x, w, int8_dot)
    if tiled and (isinstance(w, QArray) or w.shape[-1] % TILE):
        raise ValueError("tiled applies to a plain weight whose N is a multiple of 64")
    bf16_dot = int8_dot and bf16_dot_applies(w)
    int8_dot = int8_dot and int8_dot_applies(w)
    if isinstance(w, QArray):
        x = prepare_input(x, w.act_scale, w.fmt)
        k, n = w.k, w.n
    else:
        k, n = w.shape
    narrow = _narrow(w, tiled)
    # Under the int8 dot a plain bf16 projection's inputs are rounded to bf16 (the AVX-512 BF16 dot's
    # inputs, as for bf16 experts); a narrow one (a shared expert's [D, 1] gate) keeps them, like the routers.
    bf16_dot = bf16_dot and not narrow
    if not available() or narrow:
        if int8_dot:
            x = quantize_groups(x, w.fmt.group_size)
        if bf16_dot:
            x = round_to_bf16(x.astype(jnp.float32))
        dense = dequantize(w, jnp.float32) if isinstance(w, QArray) else w.astype(jnp.float32)
        if tiled:
            dense = untile_plain(dense)
        return jnp.dot(x.astype(jnp.float32), dense, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
    operands, fmt = _weight_operands(w, tiled)
    no_plane = (native.empty(np.uint8), native.empty(np.float16))
    return _native_matmul(x, k, n, (*operands, *no_plane), int8_dot=int8_dot or bf16_dot, **fmt)


def _narrow(w, tiled: bool) -> bool:
    """Whether XLA's dot multiplies w, a float weight with no whole tile (a router of 8 or 32 experts):
    in the calling thread it costs less than a call across the kernels' thread pool
    (bench/results/router_matmul)."""
    return not isinstance(w, QArray) and not tiled and w.shape[-1] < XLA_DOT_COLUMNS


def _one_pass_operands(w, int8_dot: bool, tiled: bool):
    """(operands, attributes) of w in a shared-input call (matmuls), or None where w takes its own
    call: a six-bit weight, inputs of its own (HAQ smoothing, W8A8), or a float weight narrower than a tile."""
    if isinstance(w, QPlanes) or not _multiplies_h_as_is(w) or _narrow(w, tiled):
        return None
    n = w.n if isinstance(w, QArray) else w.shape[-1]
    dot = int8_dot and (int8_dot_applies(w) or bf16_dot_applies(w))
    operands, fmt = _weight_operands(w, tiled)
    return operands, dict(fmt, n=np.int64(n), int8_dot=bool(dot))


def matmuls(x: jax.Array, weights: list, *, int8_dot: list[bool], tiled: list[bool]) -> list[jax.Array]:
    """[x @ w for w in weights] (float32), as `matmul` computes each: one native call over the pool for
    every weight it takes (a layer's q, k and v; an MLP's gate and up), where a call each made a
    round trip per weight; the rest, and everything where the native kernels do not run, one by one."""
    shared = [_one_pass_operands(w, dot, t) if available() else None
              for w, dot, t in zip(weights, int8_dot, tiled)]
    ones = [i for i, s in enumerate(shared) if s is not None]
    if len(ones) < 2:  # nothing to share: a call each
        return [matmul(x, w, int8_dot=dot, tiled=t) for w, dot, t in zip(weights, int8_dot, tiled)]
    out = [None if s is not None else matmul(x, w, int8_dot=dot, tiled=t)
           for w, dot, t, s in zip(weights, int8_dot, tiled, shared)]
    k = x.shape[-1]
    operands, attrs, widths = [], {"k": np.int64(k)}, []
    for j, i in enumerate(ones):
        ops_i, attrs_i = shared[i]
        operands += ops_i
        attrs.update({f"{name}{j}": value for name, value in attrs_i.items()})
        widths.append(int(attrs_i["n"]))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    results = [jax.ShapeDtypeStruct((x2.shape[0], width), jnp.float32) for width in widths]
    ys = native.call(native.MATMULS, results, x2, *operands, **attrs)
    for i, y, width in zip(ones, ys, widths):
        out[i] = y.reshape(*lead, width)
    return out


def batched_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, M, K] @ w [B, K, N] -> float32 [B, M, N], one product a batch entry; w a plain float
    array (bf16 read as it is stored). Latent attention's per-head up-projections (jmoe/layers/mla.py)."""
    b, k, n = w.shape
    if not available():
        return jnp.einsum("bmk,bkn->bmn", x.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    operands, fmt = _weight_operands(w)
    no_plane = (native.empty(np.uint8), native.empty(np.float16))
    return native.call(native.MATMUL, jax.ShapeDtypeStruct((b, x.shape[1], n), jnp.float32), x.astype(jnp.float32),
                       *operands, *no_plane, k=np.int64(k), n=np.int64(n), int8_dot=False, **fmt)


def _native_matmul(x: jax.Array, k: int, n: int, operands: tuple, **attrs) -> jax.Array:
    """x [..., K] times the weight the native matmul's operands describe -> float32 [..., N]."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    y = native.call(native.MATMUL, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32), x2, *operands,
                    k=np.int64(k), n=np.int64(n), **attrs)
    return y.reshape(*lead, n)


def _matmul_planes(x: jax.Array, w: QPlanes, int8_dot: bool) -> jax.Array:
    """x @ a six-bit weight. Under the int8 dot, one native call reads both planes' codes in one pass
    with the low plane's scales (the high plane's are 16 times those, kernel_formats.qarray), where
    the sum of the two planes' products reads both planes' scales and passes over the inputs twice;
    the native call itself runs the two products where that one pass does not apply."""
    if not (int8_dot and available()):
        return matmul(x, w.low, int8_dot=int8_dot) + matmul(x, w.high, int8_dot=int8_dot)
    operands, fmt = _weight_operands(w.low)
    return _native_matmul(x, w.k, w.n, (*operands, w.high.values, w.high.scales), int8_dot=True,
                          **dict(fmt, bits=np.int64(6)))


def _pool_format(prefix: str, w, int8_dot: bool) -> tuple[tuple, dict]:
    """A pool's operands and attributes; under the int8 dot a quantized pool's inputs are rounded to
    int8 per group, a bf16 pool's to bf16 (the kernel does both, and the reference alike)."""
    operands, fmt = _weight_operands(w)
    fmt["int8_dot"] = int8_dot and (int8_dot_applies(w) or bf16_dot_applies(w))
    return operands, {f"{prefix}_{name}": value for name, value in fmt.items()}


def _native_operands(gate_up, down, gate_up_bias, down_bias, activation: GatedActivation, int8_dot: bool):
    """The pool operands and attributes both native FFN targets take. NotImplementedError where the
    kernel does not run: not loaded, or not on the CPU backend, or a smoothed down projection (which
    no converter writes)."""
    if not available():
        raise NotImplementedError("the native CPU kernels are not loaded, or the computation does not run on the CPU")
    if isinstance(down, QArray) and down.act_scale is not None:
        raise NotImplementedError("the native expert kernel does not take a smoothed down projection")
    slots = (gate_up.values if isinstance(gate_up, QArray) else gate_up).shape[0]
    inner = down.k if isinstance(down, QArray) else down.shape[-2]
    hidden = down.n if isinstance(down, QArray) else down.shape[-1]
    gu_ops, gu_fmt = _pool_format("gu", gate_up, int8_dot)
    dn_ops, dn_fmt = _pool_format("dn", down, int8_dot)
    no_bias = native.empty(np.float32)
    gu_bias = no_bias if gate_up_bias is None else gate_up_bias.astype(jnp.float32)
    dn_bias = no_bias if down_bias is None else down_bias.astype(jnp.float32)
    attrs = dict(hidden=np.int64(hidden), inner=np.int64(inner), slots=np.int64(slots),
                 clamped=activation.kind != "silu", alpha=np.float32(activation.alpha),
                 limit=np.float32(activation.limit),
                 dn_int8_inputs=isinstance(down, QArray) and down.fmt.act_bits == 8, **gu_fmt, **dn_fmt)
    return (*gu_ops, gu_bias, *dn_ops, dn_bias), attrs


def _expert_inputs(x, gate_up, row_slot):
    """What multiplies gate_up: x (float32) smoothed by each row's expert and, for W8A8, quantized per token."""
    x = x.astype(jnp.float32)
    if isinstance(gate_up, QArray):
        scale = None if gate_up.act_scale is None else gate_up.act_scale[jnp.maximum(row_slot, 0)]
        x = prepare_input(x, scale, gate_up.fmt)
    return x


def expert_ffn(rows, block_slot, gate_up, down, *, block_rows: int, gate_up_bias=None, down_bias=None,
               activation: GatedActivation = SILU, int8_dot: bool = False):
    """The grouped gated expert FFN (expert_ffn_reference's contract) on the native kernel:
    rows [R, D], block_slot [R / block_rows] -> [R, D] in rows.dtype. int8_dot as in `matmul`.
    NotImplementedError where the native kernel does not run them (see _native_operands)."""
    operands, attrs = _native_operands(gate_up, down, gate_up_bias, down_bias, activation, int8_dot)
    x = _expert_inputs(rows, gate_up, jnp.repeat(block_slot, block_rows))
    y = native.call(native.EXPERT_FFN, jax.ShapeDtypeStruct(rows.shape, jnp.float32), *operands, x,
                    block_slot.astype(jnp.int32), block_rows=np.int64(block_rows), **attrs)
    return y.astype(rows.dtype)


def _routed_result(h, token, weight):
    """(the routed kernels' output shape, their weight operand): [A, D] and no weights, or with
    combine weights [A] each token's weighted sum [N, D]."""
    if weight is None:
        return jax.ShapeDtypeStruct((token.shape[0], h.shape[1]), jnp.float32), native.empty(np.float32)
    return jax.ShapeDtypeStruct(h.shape, jnp.float32), weight.astype(jnp.float32)


def routed_expert_ffn(h, token, slot, gate_up, down, *, gate_up_bias=None, down_bias=None,
                      activation: GatedActivation = SILU, int8_dot: bool = False, weight=None):
    """Routed assignments, each expert run once over exactly its rows: h [N, D], token/slot [A]
    (slot -1: inactive) -> [A, D] in h.dtype, row a = expert `slot[a]` applied to h[token[a]]; with
    combine weights `weight` [A], float32 [N, D]: row n = sum of weight[a] * row a over token n's
    assignments, summed inside the kernel (no [A, D] array).
    The grouping happens inside the kernel (no padding to blocks, no weight gathered per block).
    NotImplementedError where the native kernel does not run them (see _native_operands)."""
    operands, attrs = _native_operands(gate_up, down, gate_up_bias, down_bias, activation, int8_dot)
    if isinstance(gate_up, QArray) and gate_up.act_scale is not None:  # smoothed: one input row per assignment
        x, rows = _expert_inputs(h[token], gate_up, slot), jnp.arange(token.shape[0], dtype=jnp.int32)
        y = native.call(native.ROUTED_FFN, jax.ShapeDtypeStruct(x.shape, jnp.float32), *operands, x, rows,
                        slot.astype(jnp.int32), native.empty(np.float32), **attrs)
        if weight is None:
            return y.astype(h.dtype)
        return jnp.zeros(h.shape, jnp.float32).at[token].add(weight[:, None].astype(jnp.float32) * y)
    result, weight_operand = _routed_result(h, token, weight)
    y = native.call(native.ROUTED_FFN, result, *operands, _expert_inputs(h, gate_up, None), token.astype(jnp.int32),
                    slot.astype(jnp.int32), weight_operand, **attrs)
    return y if weight is not None else y.astype(h.dtype)


# Attributes every pool of one layer shares; a multi-pool call numbers the others by pool.
_SHARED_ATTRS = ("hidden", "inner", "clamped", "alpha", "limit")


def _multiplies_h_as_is(w) -> bool:
    """Whether w (a pool's gate_up, a projection) multiplies its inputs as they are (no smoothing, no
    W8A8 rounding)."""
    return not isinstance(w, QArray) or (w.act_scale is None and w.fmt.act_bits != 8)


def routed_expert_ffn_tiers(h, token, slot, tier, pools, *, activation: GatedActivation = SILU,
                            int8_dot: bool = False, weight=None):
    """routed_expert_ffn over several pools at once: assignment a runs expert slot[a] of
    pools[tier[a]] (each pool a (gate_up, down, gate_up_bias, down_bias) of one layer) on h[token[a]]
    -> [A, D] in h.dtype, or with combine weights [A] each token's weighted sum, float32 [N, D]
    (as routed_expert_ffn). One native call runs every pool's experts in the same passes where each
    pool multiplies h as it is; otherwise (smoothed or W8A8 inputs) each pool runs natively on its
    own assignments and the results are added (each row is zero in all pools but its own).
    NotImplementedError where the native kernel does not run every pool (see _native_operands)."""
    native_pools = [_native_operands(*pool, activation, int8_dot) for pool in pools]
    if not all(_multiplies_h_as_is(p[0]) for p in pools):
        out = None
        for t, (gate_up, down, gate_up_bias, down_bias) in enumerate(pools):
            y = routed_expert_ffn(h, token, jnp.where(tier == t, slot, -1), gate_up, down, gate_up_bias=gate_up_bias,
                                  down_bias=down_bias, activation=activation, int8_dot=int8_dot, weight=weight)
            out = y if out is None else out + y
        return out
    operands, attrs = [], {}
    for t, (pool_operands, pool_attrs) in enumerate(native_pools):
        operands += pool_operands
        attrs.update({name if name in _SHARED_ATTRS else f"{name}{t}": value for name, value in pool_attrs.items()})
    result, weight_operand = _routed_result(h, token, weight)
    y = native.call(native.ROUTED_FFN_TIERS, result, h.astype(jnp.float32), token.astype(jnp.int32),
                    slot.astype(jnp.int32), tier.astype(jnp.int32), weight_operand, *operands, **attrs)
    return y if weight is not None else y.astype(h.dtype)


ATTENTION_CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))  # attention reads


def attention_reads(keys, values, keys2=None) -> bool:
    """Whether the native attention reads these caches as they lie, so `attention` takes them without a
    copy: keys, values (and a second term's keys) of one kind, float32, bfloat16, or int8 values with
    float32 scales."""
    kind = lambda cache: (jnp.dtype(getattr(cache, "values", cache).dtype), hasattr(cache, "scales"))  # noqa: E731
    same = kind(keys) == kind(values) and (keys2 is None or kind(keys2) == kind(keys))
    return same and kind(keys)[0] in ATTENTION_CACHE_DTYPES


def attention(q, keys, values, start, key_start, table, *, groups: int, scale: float, window: int | None,
              sink=None, keys2=None):
    """Softmax attention of a few current tokens over a paged heads-major cache, in one native call.

    q [B, K, groups * T, w] (query heads of each cache head, then tokens); keys [P, K, page, w] and
    values [P, K, page, wv], pools of pages, each an array or int8 values with float32 scales
    [P, K, page, 1] (`.values`, `.scales`); table [B, n] int32: row b's logical slot s lies in page
    table[b, s // page] at s % page (S = n * page slots a row; a page outside [0, P) is absent, its
    slots never attended to). Token t of row b sits at slot start[b] + t and attends to slots
    [key_start[b], start[b] + t], the last `window` of them if set; sink [K, groups] or None. Returns
    (out [B, K, groups * T, wv] float32, top, norm [B, K, groups, T]): the normalised attention, and the
    softmax's maximum and normaliser (-inf and 0 for a query with no key and no sink, whose output is
    0). keys2 [P, K, page, w2] or None: a second score term (latent attention's rotary keys), the
    query's last w2 columns times these keys added to the first columns times `keys` (then
    [P, K, page, w - w2]). NotImplementedError (before anything is traced) where the native kernels
    are not in use or do not read these caches as they lie (attention_reads)."""
    if not available():
        raise NotImplementedError("the native CPU kernels are not loaded, or the computation does not run on the CPU")
    if not attention_reads(keys, values, keys2):
        raise NotImplementedError("the native attention does not read these caches as they lie")
    B, K, M, _ = q.shape
    wv = getattr(values, "values", values).shape[-1]

    def operands(cache):
        if cache is None:  # no second term
            return native.empty(np.float32), native.empty(np.float32)
        if hasattr(cache, "scales"):
            return cache.values, cache.scales.astype(jnp.float32)
        return cache, native.empty(np.float32)

    no_sink = native.empty(np.float32)
    sink = no_sink if sink is None else sink.astype(jnp.float32).reshape(-1)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    out, top, norm = native.call(native.ATTENTION, (f32(B, K, M, wv), f32(B, K, M), f32(B, K, M)),
                                 q.astype(jnp.float32), *operands(keys), *operands(keys2), *operands(values),
                                 start.astype(jnp.int32), key_start.astype(jnp.int32), table.astype(jnp.int32), sink,
                                 groups=np.int64(groups), scale=np.float32(scale), window=np.int64(window or 0))
    T = M // groups
    return out, top.reshape(B, K, groups, T), norm.reshape(B, K, groups, T)


def first_max(logits: jax.Array) -> jax.Array:
    """logits [..., V] float32 -> int32 [...]: each row's first index holding its largest value (NaNs
    never chosen; a row of NaNs gives V - 1), on the native kernel. Native kernels only."""
    *lead, V = logits.shape
    rows = logits.reshape(-1, V).astype(jnp.float32)
    out = native.call(native.FIRST_MAX, jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32), rows)
    return out.reshape(lead)


def write_rows(pool: jax.Array, rows: jax.Array, start: jax.Array, table: jax.Array) -> jax.Array:
    """A paged cache pool [P, H, page, w] with rows [B, H, T, w] written from logical slot start[b] of
    each row b, row b's slot s at pool[table[b, s // page], :, s % page] (table [B, n] int32); slots
    outside [0, n * page) and pages outside [0, P) skipped. In place (the result aliases the pool);
    one XLA scatter where the kernels do not run."""
    rows = rows.astype(pool.dtype)
    if not available():
        return _write_rows_xla(pool, rows, start, table)
    return native.call(native.WRITE_ROWS, jax.ShapeDtypeStruct(pool.shape, pool.dtype), pool, rows,
                       start.astype(jnp.int32), table.astype(jnp.int32), input_output_aliases={0: 0})


def _write_rows_xla(pool, rows, start, table):
    """write_rows as one scatter of the [B * T] (page, offset) pairs, H and w whole: a skipped slot's
    page is sent to P, past the pool, and dropped."""
    P, _, page, _ = pool.shape
    B, H, T, w = rows.shape
    n = table.shape[1]
    slot = start.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    pages = jnp.take_along_axis(table.astype(jnp.int32), jnp.clip(slot // page, 0, n - 1), axis=1)
    pages = jnp.where((slot >= 0) & (slot < n * page) & (pages >= 0) & (pages < P), pages, P)
    updates = rows.transpose(0, 2, 1, 3).reshape(B * T, H, w)
    return pool.at[pages.reshape(-1), :, (slot % page).reshape(-1)].set(updates, mode="drop")


def write_slots(pool: jax.Array, values: jax.Array, slots: jax.Array, offset: int | None = None,
                on_cpu: bool | None = None) -> jax.Array:
    """pool [S, ...] with row slots[i] replaced by values[i] for every slot in [0, S) (others
    skipped), in place (the result aliases the pool). values: [n, *row shape] in the pool's dtype,
    or with an `offset`, uint8 [n, nbytes] raw bytes whose bytes [offset, offset + row bytes) are a
    pool row (an expert record holding the pool's leaf there). XLA's dynamic_update_slice where the
    kernels do not run (`on_cpu`: whether the caller's step runs on the CPU; default `available()`)."""
    if available() if on_cpu is None else on_cpu:
        if offset is None:
            values = values.astype(pool.dtype)
        return native.call(native.WRITE_SLOTS, jax.ShapeDtypeStruct(pool.shape, pool.dtype), pool, values,
                           slots.astype(jnp.int32), input_output_aliases={0: 0}, offset=np.int64(offset or 0))
    if offset is None:
        values = values.astype(pool.dtype)
    else:
        row_bytes = pool.dtype.itemsize * int(np.prod(pool.shape[1:]))
        values = _from_raw(values[:, offset : offset + row_bytes], pool.dtype, pool.shape[1:])
    for i in range(values.shape[0]):
        keep = (slots[i] >= 0) & (slots[i] < pool.shape[0])
        slot = jnp.clip(slots[i], 0, pool.shape[0] - 1)
        pool = jax.lax.dynamic_update_index_in_dim(pool, jnp.where(keep, values[i], pool[slot]), slot, 0)
    return pool


def copy_records(leaves: list, store: jax.Array, rows: jax.Array, slots: jax.Array, offsets: list[int]) -> list:
    """Each leaf [S, ...] with row slots[j] replaced by bytes [offsets[i], + row bytes) of store row
    rows[j] (store: uint8 [n, nbytes], one expert record per row) wherever both are in range (others
    skipped), in place, every leaf in one call: write_slots reading straight from a host store,
    nothing done for a skipped row. Native kernels only (the in-step fetch on the CPU uses it where
    `available()`)."""
    if not native.loaded():
        raise RuntimeError("copy_records needs the native CPU kernels")
    results = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    return native.call(native.COPY_RECORDS, results, store, rows.astype(jnp.int32), slots.astype(jnp.int32), *leaves,
                       input_output_aliases={3 + i: i for i in range(len(leaves))},
                       offsets=np.asarray(offsets, np.int64))


def _from_raw(raw, dtype, shape):
    """uint8 [n, nbytes] -> [n, *shape] of `dtype` with the same bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize > 1:
        raw = raw.reshape(raw.shape[0], -1, itemsize)
    return jax.lax.bitcast_convert_type(raw, dtype).reshape(raw.shape[0], *shape)
