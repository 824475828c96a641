"""The packed quantized weight type the kernels read, and its jnp reference dequantization.

A QArray stores a K-major weight W [K, N] (y = x @ W) quantized group-wise along K:

  values   uint8 [..., Kp / pack, N]   pack = 8 // bits codes per byte (3 bits: 3Kp / 8 rows, below)
  scales   f16   [..., Kp / G, N]      one per (group, column)
  offsets  f16   [..., Kp / G, N]      asymmetric only: w = q * scale + offset
  act_scale f16  [..., K]              optional input smoothing: y = (x * act_scale) @ W

With 8-bit scales (fmt.scale_bits = 8, asymmetric only: the int2 tier's default, groups of 32 for
the bytes of float16 scales in groups of 64) scales and offsets are uint8 codes against one float16
base per column and kind, as llama.cpp's k-quants store their block scales:

  scales   u8    [..., Kp / G, N]      scale  = scales * bases[0]
  offsets  u8    [..., Kp / G, N]      offset = (offsets - 128) * bases[1]
  bases    f32   [..., 2, N]           (float32: a column's scale base can lie below float16's normals)

Symmetric codes are unsigned with a midpoint: w = (q - 2^(bits-1)) * scale. Kp is K rounded up
to the group size G (padding rows are zero and meet zero activations). Packing is planar within
each group: the G / pack bytes of group g hold, in bit field j, the K rows g*G + j*(G/pack) + r, so
a kernel unpacks bit field j into a contiguous K slice without any interleaving.

Three bits (bits = 3) do not divide a byte, so each group's 3G/8 byte rows hold two planar sections:
first the low two bits of its codes as int2 packs them (G/4 rows, pack 4), then their high bit packed
eight to a byte (G/8 rows, pack 8), q = low + 4 * high. The high bits of the low section's byte row r
(its four fields) lie in the high section's byte row r % (G/8), bits 2j + r // (G/8) for field j, so
a kernel reads the two sections of a group side by side. `group_rows` is a group's byte rows at any
width (G / pack, or 3G/8).

With act_bits = 8 (W8A8) the activations are quantized per token to int8 before the matmul.

Six bits (bits = 6, asymmetric only: a tier for the dense weights and the LM head, the place of
llama.cpp's Q6_K beside Q4_0) are stored as two ordinary QArrays of the same group size, a QPlanes:
the code's low four bits as an asymmetric int4 QArray and its high two bits as a symmetric int2 one
whose scales are 16 times the low plane's, so that

  w = q * scale + offset,  q = low + 16 * high in [0, 63]
    = (low * scale + (offset + 32 * scale)) + (high - 2) * (16 * scale)

and y = x @ low + x @ high runs on the int4 and int2 kernels as they are (Q6_K, too, keeps the low
four and high two bits of its codes in separate arrays). On the CPU under the int8 dot one native
pass reads both planes' codes as one code, low + 16 * high, with the low plane's scales (the high
plane's are never read there: keep them 16 times the low plane's, as `planes` writes them).
G = 64: 4.5 + 2.25 = 6.75 bits per weight, G = 128: 6.375. The quantizers work on the 6-bit grid
itself, a QArray of one code per byte (pack 1), which `planes` splits for storage.

With 8-bit scales (the int6 head's default, groups of 32) the low plane's scales and offsets are
8-bit codes as above, and the 6-bit grid's own offset codes already hold its value at code 32 (the
low plane's offset: `group_scales` subtracts 32 scales to give the grid's offset), so `planes` keeps
the codes as they are; each column's scale base has three significant bits, so that 16 times a
scale (the high plane's float16 scale) is exact. G = 32: 4.5 + 2.5 = 7.0 bits stored, of which the
one CPU pass reads 6.5 (the high plane's scales are not read), as G = 64 with float16 scales.

The CPU layout (fmt.tiled, written by `jmoe convert --cpu-layout`): the same arrays, same shapes,
with every row's columns regrouped into tiles of TILE: tile t (columns [TILE t, TILE t + TILE)) of
all rows is stored as one K-major [rows, TILE] block, the blocks in column order. The CPU kernels
read a tile as one sequential stream; everything else reads such an array through `untile`. A
plain bf16 dense projection is stored the same way (`tile_plain`), its flag on the module that
holds it (jmoe.layers.linear.Linear.tiled), since a plain array carries no format.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kernel_formats.optimised import optimised_jit

TILE = 64  # columns per tile of the CPU layout (the CPU kernels' tile)


@dataclass(frozen=True)
class QuantFormat:
    bits: int  # 8, 6, 4, 3 or 2 (6: stored as a QPlanes; 3: two sections per group; module docstring)
    group_size: int  # 32, 64 or 128, along K
    symmetric: bool
    act_bits: int | None = None  # 8: W8A8 (per-token int8 activations)
    smooth: bool = False  # has an act_scale input-smoothing vector (HAQ)
    tiled: bool = False  # the CPU layout: columns stored in tiles of TILE (module docstring)
    scale_bits: int = 16  # 16: float16 scales and offsets; 8: uint8 codes on per-column bases (module docstring)

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 6, 8):
            raise ValueError(f"bits must be 2, 3, 4, 6 or 8, not {self.bits}")
        if self.bits == 6 and (self.symmetric or self.act_bits or self.smooth):
            raise ValueError("6 bits are asymmetric, without W8A8 or smoothing")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, not {self.group_size}")
        if self.act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None or 8, not {self.act_bits}")
        if self.act_bits and not (self.bits == 8 and self.symmetric):
            raise ValueError("W8A8 needs symmetric int8 weights")
        if self.scale_bits not in (8, 16):
            raise ValueError(f"scale_bits must be 8 or 16, not {self.scale_bits}")
        if self.scale_bits == 8 and (self.symmetric or self.act_bits):
            raise ValueError("8-bit scales are for asymmetric weight-only formats")

    def tiles(self, n: int) -> bool:
        """Whether a weight of N columns in this format is stored tiled (N a multiple of TILE)."""
        return self.tiled and n % TILE == 0

    @property
    def pack(self) -> int:
        """Codes per byte; 6 bits: 1, the quantizers' one code per byte; 3 bits: 4, the fields of a
        group's low section (module docstring)."""
        return 4 if self.bits == 3 else 8 // self.bits

    @property
    def group_rows(self) -> int:
        """Byte rows of packed codes per group (3 bits: the low section's G/4 and the high's G/8)."""
        return 3 * self.group_size // 8 if self.bits == 3 else self.group_size // self.pack

    def packed_rows(self, k: int) -> int:
        """Byte rows of packed codes for K rows: [packed_rows(K), N] is the values' shape."""
        return self.padded_k(k) // self.group_size * self.group_rows

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    @property
    def midpoint(self) -> int:
        return 1 << (self.bits - 1)

    def padded_k(self, k: int) -> int:
        return -(-k // self.group_size) * self.group_size

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.tiled:  # written only where set: [K, N] manifests read as before
            del d["tiled"]
        if self.scale_bits == 16:  # likewise
            del d["scale_bits"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "QuantFormat":
        return cls(**d)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QArray:
    values: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    act_scale: jax.Array | None
    fmt: QuantFormat = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))  # logical K (before padding)
    bases: jax.Array | None = None  # 8-bit scales only: [..., 2, N] float32 (module docstring)

    @property
    def n(self) -> int:
        return self.values.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., K, N] of the weight this array encodes."""
        return (*self.values.shape[:-2], self.k, self.n)


def plane_formats(fmt: QuantFormat) -> tuple[QuantFormat, QuantFormat]:
    """A 6-bit format's low plane (asymmetric int4, with the 6-bit format's scales) and high plane
    (symmetric int2, float16 scales) formats."""
    return (QuantFormat(4, fmt.group_size, False, tiled=fmt.tiled, scale_bits=fmt.scale_bits),
            QuantFormat(2, fmt.group_size, True, tiled=fmt.tiled))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QPlanes:
    """A 6-bit weight [K, N] as its low four bits' and high two bits' QArrays: w = low + high
    (module docstring). Every product is the sum of the two planes' products."""
    low: QArray
    high: QArray
    fmt: QuantFormat = dataclasses.field(metadata=dict(static=True))  # the 6-bit grid's

    @property
    def k(self) -> int:
        return self.low.k

    @property
    def n(self) -> int:
        return self.low.n

    @property
    def shape(self) -> tuple[int, ...]:
        return self.low.shape


def is_quantized(w) -> bool:
    """Whether a weight is stored as codes (a QArray, or a 6-bit QPlanes), not a plain array."""
    return isinstance(w, (QArray, QPlanes))


def planes(q: QArray) -> QPlanes:
    """A 6-bit QArray as the quantizers write it (one code per byte, [K, N] layout; numpy) -> the
    QPlanes it is stored as (module docstring)."""
    if q.fmt.bits != 6 or q.fmt.tiled:
        raise ValueError("planes splits a 6-bit QArray in [K, N] layout")
    codes = np.asarray(q.values, np.uint8)
    low_fmt, high_fmt = plane_formats(q.fmt)
    values = np.asarray(pack_codes(codes & 15, low_fmt))
    if q.fmt.scale_bits == 8:  # the codes already hold the low plane's offsets (the grid's value at code 32)
        scale = np.asarray(q.scales, np.float32) * np.asarray(q.bases, np.float32)[0]
        low = QArray(values=values, scales=np.asarray(q.scales), offsets=np.asarray(q.offsets), act_scale=None,
                     fmt=low_fmt, k=q.k, bases=np.asarray(q.bases))
    else:
        scale, offset = np.asarray(q.scales, np.float32), np.asarray(q.offsets, np.float32)
        low = QArray(values=values, scales=scale.astype(np.float16),
                     offsets=(offset + SIX_BIT_MIDDLE * scale).astype(np.float16), act_scale=None, fmt=low_fmt, k=q.k)
    high = QArray(values=np.asarray(pack_codes(codes >> 4, high_fmt)), scales=(16 * scale).astype(np.float16),
                  offsets=None, act_scale=None, fmt=high_fmt, k=q.k)
    return QPlanes(low, high, q.fmt)


def template(fmt: QuantFormat, k: int, n: int, leading: tuple[int, ...] = ()) -> "QArray | QPlanes":
    """A QArray (a QPlanes at 6 bits) of ShapeDtypeStructs: the arrays a (K, N) weight takes in this format."""
    if fmt.bits == 6:
        low, high = plane_formats(fmt)
        return QPlanes(template(low, k, n, leading), template(high, k, n, leading), fmt)
    return code_template(fmt, k, n, leading)


def code_template(fmt: QuantFormat, k: int, n: int, leading: tuple[int, ...] = ()) -> QArray:
    """The QArray of ShapeDtypeStructs of a format's codes as the quantizers write them (at 6 bits
    one code per byte, before `planes` splits them)."""
    kp = fmt.padded_k(k)
    sds = lambda *shape, dtype: jax.ShapeDtypeStruct((*leading, *shape), dtype)  # noqa: E731
    coded = fmt.scale_bits == 8
    group_dtype = jnp.uint8 if coded else jnp.float16
    return QArray(
        values=sds(fmt.packed_rows(k), n, dtype=jnp.uint8),
        scales=sds(kp // fmt.group_size, n, dtype=group_dtype),
        offsets=None if fmt.symmetric else sds(kp // fmt.group_size, n, dtype=group_dtype),
        act_scale=sds(k, dtype=jnp.float16) if fmt.smooth else None,
        fmt=fmt,
        k=k,
        bases=sds(2, n, dtype=jnp.float32) if coded else None,
    )


def _regroup(a, to_tiles: bool):
    """[..., R, N] <-> the same shape with columns in tiles of TILE (numpy or jax arrays)."""
    *lead, r, n = a.shape
    if to_tiles:
        return a.reshape(*lead, r, n // TILE, TILE).swapaxes(-3, -2).reshape(*lead, r, n)
    return a.reshape(*lead, n // TILE, r, TILE).swapaxes(-3, -2).reshape(*lead, r, n)


def tile(q: QArray) -> QArray:
    """A QArray in [K, N] layout -> the same weight in the CPU layout (fmt.tiled), where N allows;
    numpy or jax arrays. Anything else is returned as it is."""
    if isinstance(q, QPlanes):
        return QPlanes(tile(q.low), tile(q.high), dataclasses.replace(q.fmt, tiled=True))
    if q.fmt.tiled or q.n % TILE:
        return q
    regroup = lambda a: None if a is None else _regroup(a, True)  # noqa: E731
    return dataclasses.replace(q, values=regroup(q.values), scales=regroup(q.scales), offsets=regroup(q.offsets),
                               bases=regroup(q.bases), fmt=dataclasses.replace(q.fmt, tiled=True))


def untile(q: QArray) -> QArray:
    """A QArray in the CPU layout -> the same weight in [K, N] layout (a tiled format's weight
    whose N is not a multiple of TILE was never tiled)."""
    if isinstance(q, QPlanes):
        return QPlanes(untile(q.low), untile(q.high), dataclasses.replace(q.fmt, tiled=False))
    if not q.fmt.tiled:
        return q
    fmt = dataclasses.replace(q.fmt, tiled=False)
    if q.n % TILE:
        return dataclasses.replace(q, fmt=fmt)
    regroup = lambda a: None if a is None else _regroup(a, False)  # noqa: E731
    return dataclasses.replace(q, values=regroup(q.values), scales=regroup(q.scales), offsets=regroup(q.offsets),
                               bases=regroup(q.bases), fmt=fmt)


def tile_plain(a):
    """A plain [..., K, N] weight (bf16/float32, numpy or jax) -> its CPU layout: columns in tiles of
    TILE, as `tile` stores a QArray's arrays (N a multiple of TILE)."""
    return _regroup(a, True)


def untile_plain(a):
    """tile_plain undone: the plain weight back in [..., K, N] layout."""
    return _regroup(a, False)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PlainTiles:
    """A plain bf16/float32 [..., K, N] weight stored in the CPU layout (tile_plain): an expert pool
    of the bf16 tier written by `jmoe convert --cpu-layout`. The native CPU kernels read it as it
    lies; every other reader takes `untiled` of what it gathered. The wrapper, not a flag beside the
    pool, says how the bytes lie, so no reader can take the tiles for a [K, N] array."""
    values: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype


def untiled(w):
    """A weight in [K, N] layout: PlainTiles untiled, anything else as it is."""
    return untile_plain(w.values) if isinstance(w, PlainTiles) else w


def take_columns(q: QArray, cols: jax.Array) -> QArray:
    """Columns `cols` [A] of the weight, as a [K, N]-layout QArray of A columns (a gather of a few
    columns, as an embedding lookup makes: in the CPU layout each column is read from its tile)."""
    if isinstance(q, QPlanes):
        return QPlanes(take_columns(q.low, cols), take_columns(q.high, cols), dataclasses.replace(q.fmt, tiled=False))
    tiled = q.fmt.tiles(q.n)

    def take(a):
        if a is None:
            return None
        if not tiled:
            return jnp.take(a, cols, axis=-1)
        r, n = a.shape
        return a.reshape(n // TILE, r, TILE)[cols // TILE, :, cols % TILE].T  # [A, r] -> [r, A]

    return QArray(take(q.values), take(q.scales), take(q.offsets), None, dataclasses.replace(q.fmt, tiled=False), q.k,
                  take(q.bases))


def _unpack_planar(v, bits: int, xp=jnp):
    """Planar codes [..., groups, G * bits / 8, N] (uint8) -> codes [..., groups * G, N], bits 1, 2, 4 or 8."""
    *lead, groups, plane, n = v.shape
    pack = 8 // bits
    dtype = xp.int32 if xp is jnp else np.uint8
    shifts = (xp.arange(pack, dtype=dtype) * bits).reshape(pack, 1, 1)
    codes = (v.astype(dtype).reshape(*lead, groups, 1, plane, n) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, groups * pack * plane, n)  # [..., groups, pack, plane, N] flattened


def unpack_codes(values, fmt: QuantFormat, xp=jnp):
    """uint8 [..., packed rows, N] -> integer codes [..., Kp, N] (int32; numpy's uint8 with xp=np),
    undoing the planar packing (3 bits: both sections of each group)."""
    *lead, rows, n = values.shape
    v = values.reshape(*lead, rows // fmt.group_rows, fmt.group_rows, n)
    if fmt.bits != 3:
        return _unpack_planar(v, fmt.bits, xp)
    low_rows = fmt.group_size // 4
    return _unpack_planar(v[..., :low_rows, :], 2, xp) + 4 * _unpack_planar(v[..., low_rows:, :], 1, xp)


def _pack_planar(codes, bits: int):
    """Codes [..., groups, G, N] in [0, 2^bits) -> planar-packed uint8 [..., groups, G * bits / 8, N]."""
    *lead, groups, g, n = codes.shape
    pack = 8 // bits
    c = jnp.asarray(codes, jnp.uint32).reshape(*lead, groups, pack, g // pack, n)
    shifts = (jnp.arange(pack, dtype=jnp.uint32) * bits).reshape(pack, 1, 1)
    return jnp.sum(c << shifts, axis=-3, dtype=jnp.uint32).astype(jnp.uint8)  # bit fields never overlap


# Jitted, as dequantize and quantize_groups: called eagerly (conversion, tests, checks) each compiles
# once per shape rather than op by op; inside a jitted function it is inlined like any nested jit.
@functools.partial(optimised_jit, static_argnums=1)
def pack_codes(codes, fmt: QuantFormat) -> jax.Array:
    """Integer codes [..., Kp, N] in [0, qmax] -> planar-packed uint8 [..., packed rows, N]."""
    *lead, kp, n = codes.shape
    c = jnp.asarray(codes, jnp.uint32).reshape(*lead, kp // fmt.group_size, fmt.group_size, n)
    if fmt.bits == 3:
        packed = jnp.concatenate([_pack_planar(c & 3, 2), _pack_planar(c >> 2, 1)], axis=-2)
    else:
        packed = _pack_planar(c, fmt.bits)
    return packed.reshape(*lead, fmt.packed_rows(kp), n)


@functools.partial(optimised_jit, static_argnums=1)  # as pack_codes
def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
    """Reference dequantization to the logical weight [..., K, N] (smoothing not applied)."""
    if isinstance(q, QPlanes):
        return (dequantize(q.low, jnp.float32) + dequantize(q.high, jnp.float32)).astype(dtype)
    q = untile(q)
    fmt = q.fmt
    codes = unpack_codes(q.values, fmt).astype(jnp.float32)
    scale, offset = group_scales(q)
    scales = jnp.repeat(scale, fmt.group_size, axis=-2)
    if fmt.symmetric:
        w = (codes - fmt.midpoint) * scales
    else:
        w = codes * scales + jnp.repeat(offset, fmt.group_size, axis=-2)
    return w[..., : q.k, :].astype(dtype)


def group_scales(q: QArray) -> tuple[jax.Array, jax.Array | None]:
    """Each group's scale and offset (None when symmetric), float32 [..., Kp / G, N], in q's layout."""
    if q.fmt.scale_bits == 16:
        return q.scales.astype(jnp.float32), None if q.offsets is None else q.offsets.astype(jnp.float32)
    scale = q.scales.astype(jnp.float32) * q.bases[..., 0:1, :]
    offset = (q.offsets.astype(jnp.float32) - OFFSET_CODE_ZERO) * q.bases[..., 1:2, :]
    # six bits: the offset codes hold the grid's value at code 32, the low plane's offset (module docstring)
    return scale, offset - SIX_BIT_MIDDLE * scale if q.fmt.bits == 6 else offset


SIX_BIT_MIDDLE = 32  # the 6-bit code whose value a six-bit weight's 8-bit offset codes hold


OFFSET_CODE_ZERO = 128  # an 8-bit offset code's zero (the codes are unsigned)


def int8_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8 (W8A8): x [..., K] -> (codes int8 [..., K], step float32 [..., 1])."""
    x32 = x.astype(jnp.float32)
    step = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    step = jnp.where(step == 0, 1.0, step)
    return jnp.clip(jnp.round(x32 / step), -127, 127).astype(jnp.int8), step


def quantize_activations(x: jax.Array) -> jax.Array:
    """Per-token symmetric int8 fake quantization (W8A8): x [..., K] -> dequantized int8 grid values."""
    codes, step = int8_per_token(x)
    return (codes.astype(jnp.float32) * step).astype(x.dtype)


@functools.partial(optimised_jit, static_argnums=1)  # as pack_codes
def quantize_groups(x: jax.Array, group: int) -> jax.Array:
    """x [..., K] onto an int8 grid per group of `group` along K (the CPU kernels' int8 dot, like
    llama.cpp's Q8 blocks): step = max |x| / 127 (1 for a zero group), codes rounded half to
    even; returns step * code in float32."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    xf = jnp.pad(x.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, -k % group)]).reshape(*lead, -1, group)
    codes, step = int8_per_token(xf)  # each group as its own "token"
    return (codes.astype(jnp.float32) * step).reshape(*lead, -1)[..., :k]


def int8_dot_applies(w) -> bool:
    """Whether the int8 dot quantizes the inputs of `w`: a QArray without W8A8's own per-token grid."""
    return isinstance(w, QArray) and w.fmt.act_bits is None


def bf16_dot_applies(pool) -> bool:
    """Whether the CPU kernels' reduced-precision dot (load's cpu_dot="int8") rounds the inputs of an
    expert pool to bf16: a plain bf16 pool (PlainTiles too), which the AVX-512 BF16 dot multiplies
    two products a lane (llama.cpp's BF16 dot rounds its inputs alike)."""
    return not is_quantized(pool) and jnp.dtype(pool.dtype) == jnp.dtype(jnp.bfloat16)


def round_to_bf16(x: jax.Array) -> jax.Array:
    """x rounded to the nearest bf16 (ties to even), in x's dtype."""
    return x.astype(jnp.bfloat16).astype(x.dtype)


def prepare_input(x: jax.Array, act_scale: jax.Array | None, fmt: QuantFormat) -> jax.Array:
    """What multiplies the dequantized weight: x [..., K] smoothed (act_scale broadcast against x)
    and, for W8A8, quantized per token."""
    if act_scale is not None:
        x = x * act_scale.astype(x.dtype)
    if fmt.act_bits == 8:
        x = quantize_activations(x)
    return x
