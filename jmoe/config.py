"""The model configuration jmoe runs from: one frozen dataclass, family-neutral.

Family modules (jmoe/models/) translate a Hugging Face config.json into it; shared layer code
reads feature flags (qk_norm, qkv_bias, shared expert, ...) and never a family name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jmoe.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Routed experts.
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: True = sparse MoE block, False = dense MLP
    dense_intermediate_size: int = 0  # width of the dense MLP in non-MoE layers
    # Qwen2-MoE style shared expert (0 = none), scaled by sigmoid(x @ shared_gate).
    shared_expert_intermediate_size: int = 0
    # Attention variants.
    qk_norm: str | None = None  # None | "head" (per head, Qwen3) | "full" (whole projection, OLMoE)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    # Special tokens.
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts})")
        if self.qk_norm not in (None, "head", "full"):
            raise ConfigError(f"qk_norm must be None, 'head' or 'full', not {self.qk_norm!r}")

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Decoder-layer index of each MoE layer; the handle table's rows follow this order."""
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown model config fields {sorted(unknown)}")
        kwargs = dict(d)
        for name in ("moe_layers", "sliding_windows", "eos_token_ids"):
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)


def require(hf: dict[str, Any], *names: str, default: Any = ConfigError) -> Any:
    """The first of `names` present in a HF config dict (4.x and 5.x spell some fields differently)."""
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    if default is ConfigError:
        spelled = " or ".join(repr(n) for n in names)
        raise ConfigError(f"config.json has no {spelled} (needed for model_type {hf.get('model_type')!r})")
    return default


def rope_theta_from_hf(hf: dict[str, Any], default_theta: float = 10000.0) -> float:
    """rope_theta from transformers 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", hf.get("rope_theta"))
    else:
        scaling = hf.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        theta = hf.get("rope_theta")
    if rope_type not in ("default", None):
        raise ConfigError(f"rope type {rope_type!r} is not supported yet (only the default RoPE)")
    return float(default_theta if theta is None else theta)


def eos_ids_from_hf(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def common_fields(hf: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """Fields every supported family spells the same way (or in a known 4.x/5.x variant)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    hidden = int(require(hf, "hidden_size"))
    heads = int(require(hf, "num_attention_heads"))
    return dict(
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(require(hf, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(require(hf, "num_key_value_heads", default=heads)),
        head_dim=int(require(hf, "head_dim", default=hidden // heads)),
        rms_norm_eps=float(require(hf, "rms_norm_eps", default=1e-6)),
        rope_theta=rope_theta_from_hf(hf, default_theta),
        max_position_embeddings=int(require(hf, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_experts=int(require(hf, "num_local_experts", "num_experts")),
        top_k=int(require(hf, "num_experts_per_tok")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids_from_hf(hf),
        pad_token_id=hf.get("pad_token_id"),
    )


def sparse_layer_pattern(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen-style `decoder_sparse_step` / `mlp_only_layers`: which layers are MoE."""
    step = int(hf.get("decoder_sparse_step") or 1)
    dense_only = set(hf.get("mlp_only_layers") or [])
    return tuple((i not in dense_only) and ((i + 1) % step == 0) for i in range(num_layers))
