"""GPT-OSS: attention sinks and q/k/v/o biases, sliding and full attention layers (layer_types),
a biased router taking the softmax over its top-k logits, experts with biases and a clamped
SwiGLU, stored fused and K-major with gate/up columns interleaved (MXFP4 blocks on the hub)."""

from jmoe.config import ModelConfig, common_fields, hf_bool, hf_float, hf_int
from jmoe.errors import ConfigError
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "gpt_oss"
MODEL_TYPES = ("gpt_oss",)
CHECKPOINT_NAMES = CheckpointNames(router=("router",), fused_kmajor=True, gate_up_interleaved=True)
LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window from `layer_types` (transformers' default: sliding on even layers)."""
    window = hf_int(hf, "sliding_window", default=None, minimum=0) or None  # 0 or null: full attention
    types = hf.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[i % 2] for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"config.json 'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ConfigError(f"config.json 'layer_types' has unknown type(s) {unknown}; expected {', '.join(LAYER_TYPES)}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def config_from_hf(hf: dict) -> ModelConfig:
    quant = hf.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"config.json 'quantization_config' method {method!r} is not supported (only 'mxfp4' "
                          "experts, which the converter dequantizes)")
    base = common_fields(hf, default_theta=150000.0)
    bias = hf_bool(hf, "attention_bias", True)
    return ModelConfig(
        family=FAMILY,
        **{**base, "rms_norm_eps": hf_float(hf, "rms_norm_eps", default=1e-5)},
        moe_intermediate_size=hf_int(hf, "intermediate_size"),
        norm_topk_prob=False,
        moe_layers=(True,) * base["num_layers"],
        sliding_windows=layer_windows(hf, base["num_layers"]),
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        router="topk_softmax",
        expert_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_alpha=hf_float(hf, "swiglu_alpha", default=1.702),
        swiglu_limit=hf_float(hf, "swiglu_limit", default=7.0),
    )
