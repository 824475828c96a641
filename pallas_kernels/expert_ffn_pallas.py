"""Pallas (Triton) grouped gated expert FFN reading expert weights straight from a pool by slot.

Computes what `expert_ffn_reference` computes, in two kernels:

  stage 1  h = act(x @ gate, x @ up)        grid (blocks, F / BN, 1): one program per row block and
                                            N tile of F; gate and up tiles share the x loads
  stage 2  y = h @ down                     grid (blocks, D / BN, splits): in decode, K is split
                                            over programs when blocks x tiles would leave SMs idle
                                            (float32 partial sums, added after the kernel)

act is SwiGLU or another gated activation (kernel_formats/glu.py), a static part of the plan.
Optional float32 bias pools ([S, 2F] for gate_up, [S, D] for down) are read by slot like the
weights and added to the float32 accumulators before the activation (stage 1) or the store
(stage 2; with split K only by the first split).

Every program loads its block's slot id from `block_slot` and indexes the whole pool ref with it,
so no weights are gathered or copied outside the kernel; a block with slot -1 writes zeros.

Several tiers in one launch (decode, `expert_ffn_pallas_tiers`): a step whose experts sit in
several pools (a DyMoE plan's bf16 and int4) passes every pool's operands to one kernel per stage
and a tier index per block (`block_tier`). The kernel holds one program body per tier and each
program runs its block's; the grid is tiled at the narrowest tier's BN (a program past the last N
tile of a wider tier does nothing), the output block is the whole row, and the K split is one that
divides every tier's steps. Prefill keeps a launch per tier (its blocks are grouped by slot anyway).

Quantized weights are unpacked inside the kernel. The activations are brought into the packed
layout outside it instead: with planar packing, bit field j of packed rows [r0, r0 + n) holds K rows
that are contiguous per group, so x is permuted once per call to [R, pack, Kp / pack] (x_planar[:, j,
r] multiplies bit field j of packed row r). Then one K step is a contiguous slice of packed rows
and, for every bit field, a contiguous slice of x. Smoothing (act_scale) and W8A8 quantization also
happen there: the per-token int8 scale needs the whole smoothed row, and both touch K values per
row against K x N weight bytes.

Two contraction paths:
- decode (block_rows == 1, memory-bound): GEMV by broadcast-multiply-add into a [step, BN] float32
  accumulator that stays in registers across K and is summed over its rows once, after the loop: no
  cross-warp reduction (and so no barrier) inside the K loop. Each loop iteration first loads
  DECODE_UNROLL steps of weights, then uses them, so that many steps of loads are in flight. tl.dot
  needs M >= 16, and a single row gains nothing from tensor cores.
- prefill (block_rows >= 16): jnp.dot on [BT, BK] x [BK, BN] tiles with float32 accumulation;
  W8A8 runs int8 x int8 dots with int32 accumulation per quantization group.

Tile choices (GPU):
- BN (output columns per program): for decode, 128 bytes of every weight row (128 packed columns,
  64 of 16-bit weights), whole memory transactions; 128 for prefill, where each weight tile is
  reused by BT rows. Capped at the largest power of two dividing N, so no program needs masked
  loads or stores.
- K step: for decode, at most 64 packed rows and never more than a quantization group, so one scale
  (and offset) row applies to the whole step; on the dot path one group, and at least 16 packed rows
  (int2 with groups of 32 has 8 per group, so two groups are taken per step). 64 rows for plain
  weights.
- Decode grid: a handful of experts times N / BN tiles leaves most of a GPU's multiprocessors (an
  H100's 132) idle, so K is split over programs (float32 partial sums, added outside the kernel)
  until there are about the device's target_programs (pallas_kernels/device_config.py). For gate/up
  the gated activation then runs outside too, on the summed partials (it is not linear).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import OFFSET_CODE_ZERO, PlainTiles, QArray, int8_per_token
from pallas_kernels import device_config

DECODE_ROW_BYTES = 128  # bytes of each weight row a decode program reads per step: one memory transaction
DECODE_STEP_ROWS = 64  # packed weight rows per decode K step (at most; never more than a group)
DECODE_UNROLL = 2  # decode K steps whose loads are issued before the first of them is used
# Decode accumulators ([step, BN] float32, two for gate/up) take step * BN / (32 * warps) registers
# per thread each; warps are chosen to keep that at this many, so that nothing spills.
DECODE_ACC_PER_THREAD = 32
# Packed codes at decode in full 128-byte rows: at 4 warps Triton gives the code tile a thread
# layout that the scale and offset rows and the unpacked fields do not share, and converts between
# them through shared memory, with barriers, inside the K loop; at 8 warps the layouts agree and the
# loop has none. Narrower code tiles (GPT-OSS's 64 columns) have none at 4 warps and keep their
# 16-byte loads there (every format and real shape compiled for an H100 by bench/gpu_compile.py).
DECODE_WIDE_CODE_WARPS = 8
PREFILL_BLOCK_N = 128
PLAIN_BLOCK_K = 64
MIN_DOT_DIM = 16  # tl.dot needs M, N, K >= 16
# Decode splits K over programs when the (blocks x N tiles) grid alone would leave the GPU's
# multiprocessors idle: about device_config.current().target_programs programs (several resident
# per multiprocessor), partial sums per split added outside.
PREFILL_PARAMS = dict(num_warps=4, num_stages=3)
# int8 codes at prefill: the gate/up tile (gate and up float32 accumulators and the dequantised
# int8 step) needs more than 255 registers per thread at 4 warps and spills (compiled for an H100,
# bench/gpu_compile.py); 8 warps halve each thread's share. int3 codes likewise (their high bits
# are a second gathered tile beside the low ones: 255 registers and 4 B spilled at 4 warps).
PREFILL_INT8_PARAMS = dict(num_warps=8, num_stages=3)


@dataclass(frozen=True)
class _Plan:
    """Static description of one grouped matmul kernel."""

    block_rows: int  # BT
    block_n: int  # BN
    step_rows: int  # packed weight rows per K step
    num_steps: int
    pack: int  # codes per byte (1 for plain weights; 3 bits: the low section's 4 fields)
    bits: int
    plane: int  # packed rows per quantization group (0 for plain weights; 3 bits: the low section's)
    quantized: bool
    symmetric: bool
    int8_activations: bool
    up_offset: int | None  # stage 1: column offset of the up half; stage 2: None
    float32: bool
    plain_dtype: str | None  # 16-bit float dtype of a plain pool passed as its bit pattern
    splits: int = 1  # programs sharing one output tile's K steps (partial sums added outside)
    bias: bool = False  # a float32 bias pool [S, N] follows the weight operands
    coded: bool = False  # 8-bit scales and offsets on per-column bases (a bases operand follows them)
    activation: GatedActivation = SILU  # stage 1 only

    @property
    def gemv(self) -> bool:
        return self.block_rows == 1

    @property
    def groups_per_step(self) -> int:
        return max(1, self.step_rows // self.plane)

    @property
    def partial_gate_up(self) -> bool:
        """Stage 1 with K split: the kernel writes float32 gate and up partial sums, and the bias and
        the gated activation are applied outside, after the partials are added."""
        return self.up_offset is not None and self.splits > 1

    @property
    def unroll(self) -> int:
        """K steps per loop iteration: DECODE_UNROLL for decode where it divides the program's steps."""
        steps = self.num_steps // self.splits
        return DECODE_UNROLL if self.gemv and steps % DECODE_UNROLL == 0 else 1


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def _weight_k(w) -> int:
    """Logical K of one pool's weights."""
    return w.k if isinstance(w, QArray) else w.shape[-2]


def _packed_rows(w) -> int:
    """Rows of the stored weight per slot that K steps walk: Kp / pack for QArrays (3 bits: the low
    sections' rows, Kp / 4; each group's high section is read beside its low one), K for plain arrays."""
    if not isinstance(w, QArray):
        return w.shape[-2]
    return w.values.shape[-2] // w.fmt.group_rows * (w.fmt.group_size // w.fmt.pack)


def _stored_itemsize(w) -> int:
    """Bytes per stored weight element: 1 for packed codes, the float's size for plain weights."""
    return 1 if isinstance(w, QArray) else jnp.dtype(w.dtype).itemsize


def _block_n(w, n_out: int, gemv: bool) -> int:
    """Output columns per program: a power of two dividing N, so no tile needs masking."""
    cap = DECODE_ROW_BYTES // _stored_itemsize(w) if gemv else PREFILL_BLOCK_N
    return _largest_pow2_divisor(n_out, cap)


def _step_rows(w, gemv: bool) -> int:
    """Packed weight rows per K step. Plain weights: PLAIN_BLOCK_K. Quantized: for decode at most
    DECODE_STEP_ROWS within one group; on the dot path one group (two for int2/G32)."""
    if not isinstance(w, QArray):
        return _largest_pow2_divisor(w.shape[-2], PLAIN_BLOCK_K)
    plane = w.fmt.group_size // w.fmt.pack
    return min(plane, DECODE_STEP_ROWS) if gemv else max(plane, MIN_DOT_DIM)


def _plan(w, block_rows: int, n_out: int, up_offset: int | None, dtype) -> _Plan:
    gemv = block_rows == 1
    step_rows = _step_rows(w, gemv)
    quantized = isinstance(w, QArray)
    fmt = w.fmt if quantized else None
    return _Plan(
        block_rows=block_rows,
        block_n=_block_n(w, n_out, gemv),
        step_rows=step_rows,
        num_steps=_packed_rows(w) // step_rows,
        pack=fmt.pack if quantized else 1,
        bits=fmt.bits if quantized else 16,
        plane=fmt.group_size // fmt.pack if quantized else 0,
        quantized=quantized,
        symmetric=fmt.symmetric if quantized else True,
        int8_activations=quantized and fmt.act_bits == 8,
        up_offset=up_offset,
        float32=jnp.dtype(dtype) == jnp.float32,
        plain_dtype=None if quantized or jnp.dtype(w.dtype).itemsize != 2 else jnp.dtype(w.dtype).name,
        coded=quantized and fmt.scale_bits == 8,
    )


def _pool_supported(w, block_rows: int, n_out: int) -> bool:
    if not (isinstance(w, QArray) or jnp.issubdtype(w.dtype, jnp.floating)):
        return False
    gemv = block_rows == 1
    block_n = _block_n(w, n_out, gemv)
    step_rows = _step_rows(w, gemv)
    if block_n < MIN_DOT_DIM or step_rows < (1 if gemv else MIN_DOT_DIM):
        return False
    return _packed_rows(w) % step_rows == 0


def supports(rows, gate_up, down, block_rows: int, gate_up_bias=None, down_bias=None, *,
             interpret: bool = False) -> bool:
    """Whether `expert_ffn_pallas` handles these inputs (else use the reference).

    Needs float32/bfloat16 rows (float32 on the dot path only in interpret mode: compiled for an
    H100, its HIGHEST-precision dots need more than 255 registers per thread and spill, see
    bench/gpu_compile.py, so the XLA reference runs float32 prefill on a GPU); block_rows 1 (GEMV)
    or a power of two >= 16 (tl.dot needs M >= 16); output widths F and D with a power-of-two factor >= 16 (unmasked N tiles). On the dot path K
    steps must reach 16 rows: plain weights need a power-of-two factor >= 16 in K, and int2 with
    groups of 32 (8 packed rows per group, two groups per step) an even number of groups. Bias
    pools, where given, must be float32 [S, 2F] and [S, D] for the pools' S slots.
    """
    if jnp.dtype(rows.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return False
    if not (block_rows == 1 or (block_rows >= MIN_DOT_DIM and block_rows & (block_rows - 1) == 0)):
        return False
    if block_rows > 1 and jnp.dtype(rows.dtype) == jnp.float32 and not interpret:
        return False
    if rows.ndim != 2 or rows.shape[0] % block_rows:
        return False
    if any(isinstance(w, PlainTiles) or (isinstance(w, QArray) and w.fmt.tiled) for w in (gate_up, down)):
        return False  # the CPU layout is the CPU kernels' (and the reference reads it through untile)
    if not all(offsets_fit(a) for w in (gate_up, down) for a in pool_arrays(w)):
        return False
    D = rows.shape[1]
    F = _weight_k(down)
    if _weight_k(gate_up) != D or gate_up.shape[-1] != 2 * F or down.shape[-1] != D:
        return False
    slots = gate_up.shape[0]
    for bias, width in ((gate_up_bias, 2 * F), (down_bias, D)):
        if bias is not None and (tuple(bias.shape) != (slots, width) or jnp.dtype(bias.dtype) != jnp.float32):
            return False
    return _pool_supported(gate_up, block_rows, F) and _pool_supported(down, block_rows, D)


def pool_arrays(w) -> list:
    """Every array of a pool: the plain array (or its tiles), or a QArray's values, scales, offsets,
    act_scale and bases."""
    return jax.tree.leaves(w)


def offsets_fit(a) -> bool:
    """Whether the Triton lowering indexes array `a` without 32-bit offset overflow.

    Pools are indexed whole (by slot inside the kernel), so element offsets reach the array's size.
    jax's Pallas Triton lowering switches to 64-bit offsets only above 2**32 bytes, so an array of
    1-byte elements (int8 and packed int4/int2 codes) between 2**31 elements and 2**32 bytes would
    be indexed with overflowing int32 offsets: for Qwen3-30B-A3B that is 1,366-2,730 int4 slots,
    683-1,365 int8 slots. Such pools run the XLA reference instead (tests/test_kernels.py checks the
    lowered Triton IR at real slot counts)."""
    elements = math.prod(a.shape)
    return elements < 2**31 or elements * jnp.dtype(a.dtype).itemsize > 2**32


# ----------------------------------------------------------------------------- activations


def _smooth(x, act_scale, block_slot, block_rows: int):
    """x [R, K] * act_scale of each block's slot, in x's dtype (as the reference rounds it)."""
    R, K = x.shape
    scale = act_scale[jnp.maximum(block_slot, 0)].astype(x.dtype)  # [nb, K]
    return (x.reshape(-1, block_rows, K) * scale[:, None, :]).reshape(R, K)


def _planar(x, w):
    """x [R, K] -> [R, pack, Kp / pack], zero-padded to Kp and permuted to the packing layout."""
    R, K = x.shape
    if not isinstance(w, QArray):
        return x[:, None, :]
    fmt = w.fmt
    kp = fmt.padded_k(K)
    plane = fmt.group_size // fmt.pack
    x = jnp.pad(x, ((0, 0), (0, kp - K)))
    x = x.reshape(R, kp // fmt.group_size, fmt.pack, plane).transpose(0, 2, 1, 3)
    return x.reshape(R, fmt.pack, kp // fmt.pack)


def _prepare_activations(x, block_slot, w, block_rows: int):
    """What the kernel multiplies: (x_planar [R, pack, Kp / pack], per-row int8 step [R] or None)."""
    step = None
    if isinstance(w, QArray):
        if w.act_scale is not None:
            x = _smooth(x, w.act_scale, block_slot, block_rows)
        if w.fmt.act_bits == 8:
            x, step = int8_per_token(x)
            step = step[:, 0]
    return _planar(x, w), step


# ----------------------------------------------------------------------------- kernel


def _load_x(x_ref, field: int, r0, plan: _Plan):
    """Dot path: bit field `field`'s activations for packed rows [r0, r0 + step): [BT, step]."""
    return x_ref[:, field, pl.ds(r0, plan.step_rows)]


SCALE, OFFSET = 0, 1  # a group parameter's kind: its weight ref is q_refs[1 + kind], its base row bases[kind]


def _group_row(q_refs, kind: int, slot, group, col, plan: _Plan):
    """One group's scale or offset row for the N tile: [BN] float32 (8-bit codes times their
    columns' base, kernel_formats/qarray.py)."""
    row = q_refs[1 + kind][slot, group, pl.ds(col, plan.block_n)].astype(jnp.float32)
    if not plan.coded:
        return row
    base = q_refs[3][slot, kind, pl.ds(col, plan.block_n)]
    return (row if kind == SCALE else row - OFFSET_CODE_ZERO) * base


def _group_rows(q_refs, kind: int, slot, g0, col, plan: _Plan):
    """Per-group parameter (scale or offset) for every packed row of the step: [step or 1, BN]."""
    tile = _group_row(q_refs, kind, slot, g0, col, plan)[None, :]  # [1, BN]
    if plan.groups_per_step == 1:
        return tile
    row = jax.lax.broadcasted_iota(jnp.int32, (plan.step_rows, plan.block_n), 0)
    tile = jnp.broadcast_to(tile, (plan.step_rows, plan.block_n))
    for i in range(1, plan.groups_per_step):
        later = _group_row(q_refs, kind, slot, g0 + i, col, plan)[None, :]
        tile = jnp.where(row >= i * plan.plane, later, tile)
    return tile


def _contract(x, w, plan: _Plan):
    """Dot path: x [BT, K] @ w [K, BN] -> [BT, BN], float32 or int32."""
    if plan.int8_activations:
        return jnp.dot(x, w, preferred_element_type=jnp.int32)
    precision = jax.lax.Precision.HIGHEST if plan.float32 else None
    return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)


def _step_plain(x_ref, w_ref, slot, r0, col, plan: _Plan):
    """Dot path: one K step over plain weights: [BT, BN] float32."""
    x = _load_x(x_ref, 0, r0, plan)
    w = w_ref[slot, pl.ds(r0, plan.step_rows), pl.ds(col, plan.block_n)]
    if plan.plain_dtype is not None:
        w = jax.lax.bitcast_convert_type(w, jnp.dtype(plan.plain_dtype))
    return _contract(x, w.astype(x.dtype), plan)


def _load_codes(values_ref, slot, r0, col, plan: _Plan):
    """The packed codes of rows [r0, r0 + step) for the N tile, [step, BN] int32. Three bits: rows of
    the groups' low sections (kernel_formats/qarray.py), each with its high bits beside it in the
    next byte, shifted so that field j's high bit is bit 8 + 2j (see _field_codes)."""
    if plan.bits != 3:
        return values_ref[slot, pl.ds(r0, plan.step_rows), pl.ds(col, plan.block_n)].astype(jnp.int32)
    half = plan.plane // 2
    row = r0 + jax.lax.broadcasted_iota(jnp.int32, (plan.step_rows,), 0)
    group, within = row // plan.plane, row % plan.plane
    first = group * (plan.plane + half)  # a group's byte rows: plane low ones, then half high ones
    cols = pl.ds(col, plan.block_n)
    low = values_ref[slot, first + within, cols].astype(jnp.int32)
    high = values_ref[slot, first + plan.plane + within % half, cols].astype(jnp.int32)
    return low | ((high >> (within // half)[:, None]) << 8)


def _field_codes(packed, field: int, plan: _Plan):
    """Bit field `field`'s codes of packed rows (int32, as _load_codes returns them)."""
    if plan.bits == 3:
        return ((packed >> (2 * field)) & 3) | (((packed >> (8 + 2 * field)) & 1) << 2)
    if plan.pack == 1:
        return packed
    return (packed >> (field * plan.bits)) & ((1 << plan.bits) - 1)


def _step_quantized(x_ref, q_refs, slot, r0, col, plan: _Plan):
    """Dot path: one K step (one group, or two for int2/G32): unpack every bit field, dequantize, contract."""
    values_ref = q_refs[0]
    g0 = r0 // plan.plane
    packed = _load_codes(values_ref, slot, r0, col, plan)
    if plan.int8_activations:
        # W8A8: integer dot per group, then the group's scale (groups_per_step == 1 for int8)
        w = (packed - 128).astype(jnp.int8)
        total = _contract(_load_x(x_ref, 0, r0, plan), w, plan).astype(jnp.float32)
        return total * _group_row(q_refs, SCALE, slot, g0, col, plan)
    scale = _group_rows(q_refs, SCALE, slot, g0, col, plan)
    offset = None if plan.symmetric else _group_rows(q_refs, OFFSET, slot, g0, col, plan)
    total = None
    for field in range(plan.pack):
        x = _load_x(x_ref, field, r0, plan)
        codes = _field_codes(packed, field, plan).astype(jnp.float32)
        if plan.symmetric:
            w = (codes - (1 << (plan.bits - 1))) * scale
        else:
            w = codes * scale + offset
        part = _contract(x, w.astype(x.dtype), plan)
        total = part if total is None else total + part
    return total


def _gemv_load(x_ref, w_refs, slot, r0, columns, plan: _Plan):
    """Everything one decode K step reads: the activations of every bit field ([step, 1] float32:
    loaded in the shape they are broadcast in, since a 1-D load broadcast afterwards costs a layout
    conversion through shared memory, with barriers, inside the K loop) and, per column tile, (weight
    tile [step, BN], the group's scale row [BN], offset row or None)."""
    rows = pl.ds(r0, plan.step_rows)
    xs = [x_ref[0, field, rows, :].astype(jnp.float32) for field in range(plan.pack)]
    if not plan.quantized:
        return xs, [(w_refs[0][slot, rows, pl.ds(col, plan.block_n)], None, None) for col in columns]
    group = r0 // plan.plane  # a decode step never crosses a group
    tiles = [(_load_codes(w_refs[0], slot, r0, col, plan), _group_row(w_refs, SCALE, slot, group, col, plan),
              None if plan.symmetric else _group_row(w_refs, OFFSET, slot, group, col, plan)) for col in columns]
    return xs, tiles


def _gemv_update(acc, xs, tile, plan: _Plan):
    """acc [step, BN] += x * w elementwise, w dequantized in float32: no reduction over K here."""
    w, scale, offset = tile
    if not plan.quantized:
        if plan.plain_dtype is not None:
            w = jax.lax.bitcast_convert_type(w, jnp.dtype(plan.plain_dtype))
        return acc + xs[0] * w.astype(jnp.float32)
    # w = code * scale + zero: symmetric codes have their midpoint (W8A8's int8 codes are stored + 128)
    zero = offset if offset is not None else scale * float(-(1 << (plan.bits - 1)))
    scale, zero = scale[None, :], zero[None, :]
    for field in range(plan.pack):
        codes = _field_codes(w, field, plan)
        acc = acc + xs[field] * (codes.astype(jnp.float32) * scale + zero)
    return acc


def _gemv_accumulate(x_ref, w_refs, slot, columns, plan: _Plan, first_step):
    """Decode: tuple of [BN] float32 sums over this program's K steps, one per column tile. The
    [step, BN] accumulators are reduced over their rows once, after the loop."""
    init = tuple(jnp.zeros((plan.step_rows, plan.block_n), jnp.float32) for _ in columns)

    def body(i, accs):
        first = first_step + i * plan.unroll
        loaded = [_gemv_load(x_ref, w_refs, slot, pl.multiple_of((first + u) * plan.step_rows, plan.step_rows),
                             columns, plan) for u in range(plan.unroll)]  # every load before any use
        for xs, tiles in loaded:
            accs = tuple(_gemv_update(a, xs, t, plan) for a, t in zip(accs, tiles))
        return accs

    accs = jax.lax.fori_loop(0, plan.num_steps // plan.splits // plan.unroll, body, init)
    return tuple(jnp.sum(a, axis=0) for a in accs)


def _accumulate(x_ref, w_refs, slot, columns, plan: _Plan, first_step=0):
    """Sum over this program's K steps of every column tile in `columns`: tuple of [BT, BN] ([BN]
    for GEMV) float32. Steps [first_step, first_step + plan.num_steps / plan.splits)."""
    if plan.gemv:
        return _gemv_accumulate(x_ref, w_refs, slot, columns, plan, first_step)
    acc_shape = (plan.block_rows, plan.block_n)

    def body(step, accs):
        r0 = pl.multiple_of((first_step + step) * plan.step_rows, plan.step_rows)
        if plan.quantized:
            parts = [_step_quantized(x_ref, w_refs, slot, r0, col, plan) for col in columns]
        else:
            parts = [_step_plain(x_ref, w_refs[0], slot, r0, col, plan) for col in columns]
        return tuple(a + p for a, p in zip(accs, parts))

    init = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in columns)
    return jax.lax.fori_loop(0, plan.num_steps // plan.splits, body, init)


def _bias_tile(bias_ref, slot, col, plan: _Plan):
    """One slot's bias for the N tile, float32: [BN] for GEMV, [1, BN] on the dot path."""
    tile = bias_ref[slot, pl.ds(col, plan.block_n)].astype(jnp.float32)
    return tile if plan.gemv else tile[None, :]


def _tier_refs(refs, plans: tuple[_Plan, ...]) -> list[tuple]:
    """The kernel's input refs split per tier: (x_ref, step_ref or None, weight refs, bias_ref or None)."""
    refs, out = list(refs), []
    for plan in plans:
        x_ref = refs.pop(0)
        step_ref = refs.pop(0) if plan.int8_activations else None
        if plan.quantized:  # (values, scales, offsets or None, bases or None)
            w_refs = [refs.pop(0), refs.pop(0), None if plan.symmetric else refs.pop(0),
                      refs.pop(0) if plan.coded else None]
        else:
            w_refs = [refs.pop(0)]
        bias_ref = refs.pop(0) if plan.bias else None
        out.append((x_ref, step_ref, tuple(w_refs), bias_ref))
    return out


def _store(o_ref, value, col, plan: _Plan, whole_rows: bool):
    """Write a program's [BT, BN] result: the whole output block, or (whole_rows: the block holds the
    full row, as tiers of different BN share one launch) its N tile."""
    if whole_rows:
        o_ref[:, pl.ds(col, plan.block_n)] = value.reshape(plan.block_rows, plan.block_n).astype(o_ref.dtype)
    else:
        o_ref[...] = value.reshape(o_ref.shape).astype(o_ref.dtype)


def _tier_program(tier_refs, out_refs, slot, tile, split, plan: _Plan, whole_rows: bool):
    """Program (row block, N tile `tile`, K split `split`) of one tier: multiply, write [BT, BN]
    (with plan.partial_gate_up: the gate and up partial sums, to two outputs); zeros for an empty
    block. (Program ids are read by the caller: interpret mode resolves them only outside branches.)"""
    x_ref, step_ref, w_refs, bias_ref = tier_refs
    col = pl.multiple_of(tile * plan.block_n, plan.block_n)
    first = split * (plan.num_steps // plan.splits) if plan.splits > 1 else 0  # this split's K steps
    # partial sums over K splits: only the first split adds the bias
    bias_share = (split == 0).astype(jnp.float32) if plan.splits > 1 else None

    @pl.when(slot < 0)
    def _empty_block():
        for o_ref in out_refs:
            _store(o_ref, jnp.zeros((plan.block_rows, plan.block_n), jnp.float32), col, plan, whole_rows)

    @pl.when(slot >= 0)
    def _expert_block():
        columns = (col,) if plan.up_offset is None else (col, col + plan.up_offset)
        accs = _accumulate(x_ref, w_refs, slot, columns, plan, first)
        if step_ref is not None:
            step = step_ref[0] if plan.gemv else step_ref[...][:, None]  # per-row int8 step
            accs = tuple(a * step for a in accs)
        if plan.partial_gate_up:  # bias and activation follow the sum over splits, outside
            for o_ref, acc in zip(out_refs, accs):
                _store(o_ref, acc, col, plan, whole_rows)
            return
        if bias_ref is not None:
            biases = [_bias_tile(bias_ref, slot, c, plan) for c in columns]
            if bias_share is not None:
                biases = [b * bias_share for b in biases]
            accs = tuple(a + b for a, b in zip(accs, biases))
        out = accs[0] if plan.up_offset is None else plan.activation.in_kernel(*accs)
        _store(out_refs[0], out, col, plan, whole_rows)


def _kernel(*refs, plans: tuple[_Plan, ...], n_out: int):
    """Load the block's slot (and, with several tiers, its tier) and run that tier's program. Tiers
    may tile N differently: a program whose N tile lies past its tier's last one does nothing."""
    outputs = 2 if plans[0].partial_gate_up else 1
    refs, out_refs = list(refs[:-outputs]), refs[-outputs:]
    tier_ref = refs.pop(0) if len(plans) > 1 else None
    slot_ref = refs.pop(0)
    block, tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ref[block]
    tier = tier_ref[block] if tier_ref is not None else None
    for t, (plan, tier_refs) in enumerate(zip(plans, _tier_refs(refs, plans))):
        program = functools.partial(_tier_program, tier_refs, out_refs, slot, tile, split, plan)
        if tier is None:
            program(whole_rows=False)
        else:
            pl.when((tier == t) & (tile < n_out // plan.block_n))(functools.partial(program, whole_rows=True))


# ----------------------------------------------------------------------------- pallas_call


def _whole(shape):
    """BlockSpec handing the kernel the whole array (pools are indexed by slot inside)."""
    return pl.BlockSpec(shape, lambda b, n, k: (0,) * len(shape))


def _weight_operands(w, plan: _Plan):
    if plan.plain_dtype is not None:
        # A bitcast view, free on GPU; in interpret mode it keeps XLA:CPU from converting the whole
        # 16-bit pool to float32 once per program of the grid.
        return [jax.lax.bitcast_convert_type(w, jnp.uint16)]
    if not plan.quantized:
        return [w]
    return [w.values, w.scales] + ([] if plan.symmetric else [w.offsets]) + ([w.bases] if plan.coded else [])


def _tier_operands(x, tier_slot, w, bias, plan: _Plan):
    """One tier's operands and BlockSpecs: its activations in the tier's packing layout (and int8
    step), its weight arrays, its bias pool. tier_slot: the block's slot where the block is this
    tier's, else -1 (smoothing reads a slot of this tier's pool)."""
    x_planar, step = _prepare_activations(x, tier_slot, w, plan.block_rows)  # [R, pack, Kp / pack]
    if plan.gemv:  # a trailing unit axis: each step's activations load as a [step, 1] column
        x_planar = x_planar[..., None]
    operands = [x_planar] + ([] if step is None else [step])
    specs = [pl.BlockSpec((plan.block_rows, *x_planar.shape[1:]),
                          lambda b, n, k: (b,) + (0,) * (x_planar.ndim - 1))]
    if step is not None:
        specs.append(pl.BlockSpec((plan.block_rows,), lambda b, n, k: (b,)))
    weights = _weight_operands(w, plan) + ([bias] if plan.bias else [])
    return operands + weights, specs + [_whole(a.shape) for a in weights]


def _grouped_matmul(x, block_tier, block_slot, ws, *, n_out, up_offset, out_dtype, block_rows, interpret,
                    biases=None, activation: GatedActivation = SILU):
    """Per row block: x [R, K] @ w[block_slot[b]] (+ bias[block_slot[b]]) -> [R, n_out] (stage 1
    with up_offset: the gated activation of the gate and up halves), w and bias those of the
    block's tier: ws[block_tier[b]] (block_tier None: one tier, ws[0]). One launch for every tier."""
    R = x.shape[0]
    nb = block_slot.shape[0]
    biases = list(biases or [None] * len(ws))
    plans = [_plan(w, block_rows, n_out, up_offset, x.dtype) for w in ws]
    splits = _splits(plans, nb, n_out)
    plans = tuple(dataclasses.replace(p, splits=splits, activation=activation) for p in plans)
    partial = plans[0].partial_gate_up
    plans = tuple(dataclasses.replace(p, bias=b is not None and not partial) for p, b in zip(plans, biases))
    whole_rows = len(plans) > 1
    operands, in_specs = [block_slot], [_whole(block_slot.shape)]
    if whole_rows:
        operands, in_specs = [block_tier] + operands, [_whole(block_tier.shape)] + in_specs
    for t, (w, bias, plan) in enumerate(zip(ws, biases, plans)):
        tier_slot = block_slot if not whole_rows else jnp.where(block_tier == t, block_slot, -1)
        tier_ops, tier_specs = _tier_operands(x, tier_slot, w, bias, plan)
        operands, in_specs = operands + tier_ops, in_specs + tier_specs
    block_n = n_out if whole_rows else plans[0].block_n
    if splits == 1:
        out_specs = pl.BlockSpec((block_rows, block_n), lambda b, n, k: (b, 0 if whole_rows else n))
        out_shape = jax.ShapeDtypeStruct((R, n_out), out_dtype)
    else:  # float32 partial sums per split, added below
        out_specs = pl.BlockSpec((None, block_rows, block_n), lambda b, n, k: (k, b, 0 if whole_rows else n))
        out_shape = jax.ShapeDtypeStruct((splits, R, n_out), jnp.float32)
        if partial:
            out_specs, out_shape = (out_specs, out_specs), (out_shape, out_shape)
    out = pl.pallas_call(
        functools.partial(_kernel, plans=plans, n_out=n_out),
        grid=(nb, n_out // min(p.block_n for p in plans), splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(**compiler_params(plans)),
        interpret=interpret,
        name=f"expert_gate_up_{activation.kind}" if up_offset is not None else "expert_down",
    )(*operands)
    if splits == 1:
        return out
    if not partial:
        return out.sum(axis=0).astype(out_dtype)
    gate, up = (part.sum(axis=0) for part in out)  # [R, F] float32 each (block_rows == 1: a row per block)
    for t, bias in enumerate(biases):
        if bias is not None:
            row_bias = bias[jnp.maximum(block_slot, 0)]
            if whole_rows:
                row_bias = jnp.where((block_tier == t)[:, None], row_bias, 0.0)
            gate, up = gate + row_bias[:, :n_out], up + row_bias[:, n_out:]
    h = activation.in_kernel(gate, up)
    return jnp.where((block_slot >= 0)[:, None], h, 0.0).astype(out_dtype)


def compiler_params(plans: tuple[_Plan, ...]) -> dict:
    """Triton warps and stages for a launch (the most warps any of its tiers wants). Decode: one
    stage (its loads are unrolled by hand, not pipelined through shared memory); full-width code
    tiles at DECODE_WIDE_CODE_WARPS, others with enough warps that each thread holds about
    DECODE_ACC_PER_THREAD accumulator values."""
    if plans[0].gemv:
        warps = [DECODE_WIDE_CODE_WARPS if plan.quantized and plan.block_n == DECODE_ROW_BYTES
                 else min(8, max(4, plan.step_rows * plan.block_n // (32 * DECODE_ACC_PER_THREAD))) for plan in plans]
        return dict(num_warps=max(warps), num_stages=1)
    return PREFILL_INT8_PARAMS if any(plan.bits in (8, 3) for plan in plans) else PREFILL_PARAMS


def _splits(plans, blocks: int, n_out: int) -> int:
    """Split-K factor, decode only: enough programs to fill the GPU (counted at the widest N tile,
    which has the fewest), a divisor of every tier's K steps so every split runs the same number."""
    if not plans[0].gemv:
        return 1
    programs = blocks * (n_out // max(p.block_n for p in plans))
    want = min(min(p.num_steps for p in plans), -(-device_config.current().target_programs // programs))
    return max(d for d in range(1, want + 1) if all(p.num_steps % d == 0 for p in plans))


def expert_ffn_pallas(rows, block_slot, gate_up, down, *, block_rows: int, interpret: bool = False,
                      gate_up_bias=None, down_bias=None, activation: GatedActivation = SILU, int8_dot: bool = False):
    """Grouped gated expert FFN, weights (and biases) read from the pools by slot inside the kernels.

    Args:
      rows: [R, D] float32 or bfloat16, R a multiple of block_rows.
      block_slot: [R / block_rows] int32 pool slot per row block (-1: empty block, zeros out).
      gate_up: pool [S, D, 2F] (gate columns, then up), plain array or QArray.
      down: pool [S, F, D], plain array or QArray.
      block_rows: rows per block (1: decode GEMV path; a power of two >= 16: dot path).
      interpret: run the kernels in Pallas interpret mode (CPU).
      gate_up_bias, down_bias: optional float32 pools [S, 2F] and [S, D] added after each matmul.
      activation: how gate and up combine (SwiGLU by default).
      int8_dot: refused (NotImplementedError): these kernels multiply float inputs.

    Returns:
      [R, D] in rows.dtype, equal to `expert_ffn_reference` within rounding.
    """
    return expert_ffn_pallas_tiers(rows, None, block_slot, [(gate_up, down, gate_up_bias, down_bias)],
                                   block_rows=block_rows, interpret=interpret, activation=activation,
                                   int8_dot=int8_dot)


def supports_tiers(rows, tiers, block_rows: int, *, interpret: bool = False) -> bool:
    """Whether `expert_ffn_pallas_tiers` takes these tiers in one launch per stage: every tier
    supported on its own, and several tiers only in decode (block_rows 1)."""
    return (len(tiers) == 1 or block_rows == 1) and all(
        supports(rows, gate_up, down, block_rows, gate_up_bias, down_bias, interpret=interpret)
        for gate_up, down, gate_up_bias, down_bias in tiers)


def expert_ffn_pallas_tiers(rows, block_tier, block_slot, tiers, *, block_rows: int, interpret: bool = False,
                            activation: GatedActivation = SILU, int8_dot: bool = False):
    """`expert_ffn_pallas` over several pools (tiers) at once: block b reads slot block_slot[b] of
    tiers[block_tier[b]], each tier in its own format, one launch per stage for all of them.

    tiers: sequence of (gate_up, down, gate_up_bias, down_bias) pools (jmoe's ExpertWeights is one);
    block_tier: [R / block_rows] int32 index into tiers (None with a single tier). Several tiers
    need block_rows 1 (decode), see supports_tiers. Inputs it does not take (see supports_tiers; an
    int8_dot) raise NotImplementedError before anything is traced.
    """
    if int8_dot:
        raise NotImplementedError("the Pallas expert kernels multiply float inputs, not int8_dot's int8 grid")
    if not supports_tiers(rows, tiers, block_rows, interpret=interpret):
        raise NotImplementedError("expert_ffn_pallas does not support these shapes/formats; see supports()")
    if len(tiers) > 1 and block_tier is None:
        raise ValueError("several tiers need block_tier")
    D = rows.shape[1]
    F = _weight_k(tiers[0][1])
    block_slot = block_slot.astype(jnp.int32)
    block_tier = None if len(tiers) == 1 else jnp.clip(block_tier.astype(jnp.int32), 0, len(tiers) - 1)
    stage = functools.partial(_grouped_matmul, block_rows=block_rows, interpret=interpret, out_dtype=rows.dtype)
    h = stage(rows, block_tier, block_slot, [t[0] for t in tiers], n_out=F, up_offset=F,
              biases=[t[2] for t in tiers], activation=activation)  # [R, F]
    return stage(h, block_tier, block_slot, [t[1] for t in tiers], n_out=D, up_offset=None,
                 biases=[t[3] for t in tiers])  # [R, D]
