"""Model families: the one registry. Each family module maps Hugging Face `model_type`s onto the
shared ModelConfig and names its checkpoint tensors.

A family module exposes FAMILY, MODEL_TYPES, config_from_hf(hf_config_dict) -> ModelConfig and
CHECKPOINT_NAMES (jmoe/models/checkpoint.py); the layers in jmoe/layers/ read only the resulting
feature flags, and the converter reads tensor names through this registry.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jmoe.config import ModelConfig
from jmoe.errors import ConfigError
from jmoe.models import deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, phimoe, qwen2_moe, qwen3_moe

FAMILIES: tuple[ModuleType, ...] = (qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v2, deepseek_v3, glm4_moe,
                                    phimoe, gpt_oss)
_FAMILIES: dict[str, ModuleType] = {model_type: module for module in FAMILIES for model_type in module.MODEL_TYPES}
_BY_NAME: dict[str, ModuleType] = {module.FAMILY: module for module in FAMILIES}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def family_for(model_type: str | None) -> ModuleType:
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; jmoe supports {', '.join(supported_model_types())}"
        )
    return _FAMILIES[model_type]


def family_named(family: str) -> ModuleType:
    """The family module behind a ModelConfig.family."""
    if family not in _BY_NAME:
        raise ConfigError(f"unknown model family {family!r}; jmoe knows {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[family]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a transformers config.json (4.x or 5.x spelling) into a ModelConfig."""
    if "model_type" not in hf:
        raise ConfigError("config.json has no 'model_type'")
    return family_for(hf["model_type"]).config_from_hf(hf)
