"""Bad input of every kind, one row each: the error class, a message that names the culprit, no debris.

Rows cover convert (options, config.json, tensors, files), the converted format (manifest and
files), load, generate, perplexity/forward and the CLI (exit status 2 with one line on stderr).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import jmoe
from convert import convert_checkpoint
from jmoe.cli import main
from jmoe.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    FormatError,
    InputError,
)
from jmoe.manifest import PARTIAL_MARKER
from jmoe.policies import DyMoE, DynaExq, StaticPlacement
from jmoe.serving import BatchEngine
from tests.conftest import CALIB_FILES
from tests.hf_models import make_checkpoint

CLI = "cli"  # rows whose `error` is this run the command line: exit status 2, one line on stderr


@pytest.fixture(scope="module")
def pristine_hf(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("bad-input") / "hf"
    make_checkpoint("qwen3_moe", src)  # 3 layers (layer 1 dense), 8 experts, vocab 256, no tokenizer
    return src


@pytest.fixture(scope="module")
def pristine_jmoe(pristine_hf, tmp_path_factory) -> Path:
    return convert_checkpoint(pristine_hf, tmp_path_factory.mktemp("bad-input-out") / "m", progress=False)


class Ctx:
    """What a row works on; everything it creates is remembered so debris can be told apart."""

    def __init__(self, tmp_path: Path, pristine_hf: Path, pristine_jmoe: Path, tiny_model, tiny_converted, tiny_hf_dir):
        self.tmp, self.model, self.tiny, self.tiny_hf = tmp_path, tiny_model, tiny_converted, tiny_hf_dir
        self._hf, self._jmoe = pristine_hf, pristine_jmoe
        self.out = tmp_path / "out"
        self.created: set[str] = set()

    def keep(self, name: str) -> Path:
        self.created.add(name)
        return self.tmp / name

    def hf(self, *tampers: Callable[[Path], None]) -> Path:
        path = self.keep("hf")
        if not path.exists():
            shutil.copytree(self._hf, path)
        for tamper in tampers:
            tamper(path)
        return path

    def converted(self, *tampers: Callable[[Path], None]) -> Path:
        path = self.keep("m")
        if not path.exists():
            shutil.copytree(self._jmoe, path)
        for tamper in tampers:
            tamper(path)
        return path

    def existing_out(self) -> Path:
        self.keep("out").mkdir()
        (self.out / "keep.txt").write_text("mine")
        return self.out


# ---------------------------------------------------------------- tampering helpers


def config(**changes) -> Callable[[Path], None]:
    """Edit config.json: set keys (a value of ... deletes the key)."""
    def tamper(root: Path):
        cfg = json.loads((root / "config.json").read_text())
        for key, value in changes.items():
            if value is ...:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (root / "config.json").write_text(json.dumps(cfg))
    return tamper


def raw(name: str, content: bytes | str) -> Callable[[Path], None]:
    def tamper(root: Path):
        data = content.encode() if isinstance(content, str) else content
        (root / name).write_bytes(data)
    return tamper


def tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def tamper(root: Path):
        state = load_file(str(root / "model.safetensors"))
        edit(state)
        save_file(state, str(root / "model.safetensors"))
    return tamper


def set_tensor(name: str, make: Callable[[torch.Tensor], torch.Tensor]):
    return tensors(lambda s: s.__setitem__(name, make(s[name])))


def poison(name: str, value: float):
    def make(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t
    return set_tensor(name, make)


def second_shard(name: str) -> Callable[[Path], None]:
    """Move nothing, but also store `name` in a second shard (an override)."""
    def tamper(root: Path):
        state = load_file(str(root / "model.safetensors"))
        save_file({name: state[name] * 2}, str(root / "model-extra.safetensors"))
    return tamper


def index(weight_map: Any) -> Callable[[Path], None]:
    return raw("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))


def symlink(name: str, target: Callable[[Path], Path]) -> Callable[[Path], None]:
    def tamper(root: Path):
        outside = target(root)
        outside.write_text('{"secret": 1}')
        (root / name).unlink(missing_ok=True)
        (root / name).symlink_to(outside)
    return tamper


def manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def tamper(root: Path):
        m = json.loads((root / "manifest.json").read_text())
        edit(m)
        (root / "manifest.json").write_text(json.dumps(m))
    return tamper


def set_in(*path_and_value):
    *path, value = path_and_value

    def edit(m):
        for key in path[:-1]:
            m = m[key]
        if value is ...:
            del m[path[-1]]
        else:
            m[path[-1]] = value
    return edit


def first_file(prefix: str) -> Callable[[dict], str]:
    return lambda m: next(f for f in m["files"] if f.startswith(prefix))


def rename_file_entry(old: str, new: str):
    return lambda m: m["files"].__setitem__(new, m["files"].pop(old))


def deep(depth: int = 200_000) -> str:
    return "[" * depth + "]" * depth


EXPERT = "model.layers.2.mlp.experts.5.down_proj.weight"
DENSE = "model.layers.0.self_attn.q_proj.weight"


def conv(c: Ctx, *tampers, **kw):
    return convert_checkpoint(c.hf(*tampers), c.out, **{"progress": False, **kw})


def load(c: Ctx, *tampers, **kw):
    return jmoe.load(c.converted(*tampers), **kw)


def gen(c: Ctx, prompt: Any = "x = ", **kw):
    return jmoe.generate(c.model, prompt, **{"max_new_tokens": 2, **kw})


@dataclass(frozen=True)
class Row:
    id: str
    call: Callable[[Ctx], Any]
    error: Any
    match: str


ROWS = [
    # ---- convert: options
    Row("convert-unknown-tier", lambda c: conv(c, tiers="bf16,int5"), InputError, "int5"),
    Row("convert-tiers-not-a-list", lambda c: conv(c, tiers=5), InputError, "tiers"),
    Row("convert-unknown-dense-tier", lambda c: conv(c, dense_tier="int2"), InputError, "dense_tier"),
    Row("convert-tier-not-a-string", lambda c: conv(c, tiers=["bf16", 4]), InputError, r"tiers\[1\]"),
    Row("convert-no-tier", lambda c: conv(c, tiers=" , "), InputError, "tier"),
    Row("convert-unknown-method", lambda c: conv(c, method="awq"), InputError, "awq"),
    Row("convert-gptq-without-calibration", lambda c: conv(c, tiers="int4", method="gptq"), InputError, "calib"),
    Row("convert-calib-sequences-zero", lambda c: conv(c, calib_sequences=0), InputError, "calib_sequences"),
    Row("convert-calib-sequences-float", lambda c: conv(c, calib_sequences=2.5), InputError, "calib_sequences"),
    Row("convert-calib-seq-len-negative", lambda c: conv(c, calib_seq_len=-4), InputError, "calib_seq_len"),
    Row("convert-calib-seq-len-beyond-positions",
        lambda c: convert_checkpoint(c.tiny_hf, c.out, tiers="int4", method="gptq", calib=CALIB_FILES,
                                     calib_seq_len=10**6, progress=False), InputError, "calib_seq_len"),
    Row("convert-group-size-48", lambda c: conv(c, tiers="int4", group_size=48), InputError, "group_size"),
    Row("convert-group-size-string", lambda c: conv(c, tiers="int4", group_size="64"), InputError, "group_size"),
    Row("convert-head-group-size-48", lambda c: conv(c, dense_tier="int4", head_tier="int6", head_group_size=48),
        InputError, "head_group_size"),
    Row("convert-head-group-size-string", lambda c: conv(c, dense_tier="int4", head_tier="int6", head_group_size="32"),
        InputError, "head_group_size"),
    Row("convert-head-group-size-bf16-head", lambda c: conv(c, dense_tier="int4", head_tier="bf16", head_group_size=32),
        InputError, "head tier is bf16"),
    Row("convert-refine-head-zero", lambda c: conv(c, dense_tier="int4", head_tier="int4", refine_head=0),
        InputError, "refine_head"),
    Row("convert-refine-head-string", lambda c: conv(c, dense_tier="int4", head_tier="int4", refine_head="256"),
        InputError, "refine_head"),
    Row("convert-refine-head-bf16-head", lambda c: conv(c, dense_tier="int4", head_tier="bf16", refine_head=256),
        InputError, "refines an integer head"),
    Row("convert-refine-head-width-not-of-32", lambda c: conv(c, config(hidden_size=48), dense_tier="int4",
                                                              head_tier="int4", refine_head=256),
        InputError, "groups of 32"),
    Row("convert-symmetric-string", lambda c: conv(c, symmetric="yes"), InputError, "symmetric"),
    Row("convert-scale-bits-12", lambda c: conv(c, tiers="int4", scale_bits=12), InputError, "scale_bits"),
    Row("convert-scale-bits-float", lambda c: conv(c, tiers="int4", scale_bits=8.0), InputError, "scale_bits"),
    Row("convert-scale-bits-8-symmetric", lambda c: conv(c, tiers="int4", scale_bits=8, symmetric=True), InputError,
        "asymmetric"),
    Row("convert-w8a8-int", lambda c: conv(c, w8a8=1), InputError, "w8a8"),
    Row("convert-cpu-layout-string", lambda c: conv(c, cpu_layout="yes"), InputError, "cpu_layout"),
    Row("convert-overwrite-string", lambda c: conv(c, overwrite="no"), InputError, "overwrite"),
    Row("convert-progress-none", lambda c: conv(c, progress=None), InputError, "progress"),
    Row("convert-calib-file-missing",
        lambda c: convert_checkpoint(c.tiny_hf, c.out, tiers="int4", method="gptq", calib=[str(c.tmp / "none.txt")],
                                     progress=False), InputError, "none.txt"),
    Row("convert-calib-not-paths", lambda c: conv(c, calib=42), InputError, "calib"),
    Row("convert-source-missing", lambda c: convert_checkpoint(c.tmp / "nowhere", c.out), CheckpointError,
        "nowhere does not exist"),
    Row("convert-source-is-a-file", lambda c: convert_checkpoint(c.hf() / "config.json", c.out), CheckpointError,
        "config.json is a file"),
    Row("convert-source-empty-string", lambda c: convert_checkpoint("", c.out), InputError, "source"),
    Row("convert-output-none", lambda c: convert_checkpoint(c.hf(), None), InputError, "output"),
    Row("convert-output-exists", lambda c: convert_checkpoint(c.hf(), c.existing_out()), InputError,
        "out already exists"),
    Row("convert-output-foreign-with-force", lambda c: convert_checkpoint(c.hf(), c.existing_out(), overwrite=True),
        InputError, "keep.txt"),
    # ---- convert: config.json
    Row("config-missing", lambda c: conv(c, lambda r: (r / "config.json").unlink()), ConfigError, "no config.json"),
    Row("config-binary", lambda c: conv(c, raw("config.json", bytes(range(256)))), ConfigError, "not UTF-8"),
    Row("config-200k-deep", lambda c: conv(c, raw("config.json", deep())), ConfigError, "nested too deeply"),
    Row("config-not-an-object", lambda c: conv(c, raw("config.json", "[1, 2]")), ConfigError, "JSON object"),
    Row("config-malformed", lambda c: conv(c, raw("config.json", "{not json")), ConfigError, "not valid JSON"),
    Row("config-hidden-size-string", lambda c: conv(c, config(hidden_size="64")), ConfigError, "hidden_size"),
    Row("config-hidden-size-zero", lambda c: conv(c, config(hidden_size=0)), ConfigError, "hidden_size"),
    Row("config-layers-negative", lambda c: conv(c, config(num_hidden_layers=-1)), ConfigError, "num_hidden_layers"),
    Row("config-experts-per-token-too-many", lambda c: conv(c, config(num_experts_per_tok=9)), ConfigError,
        "num_experts_per_tok"),
    Row("config-eps-string", lambda c: conv(c, config(rms_norm_eps="tiny")), ConfigError, "rms_norm_eps"),
    Row("config-eps-negative", lambda c: conv(c, config(rms_norm_eps=-1e-6)), ConfigError, "rms_norm_eps"),
    Row("config-bool-as-string", lambda c: conv(c, config(norm_topk_prob="true")), ConfigError, "norm_topk_prob"),
    Row("config-unknown-model-type", lambda c: conv(c, config(model_type="llama")), ConfigError, "llama"),
    Row("config-no-model-type", lambda c: conv(c, config(model_type=...)), ConfigError, "model_type"),
    Row("config-mlp-only-layers-string", lambda c: conv(c, config(mlp_only_layers="1")), ConfigError,
        "mlp_only_layers"),
    Row("config-eos-string", lambda c: conv(c, config(eos_token_id="</s>")), ConfigError, "eos_token_id"),
    Row("config-activation", lambda c: conv(c, config(hidden_act="gelu")), ConfigError, "hidden_act"),
    Row("config-rope-scaling-unknown", lambda c: conv(c, config(rope_parameters={"rope_type": "bogus"})),
        ConfigError, "bogus"),
    Row("config-heads-not-divisible", lambda c: conv(c, config(num_key_value_heads=3)), ConfigError,
        "num_key_value_heads"),
    Row("config-fewer-layers-than-checkpoint", lambda c: conv(c, config(num_hidden_layers=2)), CheckpointError,
        "layer 2.*num_hidden_layers"),
    Row("config-more-layers-than-checkpoint", lambda c: conv(c, config(num_hidden_layers=4, mlp_only_layers=[1])),
        CheckpointError, r"model\.layers\.3\."),
    # ---- convert: tensors and shards
    Row("tensor-nan-dense", lambda c: conv(c, poison(DENSE, float("nan"))), CheckpointError, DENSE + ".*NaN"),
    Row("tensor-inf-expert", lambda c: conv(c, poison(EXPERT, float("inf"))), CheckpointError, EXPERT + ".*infinite"),
    Row("tensor-int64", lambda c: conv(c, set_tensor(DENSE, lambda t: t.to(torch.int64))), CheckpointError,
        DENSE + ".*I64"),
    Row("tensor-bool", lambda c: conv(c, set_tensor(EXPERT, lambda t: t > 0)), CheckpointError, EXPERT + ".*BOOL"),
    Row("tensor-missing", lambda c: conv(c, tensors(lambda s: s.pop(EXPERT))), CheckpointError, EXPERT),
    Row("tensor-wrong-shape", lambda c: conv(c, set_tensor(DENSE, lambda t: t[:8])), CheckpointError,
        DENSE + r".*\[8, 64\]"),
    Row("tensor-in-two-shards", lambda c: conv(c, second_shard(DENSE)), CheckpointError, DENSE + ".*twice"),
    Row("safetensors-truncated", lambda c: conv(c, lambda r: (r / "model.safetensors").write_bytes(
        (r / "model.safetensors").read_bytes()[:5000])), CheckpointError, "model.safetensors"),
    Row("safetensors-not-safetensors", lambda c: conv(c, raw("model.safetensors", b"\x00" * 64)), CheckpointError,
        "model.safetensors"),
    Row("index-shard-outside", lambda c: conv(c, index({DENSE: "../elsewhere.safetensors"})), CheckpointError,
        "elsewhere.safetensors"),
    Row("index-no-weight-map", lambda c: conv(c, raw("model.safetensors.index.json", '{"metadata": {}}')),
        CheckpointError, "weight_map"),
    Row("index-missing-shard", lambda c: conv(c, index({DENSE: "model-00002.safetensors"})), CheckpointError,
        "model-00002.safetensors"),
    Row("tokenizer-symlink-out", lambda c: conv(c, symlink("tokenizer.json", lambda r: c.keep("secret.json"))),
        CheckpointError, "tokenizer.json is a symbolic link"),
    # ---- the converted format
    Row("format-not-a-directory", lambda c: jmoe.load(c.tmp / "nowhere"), FormatError, "nowhere is not a directory"),
    Row("format-no-manifest", lambda c: load(c, lambda r: (r / "manifest.json").unlink()), FormatError,
        "no manifest.json"),
    Row("format-manifest-malformed", lambda c: load(c, raw("manifest.json", "{")), FormatError, "manifest.json"),
    Row("format-manifest-binary", lambda c: load(c, raw("manifest.json", b"\xff\xfe\x00")), FormatError,
        "manifest.json is not UTF-8"),
    Row("format-manifest-deep", lambda c: load(c, raw("manifest.json", deep())), FormatError, "nested too deeply"),
    Row("format-old-version", lambda c: load(c, manifest(set_in("format_version", 1))), FormatError,
        "format version 1"),
    Row("format-missing-key", lambda c: load(c, manifest(set_in("tiers", ...))), FormatError, "missing 'tiers'"),
    Row("format-unknown-key", lambda c: load(c, manifest(set_in("extra", 1))), FormatError, "'extra'"),
    Row("format-record-bytes-string", lambda c: load(c, manifest(set_in("tiers", "bf16", "record_nbytes", "big"))),
        FormatError, "record_nbytes"),
    Row("format-unknown-tier", lambda c: load(c, manifest(lambda m: m["tiers"].__setitem__("int5", m["tiers"]["bf16"]))),
        FormatError, "int5"),
    Row("format-absolute-path", lambda c: load(c, manifest(lambda m: rename_file_entry(
        first_file("dense/")(m), "/etc/passwd")(m))), FormatError, "/etc/passwd"),
    Row("format-dotdot-path", lambda c: load(c, manifest(set_in("dense", "dir", "../../elsewhere"))), FormatError,
        r"\.\./\.\./elsewhere"),
    Row("format-bad-sha256", lambda c: load(c, manifest(lambda m: m["files"][first_file("experts/")(m)].__setitem__(
        "sha256", "xyz"))), FormatError, "sha256"),
    Row("format-head-rows-top-zero",
        lambda c: load(c, manifest(set_in("dense", "head_rows", {"bits": 8, "group_size": 32, "top": 0}))),
        FormatError, "head_rows"),
    Row("format-head-rows-bf16-head",
        lambda c: load(c, manifest(set_in("dense", "head_rows", {"bits": 8, "group_size": 32, "top": 4}))),
        FormatError, "refines an integer head"),
    Row("format-config-string-size", lambda c: load(c, manifest(set_in("config", "hidden_size", "64"))),
        FormatError, "hidden_size"),
    Row("format-config-unknown-field", lambda c: load(c, manifest(set_in("config", "dropout", 0.1))), FormatError,
        "dropout"),
    Row("format-config-negative-layers", lambda c: load(c, manifest(set_in("config", "num_layers", -3))),
        FormatError, "num_layers"),
    Row("format-family-mismatch", lambda c: load(c, manifest(set_in("family", "mixtral"))), FormatError, "family"),
    Row("format-tier-format-mismatch", lambda c: load(c, manifest(set_in("tiers", "bf16", "format", {
        "bits": 4, "group_size": 64, "symmetric": False, "act_bits": None, "smooth": False}))), FormatError,
        "bf16"),
    Row("format-config-edited-verify", lambda c: load(c, manifest(set_in("config", "rope_theta", 5000.0)),
                                                      verify=True), FormatError, "manifest.json does not match"),
    Row("format-expert-file-unlisted", lambda c: load(c, manifest(lambda m: m["files"].pop(first_file("experts/")(m)))),
        FormatError, "experts/bf16/layer000.bin"),
    Row("format-expert-file-truncated", lambda c: load(c, lambda r: (r / "experts/bf16/layer001.bin").write_bytes(
        b"\x00" * 10)), FormatError, "layer001.bin.*truncated"),
    Row("format-expert-file-corrupt-verify", lambda c: load(c, lambda r: (r / "experts/bf16/layer000.bin").write_bytes(
        bytes(reversed((r / "experts/bf16/layer000.bin").read_bytes()))), verify=True), FormatError,
        "layer000.bin does not match"),
    Row("format-partial-marker", lambda c: load(c, raw(PARTIAL_MARKER, "{}")), FormatError, "did not finish"),
    Row("format-partial-directory",
        lambda c: jmoe.load(shutil.copytree(c.converted(), c.keep(".m.abc.partial"))), FormatError,
        "temporary directory"),
    Row("format-tokenizer-symlink-out", lambda c: load(c, lambda r: (r / "tokenizer").mkdir(),
                                                       symlink("tokenizer/tokenizer.json", lambda r: c.keep("s.json")),
                                                       manifest(set_in("tokenizer", "tokenizer"))), FormatError,
        "tokenizer.json leads out"),
    # ---- load options
    Row("load-path-none", lambda c: jmoe.load(None), InputError, "path"),
    Row("load-path-int", lambda c: jmoe.load(123), InputError, "path"),
    Row("load-budget-negative", lambda c: jmoe.load(c.tiny, device_budget=-5), InputError, "device_budget"),
    Row("load-budget-garbage", lambda c: jmoe.load(c.tiny, device_budget="12 parsecs"), InputError, "device_budget"),
    Row("load-budget-bool", lambda c: jmoe.load(c.tiny, device_budget=True), InputError, "device_budget"),
    Row("load-budget-nan", lambda c: jmoe.load(c.tiny, device_budget=float("nan")), InputError, "device_budget"),
    Row("load-budget-too-small", lambda c: jmoe.load(c.tiny, device_budget="1MiB"), BudgetError, "before any expert"),
    Row("load-max-batch-negative", lambda c: jmoe.load(c.tiny, max_batch=-1), InputError, "max_batch"),
    Row("load-max-batch-zero", lambda c: jmoe.load(c.tiny, max_batch=0), InputError, "max_batch"),
    Row("load-max-batch-float", lambda c: jmoe.load(c.tiny, max_batch=1.5), InputError, "max_batch"),
    Row("load-max-seq-len-negative", lambda c: jmoe.load(c.tiny, max_seq_len=-64), InputError, "max_seq_len"),
    Row("load-max-seq-len-string", lambda c: jmoe.load(c.tiny, max_seq_len="4096"), InputError, "max_seq_len"),
    Row("load-policy-unknown", lambda c: jmoe.load(c.tiny, policy="fastest"), InputError, "policy"),
    Row("load-policy-int", lambda c: jmoe.load(c.tiny, policy=3), InputError, "policy"),
    Row("load-tier-unknown", lambda c: jmoe.load(c.tiny, tier="int5"), InputError, "tier"),
    Row("load-tier-not-converted", lambda c: jmoe.load(c.tiny, tier="int4"), FormatError, "without tier 'int4'"),
    Row("load-dtype-int", lambda c: jmoe.load(c.tiny, compute_dtype="int8"), InputError, "compute_dtype"),
    Row("load-dtype-garbage", lambda c: jmoe.load(c.tiny, compute_dtype="fp-whatever"), InputError, "compute_dtype"),
    Row("load-execution-unknown", lambda c: jmoe.load(c.tiny, execution="gpu"), InputError, "execution"),
    Row("load-kernel-backend-unknown", lambda c: jmoe.load(c.tiny, kernel_backend="cuda"), InputError,
        "kernel_backend"),
    Row("load-cpu-dot-unknown", lambda c: jmoe.load(c.tiny, cpu_dot="int4"), InputError, "cpu_dot"),
    Row("load-misses-unknown", lambda c: jmoe.load(c.tiny, misses="skip"), InputError, "misses"),
    Row("load-miss-slots-zero", lambda c: jmoe.load(c.tiny, miss_slots=0), InputError, "miss_slots"),
    Row("load-miss-slots-past-int52", lambda c: jmoe.load(c.tiny, miss_slots=2**31), InputError, "miss_slots"),
    Row("load-miss-slots-string", lambda c: jmoe.load(c.tiny, miss_slots="4"), InputError, "miss_slots"),
    Row("load-critical-tokens-negative", lambda c: jmoe.load(c.tiny, cpu_critical_tokens=-1), InputError,
        "cpu_critical_tokens"),
    Row("load-verify-string", lambda c: jmoe.load(c.tiny, verify="yes"), InputError, "verify"),
    Row("load-progress-int", lambda c: jmoe.load(c.tiny, progress=2), InputError, "progress"),
    Row("load-trace-string", lambda c: jmoe.load(c.tiny, trace="yes"), InputError, "trace"),
    Row("load-draft-unknown-tier", lambda c: jmoe.load(c.tiny, draft="int5"), InputError, "draft must be"),
    Row("load-draft-not-converted", lambda c: jmoe.load(c.tiny, draft="int4"), InputError, "was not converted"),
    Row("plan-draft-not-converted", lambda c: jmoe.memory_plan(c.tiny, draft="int4"), InputError, "was not converted"),
    Row("plan-unknown-policy", lambda c: jmoe.memory_plan(c.tiny, policy="fastest"), InputError, "policy"),
    Row("plan-misses-unknown", lambda c: jmoe.memory_plan(c.tiny, misses="skip"), InputError, "misses"),
    Row("plan-mesh-garbage", lambda c: jmoe.memory_plan(c.tiny, mesh="ep=x"), InputError, "mesh"),
    Row("load-kv-dtype-unknown", lambda c: jmoe.load(c.tiny, kv_dtype="int4"), InputError, "kv_dtype"),
    Row("plan-kv-dtype-unknown", lambda c: jmoe.memory_plan(c.tiny, kv_dtype="fp4"), InputError, "kv_dtype"),
    Row("load-prefix-cache-garbage", lambda c: jmoe.load(c.tiny, prefix_cache="lots"), InputError, "prefix_cache"),
    Row("load-prefix-cache-negative", lambda c: jmoe.load(c.tiny, prefix_cache=-5), InputError, "prefix_cache"),
    Row("plan-prefix-cache-garbage", lambda c: jmoe.memory_plan(c.tiny, prefix_cache=[1]), InputError,
        "prefix_cache"),
    Row("load-kv-cache-garbage", lambda c: jmoe.load(c.tiny, kv_cache="lots"), InputError, "kv_cache"),
    Row("load-kv-cache-negative", lambda c: jmoe.load(c.tiny, kv_cache=-5), InputError, "kv_cache"),
    Row("load-kv-cache-under-one-context", lambda c: jmoe.load(c.tiny, kv_cache="1KiB", max_seq_len=256), InputError,
        "fewer than one 256-token context"),
    Row("plan-kv-cache-garbage", lambda c: jmoe.memory_plan(c.tiny, kv_cache=[1]), InputError, "kv_cache"),
    Row("engine-kv-pages-zero", lambda c: BatchEngine(c.model, kv_pages=0), InputError, "kv_pages"),
    Row("engine-kv-pages-under-one-context", lambda c: BatchEngine(c.model, context=256, kv_pages=2), InputError,
        "do not hold one 256-token context"),
    Row("load-dymoe-on-a-bf16-only-model", lambda c: jmoe.load(c.tiny, policy="dymoe"), FormatError,
        "without tier 'int4'"),
    Row("policy-dymoe-r-out-of-range", lambda c: DyMoE(r=1.5), InputError, "r must be"),
    Row("policy-dymoe-r-and-lam", lambda c: DyMoE(r=0.75, lam=0.5), InputError, "r or lam"),
    Row("policy-dymoe-lo-above-hi", lambda c: DyMoE(hi="int2", lo="int8"), InputError, "lower tier"),
    Row("policy-dymoe-unknown-tier", lambda c: DyMoE(hi="int5"), InputError, "hi must be"),
    Row("policy-dymoe-heavy-hitters-zero", lambda c: DyMoE(heavy_hitters=0), InputError, "heavy_hitters"),
    Row("policy-dynaexq-alpha", lambda c: DynaExq(alpha=1.5), InputError, "alpha"),
    Row("policy-dynaexq-margin-negative", lambda c: DynaExq(margin=-0.1), InputError, "margin"),
    Row("policy-dynaexq-hi-per-layer-float", lambda c: DynaExq(hi_per_layer=2.5), InputError, "hi_per_layer"),
    Row("policy-dynaexq-hotness", lambda c: DynaExq(hotness="heat"), InputError, "hotness"),
    Row("policy-dynaexq-shift-negative", lambda c: DynaExq(shift=-1.0), InputError, "shift"),
    Row("policy-dynaexq-fast-alpha", lambda c: DynaExq(fast_alpha=2.0), InputError, "fast_alpha"),
    Row("policy-dynaexq-allocation", lambda c: DynaExq(allocation="global"), InputError, "allocation"),
    Row("policy-dynaexq-keep-lo-string", lambda c: DynaExq(keep_lo="no"), InputError, "keep_lo"),
    Row("policy-placement-strategy", lambda c: StaticPlacement(np.zeros((4, 2, 2), int), strategy="best"),
        InputError, "strategy"),
    # ---- generate
    Row("gen-speculative-not-converted", lambda c: gen(c, speculative="int4"), InputError, "was not converted"),
    Row("gen-speculative-int", lambda c: gen(c, speculative=4), InputError, "speculative must be"),
    Row("gen-speculative-unknown-key", lambda c: gen(c, speculative={"draft": "bf16", "depth": 3}), InputError,
        "unknown keys"),
    Row("gen-speculative-k-zero", lambda c: gen(c, speculative={"draft": "bf16", "k": 0}), InputError,
        "speculative k"),
    Row("gen-speculative-k-float", lambda c: gen(c, speculative={"draft": "bf16", "k": 2.5}), InputError,
        "speculative k"),
    Row("gen-speculative-max-cycle-negative", lambda c: gen(c, speculative={"draft": "bf16", "max_cycle_s": -1}),
        InputError, "max_cycle_s"),
    Row("gen-speculative-draft-not-reserved", lambda c: jmoe.generate(jmoe.load(c.tiny, device_budget="4GiB"), "x",
                                                                      speculative="bf16"), InputError,
        "load the model with draft"),
    Row("gen-temperature-nan", lambda c: gen(c, temperature=float("nan")), InputError, "temperature"),
    Row("gen-temperature-negative", lambda c: gen(c, temperature=-1.0), InputError, "temperature"),
    Row("gen-temperature-string", lambda c: gen(c, temperature="hot"), InputError, "temperature"),
    Row("gen-temperature-inf", lambda c: gen(c, temperature=float("inf")), InputError, "temperature"),
    Row("gen-penalty-nan", lambda c: gen(c, repetition_penalty=float("nan")), InputError, "repetition_penalty"),
    Row("gen-penalty-zero", lambda c: gen(c, repetition_penalty=0), InputError, "repetition_penalty"),
    Row("gen-top-p-zero", lambda c: gen(c, top_p=0.0), InputError, "top_p"),
    Row("gen-top-p-above-one", lambda c: gen(c, top_p=1.5), InputError, "top_p"),
    Row("gen-top-p-nan", lambda c: gen(c, top_p=float("nan")), InputError, "top_p"),
    Row("gen-top-k-float", lambda c: gen(c, top_k=2.5), InputError, "top_k"),
    Row("gen-top-k-negative", lambda c: gen(c, top_k=-1), InputError, "top_k"),
    Row("gen-max-new-tokens-float", lambda c: gen(c, max_new_tokens=1.5), InputError, "max_new_tokens"),
    Row("gen-max-new-tokens-zero", lambda c: gen(c, max_new_tokens=0), InputError, "max_new_tokens"),
    Row("gen-max-new-tokens-bool", lambda c: gen(c, max_new_tokens=True), InputError, "max_new_tokens"),
    Row("gen-seed-beyond-64-bits", lambda c: gen(c, seed=2**64), InputError, "seed"),
    Row("gen-min-p-above-one", lambda c: gen(c, min_p=1.5), InputError, "min_p"),
    Row("gen-min-p-nan", lambda c: gen(c, min_p=float("nan")), InputError, "min_p"),
    Row("gen-logit-bias-not-a-map", lambda c: gen(c, logit_bias=[1, 2]), InputError, "logit_bias"),
    Row("gen-logit-bias-past-100", lambda c: gen(c, logit_bias={5: 101}), InputError, "logit_bias"),
    Row("gen-logit-bias-beyond-vocabulary", lambda c: gen(c, logit_bias={10**6: 1}), InputError, "vocabulary"),
    Row("gen-logit-bias-beyond-int52", lambda c: gen(c, logit_bias={2**31: 1}), InputError, "logit_bias token"),
    Row("gen-presence-penalty-above-two", lambda c: gen(c, presence_penalty=2.5), InputError, "presence_penalty"),
    Row("gen-frequency-penalty-nan", lambda c: gen(c, frequency_penalty=float("nan")), InputError,
        "frequency_penalty"),
    Row("gen-frequency-penalty-string", lambda c: gen(c, frequency_penalty="x"), InputError, "frequency_penalty"),
    Row("gen-seed-negative", lambda c: gen(c, seed=-1), InputError, "seed"),
    Row("gen-seed-float", lambda c: gen(c, seed=1.0), InputError, "seed"),
    Row("gen-stop-int-list", lambda c: gen(c, stop=[1]), InputError, "stop"),
    Row("gen-stop-int", lambda c: gen(c, stop=5), InputError, "stop"),
    Row("gen-stream-string", lambda c: gen(c, stream="yes"), InputError, "stream"),
    Row("gen-stream-bad-input-fails-at-once", lambda c: gen(c, stream=True, temperature=float("nan")), InputError,
        "temperature"),
    Row("gen-id-beyond-vocab", lambda c: gen(c, [5, 4096]), InputError, r"prompt\[1\] = 4096"),
    Row("gen-id-negative", lambda c: gen(c, [-1, 5]), InputError, r"prompt\[0\] = -1"),
    Row("gen-id-float", lambda c: gen(c, [1.5, 2]), InputError, r"prompt\[0\]"),
    Row("gen-id-bool", lambda c: gen(c, [True, 2]), InputError, r"prompt\[0\]"),
    Row("gen-ids-float-array", lambda c: gen(c, np.array([1.0, 2.0])), InputError, "prompt"),
    Row("gen-chat-without-role", lambda c: gen(c, [{"content": "hi"}]), InputError, "'role'"),
    Row("gen-chat-without-content", lambda c: gen(c, [{"role": "user"}]), InputError, "'content'"),
    Row("gen-chat-content-not-text", lambda c: gen(c, [{"role": "user", "content": 5}]), InputError, "'content'"),
    Row("gen-prompt-none", lambda c: gen(c, None), InputError, "prompt"),
    Row("gen-prompt-dict", lambda c: gen(c, {"role": "user", "content": "hi"}), InputError, "prompt"),
    Row("gen-prompt-empty-string", lambda c: gen(c, ""), InputError, "empty"),
    Row("gen-prompt-lone-surrogate", lambda c: gen(c, "a\ud800b"), InputError, "lone surrogate"),
    Row("gen-chat-lone-surrogate", lambda c: gen(c, [{"role": "user", "content": "\udfff"}]), InputError,
        "lone surrogate"),
    Row("gen-prompt-empty-list", lambda c: gen(c, []), InputError, "empty"),
    Row("gen-batch-mixed", lambda c: gen(c, ["text", [1, 2]]), InputError, "mix"),
    Row("gen-batch-bad-row", lambda c: gen(c, [[1, 2], [3, 9999]]), InputError, r"prompt\[1\]\[1\] = 9999"),
    Row("gen-ids-with-stop", lambda c: gen(c, [1, 2], stop="x"), InputError, "stop strings need text"),
    Row("gen-prompt-too-long", lambda c: gen(c, [1] * 5000), InputError, "context"),
    Row("gen-not-a-model", lambda c: jmoe.generate("model", "x"), InputError, "model"),
    # ---- perplexity and forward
    Row("ppl-window-one", lambda c: jmoe.perplexity(c.model, [1, 2, 3], window=1), InputError, "window"),
    Row("ppl-window-float", lambda c: jmoe.perplexity(c.model, [1, 2, 3], window=1.5), InputError, "window"),
    Row("ppl-window-beyond-context", lambda c: jmoe.perplexity(c.model, [1, 2, 3], window=10**6), InputError,
        "window"),
    Row("ppl-one-token", lambda c: jmoe.perplexity(c.model, [1]), InputError, "at least 2"),
    Row("ppl-id-beyond-vocab", lambda c: jmoe.perplexity(c.model, [1, 99999]), InputError, r"token_ids\[1\]"),
    Row("ppl-float-ids", lambda c: jmoe.perplexity(c.model, np.array([1.0, 2.0])), InputError, "token_ids"),
    Row("ppl-not-a-model", lambda c: jmoe.perplexity(None, [1, 2]), InputError, "model"),
    Row("ppl-mode-unknown", lambda c: jmoe.perplexity(c.model, [1, 2, 3], mode="beam"), InputError, "mode"),
    Row("forward-empty", lambda c: jmoe.forward(c.model, []), InputError, "at least 1"),
    Row("forward-negative-id", lambda c: jmoe.forward(c.model, [-3]), InputError, r"token_ids\[0\]"),
    # ---- the command line
    Row("cli-max-new-tokens-float", lambda c: ["generate", str(c.tiny), "x", "--max-new-tokens", "1.5"], CLI,
        "max-new-tokens"),
    Row("cli-temperature-nan", lambda c: ["generate", str(c.tiny), "x", "--temperature", "nan"], CLI, "temperature"),
    Row("cli-top-p-two", lambda c: ["generate", str(c.tiny), "x", "--top-p", "2"], CLI, "top_p"),
    Row("cli-seed-negative", lambda c: ["generate", str(c.tiny), "x", "--seed", "-1"], CLI, "seed"),
    Row("cli-budget-garbage", lambda c: ["generate", str(c.tiny), "x", "--device-budget", "lots"], CLI,
        "device_budget"),
    Row("cli-max-seq-len-negative", lambda c: ["generate", str(c.tiny), "x", "--max-seq-len", "-64"], CLI,
        "max_seq_len"),
    Row("cli-policy-unknown", lambda c: ["generate", str(c.tiny), "x", "--policy", "fastest"], CLI, "policy"),
    Row("cli-model-missing", lambda c: ["generate", str(c.tmp / "nowhere"), "x"], CLI, "nowhere"),
    Row("cli-convert-unknown-tier", lambda c: ["convert", str(c.hf()), "-o", str(c.out), "--tiers", "int5"], CLI,
        "int5"),
    Row("cli-convert-group-size", lambda c: ["convert", str(c.hf()), "-o", str(c.out), "--tiers", "int4",
                                             "--group-size", "48"], CLI, "group_size"),
    Row("cli-convert-head-group-size", lambda c: ["convert", str(c.hf()), "-o", str(c.out), "--dense-tier", "int4",
                                                  "--head-group-size", "48"], CLI, "head_group_size"),
    Row("cli-convert-scale-bits", lambda c: ["convert", str(c.hf()), "-o", str(c.out), "--tiers", "int4",
                                             "--scale-bits", "4"], CLI, "scale_bits"),
    Row("cli-convert-source-missing", lambda c: ["convert", str(c.tmp / "nowhere"), "-o", str(c.out)], CLI,
        "nowhere"),
    Row("cli-convert-output-exists", lambda c: ["convert", str(c.hf()), "-o", str(c.existing_out())], CLI,
        "already exists"),
    Row("cli-convert-nan-tensor", lambda c: ["convert", str(c.hf(poison(EXPERT, float("nan")))), "-o", str(c.out),
                                             "--no-progress"], CLI, EXPERT),
    Row("cli-convert-calib-sequences", lambda c: ["convert", str(c.hf()), "-o", str(c.out), "--calib-sequences", "x"],
        CLI, "calib-sequences"),
    Row("cli-convert-deep-config", lambda c: ["convert", str(c.hf(raw("config.json", deep()))), "-o", str(c.out)],
        CLI, "nested too deeply"),
    Row("cli-info-missing", lambda c: ["info", str(c.tmp / "nowhere")], CLI, "nowhere"),
    Row("cli-unknown-command", lambda c: ["fly"], CLI, "invalid choice"),
    Row("cli-serve-max-batch-zero", lambda c: ["serve", str(c.tiny), "--max-batch", "0"], CLI, "max_batch"),
    Row("cli-serve-prefix-cache-garbage", lambda c: ["serve", str(c.tiny), "--prefix-cache", "lots"], CLI,
        "prefix_cache"),
    Row("cli-serve-kv-cache-garbage", lambda c: ["serve", str(c.tiny), "--kv-cache", "lots"], CLI, "kv_cache"),
    Row("cli-serve-kv-dtype-unknown", lambda c: ["serve", str(c.tiny), "--kv-dtype", "int4"], CLI, "kv-dtype"),
    Row("cli-generate-threads-zero", lambda c: ["generate", str(c.tiny), "hi", "--threads", "0"], CLI, "threads"),
    Row("cli-serve-port-too-big", lambda c: ["serve", str(c.tiny), "--port", "70000"], CLI, "port"),
    Row("cli-serve-reader-timeout-zero", lambda c: ["serve", str(c.tiny), "--reader-timeout", "0"], CLI,
        "reader_timeout"),
    Row("cli-serve-request-timeout-negative", lambda c: ["serve", str(c.tiny), "--request-timeout", "-5"], CLI,
        "request_timeout"),
    Row("cli-chat-max-tokens-zero", lambda c: ["chat", str(c.tiny), "--max-tokens", "0"], CLI, "max_tokens"),
    Row("cli-chat-temperature-negative", lambda c: ["chat", str(c.tiny), "--temperature", "-1"], CLI, "temperature"),
    Row("cli-bench-repetitions-zero", lambda c: ["bench", str(c.tiny), "-r", "0"], CLI, "repetitions"),
    Row("cli-bench-batches-empty", lambda c: ["bench", str(c.tiny), "-b", ","], CLI, "--batches"),
    Row("cli-r-without-dymoe", lambda c: ["generate", str(c.tiny), "x", "--r", "0.7"], CLI, "--r only apply"),
    Row("cli-dymoe-r-out-of-range", lambda c: ["generate", str(c.tiny), "x", "--policy", "dymoe", "--r", "3"], CLI,
        "r must be"),
    Row("cli-hi-per-layer-on-dymoe", lambda c: ["generate", str(c.tiny), "x", "--policy", "dymoe",
                                                "--hi-per-layer", "4"], CLI, "hi-per-layer does not apply"),
    Row("cli-hi-sets-on-dymoe", lambda c: ["generate", str(c.tiny), "x", "--policy", "dymoe",
                                           "--hi-sets", "layer"], CLI, "hi-sets does not apply"),
    Row("cli-hi-sets-without-dynaexq", lambda c: ["generate", str(c.tiny), "x", "--hi-sets", "model"], CLI,
        "--hi-sets only apply"),
    Row("cli-keep-lo-on-dymoe", lambda c: ["generate", str(c.tiny), "x", "--policy", "dymoe", "--keep-lo"], CLI,
        "keep-lo does not apply"),
    Row("cli-hi-and-tier-differ", lambda c: ["generate", str(c.tiny), "x", "--policy", "dymoe", "--tier", "int8",
                                             "--hi", "int4"], CLI, "differs"),
    Row("cli-draft-k-without-speculative", lambda c: ["generate", str(c.tiny), "x", "--draft-k", "3"], CLI,
        "--draft-k needs"),
    Row("cli-speculative-unknown-tier", lambda c: ["generate", str(c.tiny), "x", "--speculative", "int5"], CLI,
        "speculative draft"),
    Row("cli-draft-k-zero", lambda c: ["generate", str(c.tiny), "x", "--speculative", "bf16", "--draft-k", "0"], CLI,
        "speculative k"),
    Row("cli-execution-unknown", lambda c: ["generate", str(c.tiny), "x", "--execution", "fast"], CLI, "execution"),
    # past the range the step or the server can hold
    Row("cli-top-k-beyond-int52", lambda c: ["generate", str(c.tiny), "x", "--top-k", "3000000000"], CLI, "top_k"),
    Row("cli-temperature-beyond-float32", lambda c: ["generate", str(c.tiny), "x", "--temperature", "1e39"], CLI,
        "temperature"),
    Row("cli-penalty-below-float32", lambda c: ["generate", str(c.tiny), "x", "--repetition-penalty", "1e-300"], CLI,
        "repetition_penalty"),
    Row("cli-max-seq-len-huge", lambda c: ["generate", str(c.tiny), "x", "--max-seq-len", str(10**30)], CLI,
        "max_seq_len"),
    Row("cli-num-processes-huge", lambda c: ["generate", str(c.tiny), "x", "--coordinator", "127.0.0.1:1",
                                             "--num-processes", str(10**30), "--process-id", "0"], CLI,
        "num_processes"),
    Row("cli-chat-top-k-beyond-int52", lambda c: ["chat", str(c.tiny), "--top-k", "3000000000"], CLI, "top_k"),
    Row("cli-min-p-negative", lambda c: ["generate", str(c.tiny), "x", "--min-p", "-0.5"], CLI, "min_p"),
    Row("cli-presence-penalty-above-two", lambda c: ["generate", str(c.tiny), "x", "--presence-penalty", "2.5"], CLI,
        "presence_penalty"),
    Row("cli-frequency-penalty-nan", lambda c: ["generate", str(c.tiny), "x", "--frequency-penalty", "nan"], CLI,
        "frequency_penalty"),
    Row("cli-frequency-penalty-huge", lambda c: ["generate", str(c.tiny), "x", "--frequency-penalty", "1e999"], CLI,
        "frequency_penalty"),
    Row("cli-chat-min-p-above-one", lambda c: ["chat", str(c.tiny), "--min-p", "2"], CLI, "min_p"),
    Row("cli-chat-presence-penalty-above-two", lambda c: ["chat", str(c.tiny), "--presence-penalty", "2.5"], CLI,
        "presence_penalty"),
    Row("cli-chat-repetition-penalty-zero", lambda c: ["chat", str(c.tiny), "--repetition-penalty", "0"], CLI,
        "repetition_penalty"),
    Row("cli-serve-max-batch-huge", lambda c: ["serve", str(c.tiny), "--max-batch", str(10**30)], CLI, "max_batch"),
    Row("cli-serve-max-waiting-negative", lambda c: ["serve", str(c.tiny), "--max-waiting", "-1"], CLI,
        "max_waiting"),
    Row("cli-serve-max-tokens-zero", lambda c: ["serve", str(c.tiny), "--max-tokens", "0"], CLI, "max_tokens"),
    Row("cli-serve-idle-timeout-huge", lambda c: ["serve", str(c.tiny), "--idle-timeout", "1e300"], CLI,
        "idle_timeout"),
    Row("cli-serve-max-connections-zero", lambda c: ["serve", str(c.tiny), "--max-connections", "0"], CLI,
        "max_connections"),
    Row("cli-serve-drain-timeout-negative", lambda c: ["serve", str(c.tiny), "--drain-timeout", "-1"], CLI,
        "drain_timeout"),
    Row("cli-bench-prompt-beyond-context", lambda c: ["bench", str(c.tiny), "-p", str(10**30)], CLI, "prompt length"),
    Row("cli-bench-batch-huge", lambda c: ["bench", str(c.tiny), "-b", str(10**30)], CLI, "batch"),
    Row("cli-bench-repetitions-huge", lambda c: ["bench", str(c.tiny), "-r", str(10**30)], CLI, "repetitions"),
]


def test_enough_rows_with_unique_ids():
    assert len(ROWS) >= 80 and len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_bad_input_is_refused_by_name(row, tmp_path, pristine_hf, pristine_jmoe, tiny_model, tiny_converted,
                                      tiny_hf_dir, capsys):
    c = Ctx(tmp_path, pristine_hf, pristine_jmoe, tiny_model, tiny_converted, tiny_hf_dir)
    before = {p.name for p in tmp_path.iterdir()}
    if row.error == CLI:
        argv = row.call(c)
        before = {p.name for p in tmp_path.iterdir()}
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jmoe: error:"), err
        assert re.search(row.match, err[0]), err[0]
    else:
        with pytest.raises(row.error, match=row.match):
            result = row.call(c)
            if hasattr(result, "__next__"):  # a stream must fail when called, not when read
                pytest.fail("the call returned a stream instead of raising")
    leftovers = {p.name for p in tmp_path.iterdir()} - before - c.created
    assert not leftovers, f"left behind: {leftovers}"
    assert not [n for n in c.created if n.startswith(".out.")]
