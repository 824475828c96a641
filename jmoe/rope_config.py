"""RoPE settings from a Hugging Face config.json: the type and every parameter its frequencies need.

transformers 5.x writes `rope_parameters` (rope_theta inside); 4.x wrote `rope_theta` and
`rope_scaling` at the top level, older configs with `type` for `rope_type`. Whatever transformers
fills in from other config fields (original_max_position_embeddings, a factor from the context
lengths, YaRN's and LongRoPE's attention factor) is resolved here, so the runtime
(jmoe/layers/rope.py) reads `ModelConfig.rope_params` only.
"""

from __future__ import annotations

import math
from typing import Any

from jmoe import validate
from jmoe.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# The parameters each type's frequencies read. Optional: yarn's mscale/mscale_all_dim (DeepSeek's
# attention reads them for its softmax scale); longrope's short_mscale/long_mscale, which a family
# sets to scale cos/sin per side instead of by attention_factor (Phi-3.5-MoE).
REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
OPTIONAL = {"yarn": ("mscale", "mscale_all_dim"), "longrope": ("short_mscale", "long_mscale")}

POSITIVE = ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor",
            "short_mscale", "long_mscale")
LENGTHS = ("max_position_embeddings", "original_max_position_embeddings")
FACTOR_LISTS = ("short_factor", "long_factor")


def check_param(field: str, key: str, value: Any) -> Any:
    """One RoPE parameter, type- and range-checked; `field` is how the error names it."""
    if key in POSITIVE:
        return validate.real(field, value, above=0, error=ConfigError)
    if key in LENGTHS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return validate.integer(field, value, minimum=1, error=ConfigError)
    if key in FACTOR_LISTS:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field} must be a list of numbers, got {type(value).__name__}")
        return tuple(validate.real(f"{field}[{i}]", v, above=0, error=ConfigError) for i, v in enumerate(value))
    if key == "truncate":
        return validate.boolean(field, value, error=ConfigError)
    return validate.real(field, value, error=ConfigError)  # mscale, mscale_all_dim


def check_rope(rope_type: str, rope_params: tuple, rotary_dim: int) -> None:
    """A ModelConfig's RoPE (also one read back from a converted model): a known type, exactly the
    parameters it needs, each in range, LongRoPE's lists one entry per frequency."""
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in rope_params):
        raise ConfigError("rope_params must be a list of [name, value] pairs")
    params = dict(rope_params)
    missing = [k for k in REQUIRED[rope_type] if k not in params]
    unknown = sorted(set(params) - set(REQUIRED[rope_type]) - set(OPTIONAL.get(rope_type, ())))
    if missing or unknown:
        raise ConfigError(f"rope_params for {rope_type} RoPE: missing {missing}, unknown {unknown}")
    for key, value in params.items():
        check_param(f"rope_params {key!r}", key, value)
    if ("short_mscale" in params) != ("long_mscale" in params):
        raise ConfigError("rope_params: short_mscale and long_mscale go together")
    if rope_type == "dynamic" and rotary_dim <= 2:  # its base grows with the power dim / (dim - 2)
        raise ConfigError(f"dynamic RoPE needs a rotary dimension above 2, got {rotary_dim}")
    for key in FACTOR_LISTS:
        if key in params and len(params[key]) != rotary_dim // 2:
            raise ConfigError(f"RoPE {key!r} has {len(params[key])} entries, but the rotary dimension {rotary_dim} "
                              f"needs {rotary_dim // 2} (one per frequency)")


def rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """rope_theta, rope_type and rope_params (sorted (name, value) pairs) for ModelConfig."""
    source, rope = _rope_dict(hf)
    theta = rope.get("rope_theta")
    theta = hf.get("rope_theta") if theta is None else theta
    theta = default_theta if theta is None else theta
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "default" if rope_type is None else rope_type
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"config.json {source} rope_type {rope_type!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    params = _RESOLVE[rope_type](_Reader(hf, source, rope)) if rope_type != "default" else {}
    return {
        "rope_theta": validate.real("config.json 'rope_theta'", theta, above=0, error=ConfigError),
        "rope_type": rope_type,
        "rope_params": tuple(sorted(params.items())),
    }


def _rope_dict(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(its name, the RoPE dict); a 4.x `rope_scaling` replaces `rope_parameters`, as in transformers."""
    for name in ("rope_parameters", "rope_scaling"):
        value = hf.get(name)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json {name!r} must be an object, got {type(value).__name__}")
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(name) or {}
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"config.json {name!r} gives RoPE per layer type ({', '.join(nested)}); not supported")
    return name, rope


class _Reader:
    """Reads one type's parameters from the RoPE dict, naming config.json's field in every error."""

    def __init__(self, hf: dict[str, Any], source: str, rope: dict[str, Any]):
        self.hf, self.source, self.rope = hf, source, rope
        self.rope_type = rope.get("rope_type", rope.get("type"))

    def get(self, key: str, default: Any = None) -> Any:
        value = self.rope.get(key)
        return default if value is None else check_param(f"config.json {self.source} {key!r}", key, value)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"config.json {self.source} has no {key!r} (needed for {self.rope_type} RoPE)")
        return value

    def max_position_embeddings(self) -> int:
        value = self.hf.get("max_position_embeddings")
        if value is None:
            raise ConfigError(f"config.json has no 'max_position_embeddings' (needed for {self.rope_type} RoPE)")
        return check_param("config.json 'max_position_embeddings'", "max_position_embeddings", value)

    def original_max_position_embeddings(self) -> int:
        # transformers gives a top-level original_max_position_embeddings (Phi-3 style) priority
        # over the RoPE dict's, and falls back to max_position_embeddings.
        top = self.hf.get("original_max_position_embeddings")
        if top is not None:
            return check_param("config.json 'original_max_position_embeddings'",
                               "original_max_position_embeddings", top)
        return self.get("original_max_position_embeddings") or self.max_position_embeddings()

    def factor_or_context_ratio(self, original: int) -> float:
        """`factor`, else (as transformers does) max_position_embeddings / original."""
        factor = self.get("factor")
        return self.max_position_embeddings() / original if factor is None else factor


def _linear(r: _Reader) -> dict[str, Any]:
    return {"factor": r.need("factor")}


def _dynamic(r: _Reader) -> dict[str, Any]:
    return {"factor": r.need("factor"), "max_position_embeddings": r.max_position_embeddings()}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(r: _Reader) -> dict[str, Any]:
    original = r.original_max_position_embeddings()
    factor = r.factor_or_context_ratio(original)
    mscale, mscale_all_dim = r.get("mscale"), r.get("mscale_all_dim")
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        # transformers: the mscale ratio only when both are set and non-zero
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    truncate = r.rope.get("truncate", True)
    params = {
        "factor": factor,
        "original_max_position_embeddings": original,
        "attention_factor": check_param(f"config.json {r.source} 'attention_factor'", "attention_factor",
                                        attention_factor),
        # transformers reads these with `or`: 0 or null means the default
        "beta_fast": r.get("beta_fast") or 32.0,
        "beta_slow": r.get("beta_slow") or 1.0,
        # an explicit null reads as false there too
        "truncate": truncate is not None and check_param(f"config.json {r.source} 'truncate'", "truncate", truncate),
    }
    params.update({k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)) if v is not None})
    return params


def _longrope(r: _Reader) -> dict[str, Any]:
    original = r.original_max_position_embeddings()
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        factor = r.factor_or_context_ratio(original)
        if factor > 1 and original < 2:
            raise ConfigError(f"config.json {r.source} 'original_max_position_embeddings' must be >= 2 for a "
                              f"LongRoPE factor above 1, got {original}")
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "short_factor": r.need("short_factor"),
        "long_factor": r.need("long_factor"),
        "original_max_position_embeddings": original,
        "attention_factor": attention_factor,
    }


def _llama3(r: _Reader) -> dict[str, Any]:
    return {
        "factor": r.need("factor"),
        "low_freq_factor": r.need("low_freq_factor"),
        "high_freq_factor": r.need("high_freq_factor"),
        "original_max_position_embeddings": r.original_max_position_embeddings(),
    }


_RESOLVE = {"linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope, "llama3": _llama3}
