"""OLMoE: q/k RMSNorm over the whole projection (before the head split), optional q/k/v clipping."""

from jmoe.config import ModelConfig, common_fields, hf_bool, hf_float, hf_int
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "olmoe"
MODEL_TYPES = ("olmoe",)
CHECKPOINT_NAMES = CheckpointNames()


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    bias = hf_bool(hf, "attention_bias", False)
    return ModelConfig(
        family=FAMILY,
        **base,
        moe_intermediate_size=hf_int(hf, "intermediate_size"),
        norm_topk_prob=hf_bool(hf, "norm_topk_prob", False),
        moe_layers=(True,) * base["num_layers"],
        qk_norm="full",
        qkv_bias=bias,
        o_bias=bias,
        clip_qkv=hf_float(hf, "clip_qkv", default=None),
    )
