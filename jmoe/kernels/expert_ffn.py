"""The grouped gated expert FFN's entry point: which kernel runs it (pallas_kernels/expert_ffn.py
describes the operation and holds its XLA reference).

Backends: "pallas" (the Triton-lowered Pallas kernel, GPUs), "mosaic" (int4 decode on the Pallas
Mosaic GPU kernel), "interpret" (the Pallas kernel interpreted), "cpu" (the native kernels of
cpu_kernels) and "xla" (the reference). A kernel that does not take some inputs leaves them to the
reference. Neither backend package imports the other: the choice lives here.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

import cpu_kernels
from pallas_kernels.expert_ffn import expert_ffn_reference
from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic, supports_mosaic
from pallas_kernels.expert_ffn_pallas import (expert_ffn_pallas, expert_ffn_pallas_tiers, offsets_fit, pool_arrays,
                                             supports, supports_tiers)
from pallas_kernels.glu import SILU, GatedActivation

BACKENDS = ("xla", "pallas", "mosaic", "interpret", "cpu")
log = logging.getLogger("jmoe.kernels")
_warned: set = set()


def default_backend() -> str:
    """Pallas on a GPU; on the CPU the native kernels (cpu_kernels) when they are built, else XLA."""
    if jax.default_backend() == "gpu":
        return "pallas"
    return "cpu" if cpu_kernels.available() else "xla"


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
        return cpu_kernels.expert_ffn(rows, block_slot, gate_up, down, block_rows=block_rows, int8_dot=int8_dot, **extra)
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
