"""GPT-OSS (model_type "gpt_oss"): parity with transformers (attention sinks, sliding and full layers,
the biased top-k-softmax router, biased experts with the clamped SwiGLU, YaRN), MXFP4 expert
checkpoints, and quantized / offloaded / CPU-run experts that keep their biases."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import jmoe
import jmoe.runtime.loader
from convert import convert_checkpoint
from convert.mxfp4 import FP4_VALUES, dequantize_mxfp4
from jmoe.errors import CheckpointError, ConfigError
from jmoe.kernels.expert_ffn.reference import expert_ffn_reference
from jmoe.manifest import read_manifest
from jmoe.models import config_from_hf
from jmoe.quant import ExpertWeights
from jmoe.runtime.store import ExpertStore
from jmoe.tiers import tier_format
from kernel_formats.glu import SILU, GatedActivation
from tests.hf_models import hf_config, make_checkpoint
from tests.test_family_parity import PROMPT, assert_parity, converted

EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")
EVERY_BIAS = ("bias", "sinks", *EXPERT_BIASES)  # q/k/v/o and router biases, sinks, expert biases
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 150000.0}

# name -> (overrides of tests/hf_models.py's gpt_oss config, zero-initialised tensors given random values, fused)
VARIANTS = {
    # the family config: sliding (window 8) / full / sliding layers, top-2, YaRN (GPT-OSS's default RoPE)
    "sliding_full-top2-yarn": ({}, EVERY_BIAS, False),
    "full-top4-alpha_limit": (dict(layer_types=["full_attention"] * 3, num_experts_per_tok=4, swiglu_alpha=1.3,
                                   swiglu_limit=0.2), EXPERT_BIASES, False),
    "sliding-top1-no_attention_bias-default_rope": (dict(layer_types=["sliding_attention"] * 3, sliding_window=4,
                                                         num_experts_per_tok=1, attention_bias=False,
                                                         rope_parameters=DEFAULT_ROPE), ("gate_up_proj_bias",), False),
    # the state dict as is (for GPT-OSS the same tensors save_pretrained writes)
    "fused-state_dict": (dict(num_experts_per_tok=3), EVERY_BIAS, True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_oss_matches_transformers(tmp_path, variant):
    overrides, randomize, fused = VARIANTS[variant]
    model, reference = converted(tmp_path, "gpt_oss", fused=fused, overrides=overrides, randomize=randomize)
    cfg = model.config
    assert cfg.family == "gpt_oss" and cfg.expert_bias and cfg.expert_activation == "clamped_swiglu"
    assert cfg.attention_sinks and cfg.router == "topk_softmax"
    assert cfg.top_k == reference.config.num_experts_per_tok
    assert cfg.rope_type == reference.config.rope_parameters["rope_type"]
    windows = [reference.config.sliding_window if t == "sliding_attention" else None
               for t in reference.config.layer_types]
    assert list(cfg.sliding_windows) == windows
    assert_parity(model, reference)


def rewrite_tensors(checkpoint, edit) -> None:
    """Replace a saved checkpoint's tensors by edit(tensors) (a dict of torch tensors)."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    tensors = edit(load_file(str(path)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def load_reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


def test_strong_attention_sinks_match_transformers(tmp_path):
    # sinks around +3 take most of each softmax: attention sinks must enter the normaliser exactly
    src = tmp_path / "hf"
    make_checkpoint("gpt_oss", src, randomize=EVERY_BIAS)
    generator = torch.Generator().manual_seed(1)

    def strong_sinks(tensors):
        for name in [n for n in tensors if n.endswith("self_attn.sinks")]:
            tensors[name] = (3.0 + torch.randn(tensors[name].shape, generator=generator)).to(torch.bfloat16)
        return tensors

    rewrite_tensors(src, strong_sinks)
    model = jmoe.load(convert_checkpoint(src, tmp_path / "jmoe", progress=False), compute_dtype="float32")
    assert_parity(model, load_reference(src))


# ----------------------------------------------------------------------------- MXFP4 experts


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., K] (K a multiple of 32) -> MXFP4 blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]:
    per block of 32 the smallest power-of-two scale that fits its largest magnitude under 6, each
    value rounded to the nearest e2m1 code, two codes per byte with the even element in the low nibble."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    magnitude = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(-1)
    codes = (magnitude | ((scaled < 0) << 3)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def test_mxfp4_decoding_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    w = (rng.normal(size=(3, 48, 64)) * rng.uniform(0.01, 10, size=(3, 48, 1))).astype(np.float32)  # [E, N, K]
    blocks, scales = mxfp4_encode(w)
    assert blocks.shape == (3, 48, 2, 16) and scales.shape == (3, 48, 2)
    ours = dequantize_mxfp4(blocks, scales)  # [E, N, K]
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours.transpose(0, 2, 1), theirs.numpy())  # transformers: [E, K, N]
    assert np.abs(ours - w).max() <= np.abs(w).max() / 6  # within half a step of the coarsest code
    np.testing.assert_array_equal(dequantize_mxfp4(*mxfp4_encode(ours)), ours)  # decoded values round-trip


@pytest.mark.parametrize("top_k", [2, 4])
def test_mxfp4_checkpoint_converts_to_its_dequantized_weights(tmp_path, top_k):
    """Experts stored as gate_up_proj_blocks/_scales and down_proj_blocks/_scales (as on the hub) convert
    to the model transformers runs from the dequantized weights."""
    plain, packed = tmp_path / "dequantized", tmp_path / "mxfp4"
    make_checkpoint("gpt_oss", plain, overrides=dict(num_experts_per_tok=top_k), randomize=EVERY_BIAS)
    packed.mkdir()
    mx = {}

    def dequantize_experts(tensors):
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            linear = tensors[name].float().numpy().transpose(0, 2, 1)  # [E, D, 2F] -> linear [E, 2F, D]
            blocks, scales = mxfp4_encode(linear)
            mx[name + "_blocks"], mx[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            dequantized = dequantize_mxfp4(blocks, scales).transpose(0, 2, 1)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(dequantized)).to(torch.bfloat16)  # exact in bf16
            assert torch.equal(tensors[name].float(), torch.from_numpy(np.ascontiguousarray(dequantized)))
        mx.update({k: v for k, v in tensors.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))})
        return tensors

    rewrite_tensors(plain, dequantize_experts)
    reference = load_reference(plain)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in mx.items()}, str(packed / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    out = convert_checkpoint(packed, tmp_path / "jmoe", progress=False)
    used = {t["hf_name"] for t in read_manifest(out)["dense"]["tensors"].values()}
    assert not any("_blocks" in n or "_scales" in n for n in used)  # the experts never went to the dense weights
    assert_parity(jmoe.load(out, compute_dtype="float32"), reference)


def test_bad_mxfp4_tensors_are_named(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint("gpt_oss", src)

    def packed(tensors, *, scale=None, dtype=None):
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = mxfp4_encode(tensors.pop(name).float().numpy().transpose(0, 2, 1))
            if scale is not None:
                scales[...] = scale
            tensors[name + "_blocks"] = torch.from_numpy(blocks)
            tensors[name + "_scales"] = torch.from_numpy(scales).to(dtype or torch.uint8)
        return tensors

    rewrite_tensors(src, lambda t: packed(t, scale=255))  # e8m0 255: NaN
    with pytest.raises(CheckpointError, match="scales too large"):
        convert_checkpoint(src, tmp_path / "a", progress=False)
    make_checkpoint("gpt_oss", src)
    rewrite_tensors(src, lambda t: packed(t, dtype=torch.float16))
    with pytest.raises(CheckpointError, match="_scales has dtype F16"):
        convert_checkpoint(src, tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- config translation


def test_config_translation():
    hf = hf_config("gpt_oss", layer_types=["full_attention", "sliding_attention", "full_attention"],
                   swiglu_alpha=1.5, swiglu_limit=3.0).to_dict()
    cfg = config_from_hf(hf)
    assert cfg.sliding_windows == (None, 8, None) and cfg.moe_layers == (True,) * 3
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.5, 3.0) and cfg.moe_intermediate_size == 32
    assert cfg.qkv_bias and cfg.o_bias and not cfg.norm_topk_prob and cfg.rms_norm_eps == 1e-5
    assert jmoe.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    del hf["layer_types"]  # transformers' default: sliding on even layers
    assert config_from_hf(hf).sliding_windows == (8, None, 8)
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_hf({**hf, "layer_types": ["sliding_attention", "chunked_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_hf({**hf, "layer_types": ["full_attention"]})
    with pytest.raises(ConfigError, match="quantization_config"):
        config_from_hf({**hf, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ConfigError, match="swiglu_limit"):
        config_from_hf({**hf, "swiglu_limit": -1.0})
    with pytest.raises(ConfigError, match="expert_activation"):
        jmoe.ModelConfig.from_dict({**cfg.to_dict(), "expert_activation": "gelu"})


# ----------------------------------------------------------------------------- quantized and offloaded experts


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_quantized")
    make_checkpoint("gpt_oss", root / "hf", randomize=EVERY_BIAS)
    return root / "hf", convert_checkpoint(root / "hf", root / "jmoe", tiers="bf16,int4,int2", progress=False)


def test_every_tier_carries_the_float32_biases(quantized):
    src, out = quantized
    manifest = read_manifest(out)
    store = ExpertStore(out, manifest, jmoe.ModelConfig.from_dict(manifest["config"]))
    for tier, entry in manifest["tiers"].items():
        leaves = {leaf["name"]: leaf for leaf in entry["leaves"]}
        assert leaves["gate_up_bias"]["shape"] == [64] and leaves["gate_up_bias"]["dtype"] == "float32"
        assert leaves["down_bias"]["shape"] == [64] and leaves["down_bias"]["dtype"] == "float32"
    from safetensors.torch import load_file

    hf = load_file(str(src / "model.safetensors"))
    gate_up_bias = hf["model.layers.2.mlp.experts.gate_up_proj_bias"][5].float().numpy()  # interleaved gate, up
    down_bias = hf["model.layers.2.mlp.experts.down_proj_bias"][5].float().numpy()
    for tier in ("bf16", "int4", "int2"):  # never quantized: every version holds the checkpoint's values
        record = store.record(tier, 2, 5)
        np.testing.assert_array_equal(record.gate_up_bias, np.concatenate([gate_up_bias[0::2], gate_up_bias[1::2]]))
        np.testing.assert_array_equal(record.down_bias, down_bias)


def test_quantized_tiers_track_bf16(quantized):
    _, out = quantized
    logits = {t: np.asarray(jmoe.forward(jmoe.load(out, tier=t, compute_dtype="float32"), PROMPT))
              for t in ("bf16", "int4", "int2")}
    scale = float(np.abs(logits["bf16"]).mean())
    err = {t: float(np.abs(logits[t] - logits["bf16"]).mean()) for t in ("int4", "int2")}
    assert 0 < err["int4"] < err["int2"] and err["int4"] < 0.1 * scale, (err, scale)


OFFLOADED = [("lru", "resident"), ("lru+prefetch", "layerwise"), ("lru+cpu", "layerwise"), ("ondemand", "auto")]


@pytest.mark.parametrize("tier", ["int4", "int2"])
def test_offloaded_quantized_experts_give_the_resident_tokens(quantized, tier):
    _, out = quantized
    ids = PROMPT[:8]
    reference = jmoe.generate(jmoe.load(out, tier=tier, compute_dtype="float32"), ids, max_new_tokens=16)
    plan = jmoe.runtime.loader.memory_plan(out, tier=tier, compute_dtype="float32")
    budget = int(plan["dense"] + plan["kv_cache"] + plan["workspace"] + 0.4 * plan["all_experts"])
    for policy, execution in OFFLOADED:
        model = jmoe.load(out, tier=tier, compute_dtype="float32", device_budget=budget, policy=policy,
                          execution=execution, cpu_critical_tokens=1)
        assert model.residency.slots < 3 * 8  # really offloading
        assert jmoe.generate(model, ids, max_new_tokens=16) == reference, (policy, execution)
        stats = jmoe.stats(model)
        assert stats["transfers"] > 0 and stats["degraded"] == 0 and stats["skipped"] == 0
        if "cpu" in policy:
            assert stats["cpu_expert_runs"] > 0  # biased, clamped experts run on the host CPU too
        model.residency.cache.check()


@pytest.mark.parametrize("activation", [SILU, GatedActivation("clamped_swiglu", limit=0.5)], ids=["silu", "clamped"])
@pytest.mark.parametrize("method", ["gptq", "haq"])
def test_calibrated_quantizers_keep_biases_and_the_activation(method, activation):
    """GPTQ/HAQ calibrate on the expert's real down-projection input act(x @ gate_up + b) and carry
    the biases (GPTQ in its act order of the intermediate units); HAQ folds down's smoothing into up
    (and its bias) only where that is exact (SwiGLU)."""
    from convert.calibration import LayerInputs
    from convert.quantizers.expert import LayerQuantizer, rtn_expert

    rng = np.random.default_rng(3)
    D, F, E, n = 64, 64, 2, 256
    experts = [ExpertWeights(rng.normal(size=(D, 2 * F)).astype(np.float32) * 0.15,
                             rng.normal(size=(F, D)).astype(np.float32) * 0.15,
                             rng.normal(size=2 * F).astype(np.float32) * 0.3,
                             rng.normal(size=D).astype(np.float32) * 0.3) for _ in range(E)]
    x = rng.normal(size=(n, D)).astype(np.float32)
    inputs = LayerInputs(x, np.stack([np.arange(n) % E, (np.arange(n) + 1) % E], axis=1))
    fmt = tier_format("int4", smooth=method == "haq")
    plan = LayerQuantizer(method, {"int4": fmt}, experts, inputs, activation)
    if method == "haq":
        assert (plan.alphas["int4"][1] is None) == (activation.kind != "silu")  # no down smoothing to fold
    for e, expert in enumerate(experts):
        version = plan.quantize(e, "int4")
        np.testing.assert_array_equal(version.down_bias, expert.down_bias)
        if activation.kind != "silu" or method == "gptq":
            # GPTQ quantizes down in act order: gate_up's columns and their biases move with its rows
            np.testing.assert_array_equal(np.sort(version.gate_up_bias), np.sort(expert.gate_up_bias))
        exact, approx, rtn = (one_expert(x, w, activation) for w in (expert, version, rtn_expert(expert, fmt)))
        error = lambda y: np.linalg.norm(y - exact) / np.linalg.norm(exact)  # noqa: E731
        assert error(approx) < min(0.2, error(rtn))  # calibrated on the right inputs: better than RTN


def one_expert(x, weights: ExpertWeights, activation) -> np.ndarray:
    """x [n, D] through one expert version (biases included), float32."""
    import jax

    pool = jax.tree.map(lambda a: np.asarray(a)[None], weights)
    return np.asarray(expert_ffn_reference(x, np.zeros(1, np.int32), pool.gate_up, pool.down, block_rows=len(x),
                                           gate_up_bias=pool.gate_up_bias, down_bias=pool.down_bias,
                                           activation=activation))
