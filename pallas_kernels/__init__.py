"""GPU kernels (Pallas): the grouped expert FFN and decode attention
over the paged KV cache (decode_attention.py). Imports jax and kernel_formats only. Which expert
kernel runs is chosen in jmoe/kernels; attention's kernel in jmoe/layers/attention.py (blocked_attention)."""

from pallas_kernels.expert_ffn_pallas import expert_ffn_pallas, expert_ffn_pallas_tiers, supports, supports_tiers

__all__ = ["expert_ffn_pallas", "expert_ffn_pallas_tiers",
           "supports", "supports_tiers"]
