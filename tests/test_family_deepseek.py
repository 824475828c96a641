"""DeepSeek-V2/V3 (multi-head latent attention) and GLM-4.5-MoE against transformers, and what the
latent cache saves."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jmoe.layers.modules import cache_bytes_per_token, cache_spec
from jmoe.models import config_from_hf
from tests.hf_models import hf_config
from tests.test_family_parity import assert_parity, converted

MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
           first_k_dense_replace=1, n_shared_experts=1, eos_token_id=None)  # no early stop: 32 tokens

DEEPSEEK_V2 = {
    "lite-greedy": dict(MLA, q_lora_rank=None, topk_method="greedy"),
    "q-lora-grouped": dict(MLA, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                           routed_scaling_factor=2.0, n_shared_experts=2),
    "all-sparse-biased": dict(MLA, q_lora_rank=None, first_k_dense_replace=0, attention_bias=True),
}
DEEPSEEK_V3 = {
    "grouped-interleaved": dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                norm_topk_prob=True, rope_interleave=True),
    "ungrouped-rotate-half": dict(MLA, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                  rope_interleave=False, num_experts_per_tok=3),
    # DeepSeek-V3's own RoPE: YaRN, whose mscale_all_dim also scales the softmax
    "yarn-mscale": dict(MLA, q_lora_rank=24, n_group=2, topk_group=1, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
}
GLM4_MOE = {
    "half-rotary-qk-norm": dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
                                use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5),
    "grouped-no-qk-norm": dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                               num_experts_per_tok=2, first_k_dense_replace=0, n_shared_experts=2, n_group=2,
                               topk_group=1, use_qk_norm=False, norm_topk_prob=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.75}),
}
for case in GLM4_MOE.values():
    case["eos_token_id"] = None
CASES = [(f, name, cfg) for f, table in (("deepseek_v2", DEEPSEEK_V2), ("deepseek_v3", DEEPSEEK_V3),
                                         ("glm4_moe", GLM4_MOE)) for name, cfg in table.items()]
RANDOMIZED = ("e_score_correction_bias",)  # zero at init: random values show it steers selection


@pytest.mark.usefixtures("small_key_blocks")  # attention in blocks of 16 keys: the 64-slot caches take four
@pytest.mark.parametrize("family,name,overrides", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_matches_transformers(tmp_path, family, name, overrides):
    model, reference = converted(tmp_path, family, overrides=overrides, randomize=RANDOMIZED)
    assert model.config.family == family
    assert_parity(model, reference)


@pytest.mark.parametrize("family,overrides", [("deepseek_v2", DEEPSEEK_V2["q-lora-grouped"]),
                                              ("deepseek_v3", DEEPSEEK_V3["grouped-interleaved"]),
                                              ("glm4_moe", GLM4_MOE["half-rotary-qk-norm"])])
def test_fused_expert_layout(tmp_path, family, overrides):
    model, reference = converted(tmp_path, family, fused=True, overrides=overrides, randomize=RANDOMIZED)
    assert_parity(model, reference)


def test_configs_exercise_each_variant():
    cfgs = {(f, n): config_from_hf(hf_config(f, **o).to_dict()) for f, n, o in CASES}
    v2 = cfgs["deepseek_v2", "q-lora-grouped"]
    assert v2.attention == "mla" and v2.q_lora_rank == 24 and v2.router_groups == 4 and v2.router_topk_groups == 2
    assert v2.routed_scaling_factor == 2.0 and v2.shared_expert_intermediate_size == 64
    assert v2.moe_layers == (False, True, True) and v2.rope_interleaved and not v2.shared_expert_gated
    assert cfgs["deepseek_v2", "lite-greedy"].q_lora_rank == 0
    assert cfgs["deepseek_v2", "all-sparse-biased"].moe_layers == (True, True, True)
    v3 = cfgs["deepseek_v3", "grouped-interleaved"]
    assert v3.router == "sigmoid" and v3.norm_topk_prob and v3.rope_interleaved
    assert not cfgs["deepseek_v3", "ungrouped-rotate-half"].rope_interleaved
    glm = cfgs["glm4_moe", "half-rotary-qk-norm"]
    assert glm.rotary_dim == 8 and glm.qk_norm == "head" and glm.qkv_bias and not glm.o_bias
    assert cfgs["glm4_moe", "grouped-no-qk-norm"].rotary_dim == 12


# DeepSeek-V2-Lite's attention shapes (config.json of deepseek-ai/DeepSeek-V2-Lite).
V2_LITE = dict(vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
               num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
               n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, n_shared_experts=2)


def test_latent_cache_is_what_the_budget_counts():
    """DeepSeek-V2-Lite caches 512 + 64 numbers per token and layer, not 16 heads x (192 + 128)."""
    from transformers import AutoConfig

    cfg = config_from_hf(AutoConfig.for_model("deepseek_v2", **V2_LITE).to_dict())
    assert all(cache_spec(cfg, i) == ((1, 512), (1, 64)) for i in range(cfg.num_layers))
    latent = cache_bytes_per_token(cfg, jnp.bfloat16)
    expanded = cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 2
    assert latent == 27 * (512 + 64) * 2
    assert expanded / latent > 8


@pytest.mark.parametrize("dense_tier,held_dtype", [("int4", "float32"), ("bf16", "bfloat16")])
def test_on_the_cpu_latent_attention_holds_its_up_projections_as_its_products_read_them(tmp_path, dense_tier,
                                                                                        held_dtype):
    """Loaded on the CPU, each latent attention holds kv_b as W_uk [H, nope, r] and W_uv [H, r, v]: an
    int4 kv_b dequantized to the compute dtype (not its codes, which each step otherwise dequantized
    and transposed), a bf16 one in bf16 (its transposes round nothing); both load's reservation and
    memory_plan count what it holds; it decodes."""
    import jax
    import numpy as np
    from flax import nnx

    import jmoe
    from convert import convert_checkpoint
    from jmoe.runtime.budget import tree_nbytes
    from tests.hf_models import make_checkpoint

    overrides = DEEPSEEK_V2["lite-greedy"]
    make_checkpoint("deepseek_v2", tmp_path / "hf", overrides=overrides, randomize=RANDOMIZED)
    out = convert_checkpoint(tmp_path / "hf", tmp_path / "m", tiers="int4", dense_tier=dense_tier, progress=False)
    model = jmoe.load(out, compute_dtype="float32")
    cfg = model.config
    heads, nope, rank, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(model.dense))}
    held = {name: leaf for name, leaf in flat.items() if "w_uk" in name or "w_uv" in name}
    layers = cfg.num_layers
    assert len(held) == 2 * layers and not any("kv_b_proj" in name for name in flat)
    assert all(leaf.dtype == np.dtype(held_dtype) for leaf in held.values())
    assert {leaf.shape for name, leaf in held.items() if "w_uk" in name} == {(heads, nope, rank)}
    assert {leaf.shape for name, leaf in held.items() if "w_uv" in name} == {(heads, rank, v)}
    assert model.memory["dense"] == tree_nbytes(model.dense) == jmoe.memory_plan(out, compute_dtype="float32")["dense"]
    assert len(jmoe.generate(model, [5, 17, 99, 3], max_new_tokens=4)) == 4


# ---------------------------------------------------------------- downstream: tiers, policies, paths

# each with one offloaded execution path (both run on the tiny model and every other family)
DOWNSTREAM = [("deepseek_v2", DEEPSEEK_V2["q-lora-grouped"], "rtn", "layerwise"),
              ("deepseek_v3", DEEPSEEK_V3["grouped-interleaved"], "gptq", "resident"),
              ("glm4_moe", GLM4_MOE["half-rotary-qk-norm"], "haq", "layerwise")]
IDS = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 2047]


@pytest.mark.parametrize("family,overrides,method,execution", DOWNSTREAM, ids=[d[0] for d in DOWNSTREAM])
def test_quantized_tiers_policies_and_paths(tmp_path, family, overrides, method, execution):
    """Integer tiers (calibrated through the family's own attention and cache layout for GPTQ and
    HAQ) and an int8 KV cache track bf16; speculative decoding and offloaded runs on both paths give the resident
    tokens; DyMoE mixes tiers."""
    import shutil

    import numpy as np

    import jmoe
    from convert import convert_checkpoint
    from jmoe.policies import DyMoE
    from jmoe.tiers import TIER_CODES
    from tests.conftest import DATA, ROOT
    from tests.hf_models import make_checkpoint

    src = tmp_path / "hf"
    make_checkpoint(family, src, overrides=dict(overrides, vocab_size=4096), randomize=RANDOMIZED)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # calibration text needs a tokenizer
        shutil.copy(ROOT / "examples" / "tiny-qwen3-moe" / name, src / name)
    calib = dict(calib=str(DATA / "code.train.txt"), calib_sequences=8, calib_seq_len=64) if method != "rtn" else {}
    out = convert_checkpoint(src, tmp_path / "jmoe", tiers="bf16,int4,int2", method=method, progress=False, **calib)

    logits = {t: np.asarray(jmoe.forward(jmoe.load(out, tier=t, compute_dtype="float32"), IDS)) for t in ("bf16",
                                                                                                      "int4", "int2")}
    error = {t: np.abs(logits[t] - logits["bf16"]).mean() / np.abs(logits["bf16"]).mean() for t in ("int4", "int2")}
    assert 0 < error["int4"] < error["int2"] < 1, error
    # an int8 cache (the latent and rotary key for latent attention) stays close to the float one
    int8_kv = np.asarray(jmoe.forward(jmoe.load(out, tier="bf16", compute_dtype="float32", kv_dtype="int8"), IDS))
    assert 0 < np.abs(int8_kv - logits["bf16"]).mean() / np.abs(logits["bf16"]).mean() < 0.02

    resident = jmoe.load(out, tier="int4", compute_dtype="float32")
    reference = jmoe.generate(resident, IDS, max_new_tokens=12)
    # speculative decoding with the int2 copy as draft shares the latent cache and keeps greedy output
    assert jmoe.generate(resident, IDS, max_new_tokens=12, speculative="int2") == reference
    fixed = sum(v for k, v in resident.memory.items() if k != "experts")
    model = jmoe.load(out, tier="int4", compute_dtype="float32", device_budget=int(fixed + 0.4 * resident.memory[
        "experts"]), policy="lru+prefetch+cpu", execution=execution, cpu_critical_tokens=1)
    assert model.residency.slots < model.config.num_moe_layers * model.config.num_experts
    assert jmoe.generate(model, IDS, max_new_tokens=12) == reference, execution
    model.residency.cache.check()

    model = jmoe.load(out, compute_dtype="float32", policy=DyMoE())  # both tiers whole: picked in the step
    assert len(jmoe.generate(model, IDS, max_new_tokens=8)) == 8
    counts, _, chosen = np.asarray(model.residency.signals.per_expert)  # the last decode step's
    assert set(chosen[counts > 0].tolist()) == {TIER_CODES["int4"], TIER_CODES["int2"]}


@pytest.mark.parametrize("family,change,message", [
    ("deepseek_v2", dict(topk_method="noaux_tc"), "'topk_method' 'noaux_tc' is not supported"),
    ("deepseek_v2", dict(mlp_bias=True), "'mlp_bias' true is not supported"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3, topk_group=1),
     r"n_group \(3\) must divide the number of experts \(8\)"),
    ("deepseek_v3", dict(n_group=4, topk_group=1, num_experts_per_tok=3), r"exceeds the experts of the topk_group"),
    ("deepseek_v3", dict(n_group=2, topk_group=3), "router_topk_groups"),
    ("deepseek_v3", dict(kv_lora_rank=0), "kv_lora_rank"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
     "'partial_rotary_factor' must be in"),
    ("glm4_moe", dict(routed_scaling_factor=-1.0), "routed_scaling_factor"),
])
def test_bad_configs_name_the_field(family, change, message):
    from jmoe.errors import ConfigError

    base = {"deepseek_v2": DEEPSEEK_V2["lite-greedy"], "deepseek_v3": DEEPSEEK_V3["grouped-interleaved"],
            "glm4_moe": GLM4_MOE["half-rotary-qk-norm"]}[family]
    hf = {**hf_config(family, **base).to_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        config_from_hf(hf)


def test_a_hand_edited_latent_attention_config_is_refused():
    import dataclasses

    from jmoe.errors import ConfigError

    cfg = config_from_hf(hf_config("deepseek_v3", **DEEPSEEK_V3["grouped-interleaved"]).to_dict())
    for change in (dict(kv_lora_rank=0), dict(v_head_dim=0), dict(head_dim=cfg.head_dim + 2)):
        with pytest.raises(ConfigError, match="latent attention needs"):
            dataclasses.replace(cfg, **change)
