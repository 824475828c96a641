"""Grouped SwiGLU expert FFN over a pool of expert weights, blocks of rows per expert slot.

Rows arrive grouped: rows [R, D] split into R / block_rows blocks, block b reading the expert in
pool slot block_slot[b] (-1: empty block, output zeros). Weights are K-major: gate_up [S, D, 2F]
(gate columns then up columns), down [S, F, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def expert_ffn_reference(rows, block_slot, gate_up, down, *, block_rows: int):
    """jnp reference: gather each block's weights, matmul, SwiGLU, matmul. Returns [R, D] in rows.dtype."""
    R, D = rows.shape
    nb = block_slot.shape[0]
    safe = jnp.maximum(block_slot, 0)
    dtype = rows.dtype
    prec = _precision(dtype)
    x = rows.reshape(nb, block_rows, D)
    gu = jnp.einsum("btd,bdf->btf", x, gate_up[safe].astype(dtype), precision=prec)
    gate, up = jnp.split(gu, 2, axis=-1)
    mid = jax.nn.silu(gate) * up
    y = jnp.einsum("btf,bfd->btd", mid, down[safe].astype(dtype), precision=prec)
    y = jnp.where((block_slot >= 0)[:, None, None], y, jnp.zeros_like(y))
    return y.reshape(R, -1)


def expert_ffn(rows, block_slot, gate_up, down, *, block_rows: int):
    """Entry point the model calls; dispatches to a kernel where one supports the inputs."""
    return expert_ffn_reference(rows, block_slot, gate_up, down, block_rows=block_rows)
