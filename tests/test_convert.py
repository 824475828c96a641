"""Converted format and converter failure modes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors import safe_open

import jmoe
from convert import convert_checkpoint
from jmoe.errors import CheckpointError, ConfigError, FormatError, InputError
from jmoe.manifest import check_files, read_manifest
from jmoe.policies import DyMoE
from jmoe.runtime.store import ExpertStore
from tests.hf_models import make_checkpoint


def hf_tensor(path, name):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name).float().numpy()


def test_manifest_describes_the_model(tiny_converted):
    manifest = read_manifest(tiny_converted)
    assert manifest["family"] == "qwen3_moe"
    cfg = manifest["config"]
    D, F = cfg["hidden_size"], cfg["moe_intermediate_size"]
    # bf16 record: gate_up [D, 2F] and down [F, D], two bytes each (both already 64-byte aligned here)
    assert manifest["tiers"]["bf16"]["record_nbytes"] == 2 * (D * 2 * F) + 2 * (F * D)
    expert_files = [f for f in manifest["files"] if f.startswith("experts/bf16/")]
    assert len(expert_files) == cfg["num_layers"]
    assert all(manifest["files"][f]["bytes"] == 32 * manifest["tiers"]["bf16"]["record_nbytes"] for f in expert_files)
    assert "dense.embed_tokens.embedding" not in manifest["dense"]["tensors"]
    assert manifest["dense"]["tensors"]["embed_tokens.embedding"]["hf_name"] == "model.embed_tokens.weight"
    check_files(tiny_converted, manifest, verify_checksums=True)


def test_one_expert_record_holds_that_expert(tiny_converted, tiny_hf_dir):
    manifest = read_manifest(tiny_converted)
    store = ExpertStore(tiny_converted, manifest, jmoe.ModelConfig.from_dict(manifest["config"]))
    record = store.record("bf16", 5, 17)
    base = "model.layers.5.mlp.experts.17"
    gate, up, down = (hf_tensor(tiny_hf_dir, f"{base}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
    np.testing.assert_array_equal(np.asarray(record.gate_up, np.float32), np.concatenate([gate.T, up.T], axis=1))
    np.testing.assert_array_equal(np.asarray(record.down, np.float32), down.T)


def test_dense_weights_are_the_checkpoints(tiny_model, tiny_hf_dir):
    q = hf_tensor(tiny_hf_dir, "model.layers.2.self_attn.q_proj.weight")
    ours = np.asarray(tiny_model.dense["layers"][2]["self_attn"]["q_proj"]["kernel"][...], np.float32)
    np.testing.assert_array_equal(ours, q.T)


@pytest.fixture()
def small_hf(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint("qwen3_moe", src)
    return src


def no_partial_output(parent, name):
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]
    return not (parent / name).exists() and not leftovers


def test_existing_output_is_refused_unless_overwrite(small_hf, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(small_hf, out, progress=False)
    with pytest.raises(InputError, match="already exists"):
        convert_checkpoint(small_hf, out, progress=False)
    convert_checkpoint(small_hf, out, overwrite=True, progress=False)
    assert read_manifest(out)["family"] == "qwen3_moe"


def rewrite_safetensors(src, drop=None, replace=None):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        del tensors[drop]
    if replace:
        tensors.update(replace)
    save_file(tensors, str(src / "model.safetensors"))


def test_missing_tensor_is_named_and_nothing_is_written(small_hf, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite_safetensors(small_hf, drop=name)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        convert_checkpoint(small_hf, tmp_path / "out", progress=False)
    assert no_partial_output(tmp_path, "out")


def test_wrong_shape_is_named(small_hf, tmp_path):
    import torch

    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite_safetensors(small_hf, replace={name: torch.zeros(8, 64, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=rf"{name}.*\[8, 64\].*expected \[32, 64\]"):
        convert_checkpoint(small_hf, tmp_path / "out", progress=False)
    assert no_partial_output(tmp_path, "out")


def test_truncated_safetensors_fails_cleanly(small_hf, tmp_path):
    path = small_hf / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        convert_checkpoint(small_hf, tmp_path / "out", progress=False)
    assert no_partial_output(tmp_path, "out")


def test_missing_config(small_hf, tmp_path):
    (small_hf / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        convert_checkpoint(small_hf, tmp_path / "out", progress=False)


def test_unknown_model_type_lists_the_supported_ones(small_hf, tmp_path):
    cfg = json.loads((small_hf / "config.json").read_text())
    cfg["model_type"] = "llama"
    (small_hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported model_type 'llama'.*qwen3_moe"):
        convert_checkpoint(small_hf, tmp_path / "out", progress=False)


def test_malformed_config_json(small_hf, tmp_path):
    (small_hf / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        convert_checkpoint(small_hf, tmp_path / "out", progress=False)


def test_missing_source_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "out", progress=False)


def test_unknown_tier_is_refused(small_hf, tmp_path):
    with pytest.raises(InputError, match="unknown tier"):
        convert_checkpoint(small_hf, tmp_path / "out", tiers="bf16,int5", progress=False)


def test_load_rejects_damaged_models(tiny_converted, tmp_path):
    with pytest.raises(FormatError, match="not a directory"):
        jmoe.load(tmp_path / "missing")
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_converted, damaged)
    expert_file = damaged / "experts" / "bf16" / "layer003.bin"
    data = bytearray(expert_file.read_bytes())
    data[1000] ^= 0xFF
    expert_file.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="sha256"):
        jmoe.load(damaged, verify=True)
    expert_file.write_bytes(bytes(data[:-10]))
    with pytest.raises(FormatError, match="truncated"):
        jmoe.load(damaged)
    (damaged / "manifest.json").unlink()
    with pytest.raises(FormatError, match="no manifest.json"):
        jmoe.load(damaged)


def test_hub_id_that_cannot_be_fetched_fails_cleanly(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="not a local directory and could not be fetched from the hub: no network"):
        convert_checkpoint("some-org/some-moe", tmp_path / "out", progress=False)
    assert no_partial_output(tmp_path, "out")


def test_cpu_layout_stores_experts_in_tiles_that_compute_the_same(tmp_path, caplog):
    """--cpu-layout writes every expert tier in column tiles, bf16 too (the manifest says so, the
    records hold other bytes of the same size); the model computes the same logits from them, on
    both CPU dots, on the XLA path and offloaded, one tier or two a token; widths that are no whole
    number of tiles stay [K, N], with a warning."""
    small_hf = tmp_path / "hf"
    make_checkpoint("qwen3_moe", small_hf, overrides=dict(moe_intermediate_size=64))  # gate_up: two tiles
    plain = convert_checkpoint(small_hf, tmp_path / "plain", tiers="bf16,int4,int2", progress=False)
    tiled = convert_checkpoint(small_hf, tmp_path / "tiled", tiers="bf16,int4,int2", cpu_layout=True, progress=False)
    tiers = read_manifest(tiled)["tiers"]
    assert tiers["int4"]["format"]["tiled"] and tiers["int2"]["format"]["tiled"] and tiers["bf16"]["format"] is None
    assert tiers["bf16"]["tiled"] and "tiled" not in tiers["int4"]
    plain_tiers = read_manifest(plain)["tiers"]
    assert "tiled" not in plain_tiers["int4"]["format"] and "tiled" not in plain_tiers["bf16"]
    for tier in ("bf16", "int4", "int2"):
        a, b = ((p / "experts" / tier / "layer000.bin").read_bytes() for p in (plain, tiled))
        assert len(a) == len(b) and a != b
    ids = [5, 17, 99, 3, 42, 250, 7]
    for tier, cpu_dot, backend in (("int4", "float", None), ("int4", "int8", None), ("int2", "int8", None),
                                   ("bf16", "float", None), ("bf16", "float", "xla")):
        logits = [np.asarray(jmoe.forward(jmoe.load(p, tier=tier, cpu_dot=cpu_dot, compute_dtype="float32",
                                                    kernel_backend=backend), ids)) for p in (plain, tiled)]
        assert np.array_equal(*logits), (tier, cpu_dot, backend)
    two_tiers = [jmoe.load(p, policy=DyMoE(hi="bf16", lo="int4", r=0.5), compute_dtype="float32")
                 for p in (plain, tiled)]
    assert jmoe.generate(two_tiers[0], ids, max_new_tokens=8) == jmoe.generate(two_tiers[1], ids, max_new_tokens=8)
    for tier in ("int4", "bf16"):
        resident = jmoe.load(plain, tier=tier, compute_dtype="float32")
        fixed = sum(v for k, v in resident.memory.items() if k != "experts")
        offloaded = jmoe.load(tiled, tier=tier, compute_dtype="float32", policy="lru",
                              device_budget=int(fixed + 0.8 * resident.memory["experts"]))
        assert offloaded.residency.slots < offloaded.config.num_moe_layers * offloaded.config.num_experts
        assert jmoe.generate(offloaded, ids, max_new_tokens=8) == jmoe.generate(resident, ids, max_new_tokens=8)

    narrow = tmp_path / "narrow"
    make_checkpoint("qwen3_moe", narrow, overrides=dict(moe_intermediate_size=40))
    with caplog.at_level("WARNING", logger="jmoe.convert"):
        out = convert_checkpoint(narrow, tmp_path / "narrow-out", tiers="int4", cpu_layout=True, progress=False)
    assert "tiled" not in read_manifest(out)["tiers"]["int4"]["format"]
    assert "not multiples of 64" in caplog.text
    manifest = read_manifest(tiled)
    manifest["tiers"]["int4"]["tiled"] = True  # the flag belongs to the bf16 tier (a format says the rest's)
    with pytest.raises(FormatError, match="tiers.int4.tiled applies to a bf16 tier"):
        ExpertStore(tiled, manifest, jmoe.load(tiled, tier="int4").config)


@pytest.mark.parametrize("head_tier", ["int4", "int6"])
def test_cpu_layout_stores_integer_dense_weights_and_head_in_tiles_that_compute_the_same(tmp_path, head_tier):
    """--cpu-layout also tiles integer dense weights, LM head and embedding table (the lookup reads
    each token's column from its tile, the tied head multiplies the tiles; the 32-column k and v
    projections stay [K, N]): logits and greedy tokens are those of the [K, N] conversion under the
    int8 dot. (An untied head is a Linear like the projections; the float dot and the int8 tier on
    tiles are the kernel tests'.)"""
    hf = tmp_path / "hf"
    make_checkpoint("qwen3_moe", hf, overrides=dict(tie_word_embeddings=True))
    kw = dict(tiers="int4", dense_tier="int4", head_tier=head_tier, progress=False)
    plain = convert_checkpoint(hf, tmp_path / "plain", **kw)
    tiled = convert_checkpoint(hf, tmp_path / "tiled", cpu_layout=True, **kw)
    dense = read_manifest(tiled)["dense"]
    assert dense["head_format"]["tiled"] and dense["format"]["tiled"]
    assert not any("tiled" in read_manifest(plain)["dense"][f] for f in ("format", "head_format"))
    ids = [5, 17, 99, 3, 42, 250, 7, 255, 64]
    models = [jmoe.load(p, cpu_dot="int8", compute_dtype="float32") for p in (plain, tiled)]
    assert np.array_equal(*(np.asarray(jmoe.forward(m, ids)) for m in models))
    assert jmoe.generate(models[0], ids, max_new_tokens=6) == jmoe.generate(models[1], ids, max_new_tokens=6)


def test_cpu_layout_stores_plain_bf16_projections_and_head_in_tiles_that_compute_the_same(tmp_path):
    """At the bf16 dense tier --cpu-layout stores the plain projections and the untied LM head in
    column tiles (the manifest's dense.tiled_kernels; k and v, 32 columns wide, and the routers stay
    [K, N]): the stored bytes are the [K, N] conversion's regrouped, and the model gives the same
    logits and greedy tokens from them."""
    import orbax.checkpoint as ocp

    from kernel_formats.qarray import tile_plain

    hf = tmp_path / "hf"
    make_checkpoint("qwen3_moe", hf, overrides=dict(tie_word_embeddings=False, num_attention_heads=8))  # q: 2 tiles
    kw = dict(tiers="bf16", progress=False)
    plain = convert_checkpoint(hf, tmp_path / "plain", **kw)
    tiled = convert_checkpoint(hf, tmp_path / "tiled", cpu_layout=True, **kw)
    assert read_manifest(tiled)["dense"]["tiled_kernels"] and "tiled_kernels" not in read_manifest(plain)["dense"]
    a, b = (ocp.StandardCheckpointer().restore((p / "dense").absolute()) for p in (plain, tiled))
    for name in ("q_proj", "k_proj"):
        kernels = [np.asarray(d["layers"]["0"]["self_attn"][name]["kernel"]) for d in (a, b)]
        assert kernels[0].shape[1] == (128 if name == "q_proj" else 32)
        expected = np.asarray(tile_plain(kernels[0])) if name == "q_proj" else kernels[0]
        assert np.array_equal(kernels[1], expected) and (name == "k_proj") == np.array_equal(*kernels), name
    assert not np.array_equal(np.asarray(a["lm_head"]["kernel"]), np.asarray(b["lm_head"]["kernel"]))
    ids = [5, 17, 99, 3, 42, 250, 7, 255, 64]
    models = [jmoe.load(p, compute_dtype="float32") for p in (plain, tiled)]
    assert np.array_equal(*(np.asarray(jmoe.forward(m, ids)) for m in models))
    assert jmoe.generate(models[0], ids, max_new_tokens=6) == jmoe.generate(models[1], ids, max_new_tokens=6)


@pytest.mark.parametrize("small", [True, False])
def test_a_small_models_experts_are_quantized_on_one_blas_thread(small_hf, tmp_path, monkeypatch, small):
    """OpenBLAS's pool costs more than a small model's matrices and spins for the cores another
    process needs (GPTQ of the bundled model: 61 s instead of 16 s beside one busy core), so a small
    model's experts are quantized on one BLAS thread; a wide model's keep the pool's own count."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from convert import pipeline

    def pool_sizes():  # the BLAS libraries' thread counts now
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

    seen = []
    write_experts = pipeline.write_experts

    def recording(reader, cfg, *args, **kwargs):
        seen.append(pool_sizes())
        return write_experts(reader, cfg, *args, **kwargs)

    monkeypatch.setattr(pipeline, "write_experts", recording)
    monkeypatch.setattr(pipeline, "SMALL_WIDTH", 1 << 30 if small else 0)  # the model is small, or wide
    with threadpool_limits(2, user_api="blas"):  # a pool of 2, whatever the suite's own setting
        convert_checkpoint(small_hf, tmp_path / "out", tiers="int4", progress=False)
        assert pool_sizes() == {2}  # restored
    assert seen == [{1} if small else {2}]
