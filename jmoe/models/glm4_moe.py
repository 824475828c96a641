"""GLM-4.5 / GLM-4.5-Air MoE: partial rotary (rotate-half on the first part of each head), q/k/v
bias, optional per-head q/k norm, dense first layers, ungated shared experts, sigmoid routing with
a correction bias (DeepSeek-V3's router)."""

from jmoe.config import ModelConfig, common_fields, hf_bool, hf_float, hf_int
from jmoe.errors import ConfigError
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "glm4_moe"
MODEL_TYPES = ("glm4_moe",)
CHECKPOINT_NAMES = CheckpointNames(shared_expert="shared_experts")
DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' default when config.json does not say


def _rotary_dim(hf: dict, head_dim: int) -> int:
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
    factor = hf_float({"partial_rotary_factor": factor}, "partial_rotary_factor")
    if factor > 1:
        raise ConfigError(f"config.json 'partial_rotary_factor' must be in (0, 1], got {factor}")
    return int(head_dim * factor)


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    layers = base["num_layers"]
    first_dense = hf_int(hf, "first_k_dense_replace", default=1, minimum=0)
    moe = hf_int(hf, "moe_intermediate_size")
    return ModelConfig(
        family=FAMILY,
        **base,
        rope_dim=_rotary_dim(hf, base["head_dim"]),
        qk_norm="head" if hf_bool(hf, "use_qk_norm", False) else None,
        qkv_bias=hf_bool(hf, "attention_bias", False),
        moe_intermediate_size=moe,
        dense_intermediate_size=hf_int(hf, "intermediate_size", default=0, minimum=0),
        moe_layers=tuple(i >= first_dense for i in range(layers)),
        shared_expert_intermediate_size=moe * hf_int(hf, "n_shared_experts", default=0, minimum=0),
        shared_expert_gated=False,
        router="sigmoid",
        norm_topk_prob=hf_bool(hf, "norm_topk_prob", True),
        routed_scaling_factor=hf_float(hf, "routed_scaling_factor", default=1.0),
        router_groups=hf_int(hf, "n_group", default=1),
        router_topk_groups=hf_int(hf, "topk_group", default=1),
    )
