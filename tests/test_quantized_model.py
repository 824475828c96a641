"""Quantized tiers end to end: format arithmetic, per-tier accuracy, GPTQ/HAQ/W8A8 conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from jmoe.errors import InputError
from jmoe.manifest import read_manifest
from jmoe.quant import dequantize_expert
from jmoe.runtime.store import ExpertStore
from tests.conftest import CALIB_FILES as CALIB
from tests.conftest import dev_text


def expected_record_bytes(D: int, F: int, bits: int, group: int, symmetric: bool, smooth: bool = False,
                          scale_bits: int = 16) -> int:
    """Bytes of one expert version, from the format's definition (64-byte aligned arrays)."""
    align = lambda n: -(-n // 64) * 64  # noqa: E731
    per_group = scale_bits // 8  # bytes of a scale (float16, or an 8-bit code)

    def matrix(K, N, with_smooth):
        Kp = -(-K // group) * group
        size = align(Kp * N * bits // 8) + align(Kp // group * N * per_group)  # codes + scales
        size += 0 if symmetric else align(Kp // group * N * per_group)  # offsets
        size += align(2 * N * 4) if scale_bits == 8 else 0  # float32 scale and offset bases per column
        return size + (align(K * 2) if with_smooth else 0)  # f16 input scale

    return matrix(D, 2 * F, smooth) + matrix(F, D, False)


@pytest.fixture(scope="module")
def rtn_model_dir(tmp_path_factory, tiny_hf_dir):
    return convert_checkpoint(tiny_hf_dir, tmp_path_factory.mktemp("rtn") / "m", tiers="bf16,int8,int4,int3,int2",
                              progress=False)


def test_bytes_per_expert_follow_the_format(rtn_model_dir):
    manifest = read_manifest(rtn_model_dir)
    D, F = manifest["config"]["hidden_size"], manifest["config"]["moe_intermediate_size"]
    tiers = manifest["tiers"]
    assert tiers["bf16"]["record_nbytes"] == 2 * (D * 2 * F + F * D)
    assert tiers["int8"]["record_nbytes"] == expected_record_bytes(D, F, 8, 128, True)
    assert tiers["int4"]["record_nbytes"] == expected_record_bytes(D, F, 4, 64, False)
    assert tiers["int3"]["record_nbytes"] == expected_record_bytes(D, F, 3, 32, False, scale_bits=8)
    assert tiers["int2"]["record_nbytes"] == expected_record_bytes(D, F, 2, 32, False, scale_bits=8)
    for tier, info in tiers.items():
        files = [f for f in manifest["files"] if f.startswith(f"experts/{tier}/")]
        assert sum(manifest["files"][f]["bytes"] for f in files) == 8 * 32 * info["record_nbytes"]


def test_each_tier_reconstructs_the_expert(rtn_model_dir):
    manifest = read_manifest(rtn_model_dir)
    store = ExpertStore(rtn_model_dir, manifest, jmoe.ModelConfig.from_dict(manifest["config"]))
    reference = dequantize_expert(store.record("bf16", 4, 9))
    errors = {}
    for tier in ("int8", "int4", "int3", "int2"):
        approx = dequantize_expert(store.record(tier, 4, 9))
        errors[tier] = max(
            float(np.linalg.norm(a - r) / np.linalg.norm(r)) for a, r in zip(approx[:2], reference[:2])
        )
    assert errors["int8"] < 0.01 < errors["int4"] < errors["int3"] < errors["int2"] < 0.6
    assert errors["int4"] < 0.15 and errors["int3"] < 0.3


def test_int4_with_8_bit_scales_is_a_conversion_option(tiny_hf_dir, rtn_model_dir, tmp_path):
    """scale_bits=8 (--scale-bits 8): the int4 tier's scales and offsets as 8-bit codes on per-column
    bases, 4.25 bits per weight at a real model's widths where float16 ones take 4.5, and an expert
    about as close to bf16 as with float16 scales; a symmetric grid, or other widths, are refused."""
    out = convert_checkpoint(tiny_hf_dir, tmp_path / "m", tiers="int4", scale_bits=8, progress=False)
    manifest = read_manifest(out)
    D, F = manifest["config"]["hidden_size"], manifest["config"]["moe_intermediate_size"]
    tier = manifest["tiers"]["int4"]
    assert tier["format"]["scale_bits"] == 8 and tier["format"]["group_size"] == 64
    assert tier["record_nbytes"] == expected_record_bytes(D, F, 4, 64, False, scale_bits=8)
    cfg = jmoe.ModelConfig.from_dict(manifest["config"])
    plain_store = ExpertStore(rtn_model_dir, read_manifest(rtn_model_dir), cfg)
    reference = dequantize_expert(plain_store.record("bf16", 4, 9))
    error = {name: max(float(np.linalg.norm(a - r) / np.linalg.norm(r)) for a, r in zip(q[:2], reference[:2]))
             for name, q in (("coded", dequantize_expert(ExpertStore(out, manifest, cfg).record("int4", 4, 9))),
                             ("float16", dequantize_expert(plain_store.record("int4", 4, 9))))}
    assert abs(error["coded"] - error["float16"]) < 0.1 * error["float16"], error
    with pytest.raises(InputError, match="asymmetric"):
        convert_checkpoint(tiny_hf_dir, tmp_path / "s", tiers="int4", scale_bits=8, symmetric=True, progress=False)
    with pytest.raises(InputError, match="scale_bits"):
        convert_checkpoint(tiny_hf_dir, tmp_path / "w", tiers="int4", scale_bits=12, progress=False)


def test_logit_error_grows_as_bits_shrink(rtn_model_dir, tiny_tokenizer):
    ids = tiny_tokenizer.encode("def parse(text):\n    tokens = text.split()\n    return tokens\n")
    logits = {t: np.asarray(jmoe.forward(jmoe.load(rtn_model_dir, tier=t, compute_dtype="float32"), ids))
              for t in ("bf16", "int8", "int4", "int3", "int2")}
    err = {t: float(np.abs(logits[t] - logits["bf16"]).mean()) for t in ("int8", "int4", "int3", "int2")}
    assert err["int8"] < err["int4"] < err["int3"] < err["int2"]
    assert err["int8"] < 0.02 * float(np.abs(logits["bf16"]).mean())


def slice_ppl(model, tokenizer, tokens: int = 1024, domains=("prose", "code", "math")) -> float:
    """Geometric mean of the perplexity on the first `tokens` tokens of each domain's dev split."""
    logs = [math.log(jmoe.perplexity(model, tokenizer.encode(dev_text(d)[:30000])[:tokens], window=256))
            for d in domains]
    return math.exp(sum(logs) / len(logs))


@pytest.fixture(scope="module")
def calibrated_dirs(tmp_path_factory, tiny_hf_dir):
    root = tmp_path_factory.mktemp("calibrated")
    kw = dict(tiers="int2", calib=CALIB, calib_sequences=16, calib_seq_len=256, progress=False)
    return {m: convert_checkpoint(tiny_hf_dir, root / m, method=m, **kw) for m in ("gptq", "haq")}


def test_gptq_and_haq_beat_rtn_at_int2(rtn_model_dir, calibrated_dirs, tiny_tokenizer):
    ppl = {"rtn": slice_ppl(jmoe.load(rtn_model_dir, tier="int2", compute_dtype="float32"), tiny_tokenizer)}
    for method, path in calibrated_dirs.items():
        ppl[method] = slice_ppl(jmoe.load(path, tier="int2", compute_dtype="float32"), tiny_tokenizer)
    assert ppl["gptq"] < ppl["rtn"] and ppl["haq"] < ppl["rtn"], ppl
    assert all(math.isfinite(v) for v in ppl.values())


def test_haq_records_its_smoothing(calibrated_dirs):
    manifest = read_manifest(calibrated_dirs["haq"])
    assert manifest["quantization"]["method"] == "haq"
    alphas = manifest["quantization"]["haq_alpha"]
    assert len(alphas) == 8 and all(0.0 <= a <= 1.0 for layer in alphas.values() for a in layer["int2"])
    names = [leaf["name"] for leaf in manifest["tiers"]["int2"]["leaves"]]
    assert "gate_up.act_scale" in names and "down.act_scale" not in names


def cpu_run_matches_device(path, tier: str) -> None:
    """An offloaded model that runs every cold expert on the CPU gives the resident model's tokens
    (the CPU's copy of a version must multiply like the device's: smoothing, W8A8 included)."""
    ids = [5, 17, 99, 3, 42, 250, 7, 61]
    resident = jmoe.load(path, tier=tier, compute_dtype="float32")
    fixed = sum(v for k, v in resident.memory.items() if k != "experts")
    model = jmoe.load(path, tier=tier, compute_dtype="float32", device_budget=int(fixed + 0.3 * resident.memory[
        "experts"]), policy="lru+cpu", execution="layerwise", cpu_critical_tokens=64)
    assert jmoe.generate(model, ids, max_new_tokens=8) == jmoe.generate(resident, ids, max_new_tokens=8)
    assert jmoe.stats(model)["cpu_expert_runs"] > 0


def test_cpu_execution_of_smoothed_experts(calibrated_dirs):
    cpu_run_matches_device(calibrated_dirs["haq"], "int2")


def test_w8a8_tier_tracks_bf16(tiny_hf_dir, tmp_path, tiny_tokenizer):
    out = convert_checkpoint(tiny_hf_dir, tmp_path / "w8a8", tiers="bf16,int8", w8a8=True, progress=False)
    fmt = read_manifest(out)["tiers"]["int8"]["format"]
    assert fmt["act_bits"] == 8 and fmt["symmetric"]
    ppl = {t: slice_ppl(jmoe.load(out, tier=t, compute_dtype="float32"), tiny_tokenizer, 512) for t in ("bf16", "int8")}
    assert ppl["int8"] == pytest.approx(ppl["bf16"], rel=0.02)
    cpu_run_matches_device(out, "int8")


def test_group_size_that_does_not_divide_the_width(tiny_hf_dir, tmp_path):
    # F = 96: groups of 64 cover it with padding; groups of 32 divide it.
    for group in (32, 64, 128):
        out = convert_checkpoint(tiny_hf_dir, tmp_path / f"g{group}", tiers="int4", group_size=group, progress=False)
        model = jmoe.load(out, compute_dtype="float32")
        assert jmoe.generate(model, "import os\n", max_new_tokens=8)


def test_quantization_options_are_checked(tiny_hf_dir, tmp_path):
    with pytest.raises(InputError, match="calibrates"):
        convert_checkpoint(tiny_hf_dir, tmp_path / "x", tiers="int4", method="gptq", progress=False)
    with pytest.raises(InputError, match="group_size"):
        convert_checkpoint(tiny_hf_dir, tmp_path / "x", tiers="int4", group_size=48, progress=False)
    with pytest.raises(InputError, match="unknown quantization method"):
        convert_checkpoint(tiny_hf_dir, tmp_path / "x", tiers="int4", method="awq", progress=False)
    with pytest.raises(InputError, match="calibration file"):
        convert_checkpoint(tiny_hf_dir, tmp_path / "x", tiers="int4", method="gptq", calib=[str(tmp_path / "none.txt")],
                           progress=False)
    assert not (tmp_path / "x").exists()
