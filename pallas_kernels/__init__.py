"""Grouped expert kernels for GPUs (Pallas). Imports jax only; every kernel sits next to its jnp
reference. Which kernel runs is chosen in jmoe/kernels."""

from pallas_kernels.expert_ffn import expert_ffn_reference
from pallas_kernels.expert_ffn_pallas import expert_ffn_pallas, expert_ffn_pallas_tiers, supports, supports_tiers

__all__ = ["expert_ffn_reference", "expert_ffn_pallas", "expert_ffn_pallas_tiers",
           "supports", "supports_tiers"]
