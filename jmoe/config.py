"""The model configuration jmoe runs from: one frozen dataclass, family-neutral.

Family modules (jmoe/models/) translate a Hugging Face config.json into it; shared layer code
reads feature flags (qk_norm, qkv_bias, shared expert, ...) and never a family name.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from jmoe import validate
from jmoe.errors import ConfigError
from jmoe.rope_config import check_rope, rope_from_hf

log = logging.getLogger("jmoe.config")


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
    attention_sinks: bool = False  # GPT-OSS: a learned per-head logit in the softmax's normaliser
    # Layer norms (decoder layers and the final norm): "rms" (RMSNorm) or "layer" (LayerNorm with weight
    # and bias, Phi-3.5-MoE); rms_norm_eps is the eps of either. lm_head_bias: the LM head adds a bias.
    norm: str = "rms"
    lm_head_bias: bool = False
    # SparseMixer router (Phi-3.5-MoE): experts scoring more than 2 * eps (relative) below the best
    # are masked out of each pick's softmax (HF's router_jitter_noise).
    router_jitter_eps: float = 0.0
    # Which modules the family's layers use (jmoe/layers/modules.py): attention and router kinds.
    attention: str = "gqa"
    router: str = "softmax"
    # Router options: scores scaled after selection; group-limited top-k (the top `router_topk_groups`
    # of `router_groups` equal groups of experts are eligible).
    routed_scaling_factor: float = 1.0
    router_groups: int = 1
    router_topk_groups: int = 1
    # Multi-head latent attention (attention "mla"): ranks of the query and key/value compressions
    # (q_lora_rank 0 = a full-rank query), and the per-head widths without position (nope) and of
    # values; the rotary part of each head is rope_dim wide and head_dim = nope + rope.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE scales its shared expert by sigmoid(x @ gate)
    # Routed-expert FFN variants (GPT-OSS): biases after gate_up and down, carried unquantized (float32)
    # in every expert version; the gated activation, "silu" (SwiGLU) or "clamped_swiglu" with its
    # sigmoid gain and clamp (kernel_formats/glu.py).
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # RoPE: type and its extra parameters as sorted (name, value) pairs (hashable, JSON-friendly);
    # rope_dim 0 = the whole head; interleaved pairs (DeepSeek) instead of rotate-half.
    rope_type: str = "default"
    rope_params: tuple = ()
    rope_dim: int = 0
    rope_interleaved: bool = False
    # Special tokens.
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        self._check_fields()
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts % self.router_groups:
            raise ConfigError(f"n_group ({self.router_groups}) must divide the number of experts ({self.num_experts})")
        if self.top_k > self.router_topk_groups * (self.num_experts // self.router_groups):
            raise ConfigError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of the topk_group "
                              f"({self.router_topk_groups}) groups a token may use")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts})")
        if self.qk_norm not in (None, "head", "full"):
            raise ConfigError(f"qk_norm must be None, 'head' or 'full', not {self.qk_norm!r}")
        if self.expert_activation not in ("silu", "clamped_swiglu"):
            raise ConfigError(f"expert_activation must be 'silu' or 'clamped_swiglu', not {self.expert_activation!r}")
        if self.norm not in ("rms", "layer"):
            raise ConfigError(f"norm must be 'rms' or 'layer', not {self.norm!r}")
        if self.lm_head_bias and self.tie_word_embeddings:
            raise ConfigError("lm_head_bias with tie_word_embeddings (an LM head bias on the embedding table) "
                              "is not supported")
        if not all(self.moe_layers) and self.dense_intermediate_size < 1:
            raise ConfigError("the model has dense (non-MoE) layers but intermediate_size is missing or 0")
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_nope_head_dim and self.v_head_dim
                                            and self.head_dim == self.qk_nope_head_dim + self.rotary_dim):
            raise ConfigError("latent attention needs kv_lora_rank, qk_nope_head_dim and v_head_dim >= 1 and "
                              "head_dim = qk_nope_head_dim + the rotary width")
        if self.rotary_dim % 2:
            raise ConfigError(f"the rotary dimension must be even, got {self.rotary_dim}")
        check_rope(self.rope_type, self.rope_params, self.rotary_dim)

    def _check_fields(self) -> None:
        """Types and ranges of every field (configs come from files a user may have edited)."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings", "num_experts", "top_k", "moe_intermediate_size"):
            validate.integer(name, getattr(self, name), minimum=1, error=ConfigError)
        for name in ("dense_intermediate_size", "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim"):
            validate.integer(name, getattr(self, name), minimum=0, error=ConfigError)
        validate.real("rms_norm_eps", self.rms_norm_eps, above=0, error=ConfigError)
        validate.real("rope_theta", self.rope_theta, above=0, error=ConfigError)
        validate.real("routed_scaling_factor", self.routed_scaling_factor, above=0, error=ConfigError)
        validate.integer("router_groups", self.router_groups, minimum=1, error=ConfigError)
        validate.integer("router_topk_groups", self.router_topk_groups, minimum=1, maximum=self.router_groups,
                         error=ConfigError)
        validate.integer("rope_dim", self.rope_dim, minimum=0, error=ConfigError)
        if self.clip_qkv is not None:
            validate.real("clip_qkv", self.clip_qkv, above=0, error=ConfigError)
        validate.real("router_jitter_eps", self.router_jitter_eps, minimum=0, error=ConfigError)
        validate.real("swiglu_alpha", self.swiglu_alpha, above=0, error=ConfigError)
        validate.real("swiglu_limit", self.swiglu_limit, above=0, error=ConfigError)
        for name in ("tie_word_embeddings", "norm_topk_prob", "qkv_bias", "o_bias", "attention_sinks",
                     "shared_expert_gated", "rope_interleaved", "lm_head_bias", "expert_bias"):
            validate.boolean(name, getattr(self, name), error=ConfigError)
        for name in ("family", "attention", "router", "rope_type", "norm"):
            validate.text(name, getattr(self, name), error=ConfigError)
        for name in ("moe_layers", "sliding_windows", "eos_token_ids", "rope_params"):
            if not isinstance(getattr(self, name), tuple):
                raise ConfigError(f"{name} must be a list, got {type(getattr(self, name)).__name__}")
        for i, flag in enumerate(self.moe_layers):
            validate.boolean(f"moe_layers[{i}]", flag, error=ConfigError)
        for i, window in enumerate(self.sliding_windows):
            if window is not None:
                validate.integer(f"sliding_windows[{i}]", window, minimum=1, error=ConfigError)
        token = dict(minimum=0, maximum=self.vocab_size - 1, error=ConfigError)
        for i, eos in enumerate(self.eos_token_ids):
            validate.integer(f"eos_token_id[{i}]", eos, **token)
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                validate.integer(name, getattr(self, name), **token)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Decoder-layer index of each MoE layer; the handle table's rows follow this order."""
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def rope_param(self) -> dict[str, Any]:
        return dict(self.rope_params)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"a model config must be a JSON object, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ConfigError(f"unknown model config fields {sorted(unknown)}")
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in d]
        if missing:
            raise ConfigError(f"model config is missing {', '.join(missing)}")
        kwargs = {k: _tuples(v) for k, v in d.items()}
        return cls(**kwargs)


def _tuples(value: Any) -> Any:
    """JSON lists back into the tuples a frozen (hashable) config holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def hf_value(hf: dict[str, Any], *names: str, default: Any = ConfigError) -> Any:
    """The first of `names` present in a HF config dict (4.x and 5.x spell some fields differently)."""
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    if default is ConfigError:
        spelled = " or ".join(repr(n) for n in names)
        raise ConfigError(f"config.json has no {spelled} (needed for model_type {hf.get('model_type')!r})")
    return default


def _field(names: tuple[str, ...]) -> str:
    return f"config.json {names[0]!r}"


def hf_int(hf: dict[str, Any], *names: str, default: Any = ConfigError, minimum: int | None = 1) -> int | None:
    """An integer field (an integral float such as 1e6 is accepted), range-checked, named in errors."""
    value = hf_value(hf, *names, default=default)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return validate.integer(_field(names), value, minimum=minimum, error=ConfigError)


def hf_float(hf: dict[str, Any], *names: str, default: Any = ConfigError, above: float | None = 0.0) -> float | None:
    value = hf_value(hf, *names, default=default)
    return None if value is None else validate.real(_field(names), value, above=above, error=ConfigError)


def hf_bool(hf: dict[str, Any], name: str, default: bool) -> bool:
    value = hf.get(name)
    return default if value is None else validate.boolean(_field((name,)), value, error=ConfigError)


def hf_int_list(hf: dict[str, Any], name: str, *, minimum: int = 0) -> tuple[int, ...]:
    """A list of integers (or one integer) such as eos_token_id or mlp_only_layers; () when absent."""
    value = hf.get(name)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    return tuple(validate.integer(f"{_field((name,))}[{i}]", v, minimum=minimum, error=ConfigError)
                 for i, v in enumerate(items))


def common_fields(hf: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """Fields every supported family spells the same way (or in a known 4.x/5.x variant)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    hidden = hf_int(hf, "hidden_size")
    heads = hf_int(hf, "num_attention_heads")
    return dict(
        vocab_size=hf_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=hf_int(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf_int(hf, "num_key_value_heads", default=heads),
        head_dim=hf_int(hf, "head_dim", default=hidden // heads),
        rms_norm_eps=hf_float(hf, "rms_norm_eps", default=1e-6),
        **rope_from_hf(hf, default_theta),
        max_position_embeddings=hf_int(hf, "max_position_embeddings", default=4096),
        tie_word_embeddings=hf_bool(hf, "tie_word_embeddings", False),
        num_experts=hf_int(hf, "num_local_experts", "num_experts", "n_routed_experts"),
        top_k=hf_int(hf, "num_experts_per_tok"),
        **special_tokens(hf, hf_int(hf, "vocab_size")),
    )


def special_tokens(hf: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """bos/eos/pad ids; ids outside the vocabulary (a config default some checkpoints keep) are
    dropped with a warning, as transformers only warns about them too."""
    def in_vocab(name: str, ids: tuple[int, ...]) -> tuple[int, ...]:
        outside = [i for i in ids if i >= vocab_size]
        if outside:
            log.warning("config.json %r %s is outside the vocabulary of %d; ignored", name, outside, vocab_size)
        return tuple(i for i in ids if i < vocab_size)

    single = {name: in_vocab(name, hf_int_list(hf, name)[:1]) for name in ("bos_token_id", "pad_token_id")}
    return dict(
        bos_token_id=single["bos_token_id"][0] if single["bos_token_id"] else None,
        eos_token_ids=in_vocab("eos_token_id", hf_int_list(hf, "eos_token_id")),
        pad_token_id=single["pad_token_id"][0] if single["pad_token_id"] else None,
    )


def sparse_layer_pattern(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen-style `decoder_sparse_step` / `mlp_only_layers`: which layers are MoE."""
    step = hf_int(hf, "decoder_sparse_step", default=1)
    dense_only = set(hf_int_list(hf, "mlp_only_layers"))
    return tuple((i not in dense_only) and ((i + 1) % step == 0) for i in range(num_layers))
