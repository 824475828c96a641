"""Decode (one row per block) int4 expert FFN as Pallas Mosaic GPU kernels: TMA copies into shared
memory, a pipeline over K, warpgroup register layouts (kernel_backend="mosaic").

The Triton kernels (expert_ffn_pallas) are the default; this is the start of the path past Pallas'
Triton backend, which jax 0.11 deprecates. It computes what `expert_ffn_reference` computes for
int4 pools in decode, in two launches (x @ gate_up over all 2F columns, then h @ down), each a
`plgpu.kernel` over:

  grid (blocks, N / 128, splits)   one program (a warpgroup, 128 threads) per row block, 128-column
                                   N tile and K split; K is split until every program's steps fit
                                   in flight at once (at most MOSAIC_STAGES) and there are about
                                   device_config's target_programs programs
  per program                      the block's slot is read from shared memory; `emit_pipeline`
                                   copies, with TMA, 64 packed rows x 128 columns of codes (and the
                                   tile's scale/offset rows and activations) of that slot per K
                                   step into shared memory, every step's copy issued up front
  per K step                       codes -> registers in the WGMMA layout, both bit fields
                                   dequantized and multiplied by the activations into a [64, 128]
                                   float32 accumulator (elementwise: no reduction inside the loop)
  after the loop                   one reduction over the 64 rows, a [128] float32 partial sum

The partial sums over splits are added in XLA, then the bias and gated activation (gate/up) are
applied there too, as the Triton path does when it splits K. Interpret mode runs the same K steps
in Pallas' interpreter (Mosaic GPU's own interpreter does not run a grid of programs in jax 0.10
or 0.11).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import QArray
from pallas_kernels import device_config
from pallas_kernels.expert_ffn_pallas import _planar  # the activations in the packing layout, as there

TILE_ROWS = 64  # packed rows per K step: the WGMMA register layout tiles 64 rows
TILE_N = 128  # output columns per program: 128 bytes of every code row
MOSAIC_STAGES = 4  # K steps per program at most, all of them in flight at once
SLOT_PAD = 32  # a shared-memory copy moves a multiple of 128 bytes: slots padded to 32 int32
GRID_NAMES = ("block", "tile", "split")


def _mosaic():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # imported late: jax without it still loads us

    return plgpu


def supports_mosaic(rows, gate_up, down, block_rows: int, gate_up_bias=None, down_bias=None) -> bool:
    """Decode (block_rows 1) over int4 pools (any group size, without W8A8 or smoothing), float32 or
    bfloat16 rows, widths F and D multiples of 128, packed K a multiple of 64 rows."""
    if block_rows != 1 or rows.ndim != 2 or jnp.dtype(rows.dtype) not in (jnp.dtype(jnp.float32),
                                                                          jnp.dtype(jnp.bfloat16)):
        return False
    for w in (gate_up, down):
        if not (isinstance(w, QArray) and w.fmt.bits == 4 and w.fmt.act_bits is None and w.act_scale is None
                and not w.fmt.tiled and w.fmt.scale_bits == 16):
            return False
        if w.values.shape[-2] % TILE_ROWS or w.n % TILE_N:
            return False
    D, F = rows.shape[1], down.k
    if gate_up.k != D or gate_up.n != 2 * F or down.n != D or F % TILE_N:
        return False
    slots = gate_up.values.shape[0]
    return all(b is None or (tuple(b.shape) == (slots, n) and jnp.dtype(b.dtype) == jnp.float32)
               for b, n in ((gate_up_bias, 2 * F), (down_bias, D)))


def launch_plan(rows: int, w: QArray) -> dict:
    """One launch: grid (blocks, N tiles, K splits), K steps per program (all of them in flight at
    once), and the bytes one K step copies into shared memory (codes, scale/offset rows, and the
    activations counted at 4 bytes)."""
    fmt = w.fmt
    steps = w.values.shape[-2] // TILE_ROWS
    tiles = w.n // TILE_N
    # enough splits that every program's K steps are in flight at once (copied in the pipeline's
    # prologue: its loop then never waits to reuse a buffer), and about the device's target number of
    # programs (as the Triton path)
    target = device_config.current().target_programs
    want = max(-(-steps // MOSAIC_STAGES), min(steps, -(-target // (rows * tiles))))
    splits = min(d for d in range(want, steps + 1) if steps % d == 0)
    plane = fmt.group_size // fmt.pack
    param_rows = max(1, TILE_ROWS // plane) * (1 if fmt.symmetric else 2)
    step_bytes = fmt.pack * TILE_ROWS * 4 + TILE_ROWS * TILE_N + param_rows * TILE_N * 2
    return dict(grid=(rows, tiles, splits), steps=steps // splits, step_bytes=step_bytes)


class _Registers:
    """Loads into registers in an explicit Mosaic GPU layout (WGMMA tiles, their row and column
    vectors). In interpret mode a plain ref read: layouts only say how values spread over threads."""

    def __init__(self, interpret: bool):
        self.plgpu = _mosaic()
        self.interpret = interpret
        self.tile = self.plgpu.Layout.WGMMA

    def load(self, ref, layout):
        if self.interpret:
            return ref[...]
        return self.plgpu.load(ref, (), layout=layout, optimized=False)  # unswizzled SMEM: bank conflicts allowed

    def tile_of(self, ref):
        """A [TILE_ROWS, TILE_N] tile."""
        return self.load(ref, self.tile)

    def column(self, ref, dtype=jnp.float32):
        """A [TILE_ROWS] vector broadcast along the tile's columns (x[:, None])."""
        v = self.load(ref, self.tile.reduce(1)).astype(dtype)
        return jax.lax.broadcast_in_dim(v, (TILE_ROWS, TILE_N), (0,))

    def row(self, ref, dtype=jnp.float32):
        """A [TILE_N] vector broadcast along the tile's rows (s[None, :])."""
        v = self.load(ref, self.tile.reduce(0)).astype(dtype)
        return jax.lax.broadcast_in_dim(v, (TILE_ROWS, TILE_N), (1,))

    def row_index(self):
        if self.interpret:
            return jax.lax.broadcasted_iota(jnp.int32, (TILE_ROWS, TILE_N), 0)
        return self.plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, TILE_N), 0, layout=self.tile)

    def zeros(self, shape, layout):
        z = jnp.zeros(shape, jnp.float32)
        return z if self.interpret else self.plgpu.layout_cast(z, layout)


def _matmul_partials(x, block_slot, w: QArray, *, interpret: bool, name: str):
    """Per block b: float32 partial sums over K splits of x[b] @ w[block_slot[b]]: [splits, R, N]
    (zeros for an empty block)."""
    plgpu = _mosaic()
    regs = _Registers(interpret)
    R = x.shape[0]
    fmt = w.fmt
    plane = fmt.group_size // fmt.pack  # packed rows per group
    plan = launch_plan(R, w)
    (_, tiles, splits), per_split = plan["grid"], plan["steps"]
    x_planar = _planar(x, w)  # [R, 2, Kp / 2]
    slots = jnp.pad(block_slot, (0, -R % SLOT_PAD), constant_values=-1)
    group_rows = max(1, TILE_ROWS // plane)  # scale (offset) rows one K step spans

    def group_param(ref, row):
        """[TILE_ROWS, TILE_N] float32: each row's group's scale (or offset), from [group_rows, TILE_N]."""
        value = regs.row(ref.at[0])
        for g in range(1, group_rows):
            value = jnp.where(row >= g * plane, regs.row(ref.at[g]), value)
        return value

    def step(indices, x_smem, codes_smem, scales_smem, *offsets_and_acc):
        """One K step: the [TILE_ROWS, TILE_N] accumulator += x * dequantized codes."""
        del indices
        *offsets_smem, acc = offsets_and_acc
        row = regs.row_index()
        scale = group_param(scales_smem, row)
        zero = group_param(offsets_smem[0], row) if offsets_smem else scale * float(-fmt.midpoint)
        packed = regs.tile_of(codes_smem).astype(jnp.int32)
        for j in range(fmt.pack):
            codes = (packed >> (j * fmt.bits)) & fmt.qmax
            acc = acc + regs.column(x_smem.at[j]) * (codes.astype(jnp.float32) * scale + zero)
        return acc

    def program(ids, slot_ref, x_ref, values_ref, scales_ref, *rest):
        """Program (block, N tile, K split) = ids; rest: the offsets (asymmetric), the output and
        (compiled) its shared-memory staging buffer."""
        offsets_ref = None if fmt.symmetric else rest[0]
        out_ref, *out_smem = rest[0 if fmt.symmetric else 1:]
        block, tile, split = ids
        slot = slot_ref[block]
        first = split * per_split
        # what one K step copies into shared memory (TMA): the activations of every bit field, the
        # code tile, the scale (and offset) rows
        if plane >= TILE_ROWS:  # a group spans whole steps: one scale row per step
            param_spec = pl.BlockSpec((1, TILE_N), lambda i: ((first + i) * TILE_ROWS // plane, tile))
        else:
            param_spec = pl.BlockSpec((group_rows, TILE_N), lambda i: (first + i, tile))
        in_specs = [pl.BlockSpec((fmt.pack, TILE_ROWS), lambda i: (0, first + i)),
                    pl.BlockSpec((TILE_ROWS, TILE_N), lambda i: (first + i, tile)), param_spec]
        operands = [x_ref.at[block], values_ref.at[slot], scales_ref.at[slot]]
        if offsets_ref is not None:
            in_specs.append(param_spec)
            operands.append(offsets_ref.at[slot])
        init = regs.zeros((TILE_ROWS, TILE_N), regs.tile)
        columns = pl.ds(tile * TILE_N, TILE_N)
        if interpret:  # Pallas' interpreter: the same steps, each reading its blocks in place
            def loop_body(i, acc):
                views = [ref.at[tuple(pl.ds(b * size, size) for b, size in zip(spec.index_map(i), spec.block_shape))]
                         for ref, spec in zip(operands, in_specs)]
                return step((i,), *views, acc)

            acc = jax.lax.fori_loop(0, per_split, loop_body, init)
            out_ref[split, block, columns] = jnp.where(slot >= 0, jnp.sum(acc, axis=0), 0.0)
            return
        (o_smem,) = out_smem

        @pl.when(slot >= 0)
        def _expert():
            pipeline = plgpu.emit_pipeline(step, grid=(per_split,), in_specs=in_specs, max_concurrent_steps=per_split,
                                           init_carry=init)
            o_smem[...] = jnp.sum(pipeline(*operands), axis=0)  # the one reduction over K rows

        @pl.when(slot < 0)
        def _empty():
            o_smem[...] = regs.zeros((TILE_N,), regs.tile.reduce(0))

        plgpu.commit_smem()  # the partial sum leaves through shared memory, by TMA
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[split, block, columns])
        plgpu.wait_smem_to_gmem(0)

    operands = [slots, x_planar, w.values, w.scales] + ([] if fmt.symmetric else [w.offsets])
    out_type = jax.ShapeDtypeStruct((splits, R, w.n), jnp.float32)
    if interpret:  # Pallas' interpreter, a program per grid point (Mosaic GPU's own does not run a grid)
        return pl.pallas_call(
            lambda *refs: program((pl.program_id(0), pl.program_id(1), pl.program_id(2)), *refs),
            grid=(R, tiles, splits), out_shape=out_type, interpret=True, name=name)(*operands)

    def kernel(slot_gmem, *refs):
        *refs, slot_smem, barrier = refs
        plgpu.copy_gmem_to_smem(slot_gmem, slot_smem, barrier)  # the block's slot, read as a scalar
        plgpu.barrier_wait(barrier)
        program(tuple(jax.lax.axis_index(axis) for axis in GRID_NAMES), slot_smem, *refs)

    kernel.__name__ = name  # the compiled kernel's name (<name>_mosaic_gpu_kernel)
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[plgpu.SMEM((TILE_N,), jnp.float32), plgpu.SMEM(slots.shape, jnp.int32),
                       plgpu.Barrier(num_arrivals=1)],
        grid=(R, tiles, splits),
        grid_names=GRID_NAMES,
        compiler_params=plgpu.CompilerParams(),
    )(*operands)


def expert_ffn_mosaic(rows, block_slot, gate_up: QArray, down: QArray, *, block_rows: int = 1, interpret: bool = False,
                      gate_up_bias=None, down_bias=None, activation: GatedActivation = SILU, int8_dot: bool = False):
    """Decode int4 expert FFN on Mosaic GPU: [R, D] in rows.dtype, equal to `expert_ffn_reference`
    within rounding. interpret: run the kernels' steps in Pallas' interpreter. Inputs it does not
    take (see supports_mosaic; an int8_dot) raise NotImplementedError before anything is traced."""
    if int8_dot:
        raise NotImplementedError("the Mosaic expert kernel multiplies float inputs, not int8_dot's int8 grid")
    if not supports_mosaic(rows, gate_up, down, block_rows, gate_up_bias, down_bias):
        raise NotImplementedError("expert_ffn_mosaic does not support these shapes/formats; see supports_mosaic()")
    F = down.k
    block_slot = block_slot.astype(jnp.int32)
    safe = jnp.maximum(block_slot, 0)
    gate_up_out = _matmul_partials(rows, block_slot, gate_up, interpret=interpret, name="expert_gate_up_mosaic")
    gate_up_out = gate_up_out.sum(axis=0)  # [R, 2F] float32
    if gate_up_bias is not None:
        gate_up_out = gate_up_out + gate_up_bias[safe]
    h = activation.in_kernel(gate_up_out[:, :F], gate_up_out[:, F:]).astype(rows.dtype)
    y = _matmul_partials(h, block_slot, down, interpret=interpret, name="expert_down_mosaic").sum(axis=0)
    if down_bias is not None:
        y = y + down_bias[safe]
    return jnp.where((block_slot >= 0)[:, None], y, 0.0).astype(rows.dtype)
