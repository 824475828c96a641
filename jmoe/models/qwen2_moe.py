"""Qwen2-MoE / Qwen1.5-MoE: q/k/v bias, shared expert behind a sigmoid gate, top-k usually not renormalised."""

from jmoe.config import (
    ModelConfig,
    common_fields,
    hf_bool,
    hf_int,
    sparse_layer_pattern,
)
from jmoe.errors import ConfigError
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "qwen2_moe"
MODEL_TYPES = ("qwen2_moe",)
CHECKPOINT_NAMES = CheckpointNames()


def _layer_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    if not hf_bool(hf, "use_sliding_window", False):
        return (None,) * num_layers
    window = hf_int(hf, "sliding_window")
    types = hf.get("layer_types")
    if types is None:  # transformers' default pattern for Qwen2-MoE
        max_window_layers = hf_int(hf, "max_window_layers", default=num_layers, minimum=0)
        types = [
            "sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"config.json 'layer_types' must list one attention type per layer ({num_layers})")
    return tuple(window if t == "sliding_attention" else None for t in types)


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    return ModelConfig(
        family=FAMILY,
        **base,
        moe_intermediate_size=hf_int(hf, "moe_intermediate_size"),
        dense_intermediate_size=hf_int(hf, "intermediate_size", default=0, minimum=0),
        norm_topk_prob=hf_bool(hf, "norm_topk_prob", False),
        moe_layers=sparse_layer_pattern(hf, base["num_layers"]),
        shared_expert_intermediate_size=hf_int(hf, "shared_expert_intermediate_size"),
        qkv_bias=hf_bool(hf, "qkv_bias", True),
        sliding_windows=_layer_windows(hf, base["num_layers"]),
    )
