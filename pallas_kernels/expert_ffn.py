"""Grouped gated expert FFN over a pool of expert weights, blocks of rows per expert slot.

Rows arrive grouped: rows [R, D] split into R / block_rows blocks, block b reading the expert in
pool slot block_slot[b] (-1: empty block, output zeros). Weights are K-major: gate_up [S, D, 2F]
(gate columns then up columns), down [S, F, D], each a plain array (bf16 tier) or a QArray pool.
Optional float32 bias pools gate_up_bias [S, 2F] and down_bias [S, D] are added after each matmul,
and `activation` (pallas_kernels/glu.py; SwiGLU by default) combines gate and up.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from pallas_kernels.expert_ffn_pallas import (expert_ffn_pallas, expert_ffn_pallas_tiers, offsets_fit, pool_arrays,
                                             supports, supports_tiers)
from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic, supports_mosaic
from pallas_kernels.glu import SILU, GatedActivation
from pallas_kernels.qarray import QArray, dequantize, int8_dot_applies, prepare_input, quantize_groups

BACKENDS = ("xla", "pallas", "mosaic", "interpret", "cpu")
log = logging.getLogger("jmoe.kernels")
_warned: set = set()


def default_backend() -> str:
    """Pallas on a GPU; on the CPU the native kernels (cpu_kernels) when they are built, else XLA."""
    if jax.default_backend() == "gpu":
        return "pallas"
    from cpu_kernels import available  # imported here: cpu_kernels builds on this module

    return "cpu" if available() else "xla"


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _block_matmul(x, w, safe, dtype, int8_dot: bool = False):
    """x [nb, BT, K] @ (weights of the blocks' slots) -> [nb, BT, N]; quantized pools dequantized."""
    if isinstance(w, QArray):
        blocks = jax.tree.map(lambda a: a[safe], w)
        scale = None if blocks.act_scale is None else blocks.act_scale[:, None, :]
        x = prepare_input(x, scale, w.fmt)
        if int8_dot and int8_dot_applies(w):
            x = quantize_groups(x, w.fmt.group_size).astype(x.dtype)
        weights = dequantize(blocks, dtype)
    else:
        weights = w[safe].astype(dtype)
    return jnp.einsum("btk,bkn->btn", x, weights, precision=_precision(dtype))


def _add_bias(y, bias, safe):
    """y [nb, BT, N] + each block's bias row (float32 pool [S, N]), in y's dtype; y when bias is None."""
    return y if bias is None else y + bias[safe][:, None, :].astype(y.dtype)


def expert_ffn_reference(rows, block_slot, gate_up, down, *, block_rows: int, gate_up_bias=None, down_bias=None,
                         activation: GatedActivation = SILU, int8_dot: bool = False):
    """jnp reference: gather each block's weights, dequantize, matmul (+ bias), gated activation,
    matmul (+ bias). [R, D] in rows.dtype. int8_dot: each matmul's inputs on the CPU kernels'
    per-group int8 grid first (quantize_groups), for quantized weights."""
    R, D = rows.shape
    nb = block_slot.shape[0]
    safe = jnp.maximum(block_slot, 0)
    x = rows.reshape(nb, block_rows, D)
    gate_up_out = _add_bias(_block_matmul(x, gate_up, safe, rows.dtype, int8_dot), gate_up_bias, safe)
    gate, up = jnp.split(gate_up_out, 2, axis=-1)
    y = _add_bias(_block_matmul(activation(gate, up), down, safe, rows.dtype, int8_dot), down_bias, safe)
    y = jnp.where((block_slot >= 0)[:, None, None], y, jnp.zeros_like(y))
    return y.reshape(R, -1)


def expert_ffn(rows, block_slot, gate_up, down, *, block_rows: int, backend: str | None = None, gate_up_bias=None,
               down_bias=None, activation: GatedActivation = SILU, int8_dot: bool = False):
    """Entry point the model calls; dispatches to a kernel where one supports the inputs.

    "pallas" runs the compiled Pallas kernel, "interpret" the same kernel in interpret mode; either
    falls back to the XLA reference for inputs the kernel does not support. "mosaic" runs int4
    decode on the Pallas Mosaic GPU kernel (expert_ffn_mosaic) and everything else as "pallas". "cpu" runs the native
    CPU kernel (cpu_kernels; the XLA reference where it is not built). int8_dot (the CPU kernels'
    per-group int8 inputs) is honoured by the CPU kernel and the reference, which the Pallas
    kernels then leave to.
    """
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose from {BACKENDS}")
    extra = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation)
    if backend == "cpu":
        from cpu_kernels import expert_ffn as cpu_expert_ffn

        return cpu_expert_ffn(rows, block_slot, gate_up, down, block_rows=block_rows, int8_dot=int8_dot, **extra)
    if backend == "mosaic" and not int8_dot and supports_mosaic(rows, gate_up, down, block_rows, gate_up_bias,
                                                                 down_bias):
        return expert_ffn_mosaic(rows, block_slot, gate_up, down, block_rows=block_rows, **extra)
    interpret = backend == "interpret"
    if backend != "xla" and not int8_dot and supports(rows, gate_up, down, block_rows, gate_up_bias, down_bias,
                                                      interpret=interpret):
        return expert_ffn_pallas(
            rows, block_slot, gate_up, down, block_rows=block_rows, interpret=interpret, **extra
        )
    if backend != "xla":
        _warn_offsets(gate_up, down)
    return expert_ffn_reference(rows, block_slot, gate_up, down, block_rows=block_rows, int8_dot=int8_dot, **extra)


def expert_ffn_tiers(rows, block_tier, block_slot, tiers, *, block_rows: int, backend: str | None = None,
                     activation: GatedActivation = SILU, int8_dot: bool = False):
    """`expert_ffn` over several pools at once: block b reads slot block_slot[b] (-1: none) of
    tiers[block_tier[b]], tiers a sequence of (gate_up, down, gate_up_bias, down_bias) pools.

    Where the Pallas kernels take every tier (decode), each stage is one launch for all of them (a
    tier index per block); otherwise each tier runs on its own blocks and the results are added
    (every block is zero in all tiers but its own).
    """
    backend = backend or default_backend()
    interpret = backend == "interpret"
    if (backend in ("pallas", "interpret") and not int8_dot and len(tiers) > 1
            and supports_tiers(rows, tiers, block_rows, interpret=interpret)):
        return expert_ffn_pallas_tiers(rows, block_tier, block_slot, tiers, block_rows=block_rows,
                                       interpret=interpret, activation=activation)
    out = None
    for t, (gate_up, down, gate_up_bias, down_bias) in enumerate(tiers):
        slots = jnp.where(block_tier == t, block_slot, -1)
        y = expert_ffn(rows, slots, gate_up, down, block_rows=block_rows, backend=backend, gate_up_bias=gate_up_bias,
                       down_bias=down_bias, activation=activation, int8_dot=int8_dot)
        out = y if out is None else out + y
    return out


def _warn_offsets(gate_up, down) -> None:
    unsafe = [a.shape for w in (gate_up, down) for a in pool_arrays(w) if not offsets_fit(a)]
    if unsafe and tuple(unsafe) not in _warned:
        _warned.add(tuple(unsafe))
        log.warning("expert pool arrays %s have 2**31 or more 1-byte elements but no more than 2**32 bytes, "
                    "which the Pallas Triton lowering would index with overflowing 32-bit offsets: these "
                    "experts run on the XLA path (slower); a pool with fewer or more slots avoids it", unsafe)
