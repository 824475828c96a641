"""`jmoe convert`: a Hugging Face checkpoint -> a jmoe directory.

Streams the experts one at a time (never the whole model in memory), writes everything into a
temporary directory next to the output and renames it into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from convert.hf_source import TOKENIZER_CORE_FILES, TOKENIZER_FILES, TensorSource, read_config, resolve_source
from convert.name_maps import dense_tensor, expert_tensor_names, fused_expert_names
from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError, InputError
from jmoe.format import DENSE_DIR, FORMAT_VERSION, MANIFEST, TOKENIZER_DIR, RecordLayout, expert_file, sha256_file
from jmoe.model import abstract_model
from jmoe.models import config_from_hf
from convert.quantizers.rtn import quantize_rtn
from jmoe.quant import ExpertWeights, bf16_expert, expert_template, hf_to_kmajor, tier_format
from jmoe.tiers import TIER_NAMES

log = logging.getLogger("jmoe.convert")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
METHODS = ("rtn",)

# (layer, expert) -> gate [F, D], up [F, D], down [D, F] in float32, HF orientation.
ExpertReader = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def parse_tiers(tiers: str | Iterable[str]) -> tuple[str, ...]:
    names = [t.strip() for t in (tiers.split(",") if isinstance(tiers, str) else tiers) if t.strip()]
    unknown = [t for t in names if t not in TIER_NAMES]
    if unknown or not names:
        raise InputError(f"unknown tier(s) {unknown or names}; choose from {', '.join(TIER_NAMES)}")
    return tuple(sorted(set(names), key=TIER_NAMES.index, reverse=True))


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    tiers: str | Iterable[str] = ("bf16",),
    method: str = "rtn",
    group_size: int | None = None,
    symmetric: bool | None = None,
    w8a8: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `src` (HF directory or hub id) into a jmoe directory at `out`; returns `out`.

    Args:
      tiers: expert tiers to write, e.g. "bf16,int8,int4,int2" (all in one pass).
      method: quantizer for the integer tiers: "rtn".
      group_size: group size along K for every integer tier (default: 128 for int8, 64 otherwise).
      symmetric: force symmetric (True) or asymmetric (False) integer grids.
      w8a8: make the int8 tier W8A8 (symmetric weights, per-token int8 activations at run time).
    """
    tiers = parse_tiers(tiers)
    if method not in METHODS:
        raise InputError(f"unknown quantization method {method!r}; choose from {', '.join(METHODS)}")
    formats = {t: tier_format(t, group_size=group_size, symmetric=symmetric, w8a8=w8a8) for t in tiers}
    out = Path(out)
    if out.exists() and not overwrite:
        raise InputError(f"{out} already exists (pass overwrite=True / --force to replace it)")
    root = resolve_source(src)
    hf_config = read_config(root)
    cfg = config_from_hf(hf_config)
    source = TensorSource(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        used: set[str] = set()
        dense_index = write_dense(source, cfg, tmp, used)
        reader = expert_reader(source, cfg, used)
        layouts, checksums = write_experts(reader, cfg, tmp, formats, method, progress)
        copy_tokenizer(root, tmp)
        warn_unused(source, used)
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            checksums.setdefault(rel, {"bytes": path.stat().st_size, "sha256": sha256_file(path)})
        manifest = {
            "format_version": FORMAT_VERSION,
            "family": cfg.family,
            "source": Path(str(src)).name,
            "config": cfg.to_dict(),
            "hf_config": hf_config,
            "quantization": {"method": method},
            "tiers": {
                tier: {"format": fmt.to_json() if fmt else None, **layouts[tier].to_json()}
                for tier, fmt in formats.items()
            },
            "dense": dense_index,
            "tokenizer": TOKENIZER_DIR if (tmp / TOKENIZER_DIR).is_dir() else None,
            "files": dict(sorted(checksums.items())),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_dense(source: TensorSource, cfg: ModelConfig, tmp: Path, used: set[str]) -> dict:
    """Every non-expert weight, bf16, into an orbax checkpoint; returns the tensor index."""
    state = nnx.to_pure_dict(nnx.state(abstract_model(cfg, np.float32)))
    index = {}

    def load(path, spec):
        t = dense_tensor(cfg, tuple(k.key for k in path))
        expected = tuple(reversed(spec.shape)) if t.transpose else tuple(spec.shape)
        hf_name = next((n for n in t.hf_names if n in source), t.hf_names[0])
        value = source.get(hf_name, expected)
        used.add(hf_name)
        value = value.T if t.transpose else value
        key = ".".join(str(p) for p in t.path)
        index[key] = {"hf_name": hf_name, "shape": list(spec.shape), "dtype": np.dtype(spec.dtype).name}
        return np.ascontiguousarray(value).astype(spec.dtype)

    weights = jax.tree_util.tree_map_with_path(load, state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((tmp / DENSE_DIR).absolute(), weights)
    checkpointer.wait_until_finished()
    return {"dir": DENSE_DIR, "tensors": index}


def expert_reader(source: TensorSource, cfg: ModelConfig, used: set[str]) -> ExpertReader:
    """Reads one expert at a time from either the per-expert (hub) or the fused 3-D layout."""
    D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts

    def read(layer: int, expert: int):
        fused = [names for names in fused_expert_names(cfg, layer) if names[0] in source]
        if fused:
            gate_up_name, down_name = fused[0]
            gate_up = source.get(gate_up_name, (E, 2 * F, D), index=expert)
            down = source.get(down_name, (E, D, F), index=expert)
            used.update(fused[0])
            return gate_up[:F], gate_up[F:], down
        gate_name, up_name, down_name = expert_tensor_names(cfg, layer, expert)
        used.update((gate_name, up_name, down_name))
        return source.get(gate_name, (F, D)), source.get(up_name, (F, D)), source.get(down_name, (D, F))

    return read


def write_experts(reader: ExpertReader, cfg: ModelConfig, tmp: Path, formats: dict, method: str, progress: bool):
    """One file per (MoE layer, tier), one record per expert; sha256 computed while writing."""
    tiers = tuple(formats)
    layouts = {tier: RecordLayout.from_template(expert_template(cfg, tier, fmt)) for tier, fmt in formats.items()}
    checksums = {}
    total = cfg.num_moe_layers * cfg.num_experts
    with tqdm(total=total, desc="experts", unit="expert", disable=not progress) as bar:
        for moe_index, layer in enumerate(cfg.moe_layer_indices):
            files, hashes = {}, {}
            for tier in tiers:
                path = tmp / expert_file(tier, moe_index)
                path.parent.mkdir(parents=True, exist_ok=True)
                files[tier], hashes[tier] = open(path, "wb"), hashlib.sha256()
            try:
                for expert in range(cfg.num_experts):
                    gate, up, down = reader(layer, expert)
                    for tier in tiers:
                        record = layouts[tier].encode(make_version(formats[tier], method, gate, up, down))
                        files[tier].write(record)
                        hashes[tier].update(record)
                    bar.update(1)
            finally:
                for f in files.values():
                    f.close()
            for tier in tiers:
                rel = expert_file(tier, moe_index)
                checksums[rel] = {"bytes": layouts[tier].nbytes * cfg.num_experts, "sha256": hashes[tier].hexdigest()}
    return layouts, checksums


def make_version(fmt, method: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> ExpertWeights:
    """One expert at one tier: bf16 (fmt None) or quantized by `method`."""
    if fmt is None:
        return bf16_expert(gate, up, down)
    gate_up, down_k = hf_to_kmajor(gate, up, down)
    return ExpertWeights(quantize_rtn(gate_up, fmt), quantize_rtn(down_k, fmt))


def copy_tokenizer(root: Path, tmp: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not any(name in present for name in TOKENIZER_CORE_FILES):
        log.warning("%s has no tokenizer files; the converted model will only accept token ids", root)
        return
    (tmp / TOKENIZER_DIR).mkdir()
    for name in present:
        shutil.copy2(root / name, tmp / TOKENIZER_DIR / name)


def warn_unused(source: TensorSource, used: set[str]) -> None:
    unused = sorted(n for n in source.names - used if not n.endswith(IGNORED_SUFFIXES))
    if unused:
        shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
        log.warning("%d checkpoint tensor(s) were not used: %s", len(unused), shown)


__all__ = ["convert_checkpoint", "parse_tiers"]
