"""Phi-3.5-MoE: LayerNorm (weight and bias), attention and LM-head biases, the SparseMixer top-2
router, Mixtral's expert names, LongRoPE."""

from jmoe import validate
from jmoe.config import ModelConfig, common_fields, hf_bool, hf_float, hf_int, hf_value
from jmoe.errors import ConfigError
from jmoe.models.checkpoint import CheckpointNames
from jmoe.rope_config import check_param

FAMILY = "phimoe"
MODEL_TYPES = ("phimoe",)
# Hub layout: block_sparse_moe.gate + experts.N.w1/w3/w2; transformers 5.x's own (fused) layout
# names the router mlp.router.
CHECKPOINT_NAMES = CheckpointNames(moe_prefix="block_sparse_moe", expert_projs=("w1", "w3", "w2"),
                                   router=("gate", "router"))


def rope_params(hf: dict, base: dict) -> tuple:
    """LongRoPE as transformers 5.23 runs Phi-3.5-MoE: its rotary module recomputes the frequencies
    without the sequence length, so the short factor always applies (the long one never does), and
    cos/sin are scaled by short_mscale within original_max_position_embeddings, long_mscale past it.
    When generation crosses that length transformers recomputes the whole KV cache and jmoe keeps
    it; the released model has short_mscale == long_mscale, so the crossing changes nothing there."""
    if base["rope_type"] == "default":
        return base["rope_params"]
    if base["rope_type"] != "longrope":
        raise ConfigError(f"Phi-3.5-MoE with {base['rope_type']!r} RoPE is not supported (default or longrope)")
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(base["rope_params"])
    for key in ("short_mscale", "long_mscale"):
        value = hf[source].get(key)
        if value is None:
            raise ConfigError(f"config.json {source!r} has no {key!r} (needed for Phi-3.5-MoE's longrope RoPE)")
        params[key] = check_param(f"config.json {source} {key!r}", key, value)
    params["long_factor"] = params["short_factor"]
    return tuple(sorted(params.items()))


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf, default_theta=1e6)
    base["rope_params"] = rope_params(hf, base)
    if base["top_k"] != 2:
        raise ConfigError(f"config.json 'num_experts_per_tok' is {base['top_k']}, but Phi-3.5-MoE's sparsemixer "
                          "router always picks 2 experts")
    window = hf_int(hf, "sliding_window", default=None, minimum=0) or None  # 0 or null: full attention
    bias = hf_bool(hf, "attention_bias", False)
    return ModelConfig(
        family=FAMILY,
        **{**base, "rms_norm_eps": hf_float(hf, "rms_norm_eps", default=1e-5)},
        moe_intermediate_size=hf_int(hf, "intermediate_size"),
        norm_topk_prob=False,
        moe_layers=(True,) * base["num_layers"],
        sliding_windows=(window,) * base["num_layers"],
        qkv_bias=bias,
        o_bias=bias,
        norm="layer",
        lm_head_bias=hf_bool(hf, "lm_head_bias", False),
        router="sparsemixer",
        router_jitter_eps=validate.real("config.json 'router_jitter_noise'",
                                        hf_value(hf, "router_jitter_noise", default=0.01), minimum=0,
                                        error=ConfigError),
    )
