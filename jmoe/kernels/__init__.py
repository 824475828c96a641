"""Each kernel operation's entry point, which chooses the backend (pallas_kernels, cpu_kernels, or XLA) that runs it."""

from jmoe.kernels.expert_ffn import (BACKENDS, compile_error, default_backend, expert_ffn, expert_ffn_tiers,
                                     routed_expert_ffn, routed_expert_ffn_tiers, takes_assignments)

__all__ = ["BACKENDS", "compile_error", "default_backend", "expert_ffn", "expert_ffn_tiers", "routed_expert_ffn",
           "routed_expert_ffn_tiers", "takes_assignments"]
