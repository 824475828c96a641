"""The XLA reference of the grouped gated expert FFN over a pool of expert weights, blocks of rows per expert slot.

Rows arrive grouped: rows [R, D] split into R / block_rows blocks, block b reading the expert in
pool slot block_slot[b] (-1: empty block, output zeros). Weights are K-major: gate_up [S, D, 2F]
(gate columns then up columns), down [S, F, D], each a plain array (bf16 tier; PlainTiles in the
CPU layout) or a QArray pool.
Optional float32 bias pools gate_up_bias [S, 2F] and down_bias [S, D] are added after each matmul,
and `activation` (kernel_formats/glu.py; SwiGLU by default) combines gate and up.

Every kernel (the Pallas ones in pallas_kernels, the native CPU one in cpu_kernels) computes what
this does; which one runs is chosen by jmoe/kernels/expert_ffn (this op's folder).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import (
    QArray,
    bf16_dot_applies,
    dequantize,
    int8_dot_applies,
    prepare_input,
    quantize_groups,
    round_to_bf16,
    untiled,
)


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _block_matmul(x, w, safe, dtype, int8_dot: bool = False):
    """x [nb, BT, K] @ (weights of the blocks' slots) -> [nb, BT, N]; quantized pools dequantized,
    tiled ones (PlainTiles) untiled after the gather. int8_dot: x on the int8 grid of a quantized
    pool's groups, or rounded to bf16 for a bf16 pool (bf16_dot_applies)."""
    if isinstance(w, QArray):
        blocks = jax.tree.map(lambda a: a[safe], w)
        scale = None if blocks.act_scale is None else blocks.act_scale[:, None, :]
        x = prepare_input(x, scale, w.fmt)
        if int8_dot and int8_dot_applies(w):
            x = quantize_groups(x, w.fmt.group_size).astype(x.dtype)
        weights = dequantize(blocks, dtype)
    else:
        if int8_dot and bf16_dot_applies(w):
            x = round_to_bf16(x)
        weights = untiled(jax.tree.map(lambda a: a[safe], w)).astype(dtype)
    return jnp.einsum("btk,bkn->btn", x, weights, precision=_precision(dtype))


def _add_bias(y, bias, safe):
    """y [nb, BT, N] + each block's bias row (float32 pool [S, N]), in y's dtype; y when bias is None."""
    return y if bias is None else y + bias[safe][:, None, :].astype(y.dtype)


def expert_ffn_reference(rows, block_slot, gate_up, down, *, block_rows: int, gate_up_bias=None, down_bias=None,
                         activation: GatedActivation = SILU, int8_dot: bool = False):
    """jnp reference: gather each block's weights, dequantize, matmul (+ bias), gated activation,
    matmul (+ bias). [R, D] in rows.dtype. int8_dot: each matmul's inputs on the CPU kernels'
    per-group int8 grid first (quantize_groups) for quantized weights, rounded to bf16 for bf16 ones."""
    R, D = rows.shape
    nb = block_slot.shape[0]
    safe = jnp.maximum(block_slot, 0)
    x = rows.reshape(nb, block_rows, D)
    gate_up_out = _add_bias(_block_matmul(x, gate_up, safe, rows.dtype, int8_dot), gate_up_bias, safe)
    gate, up = jnp.split(gate_up_out, 2, axis=-1)
    y = _add_bias(_block_matmul(activation(gate, up), down, safe, rows.dtype, int8_dot), down_bias, safe)
    y = jnp.where((block_slot >= 0)[:, None, None], y, jnp.zeros_like(y))
    return y.reshape(R, -1)
