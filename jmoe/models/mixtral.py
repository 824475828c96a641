"""Mixtral: every layer sparse, top-k always renormalised, plain attention with optional sliding window."""

from jmoe.config import ModelConfig, common_fields, require

MODEL_TYPES = ("mixtral",)


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf, default_theta=1e6)
    window = hf.get("sliding_window")
    return ModelConfig(
        family="mixtral",
        **base,
        moe_intermediate_size=int(require(hf, "intermediate_size")),
        norm_topk_prob=True,
        moe_layers=(True,) * base["num_layers"],
        sliding_windows=(int(window) if window else None,) * base["num_layers"],
    )
