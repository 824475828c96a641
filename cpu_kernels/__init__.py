"""Native CPU kernels that multiply packed expert and dense weights where they lie.

`matmul` and `expert_ffn` are the entry points; each runs the native kernel (a C++ library
behind XLA's FFI, built by the package's build) when it is loaded and the inputs are on the CPU,
and the XLA reference otherwise.
"""

from cpu_kernels.ops import (attention, attention_reads, available, copy_records, expert_ffn, first_max, matmul,
                             routed_expert_ffn, routed_expert_ffn_tiers, write_rows, write_slots)

__all__ = ["attention", "attention_reads", "available", "copy_records", "expert_ffn", "first_max", "matmul",
           "routed_expert_ffn", "routed_expert_ffn_tiers", "write_rows", "write_slots"]
