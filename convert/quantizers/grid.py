"""The quantization grid every quantizer shares: per-group scale/offset, codes, and packing.

All functions take K-major weights with groups along K and work on numpy or jax arrays (jnp ops);
the quantizers run them inside jit (RTN per matrix shape, GPTQ/HAQ per block), never op by op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.qarray import QArray, QuantFormat, pack_codes


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


_pack_codes = jax.jit(pack_codes, static_argnums=1)  # one compile per shape, not one per op and call


def to_qarray(codes, scales, offsets, fmt: QuantFormat, k: int, act_scale=None) -> QArray:
    """Codes [Kp, N] and per-group scales/offsets [Kp / G, N] -> a host (numpy) QArray."""
    return host_qarray(_pack_codes(codes, fmt), scales, offsets, fmt, k, act_scale)


def host_qarray(values, scales, offsets, fmt: QuantFormat, k: int, act_scale=None) -> QArray:
    """Packed codes [Kp / pack, N] and per-group scales/offsets [Kp / G, N] -> a host (numpy) QArray."""
    return QArray(
        values=np.asarray(values),
        scales=np.asarray(scales, np.float16),
        offsets=None if fmt.symmetric else np.asarray(offsets, np.float16),
        act_scale=None if act_scale is None else np.asarray(act_scale, np.float16),
        fmt=fmt,
        k=k,
    )
