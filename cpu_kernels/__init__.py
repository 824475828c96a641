"""Native CPU kernels that multiply packed expert and dense weights where they lie.

Each op runs a native kernel (a C++ library behind XLA's FFI, built by the package's build) when
it is loaded and the computation runs on the CPU (the default backend, or a host computation
beside an accelerator: `host_computation`). The expert FFNs (`expert_ffn`, `routed_expert_ffn`,
`routed_expert_ffn_tiers`) otherwise refuse with NotImplementedError and jmoe.kernels runs the XLA
reference; the others (`matmul`, `attention`, the cache writes) run their XLA formulation
themselves.
"""

from cpu_kernels.ops import (
    attention,
    attention_reads,
    available,
    batched_matmul,
    copy_records,
    expert_ffn,
    first_max,
    host_computation,
    matmul,
    matmuls,
    routed_expert_ffn,
    routed_expert_ffn_tiers,
    write_rows,
    write_slots,
)

__all__ = ["attention", "attention_reads", "available", "batched_matmul", "copy_records", "expert_ffn", "first_max",
           "host_computation", "matmul", "matmuls", "routed_expert_ffn", "routed_expert_ffn_tiers", "write_rows", "write_slots"]
