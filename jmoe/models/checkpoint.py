"""Hugging Face tensor names, mapped onto jmoe's parameter tree.

jmoe's NNX module names follow the HF ones, so one rule set covers every family; a family module
only declares (as CHECKPOINT_NAMES) where its sparse block lives and what its expert projections
are called.
"""

from __future__ import annotations

from dataclasses import dataclass

from jmoe.config import ModelConfig


@dataclass(frozen=True)
class CheckpointNames:
    moe_prefix: str = "mlp"  # Mixtral: "block_sparse_moe"
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    shared_expert: str = "shared_expert"  # DeepSeek, GLM: "shared_experts"
    router: tuple[str, ...] = ("gate",)  # the router's names, hub first (Phi-3.5-MoE 5.x fused: "router")
    # Fused 3-D expert tensors (fused_expert_names): stored K-major, gate_up [E, D, 2F] and down
    # [E, F, D] (GPT-OSS), rather than as linear weights [E, 2F, D], [E, D, F]; gate and up columns
    # interleaved (gate = 0::2, up = 1::2, GPT-OSS) rather than concatenated. Their biases, where the
    # config has expert_bias, are `<name>_bias`; MXFP4 checkpoints store `<name>_blocks` and
    # `<name>_scales` in linear orientation instead of `<name>` (convert/mxfp4.py).
    fused_kmajor: bool = False
    gate_up_interleaved: bool = False


def checkpoint_names(cfg: ModelConfig) -> CheckpointNames:
    """The family's checkpoint names and expert layout."""
    from jmoe.models import (
        family_named,  # the registry imports this module's CheckpointNames
    )

    return family_named(cfg.family).CHECKPOINT_NAMES


@dataclass(frozen=True)
class DenseTensor:
    """Where one jmoe dense parameter comes from: HF name(s), and whether it is transposed."""

    path: tuple  # key path in jmoe's parameter tree
    hf_names: tuple[str, ...]  # the hub spelling first, then the one transformers uses internally
    transpose: bool


def dense_tensor(cfg: ModelConfig, path: tuple) -> DenseTensor:
    """The HF tensor for a dense parameter path such as ('layers', 3, 'self_attn', 'q_proj', 'kernel')."""
    names = checkpoint_names(cfg)
    parts = [str(p) for p in path]
    leaf = parts[-1]
    transpose = leaf == "kernel"
    parts[-1] = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    if parts[0] == "lm_head":  # a tied model's refined head reads the embedding table
        tied = ("model.embed_tokens.weight",) if cfg.tie_word_embeddings else ()
        return DenseTensor(tuple(path), (".".join(parts), *tied), transpose)
    if parts[0] == "layers" and cfg.moe_layers[int(parts[1])] and parts[2] == "mlp":
        modules = [parts[3]]
        if parts[3] == "router":
            modules = list(names.router)
        elif parts[3] == "shared_expert":
            modules = [names.shared_expert]
        prefixes = dict.fromkeys([names.moe_prefix, "mlp"])
        candidates = tuple("model." + ".".join([*parts[:2], p, m, *parts[4:]]) for m in modules for p in prefixes)
        return DenseTensor(tuple(path), candidates, transpose)
    return DenseTensor(tuple(path), ("model." + ".".join(parts),), transpose)


def expert_tensor_names(cfg: ModelConfig, layer: int, expert: int, leaf: str = "weight") -> tuple[str, str, str]:
    """Per-expert (hub) layout: gate [F, D], up [F, D], down [D, F] (leaf "bias": [F], [F], [D])."""
    names = checkpoint_names(cfg)
    base = f"model.layers.{layer}.{names.moe_prefix}.experts.{expert}"
    return tuple(f"{base}.{proj}.{leaf}" for proj in names.expert_projs)


def fused_expert_names(cfg: ModelConfig, layer: int) -> list[tuple[str, str]]:
    """Fused 3-D layout written by newer transformers: gate_up_proj [E, 2F, D], down_proj [E, D, F]."""
    prefixes = dict.fromkeys([checkpoint_names(cfg).moe_prefix, "mlp"])
    return [
        (f"model.layers.{layer}.{p}.experts.gate_up_proj", f"model.layers.{layer}.{p}.experts.down_proj")
        for p in prefixes
    ]
