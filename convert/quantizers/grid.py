"""The quantization grid every quantizer shares: per-group scale/offset, codes, and packing.

All functions take K-major weights with groups along K and work on numpy or jax arrays (jnp ops);
the quantizers run them inside jit (RTN per matrix shape, GPTQ/HAQ per block), never op by op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernel_formats.qarray import OFFSET_CODE_ZERO, SIX_BIT_MIDDLE, QArray, QuantFormat, pack_codes, unpack_codes


def _f16(x):
    # Scales and offsets are stored as float16: quantize against the stored values.
    return jnp.asarray(x, jnp.float32).astype(jnp.float16).astype(jnp.float32)


def group_params(w, fmt: QuantFormat):
    """w [..., G, N] (one group of rows) -> scale, offset [..., 1, N] (offset is 0 when symmetric)."""
    w = jnp.asarray(w, jnp.float32)
    if fmt.symmetric:
        amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
        scale = _f16(jnp.where(amax > 0, amax / (fmt.midpoint - 1), 1.0))
        return scale, jnp.zeros_like(scale)
    lo = jnp.min(w, axis=-2, keepdims=True)
    hi = jnp.max(w, axis=-2, keepdims=True)
    scale = _f16(jnp.where(hi > lo, (hi - lo) / fmt.qmax, 1.0))
    return scale, _f16(lo)


# Grid search for low-bit groups: the min/max grid wastes most of a 4-level grid on the extremes.
# Each candidate keeps a share of the group's range (and one of three placements of it), rounds the
# group onto it, then refits scale and offset to those codes by least squares; the candidate with
# the least (importance-weighted) squared error wins (as llama.cpp's k-quants search theirs).
SEARCH_MAX_BITS = 3  # int4 and int8 keep min/max
RANGE_SHARES = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
PLACEMENTS = (0.0, 0.5, 1.0)  # where the kept share sits in the range: at its low end, centred, at its top


# Each candidate as (share of the range, offset coefficient (1 - share) x placement), computed in
# float64 and stored as the float32 constants the arithmetic below would have folded them to.
CANDIDATES = np.array([(share, (1.0 - share) * place) for share in RANGE_SHARES
                       for place in (PLACEMENTS if share < 1.0 else (0.0,))], np.float32)


def searched_group_params(w, fmt: QuantFormat, importance=None, unroll: bool = False):
    """w [..., G, N] -> scale, offset [..., 1, N] minimising sum_i importance_i (w_i - dequantized_i)^2
    over the candidates above (importance [..., G, 1], default uniform). Asymmetric formats only.
    The candidates are a loop, one body to compile rather than 25: GPTQ's blocks and small matrices
    compile several times faster. `unroll` trades that back for run time where one compile serves
    many large matrices (RTN's tiles at a real model's widths: a third less time per matrix)."""
    w = jnp.asarray(w, jnp.float32)
    h = jnp.ones_like(w[..., :1]) if importance is None else jnp.broadcast_to(
        jnp.asarray(importance, jnp.float32), w[..., :1].shape)
    lo = jnp.min(w, axis=-2, keepdims=True)
    span = jnp.max(w, axis=-2, keepdims=True) - lo
    best_scale, best_offset = group_params(w, fmt)  # min/max, the grid to beat
    best_err = _weighted_error(w, h, best_scale, best_offset, fmt)
    candidates = jnp.asarray(CANDIDATES)

    def try_candidate(c, best):
        best_err, best_scale, best_offset = best
        share, shift = candidates[c, 0], candidates[c, 1]
        scale = _f16(jnp.where(span > 0, span * share / fmt.qmax, 1.0))
        offset = _f16(lo + shift * span)
        scale, offset = _refit(w, h, encode(w, scale, offset, fmt), scale, offset)
        err = _weighted_error(w, h, scale, offset, fmt)
        better = err < best_err
        return (jnp.where(better, err, best_err), jnp.where(better, scale, best_scale),
                jnp.where(better, offset, best_offset))

    _, best_scale, best_offset = jax.lax.fori_loop(0, len(CANDIDATES), try_candidate,
                                                   (best_err, best_scale, best_offset), unroll=unroll)
    return best_scale, best_offset


def _weighted_error(w, h, scale, offset, fmt: QuantFormat):
    """sum_i h_i (w_i - dequantized_i)^2 per column of a group [..., G, N] -> [..., 1, N]."""
    return jnp.sum(h * (w - decode(encode(w, scale, offset, fmt), scale, offset, fmt)) ** 2, axis=-2, keepdims=True)


def _refit(w, h, codes, scale, offset):
    """Weighted least-squares scale and offset for fixed codes (kept where the codes are all alike)."""
    q = codes.astype(jnp.float32)
    s, sq, sqq = (jnp.sum(h * v, axis=-2, keepdims=True) for v in (jnp.ones_like(q), q, q * q))
    sw, sqw = jnp.sum(h * w, axis=-2, keepdims=True), jnp.sum(h * q * w, axis=-2, keepdims=True)
    det = s * sqq - sq * sq
    ok = det > 1e-12 * jnp.maximum(s * sqq, 1e-30)
    a = jnp.where(ok, (s * sqw - sq * sw) / jnp.where(ok, det, 1.0), scale)
    b = jnp.where(ok, (sqq * sw - sq * sqw) / jnp.where(ok, det, 1.0), offset)
    ok &= a > 0
    return _f16(jnp.where(ok, a, scale)), _f16(jnp.where(ok, b, offset))


def searches(fmt: QuantFormat) -> bool:
    """Whether a format's groups get a searched grid (asymmetric, SEARCH_MAX_BITS bits or fewer)."""
    return not fmt.symmetric and fmt.bits <= SEARCH_MAX_BITS


def fitted_group_params(w, fmt: QuantFormat, importance=None, unroll: bool = False):
    """The grid a quantizer uses for a group: searched where `searches(fmt)` (`unroll`: see
    searched_group_params), min/max (absmax) otherwise."""
    if searches(fmt):
        return searched_group_params(w, fmt, importance, unroll)
    return group_params(w, fmt)


def encode(w, scale, offset, fmt: QuantFormat):
    """Nearest codes of w on the grid (scale, offset broadcast against w)."""
    w = jnp.asarray(w, jnp.float32)
    if fmt.symmetric:
        q = jnp.clip(jnp.round(w / scale), -(fmt.midpoint - 1), fmt.midpoint - 1) + fmt.midpoint
    else:
        q = jnp.clip(jnp.round((w - offset) / scale), 0, fmt.qmax)
    return q.astype(jnp.int32)


def decode(codes, scale, offset, fmt: QuantFormat):
    codes = jnp.asarray(codes, jnp.float32)
    return (codes - fmt.midpoint) * scale if fmt.symmetric else codes * scale + offset


def pad_k(w, fmt: QuantFormat):
    """Zero-pad K (axis -2) up to a multiple of the group size."""
    k = w.shape[-2]
    pad = fmt.padded_k(k) - k
    if pad == 0:
        return jnp.asarray(w, jnp.float32)
    widths = [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)]
    return jnp.pad(jnp.asarray(w, jnp.float32), widths)


def to_qarray(codes, scales, offsets, fmt: QuantFormat, k: int, act_scale=None) -> QArray:
    """Codes [Kp, N] and per-group scales/offsets [Kp / G, N] -> a host (numpy) QArray."""
    return host_qarray(pack_codes(codes, fmt), scales, offsets, fmt, k, act_scale)


def host_qarray(values, scales, offsets, fmt: QuantFormat, k: int, act_scale=None) -> QArray:
    """Packed codes [packed rows, N] and per-group scales/offsets [Kp / G, N] -> a host (numpy) QArray
    (with 8-bit scales, the scales and offsets coded on their columns' bases: coded_scales)."""
    values = np.asarray(values)
    bases = None
    if fmt.scale_bits == 8:
        scales, offsets, bases = coded_scales(values, scales, offsets, fmt)
    else:
        scales = np.asarray(scales, np.float16)
        offsets = None if fmt.symmetric else np.asarray(offsets, np.float16)
    return QArray(
        values=values,
        scales=scales,
        offsets=offsets,
        act_scale=None if act_scale is None else np.asarray(act_scale, np.float16),
        fmt=fmt,
        k=k,
        bases=bases,
    )


def coded_scales(values, scales, offsets, fmt: QuantFormat):
    """A [K, N] weight's float scales and offsets [Kp / G, N] as 8-bit codes on per-column bases
    (kernel_formats/qarray.py): (uint8 scale codes, uint8 offset codes, float32 bases [2, N]).

    A column's scale base is its largest scale / 255 and its offset base its largest |offset| / 127,
    so each code keeps about 0.2-0.4% of its column's range (measured on the tiny model's int2 experts:
    +0.04 points of perplexity over float16 scales). A group whose codes are all equal holds a single
    value, stored as its offset with a zero scale, so that its arbitrary scale does not widen the
    column's range. A group that varies keeps a scale code of at least 1. Six bits code the value at
    code 32 in place of the offset (kernel_formats.qarray.group_scales): their low plane's offset."""
    scales, offsets = np.asarray(scales, np.float32), np.asarray(offsets, np.float32)
    groups, n = scales.shape
    codes = unpack_codes_host(values, fmt).reshape(groups, fmt.group_size, n)
    flat = codes.min(axis=1) == codes.max(axis=1)
    offsets = np.where(flat, codes[:, 0, :] * scales + offsets, offsets)
    scales = np.where(flat, 0.0, scales)
    if fmt.bits == 6:  # six bits code the grid's value at its middle code, the low plane's offset
        offsets = offsets + SIX_BIT_MIDDLE * scales
    scale_base = scales.max(axis=0) / 255.0
    offset_base = np.abs(offsets).max(axis=0) / 127.0
    scale_base = np.where(scale_base > 0, scale_base, 1.0).astype(np.float32)
    offset_base = np.where(offset_base > 0, offset_base, 1.0).astype(np.float32)
    if fmt.bits == 6:
        scale_base = three_bit_base(scale_base)
    scale_codes = np.clip(np.rint(scales / scale_base), np.where(flat, 0, 1), 255).astype(np.uint8)
    offset_codes = (np.clip(np.rint(offsets / offset_base), -127, 127) + OFFSET_CODE_ZERO).astype(np.uint8)
    return scale_codes, offset_codes, np.stack([scale_base, offset_base])


def three_bit_base(base: np.ndarray) -> np.ndarray:
    """Each base rounded up to three significant bits: a code (8 bits) times it has at most 11, so a
    six-bit weight's high plane holds 16 times each scale exactly in float16 (kernel_formats.qarray:
    the one-pass kernel applies the low plane's scale to the whole code)."""
    mantissa, exponent = np.frexp(base.astype(np.float32))
    return np.ldexp(np.ceil(mantissa * 8) / 8, exponent).astype(np.float32)


def unpack_codes_host(values, fmt: QuantFormat) -> np.ndarray:
    """kernel_formats.qarray.unpack_codes in numpy: packed [packed rows, N] -> codes [Kp, N] uint8."""
    return unpack_codes(np.asarray(values, np.uint8), fmt, xp=np)
