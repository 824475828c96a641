"""Mixtral: every layer sparse, top-k always renormalised, plain attention with optional sliding window."""

from jmoe.config import ModelConfig, common_fields, hf_int
from jmoe.models.checkpoint import CheckpointNames

FAMILY = "mixtral"
MODEL_TYPES = ("mixtral",)
CHECKPOINT_NAMES = CheckpointNames(moe_prefix="block_sparse_moe", expert_projs=("w1", "w3", "w2"))


def config_from_hf(hf: dict) -> ModelConfig:
    base = common_fields(hf, default_theta=1e6)
    window = hf_int(hf, "sliding_window", default=None, minimum=0) or None  # 0 or null: full attention
    return ModelConfig(
        family=FAMILY,
        **base,
        moe_intermediate_size=hf_int(hf, "intermediate_size"),
        norm_topk_prob=True,
        moe_layers=(True,) * base["num_layers"],
        sliding_windows=(window,) * base["num_layers"],
    )
