"""Qwen2-MoE / Qwen1.5-MoE: q/k/v bias, shared expert behind a sigmoid gate, top-k usually not renormalised."""

from jmoe.config import ModelConfig, common_fields, require, sparse_layer_pattern

MODEL_TYPES = ("qwen2_moe",)


def _layer_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    if not hf.get("use_sliding_window"):
        return (None,) * num_layers
    window = int(hf["sliding_window"])
    types = hf.get("layer_types")
    if types is None:  # transformers' default pattern for Qwen2-MoE
        max_window_layers = int(hf.get("max_window_layers", num_layers))
        types = [
            "sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    return tuple(window if t == "sliding_attention" else None for t in types)


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    return ModelConfig(
        family="qwen2_moe",
        **base,
        moe_intermediate_size=int(require(hf, "moe_intermediate_size")),
        dense_intermediate_size=int(hf.get("intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layer_pattern(hf, base["num_layers"]),
        shared_expert_intermediate_size=int(require(hf, "shared_expert_intermediate_size")),
        qkv_bias=bool(hf.get("qkv_bias", True)),
        sliding_windows=_layer_windows(hf, base["num_layers"]),
    )
