"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k with optional renormalisation, no shared expert."""

from jmoe.config import ModelConfig, common_fields, require, sparse_layer_pattern

MODEL_TYPES = ("qwen3_moe",)


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return ModelConfig(
        family="qwen3_moe",
        **base,
        moe_intermediate_size=int(require(hf, "moe_intermediate_size")),
        dense_intermediate_size=int(hf.get("intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layer_pattern(hf, base["num_layers"]),
        qk_norm="head",
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        sliding_windows=(window,) * base["num_layers"],
    )
