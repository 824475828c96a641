"""The gated expert FFN's entry points: which kernel runs it (reference.py beside this file describes
the operation and holds its XLA reference, which every kernel computes).

Backends: "pallas" (the Triton-lowered Pallas kernel, GPUs), "mosaic" (int4 decode on the Pallas
Mosaic GPU kernel), "interpret" (the Pallas kernel interpreted), "cpu" (the native kernels of
cpu_kernels) and "xla" (the reference). Each backend tries its kernels in a fixed order (KERNELS):
a kernel that cannot take the inputs refuses with NotImplementedError before it traces anything,
and the next one runs them; the reference, last, takes everything. Neither backend package imports
the other, and no other module asks which backend it runs on: the choice lives here.

Two layouts of the same operation: rows grouped in blocks of one expert each (`expert_ffn`, what
the device kernels take), and routed assignments, each expert run over exactly its rows
(`routed_expert_ffn`, what the native CPU kernel takes, grouping by expert itself, unpadded);
`takes_assignments(backend)` says which a backend wants.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

import cpu_kernels
from jmoe.kernels.expert_ffn.reference import expert_ffn_reference
from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import QArray
from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic
from pallas_kernels.expert_ffn_pallas import expert_ffn_pallas, expert_ffn_pallas_tiers, offsets_fit, pool_arrays

log = logging.getLogger("jmoe.kernels")
_warned: set = set()


def _warn_offsets(gate_up, down) -> None:
    unsafe = [a.shape for w in (gate_up, down) for a in pool_arrays(w) if not offsets_fit(a)]
    if unsafe and tuple(unsafe) not in _warned:
        _warned.add(tuple(unsafe))
        log.warning("expert pool arrays %s have 2**31 or more 1-byte elements but no more than 2**32 bytes, "
                    "which the Pallas Triton lowering would index with overflowing 32-bit offsets: these "
                    "experts run on the XLA path (slower); a pool with fewer or more slots avoids it", unsafe)


def _reference_after_pallas(rows, block_slot, gate_up, down, **kwargs):
    """The reference where the Pallas kernels refused (warned once when 32-bit offsets were why)."""
    _warn_offsets(gate_up, down)
    return expert_ffn_reference(rows, block_slot, gate_up, down, **kwargs)


# Per backend, the kernels of the block layout in the order they are tried; each takes
# (rows, block_slot, gate_up, down, *, block_rows, gate_up_bias, down_bias, activation, int8_dot).
KERNELS = {
    "xla": (expert_ffn_reference,),
    "pallas": (expert_ffn_pallas, _reference_after_pallas),
    "mosaic": (expert_ffn_mosaic, expert_ffn_pallas, _reference_after_pallas),
    "interpret": (functools.partial(expert_ffn_pallas, interpret=True), _reference_after_pallas),
    "cpu": (cpu_kernels.expert_ffn, expert_ffn_reference),
}
BACKENDS = tuple(KERNELS)
# The backends whose kernel takes routed assignments (the rest get rows grouped in blocks), tried
# before the reference in routed_expert_ffn and routed_expert_ffn_tiers.
ROUTED_KERNELS = {"cpu": cpu_kernels.routed_expert_ffn}
ROUTED_TIERS_KERNELS = {"cpu": cpu_kernels.routed_expert_ffn_tiers}
# The backends whose kernel takes several tiers' pools in one launch (block layout, decode).
TIERS_KERNELS = {"pallas": expert_ffn_pallas_tiers,
                 "interpret": functools.partial(expert_ffn_pallas_tiers, interpret=True)}


# Block sizes a compile check builds the kernels at: decode's one row, and the dot path's smallest block.
CHECK_BLOCK_ROWS = (1, 16)
_compiled: set = set()  # what compile_error found compiling, so a later check of the same is free


def default_backend() -> str:
    """Pallas on a GPU; on the CPU the native kernels (cpu_kernels) when they are built, else XLA."""
    if jax.default_backend() == "gpu":
        return "pallas"
    return "cpu" if cpu_kernels.available() else "xla"


def _backend(backend: str | None) -> str:
    backend = backend or default_backend()
    if backend not in KERNELS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose from {BACKENDS}")
    return backend


def _first_that_runs(kernels, *args, **kwargs):
    """The first of `kernels` that does not refuse the inputs (the last one never does)."""
    for kernel in kernels[:-1]:
        try:
            return kernel(*args, **kwargs)
        except NotImplementedError:
            continue
    return kernels[-1](*args, **kwargs)


def takes_assignments(backend: str | None) -> bool:
    """Whether `backend`'s kernel takes routed assignments (routed_expert_ffn) rather than rows
    grouped in blocks (expert_ffn)."""
    return _backend(backend) in ROUTED_KERNELS


def expert_ffn(rows, block_slot, gate_up, down, *, block_rows: int, backend: str | None = None, gate_up_bias=None,
               down_bias=None, activation: GatedActivation = SILU, int8_dot: bool = False):
    """rows [R, D] in blocks of block_rows, block b through the expert in pool slot block_slot[b]
    (-1: none, zeros) -> [R, D], on the first of the backend's kernels that takes the inputs.

    int8_dot (the CPU kernels' per-group int8 inputs) is honoured by the CPU kernel and the
    reference; the Pallas kernels refuse it, leaving it to the reference."""
    return _first_that_runs(KERNELS[_backend(backend)], rows, block_slot, gate_up, down, block_rows=block_rows,
                            gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation, int8_dot=int8_dot)


def expert_ffn_tiers(rows, block_tier, block_slot, tiers, *, block_rows: int, backend: str | None = None,
                     activation: GatedActivation = SILU, int8_dot: bool = False):
    """`expert_ffn` over several pools at once: block b reads slot block_slot[b] (-1: none) of
    tiers[block_tier[b]], tiers a sequence of (gate_up, down, gate_up_bias, down_bias) pools.

    Where the backend's kernel takes every tier (Pallas, decode), each stage is one launch for all
    of them (a tier index per block); otherwise each tier runs on its own blocks and the results are
    added (every block is zero in all tiers but its own).
    """
    backend = _backend(backend)

    def each_tier(rows, block_tier, block_slot, tiers, **kwargs):
        out = None
        for t, (gate_up, down, gate_up_bias, down_bias) in enumerate(tiers):
            slots = jnp.where(block_tier == t, block_slot, -1)
            y = expert_ffn(rows, slots, gate_up, down, backend=backend, gate_up_bias=gate_up_bias,
                           down_bias=down_bias, **kwargs)
            out = y if out is None else out + y
        return out

    kernels = (TIERS_KERNELS[backend],) if backend in TIERS_KERNELS and len(tiers) > 1 else ()
    return _first_that_runs((*kernels, each_tier), rows, block_tier, block_slot, tiers, block_rows=block_rows,
                            activation=activation, int8_dot=int8_dot)


def combined(y, token, weight, tokens: int):
    """Routed rows y [A, D] summed per token with their combine weights [A]: float32 [tokens, D]."""
    out = jnp.zeros((tokens, y.shape[-1]), jnp.float32)
    return out.at[token].add(weight[:, None].astype(jnp.float32) * y.astype(jnp.float32))


def routed_expert_ffn(h, token, slot, gate_up, down, *, backend: str | None = None, gate_up_bias=None,
                      down_bias=None, activation: GatedActivation = SILU, int8_dot: bool = False, weight=None):
    """Routed assignments: h [N, D], token/slot [A] (slot -1: inactive) -> [A, D] in h.dtype, row a
    = expert slot[a] applied to h[token[a]]; with combine weights `weight` [A], each token's weighted
    sum of its rows instead, float32 [N, D] (the CPU kernel sums them itself, holding no [A, D]
    array). The backend's routed kernel where it takes the inputs, else the reference, one row per block."""
    backend = _backend(backend)

    def reference(h, token, slot, gate_up, down, weight=None, **kwargs):
        y = expert_ffn_reference(h[token], slot, gate_up, down, block_rows=1, **kwargs)
        return y if weight is None else combined(y, token, weight, h.shape[0])

    kernels = (ROUTED_KERNELS[backend],) if backend in ROUTED_KERNELS else ()
    return _first_that_runs((*kernels, reference), h, token, slot, gate_up, down, gate_up_bias=gate_up_bias,
                            down_bias=down_bias, activation=activation, int8_dot=int8_dot, weight=weight)


def routed_expert_ffn_tiers(h, token, slot, tier, pools, *, backend: str | None = None,
                            activation: GatedActivation = SILU, int8_dot: bool = False, weight=None):
    """routed_expert_ffn over several pools at once: assignment a runs expert slot[a] of
    pools[tier[a]] (each pool a (gate_up, down, gate_up_bias, down_bias) of one layer) on h[token[a]]
    -> [A, D] in h.dtype, or with combine weights [A] each token's weighted sum, float32 [N, D];
    where the backend's kernel does not take them all, each pool runs on its own assignments and the
    results are added (each row is zero in all pools but its own)."""
    backend = _backend(backend)

    def each_pool(h, token, slot, tier, pools, **kwargs):
        out = None
        for t, (gate_up, down, gate_up_bias, down_bias) in enumerate(pools):
            y = routed_expert_ffn(h, token, jnp.where(tier == t, slot, -1), gate_up, down, backend=backend,
                                  gate_up_bias=gate_up_bias, down_bias=down_bias, **kwargs)
            out = y if out is None else out + y
        return out

    kernels = (ROUTED_TIERS_KERNELS[backend],) if backend in ROUTED_TIERS_KERNELS else ()
    return _first_that_runs((*kernels, each_pool), h, token, slot, tier, pools, activation=activation,
                            int8_dot=int8_dot, weight=weight)


def compile_error(backend: str | None, pools, int8_dot: bool = False) -> Exception | None:
    """What compiling `backend`'s expert kernels alone raises, for each of `pools` (ExpertWeights of
    one tier each, and all of them together in decode) at bfloat16 and float32 rows in decode and
    prefill blocks; None when they all compile. How a kernel that cannot be built on this machine (a
    GPU, driver or Triton version it was never built for) is told from any other failure of a step
    (jmoe/runtime/kernel_fallback.py): by building the kernel, not by reading an error's text."""
    backend = _backend(backend)
    pools = list(pools)
    if not pools:
        return None
    down = pools[0].down
    hidden = down.n if isinstance(down, QArray) else down.shape[-1]
    checks = [((pool,), block_rows, dtype) for pool in pools
              for block_rows in CHECK_BLOCK_ROWS for dtype in (jnp.bfloat16, jnp.float32)]
    if len(pools) > 1:
        checks += [(tuple(pools), 1, dtype) for dtype in (jnp.bfloat16, jnp.float32)]
    for group, block_rows, dtype in checks:
        rows = jax.ShapeDtypeStruct((2 * block_rows, hidden), dtype)
        blocks = jax.ShapeDtypeStruct((2,), jnp.int32)
        key = (backend, block_rows, jnp.dtype(dtype).name, int8_dot,
               jax.tree.structure(group), tuple((a.shape, a.dtype) for a in jax.tree.leaves(group)))
        if key in _compiled:
            continue

        def call(rows, block_slot, group, block_rows=block_rows):
            if len(group) == 1:
                (gate_up, down, gate_up_bias, down_bias), = group
                return expert_ffn(rows, block_slot, gate_up, down, block_rows=block_rows, backend=backend,
                                  gate_up_bias=gate_up_bias, down_bias=down_bias, int8_dot=int8_dot)
            tier = jnp.arange(block_slot.shape[0], dtype=jnp.int32) % len(group)
            return expert_ffn_tiers(rows, tier, block_slot, [tuple(p) for p in group], block_rows=block_rows,
                                    backend=backend, int8_dot=int8_dot)

        try:
            jax.jit(call).lower(rows, blocks, group).compile()
        except Exception as error:  # noqa: BLE001 - whatever stops the kernel from being built is the answer
            return error
        _compiled.add(key)
    return None
