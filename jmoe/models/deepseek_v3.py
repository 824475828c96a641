"""DeepSeek-V3 style (also Kimi-K2): DeepSeek-V2's latent attention and layout, with sigmoid
routing whose correction bias picks experts (and groups) but not their weights."""

from jmoe.config import ModelConfig, hf_bool, hf_int
from jmoe.models.checkpoint import CheckpointNames
from jmoe.models.deepseek_v2 import deepseek_fields

FAMILY = "deepseek_v3"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
CHECKPOINT_NAMES = CheckpointNames(shared_expert="shared_experts")


def config_from_hf(hf: dict) -> ModelConfig:
    return ModelConfig(
        family=FAMILY,
        **deepseek_fields(hf),
        router="sigmoid",
        norm_topk_prob=hf_bool(hf, "norm_topk_prob", True),
        router_groups=hf_int(hf, "n_group", default=1),
        router_topk_groups=hf_int(hf, "topk_group", default=1),
        rope_interleaved=hf_bool(hf, "rope_interleave", True),
    )
