"""Round-to-nearest: each group's min/max (or absmax) grid, every weight to its nearest code."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from convert.quantizers.grid import decode, encode, fitted_group_params, host_qarray, pad_k
from pallas_kernels.qarray import QArray, QuantFormat, pack_codes


@functools.partial(jax.jit, static_argnums=1)
def rtn_block(w, fmt: QuantFormat):
    """RTN of a K-major block [K, n] (compiled once per block shape, unlike op-by-op eager jnp):
    (packed codes [Kp / pack, n], float16 scales and offsets [Kp / G, n])."""
    n = w.shape[1]
    groups = pad_k(w, fmt).reshape(-1, fmt.group_size, n)
    scale, offset = fitted_group_params(groups, fmt)
    codes = encode(groups, scale, offset, fmt).reshape(-1, n)
    return pack_codes(codes, fmt), scale[:, 0].astype(jnp.float16), offset[:, 0].astype(jnp.float16)


def quantize_rtn(w, fmt: QuantFormat, act_scale=None) -> QArray:
    """K-major weight [K, N] -> a host (numpy) QArray. With act_scale (smoothing), w must already be scaled."""
    values, scales, offsets = rtn_block(w, fmt)
    return host_qarray(values, scales, offsets, fmt, w.shape[0], act_scale)


@functools.partial(jax.jit, static_argnums=1)
def rtn_dequantized(w, fmt: QuantFormat):
    """What RTN makes of w, as float32 [K, N] (used by searches that compare candidates)."""
    k, n = w.shape
    groups = pad_k(w, fmt).reshape(-1, fmt.group_size, n)
    scale, offset = fitted_group_params(groups, fmt)
    q = encode(groups, scale, offset, fmt)
    return decode(q, scale, offset, fmt).reshape(-1, n)[:k]
