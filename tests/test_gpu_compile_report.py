"""bench.gpu_compile reads ptxas' report and names compile failures (the compile itself needs the CUDA plugin)."""

from __future__ import annotations

from bench.gpu_compile import failure_kind, parse_ptxas

PTXAS_LOG = """\
I1124 05:08:28.298485    7164 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'expert_gate_up_silu' for 'sm_90a'
ptxas info    : Function properties for expert_gate_up_silu
    8 bytes stack frame, 100 bytes spill stores, 96 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 82176 bytes smem
ptxas info    : Compile time = 151.546 ms
ptxas info    : Compiling entry function 'expert_down' for 'sm_90a'
ptxas info    : Function properties for expert_down
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 72 registers, used 1 barriers
"""


def test_ptxas_report_is_read_per_kernel():
    kernels = parse_ptxas(PTXAS_LOG)
    assert kernels["expert_gate_up_silu"] == dict(stack_bytes=8, spill_store_bytes=100, spill_load_bytes=96,
                                                  registers=255, barriers=1, static_smem_bytes=82176)
    assert kernels["expert_down"]["registers"] == 72
    assert kernels["expert_down"]["spill_store_bytes"] == 0
    assert kernels["expert_down"]["static_smem_bytes"] == 0


def test_compile_failures_are_named():
    assert failure_kind("CANCELLED: Compilation result discarded due to register spilling") == "register spilling"
    assert failure_kind("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 294912, available 232448") \
        == "shared memory over the limit"
    assert failure_kind("INTERNAL: ptxas exited with non-zero error code") == "compile error"
