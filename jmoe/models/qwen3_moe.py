"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k with optional renormalisation, no shared expert."""

from jmoe.config import (
    ModelConfig,
    common_fields,
    hf_bool,
    hf_int,
    sparse_layer_pattern,
)
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "qwen3_moe"
MODEL_TYPES = ("qwen3_moe",)
CHECKPOINT_NAMES = CheckpointNames()


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    window = hf_int(hf, "sliding_window", default=None) if hf_bool(hf, "use_sliding_window", False) else None
    bias = hf_bool(hf, "attention_bias", False)
    return ModelConfig(
        family=FAMILY,
        **base,
        moe_intermediate_size=hf_int(hf, "moe_intermediate_size"),
        dense_intermediate_size=hf_int(hf, "intermediate_size", default=0, minimum=0),
        norm_topk_prob=hf_bool(hf, "norm_topk_prob", False),
        moe_layers=sparse_layer_pattern(hf, base["num_layers"]),
        qk_norm="head",
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=(window,) * base["num_layers"],
    )
