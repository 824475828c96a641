"""OLMoE: q/k RMSNorm over the whole projection (before the head split), optional q/k/v clipping."""

from jmoe.config import ModelConfig, common_fields, require

MODEL_TYPES = ("olmoe",)


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf)
    clip = hf.get("clip_qkv")
    return ModelConfig(
        family="olmoe",
        **base,
        moe_intermediate_size=int(require(hf, "intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=(True,) * base["num_layers"],
        qk_norm="full",
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        clip_qkv=float(clip) if clip is not None else None,
    )
