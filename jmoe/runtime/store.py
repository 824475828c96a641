"""Host-side expert store: every (MoE layer, expert, tier) version of the converted model.

Records are read straight from the expert files (no repacking): a record is one contiguous byte
range whose arrays are views in the tier's layout. `record` gives views of a memory map (no copy;
touching them maps the pages into the process until `release`); `read_record` and `read_leaf` copy
from the page cache into buffers the caller owns, which maps nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import FormatError
from jmoe.format import RecordLayout, expert_file
from jmoe.quant import ExpertWeights, QuantFormat
from jmoe.runtime.host_memory import aligned_empty, read_into, release_pages
from jmoe.tiers import expert_template, tiles_fit
from kernel_formats.qarray import TILE, PlainTiles

log = logging.getLogger("jmoe.runtime")


class ExpertStore:
    def __init__(self, root: Path, manifest: dict[str, Any], cfg: ModelConfig):
        self.root = Path(root)
        self.config = cfg
        self.tiers: tuple[str, ...] = tuple(manifest["tiers"])
        self.layouts: dict[str, RecordLayout] = {}
        self.formats: dict[str, QuantFormat | None] = {}
        self._templates: dict[str, ExpertWeights] = {}
        for tier in self.tiers:
            entry = manifest["tiers"][tier]
            try:
                fmt = QuantFormat.from_json(entry["format"]) if entry.get("format") else None
            except ValueError as e:
                raise FormatError(f"manifest.json: tiers.{tier}.format: {e}") from None
            plain_tiled = entry.get("tiled", False)  # the bf16 tier in the CPU layout (a format says it of the rest)
            if plain_tiled and (fmt is not None or not tiles_fit(cfg)):
                raise FormatError(f"manifest.json: tiers.{tier}.tiled applies to a bf16 tier whose expert widths "
                                  f"are multiples of {TILE}")
            template = expert_template(cfg, tier, fmt, plain_tiled)
            layout = RecordLayout.from_json(entry)
            if RecordLayout.from_template(template) != layout:
                raise FormatError(f"tier {tier} record layout in the manifest does not match this jmoe version")
            self.layouts[tier], self.formats[tier], self._templates[tier] = layout, fmt, template
            for layer in range(cfg.num_moe_layers):
                listed = manifest["files"].get(expert_file(tier, layer))
                if listed is None or listed["bytes"] != layout.nbytes * cfg.num_experts:
                    raise FormatError(f"manifest.json does not list {expert_file(tier, layer)} with "
                                      f"{cfg.num_experts} records of {layout.nbytes} bytes")
        tiled = [t for t, fmt in self.formats.items()
                 if (fmt.tiled if fmt is not None else isinstance(self._templates[t].gate_up, PlainTiles))]
        if tiled and jax.default_backend() != "cpu":
            log.warning("tiers %s were converted with --cpu-layout: the GPU kernels leave them to the XLA "
                        "reference (slow); convert without it for a GPU", ", ".join(tiled))
        self._maps: dict[tuple[str, int], np.memmap] = {}
        self._fds: dict[tuple[str, int], int] = {}

    @property
    def num_layers(self) -> int:
        return self.config.num_moe_layers

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def template(self, tier: str) -> ExpertWeights:
        """Shapes and dtypes of one expert version at `tier`."""
        return self._templates[self._check_tier(tier)]

    def record_nbytes(self, tier: str) -> int:
        return self.layouts[self._check_tier(tier)].nbytes

    def _check_tier(self, tier: str) -> str:
        if tier not in self.layouts:
            raise FormatError(f"this model was converted without tier {tier!r} (it has {', '.join(self.tiers)})")
        return tier

    def _file(self, tier: str, layer: int) -> np.memmap:
        key = (tier, layer)
        if key not in self._maps:
            path = self.root / expert_file(tier, layer)
            try:
                self._maps[key] = np.memmap(path, dtype=np.uint8, mode="r")
            except OSError as e:
                raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
        return self._maps[key]

    def _fd(self, tier: str, layer: int) -> int:
        key = (tier, layer)
        if key not in self._fds:
            path = self.root / expert_file(tier, layer)
            try:
                self._fds[key] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
        return self._fds[key]

    def read_record(self, tier: str, layer: int, expert: int) -> np.ndarray:
        """A copy of one expert version's bytes (uint8, 64-byte aligned, so jax can take it without copying)."""
        n = self.record_nbytes(tier)
        out = aligned_empty((n,), np.uint8)
        read_into(self._fd(tier, layer), expert * n, [out])
        return out

    def read_leaf(self, tier: str, layer: int, leaf: int, out: np.ndarray, experts: range | None = None) -> None:
        """Copy array number `leaf` of the layer's experts (all, or the range `experts`) into
        out [len(experts), *leaf shape] (C-contiguous)."""
        n, spec = self.record_nbytes(tier), self.layouts[tier].leaves[leaf]
        fd = self._fd(tier, layer)
        for i, expert in enumerate(range(self.num_experts) if experts is None else experts):
            read_into(fd, expert * n + spec.offset, [out[i]])

    def release(self, tier: str, layer: int, expert: int) -> None:
        """Unmap the pages of one record that `record` views touched (the page cache keeps them)."""
        if (tier, layer) in self._maps:
            n = self.record_nbytes(tier)
            release_pages(self._maps[(tier, layer)], expert * n, n)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def layer_bytes(self, tier: str, layer: int) -> np.ndarray:
        """Every expert version of a (tier, layer): the mapped file as uint8 [E, record bytes] (read-only)."""
        return self._file(tier, layer).reshape(self.num_experts, self.record_nbytes(tier))

    def record_bytes(self, tier: str, layer: int, expert: int) -> np.ndarray:
        """The raw bytes of one expert version (a read-only view of the mapped file)."""
        n = self.record_nbytes(tier)
        return self._file(tier, layer)[expert * n : (expert + 1) * n]

    def record(self, tier: str, layer: int, expert: int) -> ExpertWeights:
        """One expert version as numpy views in its tier's layout."""
        treedef = jax.tree_util.tree_structure(self._templates[tier])
        return self.layouts[tier].decode(self.record_bytes(tier, layer, expert), treedef)
