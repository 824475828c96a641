"""Random-weight Hugging Face checkpoints with a real model's exact layer shapes, cut to N layers.

Each named model carries its released config.json values (hidden width, heads, experts, top-k,
expert width, vocabulary, RoPE, ...) and writes tensors under the hub's names and layouts:
per-expert tensors for Qwen3-MoE, Mixtral and DeepSeek-V2, GPT-OSS's fused K-major experts with
interleaved gate/up columns and biases (the bf16 layout; the hub's MXFP4 blocks are a storage
detail the converter dequantizes). Only `num_hidden_layers` (and the per-layer lists that depend
on it) changes.

Weights are bf16, written straight into each safetensors shard one tensor at a time (one shard
for the embeddings and head, one per layer), so a multi-GB checkpoint never sits in memory.
Scales keep activations finite: in-projections normal * 0.02, out-projections smaller so each
token's own embedding stays visible through depth, norms 1, biases small. Routing is skewed on
purpose, as in bench/lib/synthetic.py: token embeddings share a direction u and each router row adds
b_e * u with b heavy-tailed, so a few experts per layer take most tokens, like a trained model.

The tokenizer is the bundled tiny model's, padded with unreachable tokens to the real vocabulary
size (config.json's vocab_size is the real one), so text prompts work and every id has a token.

    python -m bench.lib.random_checkpoint qwen3-30b-a3b OUT [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from bench.lib.common import TINY_HF

STD = 0.02  # in-projections, embeddings, LM head
OUT_STD = 0.004  # out-projections (attention output, expert down)
BIAS_STD = 0.02
SKEW = 0.5  # scale of the heavy-tailed router bias along the shared direction u
ROWS_PER_CHUNK = 4096  # rows generated at once: bounds the float32 scratch of a large tensor


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its hub name, shape, and how it is filled."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal", "out", "bias", "ones", "zeros", "embed", "router"


@dataclass(frozen=True)
class RealModel:
    """A released model: its config.json (all layers) and how one layer's tensors are named."""

    name: str
    hub_id: str
    config: dict
    layer_tensors: Callable[[dict, int], list[Tensor]]
    per_layer_keys: tuple[str, ...] = ()  # config lists with one entry per layer
    notes: str = ""

    def config_for(self, layers: int) -> dict:
        full = self.config["num_hidden_layers"]
        if not 1 <= layers <= full:
            raise ValueError(f"{self.name} has {full} layers; --layers must be 1..{full}, got {layers}")
        dense_first = self.config.get("first_k_dense_replace", 0)
        if layers <= dense_first:
            raise ValueError(f"{self.name}'s first {dense_first} layer(s) are dense: keep at least {dense_first + 1} "
                             "layers so one has experts")
        cfg = dict(self.config, num_hidden_layers=layers)
        for key in self.per_layer_keys:
            cfg[key] = list(self.config[key][:layers])
        return cfg


def attention(p: str, d: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False,
              qk_norm: bool = False) -> list[Tensor]:
    t = [Tensor(f"{p}.self_attn.q_proj.weight", (heads * head_dim, d), "normal"),
         Tensor(f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, d), "normal"),
         Tensor(f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, d), "normal"),
         Tensor(f"{p}.self_attn.o_proj.weight", (d, heads * head_dim), "out")]
    if bias:
        t += [Tensor(f"{p}.self_attn.q_proj.bias", (heads * head_dim,), "bias"),
              Tensor(f"{p}.self_attn.k_proj.bias", (kv_heads * head_dim,), "bias"),
              Tensor(f"{p}.self_attn.v_proj.bias", (kv_heads * head_dim,), "bias"),
              Tensor(f"{p}.self_attn.o_proj.bias", (d,), "bias")]
    if qk_norm:
        t += [Tensor(f"{p}.self_attn.q_norm.weight", (head_dim,), "ones"),
              Tensor(f"{p}.self_attn.k_norm.weight", (head_dim,), "ones")]
    return t


def norms(p: str, d: int) -> list[Tensor]:
    return [Tensor(f"{p}.input_layernorm.weight", (d,), "ones"),
            Tensor(f"{p}.post_attention_layernorm.weight", (d,), "ones")]


def mlp(p: str, d: int, f: int, names=("gate_proj", "up_proj", "down_proj")) -> list[Tensor]:
    gate, up, down = names
    return [Tensor(f"{p}.{gate}.weight", (f, d), "normal"), Tensor(f"{p}.{up}.weight", (f, d), "normal"),
            Tensor(f"{p}.{down}.weight", (d, f), "out")]


def experts(p: str, d: int, f: int, n: int, names=("gate_proj", "up_proj", "down_proj")) -> list[Tensor]:
    return [t for e in range(n) for t in mlp(f"{p}.experts.{e}", d, f, names)]


def qwen3_moe_layer(c: dict, i: int) -> list[Tensor]:
    p, d = f"model.layers.{i}", c["hidden_size"]
    return [*norms(p, d),
            *attention(p, d, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], qk_norm=True),
            Tensor(f"{p}.mlp.gate.weight", (c["num_experts"], d), "router"),
            *experts(f"{p}.mlp", d, c["moe_intermediate_size"], c["num_experts"])]


def mixtral_layer(c: dict, i: int) -> list[Tensor]:
    p, d = f"model.layers.{i}", c["hidden_size"]
    heads = c["num_attention_heads"]
    return [*norms(p, d), *attention(p, d, heads, c["num_key_value_heads"], d // heads),
            Tensor(f"{p}.block_sparse_moe.gate.weight", (c["num_local_experts"], d), "router"),
            *experts(f"{p}.block_sparse_moe", d, c["intermediate_size"], c["num_local_experts"], ("w1", "w3", "w2"))]


def gpt_oss_layer(c: dict, i: int) -> list[Tensor]:
    p, d, f, n = f"model.layers.{i}", c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    return [*norms(p, d),
            *attention(p, d, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], bias=True),
            Tensor(f"{p}.self_attn.sinks", (c["num_attention_heads"],), "bias"),
            Tensor(f"{p}.mlp.router.weight", (n, d), "router"),
            Tensor(f"{p}.mlp.router.bias", (n,), "bias"),
            # fused and K-major: gate_up [E, D, 2F] (gate = columns 0::2, up = 1::2), down [E, F, D]
            Tensor(f"{p}.mlp.experts.gate_up_proj", (n, d, 2 * f), "normal"),
            Tensor(f"{p}.mlp.experts.gate_up_proj_bias", (n, 2 * f), "bias"),
            Tensor(f"{p}.mlp.experts.down_proj", (n, f, d), "out"),
            Tensor(f"{p}.mlp.experts.down_proj_bias", (n, d), "bias")]


def deepseek_v2_layer(c: dict, i: int) -> list[Tensor]:
    p, d, heads = f"model.layers.{i}", c["hidden_size"], c["num_attention_heads"]
    nope, rope, v, rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    assert c["q_lora_rank"] is None, "only V2-Lite's full q_proj is written"
    t = [*norms(p, d),
         Tensor(f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), d), "normal"),
         Tensor(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (rank + rope, d), "normal"),
         Tensor(f"{p}.self_attn.kv_a_layernorm.weight", (rank,), "ones"),
         Tensor(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), rank), "normal"),
         Tensor(f"{p}.self_attn.o_proj.weight", (d, heads * v), "out")]
    if i < c["first_k_dense_replace"]:
        return t + mlp(f"{p}.mlp", d, c["intermediate_size"])
    f = c["moe_intermediate_size"]
    return t + [Tensor(f"{p}.mlp.gate.weight", (c["n_routed_experts"], d), "router"),
                *experts(f"{p}.mlp", d, f, c["n_routed_experts"]),
                *mlp(f"{p}.mlp.shared_experts", d, f * c["n_shared_experts"])]


# config.json of each released model (transformers 4.x spelling, as on the hub).
MODELS = {
    "qwen3-30b-a3b": RealModel(
        "Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B",
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
         "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
         "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
         "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
         "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
         "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
         "output_router_logits": False, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
         "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
         "use_sliding_window": False, "vocab_size": 151936},
        qwen3_moe_layer),
    "gpt-oss-20b": RealModel(
        "GPT-OSS-20B", "openai/gpt-oss-20b",
        {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
         "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
         "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
         "intermediate_size": 2880,
         "layer_types": ["sliding_attention", "full_attention"] * 12,
         "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
         "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
         "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-5,
         "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                          "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
         "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0",
         "use_cache": True, "vocab_size": 201088},
        gpt_oss_layer, per_layer_keys=("layer_types",),
        notes="bf16 experts (the hub stores them as MXFP4 blocks, which jmoe convert dequantizes)"),
    "mixtral-8x7b": RealModel(
        "Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1",
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
         "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
         "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
         "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
         "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
         "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "transformers_version": "4.36.0", "use_cache": True, "vocab_size": 32000},
        mixtral_layer),
    "deepseek-v2-lite": RealModel(
        "DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite",
        {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
         "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001,
         "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
         "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
         "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
         "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
         "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
         "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
         "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
         "transformers_version": "4.39.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400},
        deepseek_v2_layer, notes="layer 0 is dense (first_k_dense_replace = 1)"),
}


def model_named(name: str) -> RealModel:
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[key]


def write_safetensors(path: Path, tensors: list[Tensor], fill: Callable[[Tensor], Iterable[np.ndarray]]) -> None:
    """Write a bf16 safetensors file tensor by tensor: the header is known from the shapes, then
    each tensor's bytes are produced in chunks by fill(tensor) and appended."""
    header, offset = {}, 0
    for t in tensors:
        nbytes = 2 * int(np.prod(t.shape))
        header[t.name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            written = 0
            for chunk in fill(t):
                f.write(np.ascontiguousarray(chunk, dtype=ml_dtypes.bfloat16).tobytes())
                written += chunk.size
            assert written == int(np.prod(t.shape)), t.name


class Filler:
    """Random values per init kind, generated in row chunks (float32 scratch stays small)."""

    def __init__(self, hidden: int, seed: int):
        self.rng = np.random.default_rng(seed)
        u = self.rng.standard_normal(hidden, dtype=np.float32)
        self.u = u / np.linalg.norm(u)

    def __call__(self, t: Tensor):
        shape = t.shape
        if t.init in ("ones", "zeros"):
            yield np.full(shape, 1.0 if t.init == "ones" else 0.0, np.float32)
            return
        if t.init == "router":  # heavy tail along u: a few hot experts per layer
            bias = self.rng.standard_exponential(shape[0]).astype(np.float32) * SKEW
            yield self.normal(shape, STD) + bias[:, None] * self.u[None, :]
            return
        std = {"normal": STD, "embed": STD, "out": OUT_STD, "bias": BIAS_STD}[t.init]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        cols = shape[-1]
        for start in range(0, rows, ROWS_PER_CHUNK):
            n = min(ROWS_PER_CHUNK, rows - start)
            chunk = self.normal((n, cols), std)
            if t.init == "embed":
                chunk += STD * self.u[None, :]  # the shared direction the routers lean on
            yield chunk

    def normal(self, shape, std: float) -> np.ndarray:
        x = self.rng.standard_normal(shape, dtype=np.float32)
        x *= std
        return x


def padded_tokenizer(vocab_size: int) -> dict:
    """The bundled tokenizer with unreachable tokens appended up to vocab_size."""
    tok = json.loads((TINY_HF / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
    for i in range(vocab_size):
        if i not in used:
            vocab[f"<|unused_{i}|>"] = i
    return tok


def write_checkpoint(model: str | RealModel, out: Path, *, layers: int, seed: int = 0) -> Path:
    """Write the checkpoint into `out` (created); returns `out`."""
    spec = model_named(model) if isinstance(model, str) else model
    cfg = spec.config_for(layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    fill = Filler(d, seed)
    shards = {"model-embed.safetensors": [Tensor("model.embed_tokens.weight", (vocab, d), "embed"),
                                          Tensor("model.norm.weight", (d,), "ones"),
                                          Tensor("lm_head.weight", (vocab, d), "normal")]}
    for i in range(layers):
        shards[f"model-layer{i:03d}.safetensors"] = spec.layer_tensors(cfg, i)
    weight_map, total = {}, 0
    for name, tensors in shards.items():
        write_safetensors(out / name, tensors, fill)
        weight_map.update({t.name: name for t in tensors})
        total += sum(2 * int(np.prod(t.shape)) for t in tensors)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "tokenizer.json").write_text(json.dumps(padded_tokenizer(vocab), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text((TINY_HF / "tokenizer_config.json").read_text())
    (out / "random_checkpoint.json").write_text(json.dumps(
        {"model": spec.name, "hub_id": spec.hub_id, "layers": layers, "seed": seed, "notes": spec.notes}, indent=1))
    return out


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        path = write_checkpoint(args.model, args.out, layers=args.layers, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {path} ({checkpoint_bytes(path) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
