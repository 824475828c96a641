"""Phi-3.5-MoE (model_type "phimoe") against transformers: LayerNorm with bias, attention and LM-head
biases, the sparsemixer top-2 router, LongRoPE; and its quantized tiers under an offloading budget."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import jmoe
from convert import convert_checkpoint
from jmoe.errors import ConfigError
from jmoe.layers.routers import sparsemixer_top2
from jmoe.models import config_from_hf
from tests.hf_models import hf_config, make_checkpoint
from tests.test_family_parity import PROMPT, assert_parity, converted

BASE = dict(eos_token_id=None)  # no early stop: 32 tokens
# router_jitter_noise is sparsemixer's threshold: at 0.01 (the released model's) a pick's softmax
# usually holds the winner alone (weight 1); at 0.1-0.3 most picks mix several experts.
CASES = {
    "biases-full-attention": dict(BASE, attention_bias=True, lm_head_bias=True, sliding_window=None),
    "no-biases-sliding": dict(BASE, attention_bias=False, lm_head_bias=False, sliding_window=12,
                              router_jitter_noise=0.1),
    "attention-bias-wide-jitter": dict(BASE, attention_bias=True, lm_head_bias=False, sliding_window=12,
                                       router_jitter_noise=0.3),
    "lm-head-bias-no-jitter": dict(BASE, attention_bias=False, lm_head_bias=True, router_jitter_noise=0.0),
}
# Linear and LayerNorm biases are zero at init: random values show each one is read and applied.
RANDOMIZED = ("bias",)


def longrope(original: int, long_mscale: float = 1.35) -> dict:
    """LongRoPE parameters for head_dim 16 (8 frequencies), distinct short/long factors and mscales."""
    return dict(BASE, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
        "short_factor": [1.0 + 0.15 * i for i in range(8)], "long_factor": [1.0 + 0.9 * i for i in range(8)],
        "short_mscale": 1.1, "long_mscale": long_mscale})


# Phi-3.5-MoE-instruct's config.json as published (transformers 4.x spelling), experts and widths as released.
RELEASED = dict(
    model_type="phimoe", vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2, hidden_act="silu",
    max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(64)],
                  "long_factor": [1.0 + 0.5 * i for i in range(64)], "short_mscale": 1.243163121016122,
                  "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096},
    attention_bias=True, lm_head_bias=True, router_jitter_noise=0.01, input_jitter_noise=0.01,
    sliding_window=131072, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000,
    transformers_version="4.43.3",
)


def test_config_translation():
    cfg = config_from_hf(hf_config("phimoe", **CASES["no-biases-sliding"]).to_dict())
    assert (cfg.norm, cfg.router, cfg.top_k, cfg.norm_topk_prob) == ("layer", "sparsemixer", 2, False)
    assert cfg.router_jitter_eps == 0.1 and cfg.rms_norm_eps == 1e-5
    assert not cfg.qkv_bias and not cfg.o_bias and not cfg.lm_head_bias
    assert cfg.sliding_windows == (12, 12, 12) and cfg.moe_layers == (True, True, True)
    cfg = config_from_hf(hf_config("phimoe", **CASES["biases-full-attention"]).to_dict())
    assert cfg.qkv_bias and cfg.o_bias and cfg.lm_head_bias and cfg.sliding_windows == (None,) * 3
    assert cfg.rope_theta == 1e6  # phimoe's default theta
    hf = hf_config("phimoe").to_dict()
    with pytest.raises(ConfigError, match="always picks 2"):
        config_from_hf({**hf, "num_experts_per_tok": 3})
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        config_from_hf({**hf, "router_jitter_noise": -0.1})
    with pytest.raises(ConfigError, match="lm_head_bias with tie_word_embeddings"):
        config_from_hf({**hf, "lm_head_bias": True, "tie_word_embeddings": True})


def test_released_config_json():
    cfg = config_from_hf(RELEASED)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.head_dim) == (16, 2, 6400, 128)
    assert cfg.qkv_bias and cfg.o_bias and cfg.lm_head_bias and cfg.norm == "layer"
    assert cfg.router_jitter_eps == 0.01 and cfg.sliding_windows == (131072,) * 32 and cfg.eos_token_ids == (32000,)
    assert cfg.rope_type == "longrope" and cfg.rope_theta == 10000.0
    p = cfg.rope_param
    assert p["original_max_position_embeddings"] == 4096
    assert p["short_mscale"] == p["long_mscale"] == 1.243163121016122
    assert p["long_factor"] == p["short_factor"] == tuple(RELEASED["rope_scaling"]["short_factor"])  # see rope_params
    assert jmoe.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # as a converted model stores it
    broken = {**RELEASED, "rope_scaling": {k: v for k, v in RELEASED["rope_scaling"].items() if k != "long_mscale"}}
    with pytest.raises(ConfigError, match="long_mscale"):
        config_from_hf(broken)
    with pytest.raises(ConfigError, match="yarn"):
        config_from_hf({**RELEASED, "rope_scaling": {"type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.1, 0.5])
def test_sparsemixer_matches_transformers(eps):
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    rng = np.random.default_rng(0)
    scores = rng.normal(size=(256, 8)).astype(np.float32)
    scores[:8] *= 0.01  # all experts within the window: the softmax over everything
    scores[8:16] = -np.abs(scores[8:16])  # every score negative
    scores[16, :] = 0.0  # all equal (0 / 0 in the threshold test)
    weights, ids = sparsemixer(torch.from_numpy(scores), jitter_eps=eps, training=False)
    ours_ids, ours_weights = sparsemixer_top2(scores, eps)
    np.testing.assert_array_equal(np.asarray(ours_ids), ids.numpy())
    np.testing.assert_allclose(np.asarray(ours_weights), weights.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", CASES)
def test_hub_layout_matches_transformers(tmp_path, name):
    model, reference = converted(tmp_path, "phimoe", overrides=CASES[name], randomize=RANDOMIZED)
    assert model.config.family == "phimoe" and model.config.norm == "layer"
    assert_parity(model, reference)


@pytest.mark.parametrize("name", ["biases-full-attention", "attention-bias-wide-jitter"])
def test_fused_expert_layout_matches_transformers(tmp_path, name):
    """transformers' own layout: mlp.router.weight, experts.gate_up_proj [E, 2F, D], experts.down_proj."""
    model, reference = converted(tmp_path, "phimoe", fused=True, overrides=CASES[name], randomize=RANDOMIZED)
    assert_parity(model, reference)


@pytest.mark.parametrize("original,long_mscale", [(16, 1.35), (64, 1.35), (24, 1.1)],
                         ids=["long-mscale", "short-mscale", "switch-in-generation-equal-mscales"])
def test_longrope_matches_transformers(tmp_path, original, long_mscale):
    """original_max_position_embeddings 16: the 18-token prompt is already past it, so every step runs
    long; 64: prompt + 32 tokens stay within it (short); 24: generation crosses it, with equal mscales
    as in the released model. transformers 5.23's Phi-3.5-MoE rotary embedding recomputes its
    frequencies without the sequence length (always the short factor); only the mscale follows the
    length. (Crossing with unequal mscales, transformers recomputes the whole cache at the crossing
    step; jmoe keeps the cached keys, so there the tokens after the crossing may differ.)"""
    model, reference = converted(tmp_path, "phimoe", overrides={**CASES["attention-bias-wide-jitter"],
                                                                **longrope(original, long_mscale)},
                                 randomize=RANDOMIZED)
    assert model.config.rope_type == "longrope"
    assert_parity(model, reference)


def test_quantized_tiers_under_an_offloading_budget(tmp_path):
    """int4 + int2 (RTN) tiers: the offloaded paths (layer-wise with look-ahead prefetch, CPU experts)
    give the resident int4 tokens; DyMoE's 4/2 mode runs a share at int2 under a budget short of every expert."""
    src = tmp_path / "hf"
    make_checkpoint("phimoe", src, overrides=CASES["attention-bias-wide-jitter"], randomize=RANDOMIZED)
    out = convert_checkpoint(src, tmp_path / "jmoe", tiers="int4,int2", progress=False)
    resident = jmoe.load(out, compute_dtype="float32", tier="int4")
    expected = jmoe.generate(resident, PROMPT, max_new_tokens=16)
    logits = {t: np.asarray(jmoe.forward(jmoe.load(out, compute_dtype="float32", tier=t), PROMPT))
              for t in ("int4", "int2")}
    assert np.isfinite(logits["int2"]).all() and not np.allclose(logits["int4"], logits["int2"])

    fixed = sum(v for k, v in resident.memory.items() if k != "experts")
    budget = int(fixed + 0.4 * resident.memory["experts"])
    for policy, execution in [("lru+prefetch", "layerwise"), ("lru+prefetch", "auto"),
                              ("lru+prefetch+cpu", "layerwise")]:
        model = jmoe.load(out, compute_dtype="float32", tier="int4", device_budget=budget, policy=policy,
                          execution=execution, cpu_critical_tokens=1)
        assert model.residency.slots < 3 * 8  # really offloading
        assert jmoe.generate(model, PROMPT, max_new_tokens=16) == expected, (policy, execution)
        stats = jmoe.stats(model)
        assert stats["transfers"] > 0 and stats["degraded"] == 0
        if execution == "layerwise":  # the look-ahead ran the next layer's LayerNorm + sparsemixer
            assert stats["predictor_recall"] > 0.5
        model.residency.cache.check()

    # both tiers' pools and staging: a larger share, still short of every expert at int4
    model = jmoe.load(out, compute_dtype="float32", device_budget=int(fixed + 0.8 * resident.memory["experts"]),
                      policy="dymoe")
    tokens = jmoe.generate(model, PROMPT, max_new_tokens=16)
    assert len(tokens) == 16
    assert set(jmoe.stats(model)["uses_by_tier"]) == {"int4", "int2"}
    model.residency.cache.check()


def test_predictor_applies_layernorm_and_sparsemixer():
    """The look-ahead predictor on a Phi-3.5-MoE layer equals torch's LayerNorm + transformers' sparsemixer."""
    from flax import nnx
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from jmoe.layers.transformer import Transformer
    from jmoe.runtime.predictor import predict_next

    cfg = config_from_hf(hf_config("phimoe", router_jitter_noise=0.3).to_dict())
    model = Transformer(cfg, dtype=np.float32, param_dtype=np.float32, rngs=nnx.Rngs(0))
    layer = model.layers[1]
    rng = np.random.default_rng(1)
    norm = layer.post_attention_layernorm
    norm.weight.value = (1 + 0.3 * rng.normal(size=norm.weight.shape)).astype(np.float32)
    norm.bias.value = (0.3 * rng.normal(size=norm.bias.shape)).astype(np.float32)
    x = rng.normal(size=(2, 5, cfg.hidden_size)).astype(np.float32)
    valid = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 0], bool)
    counts, gate = predict_next(layer, x, valid)

    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    normed = torch.nn.functional.layer_norm(t(x.reshape(10, -1)), (cfg.hidden_size,), t(norm.weight.value),
                                            t(norm.bias.value), eps=cfg.rms_norm_eps)
    weights, ids = sparsemixer(normed @ t(layer.mlp.router.kernel.value), jitter_eps=0.3, training=False)
    one_hot = torch.nn.functional.one_hot(ids, cfg.num_experts).float() * t(valid)[:, None, None]
    np.testing.assert_array_equal(np.asarray(counts), one_hot.sum((0, 1)).int().numpy())
    np.testing.assert_allclose(np.asarray(gate), (one_hot * weights[..., None]).sum((0, 1)).numpy(), rtol=1e-5)
