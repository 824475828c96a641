"""Bytes per expert and total expert bytes of every tier, from the format's record layout.

For the bundled tiny model and for Qwen3-30B-A3B and Mixtral-8x7B shapes (no weights needed: the
layout follows from the shapes and the tier format), with the effective bits per weight.

    python -m bench.tier_bytes
"""

from __future__ import annotations

import json

from bench.common import TINY_HF, write_result
from jmoe.config import ModelConfig
from jmoe.format import RecordLayout
from jmoe.models import config_from_hf
from jmoe.tiers import TIER_NAMES, expert_template, tier_format

SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=48),
    "mixtral-8x7b": dict(hidden_size=4096, moe_intermediate_size=14336, num_experts=8, top_k=2, num_layers=32),
}


def shape_config(name: str, hidden_size, moe_intermediate_size, num_experts, top_k, num_layers) -> ModelConfig:
    return ModelConfig(family=name, vocab_size=32000, hidden_size=hidden_size, num_layers=num_layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                       tie_word_embeddings=False, num_experts=num_experts, top_k=top_k,
                       moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True, moe_layers=(True,) * num_layers)


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
    return {"experts": experts, "weights_per_expert": weights, "tiers": rows}


def main() -> None:
    configs = {"tiny-qwen3-moe": config_from_hf(json.loads((TINY_HF / "config.json").read_text()))}
    configs.update({name: shape_config(name, **shape) for name, shape in SHAPES.items()})
    tables = {name: tier_table(cfg) for name, cfg in configs.items()}
    for name, table in tables.items():
        print(name, {t: f"{r['bytes_per_expert']} B ({r['bits_per_weight']:.2f} bit)" for t, r in table["tiers"].items()})
    write_result("tier_bytes", {"models": tables})


if __name__ == "__main__":
    main()
