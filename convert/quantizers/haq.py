"""HAQ: per-layer smoothing-factor grid search, then Hessian-aware (GPTQ) weight quantization.

Smoothing moves quantization difficulty between activations and weights one input channel at a
time (SmoothQuant): with s [K],

  X' = X / s,   W' = diag(s) W,   X' W' = X W.

The runtime multiplies x by act_scale = 1 / s before the matmul (`prepare_input`), and for W8A8
quantizes the smoothed x per token to int8. act_scale is stored in float16, so s is chosen with an
exactly representable reciprocal and clamped to a range float16 holds.

This module works on one matrix at a time; which activations feed which matrix is the caller's
business.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from convert.quantizers.gptq import gptq_quantize
from convert.quantizers.rtn import rtn_dequantized
from kernel_formats.optimised import optimised_jit
from kernel_formats.qarray import QArray, QuantFormat, prepare_input

# act_scale = 1 / s is stored as float16 (max 65504, smallest normal 6.1e-5): keep both inside.
S_MIN, S_MAX = 1e-4, 1e4
CHUNK_BYTES = 64 << 20  # float32 weights of the experts one call of the exponent search takes
_HIGHEST = lax.Precision.HIGHEST


def smoothing_scales(act_absmax, w, alpha: float):
    """Per-input-channel smoothing factors s_k = max|X_k|^alpha / max_n |W_k,n|^(1 - alpha).

    Args:
      act_absmax: [K] max |x_k| over the calibration inputs.
      w: [K, N] weight, y = x @ w.
      alpha: migration strength in [0, 1] (0: all on the weights, 1: all on the activations).

    Returns:
      s: [K] float32 in [S_MIN, S_MAX], 1 for channels where either side is all zero. s is the
      reciprocal of a float16 value, so the stored act_scale = float16(1 / s) loses nothing beyond
      float32 rounding.
    """
    a = jnp.asarray(act_absmax, jnp.float32)
    w_absmax = jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)), axis=1)  # [K]
    live = (a > 0) & (w_absmax > 0)
    s = jnp.power(jnp.where(live, a, 1.0), alpha) / jnp.power(jnp.where(live, w_absmax, 1.0), 1.0 - alpha)
    s = jnp.clip(jnp.where(live & jnp.isfinite(s), s, 1.0), S_MIN, S_MAX)
    act_scale = (1.0 / s).astype(jnp.float16).astype(jnp.float32)
    return 1.0 / act_scale


def search_alpha(cases, fmt: QuantFormat, alphas=tuple(np.linspace(0, 1, 11))) -> float:
    """The smoothing strength with the smallest output error over one layer's experts.

    For each alpha, error = sum over cases of || X W - prepare(X) @ RTN(diag(s) W) ||^2, where
    prepare smooths X by 1 / s and, for W8A8, quantizes it per token.

    Args:
      cases: list of (x_sample [n_e, K], act_absmax [K], w [K, N]), one per expert of the layer;
        x_sample are calibration inputs routed to that expert (may be few or none).
      fmt: the target format (fmt.act_bits == 8 for W8A8).
      alphas: candidates.

    Returns:
      The best alpha; ties go to the smaller alpha.
    """
    alphas = np.sort(np.asarray(alphas, np.float64))
    errors = np.zeros(len(alphas), np.float64)
    cases = [(np.asarray(x, np.float32), act_absmax, w) for x, act_absmax, w in cases if len(x)]
    if not cases:
        return float(alphas[0])
    # Several experts per call (one dispatch, one compile per layer shape), as many as keep a chunk's
    # weights within CHUNK_BYTES. Zero rows and zero-row experts add no error: rows are padded to a
    # power of two (at least 16) and a short last chunk with copies of its last expert fed no rows.
    k, n = np.shape(cases[0][2])
    chunk = max(1, min(len(cases), CHUNK_BYTES // (4 * k * n)))
    rows = max(16, 1 << (max(len(x) for x, _, _ in cases) - 1).bit_length())
    for start in range(0, len(cases), chunk):
        part = cases[start:start + chunk]
        part = part + [(part[-1][0][:0], part[-1][1], part[-1][2])] * (chunk - len(part))
        x = np.stack([np.pad(x, ((0, rows - len(x)), (0, 0))) for x, _, _ in part])
        absmax = np.stack([np.asarray(a, np.float32) for _, a, _ in part])
        w = np.stack([np.asarray(w, np.float32) for _, _, w in part])
        per_expert = _smoothed_rtn_errors(x, absmax, w, jnp.asarray(alphas, jnp.float32), fmt)  # [chunk, A]
        errors += np.asarray(per_expert, np.float64).sum(0)
    return float(alphas[int(np.argmin(errors))])


@functools.partial(optimised_jit, static_argnames=("fmt",))
def _smoothed_rtn_errors(x, act_absmax, w, alphas, fmt: QuantFormat):
    """x [E, n, K], act_absmax [E, K], w [E, K, N], alphas [A] -> squared output error [E, A]."""
    return jax.vmap(lambda x, a, w: _expert_errors(x, a, w, alphas, fmt))(x, act_absmax, w)


def _expert_errors(x, act_absmax, w, alphas, fmt: QuantFormat):
    """x [n, K], act_absmax [K], w [K, N], alphas [A] -> squared output error per alpha [A]."""
    x = jnp.asarray(x, jnp.float32)
    w = jnp.asarray(w, jnp.float32)
    exact = jnp.dot(x, w, precision=_HIGHEST)  # [n, N]

    def error(alpha):
        s = smoothing_scales(act_absmax, w, alpha)  # [K]
        w_hat = rtn_dequantized(s[:, None] * w, fmt)  # [K, N]
        y = jnp.dot(prepare_input(x, 1.0 / s, fmt), w_hat, precision=_HIGHEST)
        return jnp.sum(jnp.square(exact - y))

    return lax.map(error, alphas)  # one candidate at a time keeps memory at one [K, N]


def haq_quantize(w, hessian, act_absmax, alpha: float, fmt: QuantFormat, *, damp: float = 0.01) -> QArray:
    """Smooth with factor alpha, then quantize the smoothed weight with GPTQ.

    Args:
      w: [K, N] weight, y = x @ w.
      hessian: [K, K] X^T X of the (unsmoothed) inputs that multiply w.
      act_absmax: [K] max |x_k| over the calibration inputs.
      alpha: smoothing strength, e.g. from `search_alpha`.
      fmt: target format; must have fmt.smooth.
      damp: GPTQ damping, fraction of mean(diag(H')).

    Returns:
      A host QArray of diag(s) W with act_scale = 1 / s; `prepare_input(x, q.act_scale, fmt) @
      dequantize(q)` approximates x @ w.
    """
    if not fmt.smooth:
        raise ValueError(f"haq_quantize needs a format with smooth=True, not {fmt}")
    w = np.asarray(w, np.float32)
    s = np.asarray(smoothing_scales(act_absmax, w, alpha), np.float64)  # [K]
    w_smooth = (s[:, None] * w).astype(np.float32)  # [K, N]
    h_smooth = np.asarray(hessian, np.float64) / s[:, None] / s[None, :]  # [K, K], Hessian of X / s
    return gptq_quantize(w_smooth, h_smooth, fmt, damp=damp, act_scale=(1.0 / s).astype(np.float32))
