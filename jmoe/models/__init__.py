"""Model families: each module maps one Hugging Face `model_type` onto the shared ModelConfig.

A family module exposes MODEL_TYPES and config_from_hf(hf_config_dict) -> ModelConfig; the layers
in jmoe/layers/ read only the resulting feature flags.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jmoe.config import ModelConfig
from jmoe.errors import ConfigError
from jmoe.models import mixtral, olmoe, qwen2_moe, qwen3_moe

_FAMILIES: dict[str, ModuleType] = {
    model_type: module for module in (qwen3_moe, qwen2_moe, mixtral, olmoe) for model_type in module.MODEL_TYPES
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def family_for(model_type: str | None) -> ModuleType:
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; jmoe supports {', '.join(supported_model_types())}"
        )
    return _FAMILIES[model_type]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a transformers config.json (4.x or 5.x spelling) into a ModelConfig."""
    if "model_type" not in hf:
        raise ConfigError("config.json has no 'model_type'")
    return family_for(hf["model_type"]).config_from_hf(hf)
