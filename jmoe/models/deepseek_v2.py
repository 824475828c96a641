"""DeepSeek-V2 / V2-Lite: multi-head latent attention (interleaved RoPE), dense first layers, ungated
shared experts, softmax routing (greedy or group-limited) scaled by routed_scaling_factor."""

from jmoe.config import ModelConfig, common_fields, hf_bool, hf_float, hf_int
from jmoe.errors import ConfigError
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "deepseek_v2"
MODEL_TYPES = ("deepseek_v2",)
CHECKPOINT_NAMES = CheckpointNames(shared_expert="shared_experts")
TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_fields(hf: dict) -> dict:
    """What DeepSeek-V2 and V3 spell alike: MLA widths, dense first layers, shared experts."""
    base = common_fields(hf)
    if hf_bool(hf, "mlp_bias", False):
        raise ConfigError("config.json 'mlp_bias' true is not supported (DeepSeek MLPs have no biases)")
    nope, rope = hf_int(hf, "qk_nope_head_dim"), hf_int(hf, "qk_rope_head_dim")
    first_dense = hf_int(hf, "first_k_dense_replace", default=0, minimum=0)
    layers = base["num_layers"]
    moe = hf_int(hf, "moe_intermediate_size")
    bias = hf_bool(hf, "attention_bias", False)
    return dict(
        base,
        head_dim=nope + rope,  # config.json's head_dim is the rotary width
        num_kv_heads=base["num_heads"],
        attention="mla",
        q_lora_rank=hf_int(hf, "q_lora_rank", default=0, minimum=0) or 0,
        kv_lora_rank=hf_int(hf, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        v_head_dim=hf_int(hf, "v_head_dim"),
        rope_dim=rope,
        qkv_bias=bias,
        o_bias=bias,
        moe_intermediate_size=moe,
        dense_intermediate_size=hf_int(hf, "intermediate_size", default=0, minimum=0),
        moe_layers=tuple(i >= first_dense for i in range(layers)),
        shared_expert_intermediate_size=moe * hf_int(hf, "n_shared_experts", default=0, minimum=0),
        shared_expert_gated=False,
        routed_scaling_factor=hf_float(hf, "routed_scaling_factor", default=1.0),
    )


def config_from_hf(hf: dict) -> ModelConfig:
    method = hf.get("topk_method", "greedy") or "greedy"
    if method not in TOPK_METHODS:
        raise ConfigError(f"config.json 'topk_method' {method!r} is not supported; jmoe reads {', '.join(TOPK_METHODS)}")
    grouped = method == "group_limited_greedy"
    return ModelConfig(
        family=FAMILY,
        **deepseek_fields(hf),
        router="softmax",
        # transformers' DeepSeek-V2 router scales the top-k scores without renormalising them
        norm_topk_prob=False,
        router_groups=hf_int(hf, "n_group") if grouped else 1,
        router_topk_groups=hf_int(hf, "topk_group") if grouped else 1,
        rope_interleaved=True,
    )
