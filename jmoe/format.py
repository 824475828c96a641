"""The converted jmoe directory: manifest, dense weights (orbax), expert store records.

Layout (the manifest itself: jmoe/manifest.py):
    manifest.json                 format version, family, config, tiers, tensor index, checksums
    dense/                        orbax checkpoint of every non-expert weight at the dense tier: bf16
                                  arrays, or (int8 / int4) QArrays for the projections, LM head and
                                  embedding table (stored as E^T [D, V]); norms, routers, biases bf16
    experts/<tier>/layerNNN.bin   one file per (MoE layer, tier); expert e's record at e * record_nbytes
    tokenizer/                    the source model's tokenizer files

A record holds one expert version contiguously (its arrays in a fixed order, each 64-byte
aligned), so one read and one host->device transfer move exactly one (layer, expert, tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jmoe.errors import FormatError

DENSE_DIR = "dense"
EXPERTS_DIR = "experts"
TOKENIZER_DIR = "tokenizer"
ALIGN = 64

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32, "uint8": np.uint8, "int8": np.int8}


def np_dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise FormatError(f"unknown array dtype {name!r} in manifest")
    return np.dtype(_DTYPES[name])


@dataclass(frozen=True)
class LeafSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one expert version of one tier; identical for every (layer, expert)."""

    leaves: tuple[LeafSpec, ...]
    nbytes: int

    @classmethod
    def from_template(cls, template) -> "RecordLayout":
        """Layout for a pytree of ShapeDtypeStructs (leaf order = jax flatten order)."""
        leaves, offset = [], 0
        for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]:
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            spec = LeafSpec(name, tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name, offset)
            leaves.append(spec)
            offset = -(-(offset + spec.nbytes) // ALIGN) * ALIGN
        return cls(tuple(leaves), offset)

    def to_json(self) -> dict[str, Any]:
        return {
            "record_nbytes": self.nbytes,
            "leaves": [{"name": l.name, "shape": list(l.shape), "dtype": l.dtype, "offset": l.offset} for l in self.leaves],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RecordLayout":
        leaves = tuple(LeafSpec(l["name"], tuple(l["shape"]), l["dtype"], int(l["offset"])) for l in d["leaves"])
        return cls(leaves, int(d["record_nbytes"]))

    def decode(self, buffer: np.ndarray, treedef) -> Any:
        """Numpy views (no copy) of one record's arrays, as the template's pytree."""
        if buffer.nbytes != self.nbytes:
            raise FormatError(f"expert record has {buffer.nbytes} bytes, layout expects {self.nbytes}")
        arrays = [
            buffer[l.offset : l.offset + l.nbytes].view(np_dtype(l.dtype)).reshape(l.shape) for l in self.leaves
        ]
        return jax.tree_util.tree_unflatten(treedef, arrays)

    def encode(self, tree) -> bytes:
        out = np.zeros((self.nbytes,), np.uint8)
        for spec, leaf in zip(self.leaves, jax.tree_util.tree_leaves(tree), strict=True):
            arr = np.ascontiguousarray(leaf, dtype=np_dtype(spec.dtype))
            if arr.shape != spec.shape:
                raise FormatError(f"expert array {spec.name} has shape {arr.shape}, layout expects {spec.shape}")
            out[spec.offset : spec.offset + spec.nbytes] = arr.reshape(-1).view(np.uint8)
        return out.tobytes()


def expert_file(tier: str, moe_index: int) -> str:
    return f"{EXPERTS_DIR}/{tier}/layer{moe_index:03d}.bin"
