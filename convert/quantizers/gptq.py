"""GPTQ (Frantar et al., 2022): Hessian-aware rounding, one input row at a time.

W [K, N] (y = x @ W) is quantized row by row along K. After rounding row k, its error is spread over
the rows not yet quantized so that the layer output x @ W changes as little as possible on the
calibration inputs, using the upper Cholesky factor U of the damped inverse Hessian (U^T U = H^-1):

  err     = (W[k] - Q[k]) / U[k, k]
  W[j]   -= U[k, j] * err            for j > k

Rows are processed in blocks: inside a block the update is applied row by row (lax.fori_loop),
the rows after the block receive the block's errors in one matmul. Group scales and offsets come from
the error-updated weights of a group when the loop reaches the group's first row.

The Hessian is prepared (dead inputs, damping, inverse, Cholesky) in float64 with numpy/scipy on the
host; the rounding loop runs in float32 under jax.jit, on the default device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax import lax

from convert.quantizers.grid import decode, encode, fitted_group_params, searches, to_qarray
from kernel_formats.optimised import optimised_jit
from kernel_formats.qarray import QArray, QuantFormat

_HIGHEST = lax.Precision.HIGHEST  # no TF32/bf16 passes on GPU: errors feed back into later rows


def gptq_quantize(w, hessian, fmt: QuantFormat, *, damp: float = 0.01, block_size: int = 128, act_scale=None) -> QArray:
    """Quantize a K-major weight with GPTQ.

    Args:
      w: [K, N] weight, y = x @ w (float32 or anything convertible).
      hessian: [K, K] X^T X of the calibration inputs X [n, K] that multiply w (sum or mean: the
        damping is relative, so the scale does not matter).
      fmt: the target format; groups of fmt.group_size rows along K.
      damp: fraction of mean(diag(H)) added to the diagonal.
      block_size: rows per lazy-update block (rounded to a multiple of the group size).
      act_scale: [K] input smoothing vector stored with the result (w must already be scaled);
        required exactly when fmt.smooth.

    Returns:
      A host QArray of logical shape [K, N].
    """
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if np.shape(hessian) != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight of shape {w.shape}, not {np.shape(hessian)}")
    if (act_scale is not None) != fmt.smooth:
        raise ValueError(f"act_scale must be given exactly when fmt.smooth ({fmt.smooth})")
    if not np.all(np.isfinite(w)) or not np.all(np.isfinite(hessian)):
        raise ValueError("weight and hessian must be finite")

    u, dead = inverse_hessian_cholesky(hessian, damp)  # [K, K], [K]
    w = np.where(dead[:, None], 0.0, w).astype(np.float32)  # dead inputs: any weight is free, use 0

    group, kp = fmt.group_size, fmt.padded_k(k)
    w_padded, u_padded, block = padded_blocks(w, u, fmt, block_size)
    kb = w_padded.shape[0]
    codes, scales, offsets = _gptq_blocks(w_padded, u_padded, fmt, block)
    codes, scales, offsets = codes[:kp], scales[: kp // group], offsets[: kp // group]
    if searches(fmt):
        for round_ in range(REFIT_ROUNDS):
            scales, offsets = refit_groups(w, hessian, np.asarray(codes), np.asarray(scales), np.asarray(offsets),
                                           fmt, dead)
            if round_ + 1 < REFIT_ROUNDS:  # GPTQ's rounding again, onto the refit grid (padded blocks: unit scale)
                grid = (np.ones((kb // group, n), np.float32), np.zeros((kb // group, n), np.float32))
                grid[0][: kp // group], grid[1][: kp // group] = scales, offsets
                codes = _gptq_blocks(w_padded, u_padded, fmt, block, tuple(map(jnp.asarray, grid)))[0][:kp]
    return to_qarray(codes, scales, offsets, fmt, k, act_scale)


def padded_blocks(w: np.ndarray, u: np.ndarray, fmt: QuantFormat, block_size: int):
    """(w [Kb, N], u [Kb, Kb] on the device, block): w (dead inputs zeroed) and its Cholesky factor u
    padded to whole blocks of rows for _gptq_blocks, the block rounded to whole groups."""
    k, n = w.shape
    group = fmt.group_size
    block = max(group, block_size // group * group)  # groups never straddle blocks
    kb = -(-fmt.padded_k(k) // block) * block
    # Padding rows are dead inputs: zero weight, identity rows of U (no error flows in or out).
    w_padded = np.zeros((kb, n), np.float32)
    w_padded[:k] = w
    u_padded = np.eye(kb, dtype=np.float32)
    u_padded[:k, :k] = u
    return jnp.asarray(w_padded), jnp.asarray(u_padded), block


def inverse_hessian_cholesky(hessian, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Damped inverse Hessian as its upper Cholesky factor, in float64.

    Args:
      hessian: [K, K] X^T X.
      damp: fraction of mean(diag(H)) added to the diagonal (after dead inputs get H[k, k] = 1).

    Returns:
      u: [K, K] float32 upper triangular with u^T u = (H + damping)^-1.
      dead: [K] bool, inputs that never fire (H[k, k] == 0).
    """
    h = np.array(hessian, np.float64)
    diag = np.diagonal(h).copy()
    dead = diag == 0
    diag[dead] = 1.0
    diag += damp * np.mean(diag)
    np.fill_diagonal(h, diag)
    h_inv = scipy.linalg.cho_solve(scipy.linalg.cho_factor(h, lower=True), np.eye(len(h)))
    u = scipy.linalg.cholesky(h_inv, lower=False)
    return u.astype(np.float32), dead


REFIT_ROUNDS = 2  # grid refits, each but the last followed by GPTQ's rounding onto the refit grid
REFIT_COLUMNS = 256  # columns refit at once (bounds the [K, columns, groups] scratch)


def refit_groups(w, hessian, codes, scales, offsets, fmt: QuantFormat, dead):
    """Scales and offsets refit to the codes GPTQ chose, jointly over each column's groups:
    argmin over (scale_g, offset_g) of (w - dequantized)^T H (w - dequantized). GPTQ fixes a
    group's grid before the rows after it are rounded; once every code is known, the best grid for
    them is a least-squares problem per column with 2 unknowns per group. Its normal equations need
    H times each group's codes: two [K, K] x [K, N] products per matrix. A column keeps its grid
    where the refit would not lower the loss (float16 storage, a near-singular system).

    w [K, N] (dead inputs zeroed), hessian [K, K], codes [Kp, N], scales/offsets [Kp / G, N]."""
    k, n = w.shape
    group, ng = fmt.group_size, scales.shape[0]
    kp = ng * group
    h = np.zeros((kp, kp))
    h[:k, :k] = hessian
    dead = np.flatnonzero(dead)
    h[dead, :] = 0.0  # dead inputs (and the padded rows beyond k) carry no weight
    h[:, dead] = 0.0
    wp = np.zeros((kp, n))
    wp[:k] = w
    q = codes.astype(np.float64)  # [Kp, N]
    # [g', Kp, G]: H's columns of group g', contiguous for the batched product below
    h_blocks = np.ascontiguousarray(h.astype(np.float32).reshape(kp, ng, group).transpose(1, 0, 2))
    hw = h @ wp  # [Kp, N]
    h_members = h.reshape(kp, ng, group).sum(axis=2)  # [Kp, ng]: H times each group's indicator
    a11 = h_members.reshape(ng, group, ng).sum(axis=1)  # [ng, ng]
    new_scales, new_offsets = scales.astype(np.float32).copy(), offsets.astype(np.float32).copy()
    for c0 in range(0, n, REFIT_COLUMNS):
        cols = slice(c0, min(n, c0 + REFIT_COLUMNS))
        qc = q[:, cols]  # [Kp, c]
        c = qc.shape[1]
        q32 = np.ascontiguousarray(qc, np.float32)
        # h_q[g', i, c] = sum over j in group g' of H[i, j] q[j, c] (one batched product per group)
        # (float32: codes are small integers and the refit is stored in float16; twice as fast as float64)
        h_q = np.matmul(h_blocks, q32.reshape(ng, group, c))  # [g', Kp, c]
        by_group = lambda x: x.reshape(ng, group, *x.shape[1:]).sum(axis=1)  # noqa: E731 - sum rows per group
        q_rows = qc.reshape(ng, group, c).transpose(0, 2, 1)  # [g, c, j]: column c's codes in group g
        a = np.empty((c, 2 * ng, 2 * ng))
        # q_g^T H q_g' = sum over i in group g of q[i, c] h_q[g', i, c]: elementwise, then summed per group
        # (in float64), where a [1, G] x [G, g'] product per (group, column) spent more in calls than work
        h_q *= q32
        a[:, :ng, :ng] = h_q.reshape(ng, ng, group, c).sum(axis=2, dtype=np.float64).transpose(2, 1, 0)
        # q_g^T H 1_g'
        a[:, :ng, ng:] = np.matmul(q_rows, h_members.reshape(ng, group, ng)).transpose(1, 0, 2)
        a[:, ng:, :ng] = a[:, :ng, ng:].transpose(0, 2, 1)
        a[:, ng:, ng:] = a11
        rhs = np.concatenate([by_group(qc * hw[:, cols]).T, by_group(hw[:, cols]).T], axis=1)  # [c, 2ng]
        old = np.concatenate([scales[:, cols].T, offsets[:, cols].T], axis=1).astype(np.float64)
        scale_of = np.maximum(np.abs(np.diagonal(a, axis1=1, axis2=2)).max(axis=1), 1e-30)[:, None, None]
        try:
            theta = np.linalg.solve(a + 1e-10 * scale_of * np.eye(2 * ng), rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            continue
        theta = theta.astype(np.float16).astype(np.float64)  # judged as it will be stored
        loss = lambda t: np.einsum("cm,cml,cl->c", t, a, t) - 2 * np.einsum("cm,cm->c", t, rhs)  # noqa: E731
        better = np.isfinite(theta).all(axis=1) & (loss(theta) < loss(old))
        new_scales[:, cols] = np.where(better[None, :], theta[:, :ng].T, new_scales[:, cols])
        new_offsets[:, cols] = np.where(better[None, :], theta[:, ng:].T, new_offsets[:, cols])
    return new_scales, new_offsets


@functools.partial(optimised_jit, static_argnames=("fmt", "block"))
def _gptq_blocks(w, u, fmt: QuantFormat, block: int, grid=None):
    """w [Kb, N], u [Kb, Kb] (Kb a multiple of block) -> codes [Kb, N], scales/offsets [Kb / G, N]."""
    kb, n = w.shape
    group = fmt.group_size

    def one_block(b, carry):
        w, codes, scales, offsets = carry
        start = b * block
        w_block = lax.dynamic_slice_in_dim(w, start, block, 0)  # [B, N]
        u_rows = lax.dynamic_slice_in_dim(u, start, block, 0)  # [B, Kb]
        u_block = lax.dynamic_slice_in_dim(u_rows, start, block, 1)  # [B, B]
        block_grid = None if grid is None else tuple(lax.dynamic_slice_in_dim(g, start // group, block // group, 0)
                                                     for g in grid)
        block_codes, block_scales, block_offsets, errors = _quantize_block(w_block, u_block, fmt, block_grid)
        # Lazy update: u_rows is zero left of the block, and the block's own rows are never read again.
        w = w - jnp.dot(u_rows.T, errors, precision=_HIGHEST)  # [Kb, N]
        codes = lax.dynamic_update_slice_in_dim(codes, block_codes, start, 0)
        scales = lax.dynamic_update_slice_in_dim(scales, block_scales, start // group, 0)
        offsets = lax.dynamic_update_slice_in_dim(offsets, block_offsets, start // group, 0)
        return w, codes, scales, offsets

    init = (
        w,
        jnp.zeros((kb, n), jnp.int32),
        jnp.ones((kb // group, n), jnp.float32),
        jnp.zeros((kb // group, n), jnp.float32),
    )
    _, codes, scales, offsets = lax.fori_loop(0, kb // block, one_block, init)
    return codes, scales, offsets


def _quantize_block(w, u, fmt: QuantFormat, grid=None):
    """One block, row by row: w [B, N], u [B, B] -> codes [B, N], scales/offsets [B / G, N], errors [B, N]."""
    rows, n = w.shape
    group = fmt.group_size
    # What rounding row i costs GPTQ's objective per unit of squared error: 1 / U[i, i]^2 (its err^2)
    cost = 1.0 / jnp.square(jnp.diagonal(u))[:, None]  # [B, 1]

    def one_row(i, carry):
        w, codes, errors, scales, offsets, scale, offset = carry
        if grid is None:
            scale, offset = lax.cond(
                i % group == 0,
                lambda: fitted_group_params(lax.dynamic_slice_in_dim(w, i, group, 0), fmt,
                                            lax.dynamic_slice_in_dim(cost, i, group, 0)),  # [1, N] each
                lambda: (scale, offset),
            )
        else:  # a given grid (a refit's): only the codes are chosen
            scale = lax.dynamic_slice_in_dim(grid[0], i // group, 1, 0)
            offset = lax.dynamic_slice_in_dim(grid[1], i // group, 1, 0)
        row = lax.dynamic_slice_in_dim(w, i, 1, 0)  # [1, N]
        q = encode(row, scale, offset, fmt)  # [1, N]
        err = (row - decode(q, scale, offset, fmt)) / u[i, i]  # [1, N]
        # u is upper triangular: rows before i are untouched, row i becomes its dequantized value.
        w = w - u[i][:, None] * err  # [B, N]
        codes = lax.dynamic_update_slice_in_dim(codes, q, i, 0)
        errors = lax.dynamic_update_slice_in_dim(errors, err, i, 0)
        scales = lax.dynamic_update_slice_in_dim(scales, scale, i // group, 0)
        offsets = lax.dynamic_update_slice_in_dim(offsets, offset, i // group, 0)
        return w, codes, errors, scales, offsets, scale, offset

    init = (
        w,
        jnp.zeros((rows, n), jnp.int32),
        jnp.zeros((rows, n), jnp.float32),
        jnp.ones((rows // group, n), jnp.float32),
        jnp.zeros((rows // group, n), jnp.float32),
        jnp.ones((1, n), jnp.float32),
        jnp.zeros((1, n), jnp.float32),
    )
    _, codes, errors, scales, offsets, _, _ = lax.fori_loop(0, rows, one_row, init)
    return codes, scales, offsets, errors
