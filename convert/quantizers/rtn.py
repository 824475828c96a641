"""Round-to-nearest: each group's min/max (or absmax) grid, every weight to its nearest code."""

from __future__ import annotations

from convert.quantizers.grid import decode, encode, group_params, pad_k, to_qarray
from pallas_kernels.qarray import QArray, QuantFormat


def quantize_rtn(w, fmt: QuantFormat, act_scale=None) -> QArray:
    """K-major weight [K, N] -> QArray. With act_scale (smoothing), w must already be scaled."""
    k, n = w.shape
    groups = pad_k(w, fmt).reshape(-1, fmt.group_size, n)  # [Kp / G, G, N]
    scale, offset = group_params(groups, fmt)
    codes = encode(groups, scale, offset, fmt).reshape(-1, n)
    return to_qarray(codes, scale[:, 0], offset[:, 0], fmt, k, act_scale)


def rtn_dequantized(w, fmt: QuantFormat):
    """What RTN makes of w, as float32 [K, N] (used by searches that compare candidates)."""
    k, n = w.shape
    groups = pad_k(w, fmt).reshape(-1, fmt.group_size, n)
    scale, offset = group_params(groups, fmt)
    q = encode(groups, scale, offset, fmt)
    return decode(q, scale, offset, fmt).reshape(-1, n)[:k]
