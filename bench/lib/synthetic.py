"""Synthetic Hugging Face MoE checkpoints with random weights, for memory and offload benchmarks.

Writes a Qwen3-MoE checkpoint (config.json, sharded safetensors in the hub's per-expert layout,
and the bundled model's tokenizer) one layer per shard, so generating a multi-GB model never holds
more than one layer in memory. Routing is skewed on purpose: every token embedding shares a
component along one direction u, and each layer's router adds b_e * u to expert e's row with b
drawn from a heavy-tailed distribution, so a few experts per layer take most tokens, like the
trained models the offload policies are built for.

    python -m bench.lib.synthetic OUT [--layers 4] [--hidden 2048] [--experts 128] [--top-k 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from bench.lib.common import TINY_HF

QWEN3_30B_A3B = dict(hidden=2048, moe_intermediate=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128)


def bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)


def write_checkpoint(out: Path, *, layers: int, hidden: int, moe_intermediate: int, experts: int, top_k: int,
                     heads: int, kv_heads: int, head_dim: int, vocab: int = 4096, skew: float = 0.5,
                     seed: int = 0) -> Path:
    """Write the checkpoint; returns `out`. vocab is the bundled tokenizer's (4096) so text works."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    std, out_std = 0.02, 0.004
    u = rng.normal(size=hidden).astype(np.float32)
    u /= np.linalg.norm(u)
    weight_map = {}

    def shard(name: str, tensors: dict[str, np.ndarray]) -> None:
        save_file({k: bf16(v) for k, v in tensors.items()}, str(out / name))
        weight_map.update({k: name for k in tensors})

    embed = rng.normal(size=(vocab, hidden)).astype(np.float32) * std + 0.02 * u  # shared direction u
    shard("model-embed.safetensors", {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": rng.normal(size=(vocab, hidden)).astype(np.float32) * std,
    })
    for layer in range(layers):
        t = {}
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        t[f"{p}.self_attn.q_proj.weight"] = rng.normal(size=(heads * head_dim, hidden)).astype(np.float32) * std
        t[f"{p}.self_attn.k_proj.weight"] = rng.normal(size=(kv_heads * head_dim, hidden)).astype(np.float32) * std
        t[f"{p}.self_attn.v_proj.weight"] = rng.normal(size=(kv_heads * head_dim, hidden)).astype(np.float32) * std
        # Small output projections keep each token's own embedding dominant in the residual stream,
        # so routing stays token-dependent through depth (random layers otherwise blur tokens together).
        t[f"{p}.self_attn.o_proj.weight"] = rng.normal(size=(hidden, heads * head_dim)).astype(np.float32) * out_std
        t[f"{p}.self_attn.q_norm.weight"] = np.ones(head_dim, np.float32)
        t[f"{p}.self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        bias = rng.standard_exponential(experts).astype(np.float32) * skew  # heavy tail: a few hot experts
        router = rng.normal(size=(experts, hidden)).astype(np.float32) * std + bias[:, None] * u[None, :]
        t[f"{p}.mlp.gate.weight"] = router
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            t[f"{q}.gate_proj.weight"] = rng.normal(size=(moe_intermediate, hidden)).astype(np.float32) * std
            t[f"{q}.up_proj.weight"] = rng.normal(size=(moe_intermediate, hidden)).astype(np.float32) * std
            t[f"{q}.down_proj.weight"] = rng.normal(size=(hidden, moe_intermediate)).astype(np.float32) * out_std
        shard(f"model-layer{layer:03d}.safetensors", t)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_local_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
        "decoder_sparse_step": 1, "mlp_only_layers": [], "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY_HF / name, out / name)
    return out


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--skew", type=float, default=0.5)
    args = parser.parse_args()
    write_checkpoint(args.out, layers=args.layers, skew=args.skew, **QWEN3_30B_A3B)
    print(f"wrote {args.out} ({checkpoint_bytes(args.out) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
