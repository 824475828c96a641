"""Small random Hugging Face MoE checkpoints of every supported family, for parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.06, tie_word_embeddings=False)

# One config per family, each exercising that family's variants.
FAMILY_CONFIGS = {
    "qwen3_moe": dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0]),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=12),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=2.0, norm_topk_prob=False),
    "phimoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
                   lm_head_bias=True),
    # sliding (window 8) and full layers alternating; a clamp small enough to act on these activations
    "gpt_oss": dict(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                    swiglu_limit=0.5),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def hf_config(family: str, **overrides):
    """The family's test config; `overrides` replace or add fields (a family's variants)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILY_CONFIGS.get(family, {}), **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def randomize_buffers(model, names: tuple[str, ...], scale: float = 0.05) -> None:
    """Give zero-initialised parameters and buffers (router biases, correction biases, attention
    sinks, ...) random values, so a test notices when they are dropped."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.rsplit(".", 1)[-1] in names:
                tensor.copy_(torch.randn_like(tensor) * scale)


def make_checkpoint(family: str, out: Path, *, fused: bool = False, seed: int = 0, overrides: dict | None = None,
                    randomize: tuple[str, ...] = ()):
    """Random model saved in bf16 (hub per-expert layout, or the fused 3-D layout).

    Returns the reference: the saved checkpoint loaded back by transformers in float32 (loading,
    not casting the in-memory model, keeps buffers such as RoPE's inv_freq in full precision).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **(overrides or {})), dtype=torch.float32)
    randomize_buffers(model, randomize)
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    if fused:
        model.config.to_json_file(out / "config.json")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    else:
        model.save_pretrained(out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()


def rewrite_config_as_v4(checkpoint: Path) -> None:
    """Rewrite config.json the way transformers 4.x spelled it (num_experts, top-level rope_theta)."""
    path = checkpoint / "config.json"
    cfg = json.loads(path.read_text())
    if "num_local_experts" in cfg and cfg["model_type"] != "mixtral":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    cfg["transformers_version"] = "4.51.0"
    path.write_text(json.dumps(cfg, indent=2))


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def hf_logits(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
