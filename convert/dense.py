"""The dense weights of a conversion, read tensor by tensor and stored at the dense tier.

Every non-expert parameter of jmoe's tree is read from the checkpoint in blocks of rows (never a
whole float32 copy of a large tensor such as the embedding table or the LM head) and stored as the
model will hold it: at the dense tier "bf16" as bf16 arrays; at "int8" / "int4" the attention
projections, dense MLPs and shared experts as QArrays (round to nearest, groups along K), and the LM
head and embedding table at the head tier (the embedding table quantized as E^T [D, V], one column
per token), while norms, routers and biases stay bf16. Which leaves are quantized is the model's own structure
(jmoe.layers.transformer.abstract_model with the dense format), so conversion and loading agree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from flax import nnx

from convert.hf_source import TensorSource
from convert.quantizers.grid import host_qarray
from convert.quantizers.rtn import rtn_block
from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.format import DENSE_DIR
from jmoe.layers.linear import tiled_kernel_paths
from jmoe.layers.refined_head import RefinedHead, quantize_rows
from jmoe.layers.transformer import AS_DENSE, abstract_model
from jmoe.manifest import DENSE_TIERS
from jmoe.models.checkpoint import dense_tensor
from jmoe.runtime.budget import tree_nbytes
from jmoe.tiers import tier_format
from kernel_formats.qarray import QArray, QPlanes, QuantFormat, is_quantized, planes, template, tile, tile_plain

BLOCK_BYTES = 32 << 20  # float32 bytes of source rows read (and quantized) at a time


# int4 dense weights in groups of 32 rather than the experts' 64: the attention projections are
# few bytes beside the experts and feel every token, and on the bundled model groups of 64 cost
# about 1.1% of math perplexity over bf16 where groups of 32 cost 0.25% (int8 head, int4 experts).
DENSE_INT4_GROUP = 32
# Their scales and offsets as 8-bit codes on per-column bases (kernel_formats/qarray.py), the experts'
# int2 and int3 coding: 4.5 bits per weight, Q4_0's, where float16 scales and offsets made 5.0.
DENSE_INT4_SCALE_BITS = 8
# int6 (the head's tier between int8 and int4, as llama.cpp's Q6_K output matrix beside Q4_0) in
# groups of 32 with 8-bit scales and offsets (kernel_formats/qarray.py): the one-pass CPU kernel reads
# 6.5 bits per weight (Q6_K: 6.56), what groups of 64 with float16 scales read, for less error on
# every logit. On the bundled model (GPTQ, int4 experts, dense int4) groups of 32 cost +0.03% of math
# perplexity over bf16 where groups of 64 cost +0.29% with 8-bit scales (+0.15% to +0.22% with float16
# ones in earlier runs) and Q4_0 +0.16% (bench/results/quality/quality_vs_llama_cpp_head_int6_s8_zen5_cpu.json).
# Stored: 7.0 bits (the high plane keeps a float16 scale a group, which that kernel does not read).
# The head is about half of a Qwen3-30B-A3B 8-layer slice's decode bytes (bench/results/real_shapes).
DENSE_INT6_GROUP = 32
DENSE_INT6_SCALE_BITS = 8


def dense_format(tier: str, *, group_size: int | None = None, symmetric: bool | None = None) -> QuantFormat | None:
    """The dense tier's format (None for bf16): the expert tier's grid (int4 in groups of
    DENSE_INT4_GROUP unless a group size is given, with 8-bit scales where asymmetric; the same
    group-size and symmetry overrides), never W8A8 or smoothed."""
    if tier not in DENSE_TIERS:  # callers validate; this guards the library path
        raise ValueError(f"unknown dense tier {tier!r}")
    if tier == "int4":
        return tier_format(tier, group_size=group_size or DENSE_INT4_GROUP, symmetric=symmetric,
                           scale_bits=DENSE_INT4_SCALE_BITS)
    if tier == "int6":  # a dense tier only (two planes, kernel_formats.qarray): asymmetric, 8-bit scales
        if symmetric:
            raise InputError("the int6 tier is asymmetric: leave --symmetric off")
        try:
            return QuantFormat(6, group_size or DENSE_INT6_GROUP, symmetric=False, scale_bits=DENSE_INT6_SCALE_BITS)
        except ValueError as e:
            raise InputError(str(e)) from None
    return tier_format(tier, group_size=group_size, symmetric=symmetric)


def default_head_tier(dense_tier: str) -> str:
    """The LM head's and embedding table's tier when none is given: int8 beside an int4 dense tier
    (the logits are what every token's choice reads, and int4 costs the most there: on the bundled
    model about 1.7% of prose perplexity; llama.cpp's Q4_0 keeps its output matrix at 6 bits for the
    same reason), else the dense tier."""
    return "int8" if dense_tier == "int4" else dense_tier


def dense_structure(cfg: ModelConfig, fmt: QuantFormat | None, head_fmt: QuantFormat | None | str = AS_DENSE) -> dict:
    """The dense parameter tree as stored: ShapeDtypeStructs, and QArrays of them for quantized leaves."""
    return nnx.to_pure_dict(nnx.state(abstract_model(cfg, np.float32, fmt, head_fmt)))


def row_blocks(rows: int, row_bytes: int):
    step = max(1, BLOCK_BYTES // max(row_bytes, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def read_plain(source: TensorSource, name: str, hf_shape: tuple, transpose: bool, dtype, advance) -> np.ndarray:
    """A float leaf at its stored dtype, converted one block of source rows at a time."""
    if len(hf_shape) != 2:
        value = source.get(name, hf_shape)
        advance(value.size)
        return np.ascontiguousarray(value.T if transpose else value).astype(dtype)
    out = np.empty(tuple(reversed(hf_shape)) if transpose else hf_shape, dtype)
    for rows in row_blocks(hf_shape[0], hf_shape[1] * 4):
        block = source.get(name, hf_shape, rows)
        if transpose:
            out[:, rows] = block.T.astype(dtype)
        else:
            out[rows] = block.astype(dtype)
        advance(block.size)
    return out


def read_quantized(source: TensorSource, name: str, hf_shape: tuple, spec: QArray, advance) -> QArray:
    """A QArray leaf encoding the K-major transpose of the source tensor [N, K] by RTN."""
    def read_rows(rows):
        block = source.get(name, hf_shape, rows)  # [n, K]
        advance(block.size)
        return block

    return quantize_columns(read_rows, spec, rtn_block)


def quantize_columns(read_rows, spec: QArray | QPlanes, quantize, blocks=None) -> QArray | QPlanes:
    """A weight [K, N] in spec's format from the source's rows [N, K] (`read_rows(rows)` -> [n, K]):
    each block of source rows is a block of columns, quantized on its own by
    `quantize(w [K, n], fmt) -> (packed codes, scales, offsets)` (groups run along K, so columns are
    independent) and written into the stored arrays (a 6-bit weight's codes, one per byte, split into
    their planes block by block); `blocks`: the row slices (default: row_blocks of BLOCK_BYTES of float32)."""
    k, n = spec.k, spec.n
    plain = dataclasses.replace(spec.fmt, tiled=False)  # blocks of columns are quantized in [K, N] order
    stored = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), template(plain, k, n))
    for rows in row_blocks(n, k * 4) if blocks is None else blocks:
        codes, scale, offset = quantize(np.asarray(read_rows(rows), np.float32).T, plain)
        part = host_qarray(np.asarray(codes), np.asarray(scale), None if offset is None else np.asarray(offset),
                           plain, k)
        for whole, block in zip(jax.tree.leaves(stored), jax.tree.leaves(planes(part) if plain.bits == 6 else part),
                                strict=True):
            whole[..., rows] = block
    if spec.fmt.tiles(n):  # the CPU layout (convert's cpu_layout): then stored in column tiles
        stored = tile(stored)
    return dataclasses.replace(stored, fmt=spec.fmt)


ROW_TABLES = {"embed_tokens": ("embed_tokens", "embedding"), "head_rows": ("lm_head", "kernel")}  # -> source


def read_row_table(source: TensorSource, name: str, shape: tuple, advance) -> dict:
    """A refined head's int8 row table {rows, scales} (jmoe/layers/refined_head.py) of the source's
    [V, D] tensor, quantized a block of rows at a time."""
    rows, scales = np.empty(shape, np.int8), None
    for block in row_blocks(shape[0], shape[1] * 4):
        codes, block_scales = quantize_rows(source.get(name, shape, block))
        if scales is None:
            scales = np.empty((shape[0], block_scales.shape[1]), np.float16)
        rows[block], scales[block] = codes, block_scales
        advance(codes.size + block_scales.size)  # the bar's total counts both leaves
    return {"rows": rows, "scales": scales}


def source_elements(cfg: ModelConfig, structure: dict) -> int:
    """How many numbers the dense weights hold (the progress bar's total)."""
    leaves = jax.tree_util.tree_leaves(structure, is_leaf=is_quantized)
    return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in leaves))


def read_dense(source: TensorSource, cfg: ModelConfig, used: set[str], fmt: QuantFormat | None,
               advance: Callable[[int], None] = lambda n: None, *,
               head_fmt: QuantFormat | None | str = AS_DENSE, tile_kernels: bool = False) -> tuple[dict, dict]:
    """Every non-expert weight in jmoe's parameter tree at the dense tier (the LM head and embedding
    table at `head_fmt`'s, default the same), and the manifest's dense entry (tensor index, tiers,
    formats, stored bytes). `advance(n)` reports n source numbers read. tile_kernels: the plain
    Linear kernels (jmoe.layers.linear.tiled_kernel_paths) stored in the CPU layout, the entry's
    `tiled_kernels` saying so."""
    structure = dense_structure(cfg, fmt, head_fmt)
    refined = isinstance(head_fmt, RefinedHead)
    tiled = set(tiled_kernel_paths(abstract_model(cfg, np.float32, fmt, head_fmt))) if tile_kernels else set()
    index, row_tables = {}, {}

    def load_row_leaf(module: str, leaf: str, spec):
        t = dense_tensor(cfg, ROW_TABLES[module])
        hf_name = next((n for n in t.hf_names if n in source), t.hf_names[0])
        used.add(hf_name)
        if module not in row_tables:  # rows and scales from one pass over the source
            row_tables[module] = read_row_table(source, hf_name, (cfg.vocab_size, cfg.hidden_size), advance)
        value = row_tables[module].pop(leaf)
        index[f"{module}.{leaf}"] = {"hf_name": hf_name, "shape": list(spec.shape), "dtype": np.dtype(spec.dtype).name}
        return value

    def load(path, spec):
        keys = tuple(k.key for k in path)
        if refined and keys[0] in ROW_TABLES:
            return load_row_leaf(*keys, spec)
        t = dense_tensor(cfg, keys)
        quantized = is_quantized(spec)
        # A quantized embedding stores E^T: like a kernel, the source's rows become its columns.
        transpose = t.transpose or (quantized and t.path[-1] == "embedding")
        shape = tuple(spec.shape)
        hf_shape = tuple(reversed(shape)) if transpose else shape
        hf_name = next((n for n in t.hf_names if n in source), t.hf_names[0])
        used.add(hf_name)
        if quantized:
            value = read_quantized(source, hf_name, hf_shape, spec, advance)
        else:
            value = read_plain(source, hf_name, hf_shape, transpose, spec.dtype, advance)
            if t.path in tiled:
                value = tile_plain(value)
        key = ".".join(str(p) for p in t.path)
        dtype = f"int{spec.fmt.bits}" if quantized else np.dtype(spec.dtype).name
        index[key] = {"hf_name": hf_name, "shape": list(shape), "dtype": dtype}
        return value

    dense = jax.tree_util.tree_map_with_path(load, structure, is_leaf=is_quantized)
    tier_of = lambda f: "bf16" if f is None else f"int{f.bits}"  # noqa: E731
    entry = {"dir": DENSE_DIR, "tier": tier_of(fmt), "format": None if fmt is None else fmt.to_json(),
             "bytes": tree_nbytes(dense), "tensors": index}
    if tiled:
        entry["tiled_kernels"] = True
    if refined:
        entry.update(head_tier=tier_of(head_fmt.coarse), head_format=head_fmt.coarse.to_json(),
                     head_rows=head_fmt.rows_json())
    elif head_fmt is not AS_DENSE:
        entry.update(head_tier=tier_of(head_fmt), head_format=None if head_fmt is None else head_fmt.to_json())
    return dense, entry
