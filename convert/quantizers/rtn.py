"""Round-to-nearest: each group's min/max (or absmax) grid, every weight to its nearest code."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from convert.quantizers.grid import decode, encode, fitted_group_params, host_qarray, pad_k, searches
from kernel_formats.optimised import optimised_jit
from kernel_formats.qarray import QArray, QuantFormat, pack_codes

# A searched grid (int2) tries some 25 candidates per group, each a few passes over the group. Over
# a whole matrix every pass streams it from memory; in tiles of one group by TILE_COLUMNS columns
# the passes stay in cache (about twice as fast at Qwen3-30B-A3B's expert widths).
TILE_COLUMNS = 512


def group_grid(groups, fmt: QuantFormat):
    """fitted_group_params of groups [ng, G, n] -> scale, offset [ng, 1, n]; searched grids tile by tile."""
    ng, g, n = groups.shape
    if not searches(fmt) or n <= TILE_COLUMNS:  # min/max grids are one pass; a narrow matrix is one tile
        return fitted_group_params(groups, fmt)
    cols = -(-n // TILE_COLUMNS) * TILE_COLUMNS  # zero columns pad the last tile (their grid is dropped)
    tiles = jnp.pad(groups, ((0, 0), (0, 0), (0, cols - n))).reshape(ng, g, cols // TILE_COLUMNS, TILE_COLUMNS)
    tiles = tiles.transpose(0, 2, 1, 3).reshape(-1, g, TILE_COLUMNS)
    # the search unrolled: a matrix this wide is one of a real model's thousands of one shape, where
    # run time matters more than the compile
    scale, offset = jax.lax.map(lambda tile: fitted_group_params(tile, fmt, unroll=True), tiles)  # [ng * tiles, 1, T]
    untile = lambda a: a.reshape(ng, cols // TILE_COLUMNS, 1, TILE_COLUMNS).transpose(0, 2, 1, 3).reshape(  # noqa: E731
        ng, 1, cols)[..., :n]
    return untile(scale), untile(offset)


@functools.partial(optimised_jit, static_argnums=1)
def rtn_block(w, fmt: QuantFormat):
    """RTN of a K-major block [K, n] (compiled once per block shape, unlike op-by-op eager jnp):
    (packed codes [packed rows, n], float16 scales and offsets [Kp / G, n])."""
    n = w.shape[1]
    groups = pad_k(w, fmt).reshape(-1, fmt.group_size, n)
    scale, offset = group_grid(groups, fmt)
    codes = encode(groups, scale, offset, fmt).reshape(-1, n)
    return pack_codes(codes, fmt), scale[:, 0].astype(jnp.float16), offset[:, 0].astype(jnp.float16)


def quantize_rtn(w, fmt: QuantFormat, act_scale=None) -> QArray:
    """K-major weight [K, N] -> a host (numpy) QArray. With act_scale (smoothing), w must already be scaled."""
    values, scales, offsets = rtn_block(w, fmt)
    return host_qarray(values, scales, offsets, fmt, w.shape[0], act_scale)


@functools.partial(optimised_jit, static_argnums=1)
def rtn_dequantized(w, fmt: QuantFormat):
    """What RTN makes of w, as float32 [K, N] (used by searches that compare candidates)."""
    k, n = w.shape
    groups = pad_k(w, fmt).reshape(-1, fmt.group_size, n)
    scale, offset = group_grid(groups, fmt)
    q = encode(groups, scale, offset, fmt)
    return decode(q, scale, offset, fmt).reshape(-1, n)[:k]
