"""Bytes per expert and total expert bytes of every tier, from the format's record layout.

For the bundled tiny model and for Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite and GPT-OSS-20B
shapes (no weights needed: the layout follows from the shapes and the tier format), with the
effective bits per weight, and the KV-cache bytes per token the budget reserves (for latent
attention, the latent cache next to what expanded keys and values would take).

    python -m bench.tier_bytes
"""

from __future__ import annotations

import json

from bench.lib.common import TINY_HF, write_result
from jmoe.config import ModelConfig
from jmoe.format import RecordLayout
from jmoe.layers.modules import cache_bytes_per_token
from jmoe.models import config_from_hf
from jmoe.tiers import TIER_NAMES, expert_template, tier_format

SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=48),
    "mixtral-8x7b": dict(hidden_size=4096, moe_intermediate_size=14336, num_experts=8, top_k=2, num_layers=32),
}

# Hub config.json fields of models whose family has more than the shapes above.
HF_CONFIGS = {
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1, n_shared_experts=2, topk_method="greedy",
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, hidden_act="silu",
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096}, rope_theta=150000.0),
}


def shape_config(name: str, hidden_size, moe_intermediate_size, num_experts, top_k, num_layers) -> ModelConfig:
    return ModelConfig(family=name, vocab_size=32000, hidden_size=hidden_size, num_layers=num_layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                       tie_word_embeddings=False, num_experts=num_experts, top_k=top_k,
                       moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True,
                       moe_layers=(True,) * num_layers)


def tier_table(cfg: ModelConfig) -> dict:
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # gate, up, down
    experts = cfg.num_moe_layers * cfg.num_experts
    rows = {}
    for tier in reversed(TIER_NAMES):
        fmt = tier_format(tier)
        nbytes = RecordLayout.from_template(expert_template(cfg, tier, fmt)).nbytes
        rows[tier] = {
            "format": fmt.to_json() if fmt else None,
            "bytes_per_expert": nbytes,
            "bits_per_weight": 8 * nbytes / weights,
            "total_expert_bytes": nbytes * experts,
            "active_expert_bytes_per_token": nbytes * cfg.top_k * cfg.num_moe_layers,
        }
    kv = {"bf16_bytes_per_token": cache_bytes_per_token(cfg, "bfloat16")}
    if cfg.attention == "mla":  # what expanded keys (nope + rope) and values would take instead
        kv["expanded_bf16_bytes_per_token"] = 2 * cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim)
    return {"experts": experts, "weights_per_expert": weights, "tiers": rows, "kv_cache": kv}


def main() -> None:
    configs = {"tiny-qwen3-moe": config_from_hf(json.loads((TINY_HF / "config.json").read_text()))}
    configs.update({name: shape_config(name, **shape) for name, shape in SHAPES.items()})
    configs.update({name: config_from_hf(hf) for name, hf in HF_CONFIGS.items()})
    tables = {name: tier_table(cfg) for name, cfg in configs.items()}
    for name, table in tables.items():
        sizes = {t: f"{r['bytes_per_expert']} B ({r['bits_per_weight']:.2f} bit)" for t, r in table["tiers"].items()}
        print(name, sizes, table["kv_cache"])
    write_result("tier_bytes", "tier_bytes", {"models": tables})


if __name__ == "__main__":
    main()
