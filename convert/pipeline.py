"""`jmoe convert`: a Hugging Face checkpoint -> a jmoe directory.

Streams the checkpoint: dense tensors in blocks of rows, stored at the dense tier
(convert/dense.py), then the experts (one at a time for RTN, one layer at a time when GPTQ/HAQ
calibrate), never the whole model; every phase (dense weights, calibration, experts) shows a
progress bar with its ETA. Everything is written into a temporary directory next to the output
and renamed into place only when complete.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import orbax.checkpoint as ocp
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from convert import dense_gptq
from convert.calibration import LayerwiseCalibration, calibration_tokens
from convert.dense import default_head_tier, dense_format, dense_structure, read_dense, source_elements
from convert.hf_source import (
    TOKENIZER_CORE_FILES,
    TOKENIZER_FILES,
    TensorSource,
    read_config,
    resolve_source,
    trusted_root,
)
from convert.mxfp4 import BLOCK, BLOCK_BYTES, dequantize_mxfp4
from convert.output import Partial, absolute, check_output, clean_stale, output_error
from convert.quantizers.expert import METHODS, LayerQuantizer, rtn_expert
from jmoe import validate
from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError, InputError, OutputError
from jmoe.format import DENSE_DIR, TOKENIZER_DIR, RecordLayout, expert_file
from jmoe.layers.experts import expert_activation
from jmoe.layers.refined_head import ROW_GROUP, RefinedHead
from jmoe.manifest import DENSE_TIERS, MANIFEST, PARTIAL_MARKER, seal, sha256_file
from jmoe.models import config_from_hf
from jmoe.models.checkpoint import checkpoint_names, expert_tensor_names, fused_expert_names
from jmoe.quant import ExpertWeights, bf16_expert, hf_to_kmajor
from jmoe.tiers import TIER_NAMES, expert_template, expert_widths, tier_format, tiles_fit
from jmoe.tokenizer import first_line, load_tokenizer
from kernel_formats.qarray import TILE, PlainTiles, is_quantized, tile, tile_plain

log = logging.getLogger("jmoe.convert")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)  # always about the output

# (layer, expert) -> gate [F, D], up [F, D], down [D, F] in float32, HF orientation; with expert
# biases (cfg.expert_bias) followed by gate_bias [F], up_bias [F], down_bias [D].
ExpertReader = Callable[[int, int], tuple[np.ndarray, ...]]


def parse_tiers(tiers: str | Iterable[str]) -> tuple[str, ...]:
    """Tier names from "bf16,int4" or a list, most precise first."""
    items = tiers.split(",") if isinstance(tiers, str) else tiers
    if not isinstance(items, (list, tuple)):
        raise InputError(f"tiers must be a comma-separated string or a list of tier names, got {tiers!r}")
    names = [validate.text(f"tiers[{i}]", t).strip() for i, t in enumerate(items)]
    names = [t for t in names if t]
    unknown = [t for t in names if t not in TIER_NAMES]
    if unknown or not names:
        raise InputError(f"unknown tier(s) {unknown or names}; choose from {', '.join(TIER_NAMES)}")
    return tuple(sorted(set(names), key=TIER_NAMES.index, reverse=True))


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    tiers: str | Iterable[str] = ("bf16",),
    dense_tier: str = "bf16",
    head_tier: str | None = None,
    method: str = "rtn",
    calib: str | Path | Sequence[str | Path] | None = None,
    calib_sequences: int = 64,
    calib_seq_len: int = 256,
    group_size: int | None = None,
    head_group_size: int | None = None,
    refine_head: int | None = None,
    symmetric: bool | None = None,
    scale_bits: int | None = None,
    w8a8: bool = False,
    cpu_layout: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `src` (HF directory or hub id) into a jmoe directory at `out`; returns `out`.

    Every option is checked before any work. The output is written into a temporary directory
    beside `out` and renamed into place at the end, so a failure leaves nothing behind; an
    existing `out` is replaced only with `overwrite`, and only if it is an earlier jmoe output or
    an empty directory (never the source, its parents, the working or home directory).

    Args:
      tiers: expert tiers to write, e.g. "bf16,int8,int4,int3,int2" (all in one pass).
      dense_tier: "bf16", "int8" or "int4": the attention projections, dense MLPs and shared experts
        at that tier (RTN on the integer tiers' grid, group_size and symmetric apply); norms,
        routers and biases stay bf16.
      head_tier: the LM head and embedding table's tier, "bf16", "int8", "int6" or "int4" (default:
        int8 beside an int4 dense tier, else the dense tier).
      method: quantizer for the integer tiers: "rtn", "gptq" or "haq" (the last two calibrate, and
        then integer dense weights and LM head are quantized by GPTQ too: convert/dense_gptq.py).
      calib: calibration text file(s) (comma-separated string or list); needed by gptq and haq.
      calib_sequences, calib_seq_len: how many token windows of what length to calibrate on.
      group_size: group size along K for every integer tier (default: 128 for int8, 32 for int4 dense
        weights, 64 otherwise).
      head_group_size: the LM head and embedding table's group size along K where it differs from
        group_size's (int6, by default in groups of 32 with 8-bit scales, stores 7.0 bits per weight
        and the CPU reads 6.5 of them; in groups of 64, 6.5 and 6.25, for more error on every logit:
        bench/quality.py).
      refine_head: an integer head refined per token (jmoe/layers/refined_head.py): its this many
        largest logits computed again from int8 rows of the head stored beside it (which also hold
        the embedding table), so the head can be read at int4 for little more error than at int6.
      symmetric: force symmetric (True) or asymmetric (False) integer grids.
      scale_bits: 8 or 16, how the asymmetric expert tiers store each group's scale and offset: 8-bit
        codes on per-column bases or float16 (default: int2 and int3 8-bit, int4 float16; symmetric tiers and the
        dense weights keep float16). int4 with 8-bit scales stores 4.25 bits per weight instead of 4.5;
        the H100's Mosaic expert kernel reads float16 scales only, so keep float16 for a GPU.
      w8a8: make the int8 tier W8A8 (symmetric weights, per-token int8 activations at run time).
      cpu_layout: store the expert tiers (bf16 too), the dense weights (plain bf16 projections and an
        untied bf16 LM head too) and an integer LM head and embedding table in the CPU layout
        (kernel_formats/qarray.py: column tiles of 64, which the CPU kernels stream; GPU kernels
        leave such experts to the XLA reference, so convert without it for a GPU).
    """
    tiers = parse_tiers(tiers)
    validate.choice("dense_tier", dense_tier, DENSE_TIERS)
    head_tier = default_head_tier(dense_tier) if head_tier is None else validate.choice("head_tier", head_tier,
                                                                                        DENSE_TIERS)
    if not isinstance(method, str) or method not in METHODS:
        raise InputError(f"unknown quantization method {method!r}; choose from {', '.join(METHODS)}")
    calib_files = calibration_files(calib)
    if method != "rtn" and not calib_files:
        raise InputError(f"method {method!r} calibrates: pass calibration text with calib=... / --calib")
    calib_sequences = validate.integer("calib_sequences", calib_sequences, minimum=1, maximum=1 << 16)
    calib_seq_len = validate.integer("calib_seq_len", calib_seq_len, minimum=2)
    for name, size in (("group_size", group_size), ("head_group_size", head_group_size)):
        if size is not None:
            validate.choice(name, size, (32, 64, 128))
    if symmetric is not None:
        validate.boolean("symmetric", symmetric)
    if scale_bits is not None:
        validate.choice("scale_bits", validate.integer("scale_bits", scale_bits), (8, 16))
        if scale_bits == 8 and symmetric:
            raise InputError("8-bit scales code asymmetric grids: leave symmetric off")
    w8a8, cpu_layout, overwrite, progress = (validate.boolean(n, v) for n, v in
                                             (("w8a8", w8a8), ("cpu_layout", cpu_layout), ("overwrite", overwrite),
                                              ("progress", progress)))
    formats = {t: tier_format(t, group_size=group_size, symmetric=symmetric, w8a8=w8a8, smooth=method == "haq",
                              scale_bits=scale_bits) for t in tiers}
    dense_fmt = dense_format(dense_tier, group_size=group_size, symmetric=symmetric)
    if head_group_size is not None and head_tier == "bf16":
        raise InputError("head_group_size sets an integer head tier's groups: the head tier is bf16")
    head_fmt = dense_format(head_tier, group_size=head_group_size or group_size, symmetric=symmetric)
    if cpu_layout:  # integer dense weights, LM head and embedding table too (a decode step reads them all)
        dense_fmt, head_fmt = (None if f is None else dataclasses.replace(f, tiled=True) for f in (dense_fmt, head_fmt))
    if refine_head is not None:
        top = validate.integer("refine_head", refine_head, minimum=1)
        if head_fmt is None:
            raise InputError("refine_head refines an integer head: choose a head tier other than bf16")
        head_fmt = RefinedHead(head_fmt, top)
    out = absolute(validate.path("output", out))
    root = resolve_source(validate.path("source", src))
    check_output(out, root, overwrite)
    hf_config = read_config(root)
    cfg = config_from_hf(hf_config)
    if isinstance(head_fmt, RefinedHead) and cfg.hidden_size % ROW_GROUP:
        raise InputError(f"refine_head stores rows in groups of {ROW_GROUP}: hidden size {cfg.hidden_size} "
                         "is not a multiple")
    source = TensorSource(root)
    check_layer_count(source, cfg)
    stored, plain_tiled = stored_formats(formats, cfg, cpu_layout)
    calibrating = method != "rtn" and any(fmt is not None for fmt in formats.values())
    calibration = None
    if calibrating:
        if calib_seq_len > cfg.max_position_embeddings:
            raise InputError(f"calib_seq_len {calib_seq_len} exceeds the model's {cfg.max_position_embeddings} positions")
        tokens = calibration_tokens(load_source_tokenizer(root), calib_files, calib_sequences, calib_seq_len)
    clean_stale(out)
    partial = Partial(out)
    tmp = partial.path
    try:
        used: set[str] = set()
        # Calibration quantizes integer dense weights and head again by GPTQ (convert/dense_gptq.py): saved after
        gptq_dense, gptq_head = calibrating and dense_fmt is not None, calibrating and head_fmt is not None
        save_later = gptq_dense or gptq_head
        dense, dense_entry = convert_dense(source, cfg, used, dense_fmt, head_fmt, tmp, progress, cpu_layout,
                                           save=not save_later)
        if calibrating:  # the experts' inputs as the model will compute them: through the dense tier
            requantize = lambda path, stored, h: dense_gptq.calibrated_weight(source, cfg, path, stored, h)  # noqa: E731
            calibration = LayerwiseCalibration(cfg, dense, tokens, quant=dense_fmt, head_quant=head_fmt,
                                               progress=progress,
                                               tiled_kernels=dense_entry.get("tiled_kernels", False),
                                               quantize_dense=requantize if gptq_dense else None)
        if not save_later:
            del dense
        reader = expert_reader(source, cfg, used)
        source.release()
        with blas_threads(cfg):
            layouts, checksums, alphas = write_experts(reader, cfg, tmp, formats, method, progress, calibration,
                                                       release=source.release, stored=stored,
                                                       plain_tiled=plain_tiled)
            if gptq_head:
                dense_gptq.calibrated_head(source, cfg, dense, calibration.head_inputs(), progress)
                dense_entry["head_method"] = "gptq"
        if gptq_dense:
            dense_entry["method"] = "gptq"
        if save_later:
            source.release()
            save_dense(dense, tmp / DENSE_DIR)
            del dense
        copy_tokenizer(root, tmp)
        warn_unused(source, used)
        for path in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != PARTIAL_MARKER):
            rel = path.relative_to(tmp).as_posix()
            checksums.setdefault(rel, {"bytes": path.stat().st_size, "sha256": sha256_file(path)})
        quantization = {"method": method}
        if calibration is not None:
            quantization["calibration"] = {"files": [Path(f).name for f in calib_files],
                                           "sequences": calib_sequences, "seq_len": calib_seq_len}
        if alphas:
            quantization["haq_alpha"] = alphas
        manifest = seal({
            "family": cfg.family,
            "source": Path(str(src)).name,
            "config": cfg.to_dict(),
            "hf_config": hf_config,
            "quantization": quantization,
            "tiers": {
                tier: {"format": fmt.to_json() if fmt else None,
                       **({"tiled": True} if fmt is None and plain_tiled else {}), **layouts[tier].to_json()}
                for tier, fmt in stored.items()
            },
            "dense": dense_entry,
            "tokenizer": TOKENIZER_DIR if (tmp / TOKENIZER_DIR).is_dir() else None,
            "files": dict(sorted(checksums.items())),
        })
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        partial.commit(root, overwrite)
    except OSError as e:
        partial.discard()
        if e.errno in WRITE_ERRNOS or e.filename is None or str(e.filename).startswith(str(out.parent)):
            raise output_error(e) from None
        raise CheckpointError(f"cannot read {e.filename}: {e.strerror or e}") from None
    except BaseException:
        partial.discard()
        raise
    return out


def calibration_files(calib) -> list[str]:
    """Calibration text files from a comma-separated string, a path, or a list of them."""
    if calib is None:
        return []
    items = calib.split(",") if isinstance(calib, str) else [calib] if isinstance(calib, os.PathLike) else calib
    if not isinstance(items, (list, tuple)):
        raise InputError(f"calib must be a path, a comma-separated string or a list of paths, got {calib!r}")
    return [str(validate.path(f"calib[{i}]", f)).strip() for i, f in enumerate(items) if str(f).strip()]


def check_layer_count(source: TensorSource, cfg: ModelConfig) -> None:
    """A config that declares fewer layers than the checkpoint holds would silently drop layers."""
    beyond = sorted(i for i in source.layer_indices() if i >= cfg.num_layers)
    if beyond:
        raise CheckpointError(f"the checkpoint has tensors of layer {beyond[0]} (model.layers.{beyond[0]}.*) but "
                              f"config.json 'num_hidden_layers' is {cfg.num_layers}")


def load_source_tokenizer(root: Path):
    if not any((root / name).is_file() for name in TOKENIZER_CORE_FILES):
        raise InputError(f"{root} has no tokenizer; calibration text cannot be tokenized")
    return load_tokenizer(root, error=CheckpointError)


def convert_dense(source: TensorSource, cfg: ModelConfig, used: set[str], fmt, head_fmt, tmp: Path, progress: bool,
                  tile_kernels: bool = False, save: bool = True):
    """Read the dense weights at their tiers (a progress bar over the numbers read) and save them
    (unless `save` is false: the caller saves them later); returns (the stored tree, the manifest's
    dense entry). The checkpoint's pages are released after. tile_kernels: plain projections in the
    CPU layout (read_dense)."""
    total = source_elements(cfg, dense_structure(cfg, fmt, head_fmt))
    with tqdm(total=total, desc="dense weights", unit="", unit_scale=True, disable=not progress) as bar:
        dense, entry = read_dense(source, cfg, used, fmt, bar.update, head_fmt=head_fmt, tile_kernels=tile_kernels)
        source.release()
        if save:
            bar.set_postfix_str("saving")
            save_dense(dense, tmp / DENSE_DIR)
            bar.set_postfix_str("")
    return dense, entry


def save_dense(dense: dict, path: Path) -> None:
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(path.absolute(), dense)
        checkpointer.wait_until_finished()
    except OSError:
        raise
    except Exception as e:  # orbax reports write failures (disk full, ...) in several types
        raise OutputError(f"cannot write the dense weights to {path}: {first_line(e)}") from None


def expert_reader(source: TensorSource, cfg: ModelConfig, used: set[str]) -> ExpertReader:
    """Reads one expert at a time from the per-expert (hub) layout or the fused 3-D one: linear or
    K-major orientation, gate/up concatenated or interleaved, plain floats or MXFP4 blocks and
    scales (dequantized here), as the family's CheckpointNames say; with its biases where the
    config has expert biases."""
    D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    layout = checkpoint_names(cfg)

    def fused_matrix(name: str, n_out: int, k_in: int, expert: int) -> np.ndarray:
        """One expert's slice of a fused tensor in linear orientation [n_out, k_in], float32."""
        if name + "_blocks" in source:
            blocks_name, scales_name = name + "_blocks", name + "_scales"
            if k_in % BLOCK:
                raise CheckpointError(f"{blocks_name}: MXFP4 needs an input width divisible by {BLOCK}, not {k_in}")
            blocks = source.get_bytes(blocks_name, (E, n_out, k_in // BLOCK, BLOCK_BYTES), index=expert)
            scales = source.get_bytes(scales_name, (E, n_out, k_in // BLOCK), index=expert)
            used.update((blocks_name, scales_name))
            value = dequantize_mxfp4(blocks, scales)
            if not np.isfinite(value).all():
                raise CheckpointError(f"{scales_name} (expert {expert}) holds scales too large for float32 "
                                      "(e8m0 255 is NaN)")
            return value
        used.add(name)
        if layout.fused_kmajor:
            return source.get(name, (E, k_in, n_out), index=expert).T
        return source.get(name, (E, n_out, k_in), index=expert)

    def split_gate_up(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[2F, ...] -> gate [F, ...], up [F, ...] (interleaved rows or two halves)."""
        return (a[0::2], a[1::2]) if layout.gate_up_interleaved else (a[:F], a[F:])

    def fused_bias(name: str, width: int, expert: int) -> np.ndarray:
        used.add(name)
        return source.get(name, (E, width), index=expert)

    def read(layer: int, expert: int):
        fused = [names for names in fused_expert_names(cfg, layer)
                 if names[0] in source or names[0] + "_blocks" in source]
        if fused:
            gate_up_name, down_name = fused[0]
            gate, up = split_gate_up(fused_matrix(gate_up_name, 2 * F, D, expert))
            down = fused_matrix(down_name, D, F, expert)
            if not cfg.expert_bias:
                return gate, up, down
            gate_bias, up_bias = split_gate_up(fused_bias(gate_up_name + "_bias", 2 * F, expert))
            return gate, up, down, gate_bias, up_bias, fused_bias(down_name + "_bias", D, expert)
        gate_name, up_name, down_name = expert_tensor_names(cfg, layer, expert)
        used.update((gate_name, up_name, down_name))
        weights = source.get(gate_name, (F, D)), source.get(up_name, (F, D)), source.get(down_name, (D, F))
        if not cfg.expert_bias:
            return weights
        bias_names = expert_tensor_names(cfg, layer, expert, "bias")
        used.update(bias_names)
        return (*weights, *(source.get(n, (w,)) for n, w in zip(bias_names, (F, F, D))))

    return read


def stored_formats(formats: dict, cfg: ModelConfig, cpu_layout: bool) -> tuple[dict, bool]:
    """(each tier's format as written, whether the bf16 tier is written tiled): with cpu_layout,
    every tier in the CPU layout where every expert weight's width (2F and D) is a whole number of
    tiles (else written [K, N], with a warning); an integer tier's format says so, the bf16 tier's
    weights are written as PlainTiles."""
    if not cpu_layout:
        return formats, False
    if not tiles_fit(cfg):
        log.warning("expert widths %s are not multiples of %d: experts are written in [K, N] layout",
                    expert_widths(cfg), TILE)
        return formats, False
    return {t: None if fmt is None else dataclasses.replace(fmt, tiled=True) for t, fmt in formats.items()}, True


def tile_version(version: ExpertWeights) -> ExpertWeights:
    """One expert version's weights in the CPU layout (biases as they are): a QArray tiled, a plain
    weight as PlainTiles."""
    def tiled(w):
        return tile(w) if is_quantized(w) else PlainTiles(tile_plain(w))

    return version._replace(gate_up=tiled(version.gate_up), down=tiled(version.down))


class LayerFiles:
    """The expert files of one MoE layer, one per tier, hashed as they are written (tiers whose
    stored format is tiled are tiled on the way)."""

    def __init__(self, tmp: Path, moe_index: int, layouts: dict[str, RecordLayout], tiled: frozenset = frozenset()):
        self.layouts, self.tiled = layouts, tiled
        self.paths = {tier: expert_file(tier, moe_index) for tier in layouts}
        self.files, self.hashes = {}, {}
        for tier, rel in self.paths.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            self.files[tier], self.hashes[tier] = open(tmp / rel, "wb"), hashlib.sha256()

    def write(self, tier: str, version: ExpertWeights) -> None:
        record = self.layouts[tier].encode(tile_version(version) if tier in self.tiled else version)
        self.files[tier].write(record)
        self.hashes[tier].update(record)

    def close(self, num_experts: int) -> dict:
        for f in self.files.values():
            f.close()
        return {
            rel: {"bytes": self.layouts[tier].nbytes * num_experts, "sha256": self.hashes[tier].hexdigest()}
            for tier, rel in self.paths.items()
        }


SMALL_WIDTH = 1024  # hidden sizes below this calibrate on one BLAS thread (blas_threads)


def blas_threads(cfg: ModelConfig) -> threadpool_limits:
    """BLAS threads for the calibrated quantizers' host work (Hessians, Cholesky factors, grid refits).

    A small model's matrices (the bundled one's are 128 x 192) cost less than waking OpenBLAS's pool,
    whose threads then spin for cores another process needs. On 2 cores, one thread converted the
    bundled model at int2 by GPTQ in 14-16 s where the pool took 21-23 s, 61 s beside one busy core
    and 105-119 s beside a process using both (HAQ: 23-24 s against 29-31 s, 29 s against 66 s).
    At real widths the pool's own count is kept: one Qwen3-30B-A3B expert's GPTQ took the same time
    either way on 2 cores."""
    return threadpool_limits(limits=1 if cfg.hidden_size < SMALL_WIDTH else None, user_api="blas")


def write_experts(reader: ExpertReader, cfg: ModelConfig, tmp: Path, formats: dict, method: str, progress: bool,
                  calibration: LayerwiseCalibration | None = None, release: Callable[[], None] = lambda: None,
                  stored: dict | None = None, plain_tiled: bool = False):
    """One file per (MoE layer, tier), one record per expert, every tier in one pass.

    Without calibration (RTN) experts stream one at a time; with it (GPTQ, HAQ) one layer's
    experts are held while the calibration hidden states pass through that layer. `stored`: the
    formats as written (stored_formats; default `formats`): experts are quantized in `formats`.
    plain_tiled: the bf16 tier is written in the CPU layout (stored_formats).
    """
    stored = formats if stored is None else stored
    plain_tiled = plain_tiled and "bf16" in stored
    layouts = {tier: RecordLayout.from_template(expert_template(cfg, tier, fmt, plain_tiled and fmt is None))
               for tier, fmt in stored.items()}
    tiled = frozenset(t for t, fmt in stored.items() if (fmt.tiled if fmt is not None else plain_tiled))
    checksums, alphas = {}, {}
    E = cfg.num_experts
    with tqdm(total=cfg.num_moe_layers * E, desc="experts", unit="expert", disable=not progress) as bar:

        def write_layer(moe_index: int, inputs=None):
            """Every expert of one MoE layer at every tier; returns the layer's float32 experts."""
            layer = cfg.moe_layer_indices[moe_index]
            files = LayerFiles(tmp, moe_index, layouts, tiled)
            try:
                if inputs is None:
                    for expert in range(E):
                        weights = hf_to_kmajor(*reader(layer, expert))
                        write_versions(files, formats, weights, lambda tier: rtn_expert(weights, formats[tier]))
                        bar.update(1)
                    return None
                experts = [hf_to_kmajor(*reader(layer, e)) for e in range(E)]
                plan = LayerQuantizer(method, formats, experts, inputs, expert_activation(cfg))
                if plan.alphas:
                    alphas[moe_index] = plan.alphas
                for expert in range(E):
                    write_versions(files, formats, experts[expert], lambda tier: plan.quantize(expert, tier))
                    bar.update(1)
                return experts
            finally:
                checksums.update(files.close(E))
                release()  # unmap the checkpoint pages of the layer just written

        if calibration is None:
            for moe_index in range(cfg.num_moe_layers):
                write_layer(moe_index)
        else:
            calibration.run(write_layer)
    return layouts, checksums, alphas


def write_versions(files: LayerFiles, formats: dict, weights: ExpertWeights,
                   quantize: Callable[[str], ExpertWeights]) -> None:
    """Every tier of one expert (K-major float32 weights and biases): bf16 as is, integer tiers
    quantized (each version carries the expert's float32 biases, if it has them)."""
    for tier, fmt in formats.items():
        files.write(tier, bf16_expert(weights) if fmt is None else quantize(tier))


def copy_tokenizer(root: Path, tmp: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not any(name in present for name in TOKENIZER_CORE_FILES):
        log.warning("%s has no tokenizer files; the converted model will only accept token ids", root)
        return
    trusted = trusted_root(root)
    for name in present:  # a link out of the checkpoint would copy an unrelated file into the output
        if not (root / name).resolve().is_relative_to(trusted):
            raise CheckpointError(f"tokenizer file {name} is a symbolic link out of {root}; refusing to copy it")
    (tmp / TOKENIZER_DIR).mkdir()
    for name in present:
        shutil.copy2(root / name, tmp / TOKENIZER_DIR / name)


def warn_unused(source: TensorSource, used: set[str]) -> None:
    unused = sorted(n for n in source.names - used if not n.endswith(IGNORED_SUFFIXES))
    if unused:
        shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
        log.warning("%d checkpoint tensor(s) were not used: %s", len(unused), shown)


__all__ = ["convert_checkpoint", "parse_tiers"]
