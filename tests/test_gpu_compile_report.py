"""bench.gpu_compile reads ptxas' report and names compile failures (the compile itself needs the CUDA plugin)."""

from __future__ import annotations

from bench.gpu_compile import decode_loop_barriers, decode_loop_check, failure_kind, modelled_decode_bandwidth, parse_ptxas, parse_thunks

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


THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] loop_transpose_fusion_1 grid: [128, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | next=003 (1)] expert_gate_up_silu grid: [8, 6, 8] threads: [256, 1, 1]  shared_memory: 512 bytes
"""

# a K loop of two steps: four 16-byte loads, then the multiply-adds, one barrier after them
PTX = """\
.visible .entry expert_down(
$L__BB0_1:
\tld.global.b32 { %r1 }, [ %rd1 + 0 ];
$L__BB0_2:
\tld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd2 + 0 ];
\tld.global.v4.b32 { %r6, %r7, %r8, %r9 }, [ %rd3 + 0 ];
\tfma.rn.f32 %r10, %r2, %r1, %r10;
\tld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd4 + 0 ];
\tbar.sync 0;
\t@%p1 bra $L__BB0_2;
\tst.global.b32 [ %rd5 + 0 ], { %r10 };
"""


def test_thunk_sequence_gives_each_kernels_launch():
    launches = parse_thunks(THUNKS)
    assert launches["expert_gate_up_silu"] == dict(grid=[8, 6, 8], threads=256, dynamic_smem_bytes=512)
    assert launches["loop_transpose_fusion_1"]["grid"] == [128, 1, 1]


def test_decode_loop_check_counts_barriers_and_loads_before_the_first_use():
    check = decode_loop_check(PTX)
    assert check["barriers"] == 1
    assert check["vector_loads"] == 3 and check["global_loads"] == 3  # the load before the loop is not in it
    assert check["vector_loads_before_first_fma"] == 2
    assert decode_loop_check(".visible .entry expert_down(\n\tret;\n") is None  # no loop


def test_a_barrier_in_a_decode_loop_is_named():
    kernels = parse_ptxas(PTXAS_LOG)
    assert decode_loop_barriers(kernels) == {}  # prefill: no loop check at all
    kernels["expert_down"]["decode_loop"] = decode_loop_check(PTX)
    assert decode_loop_barriers(kernels) == {"expert_down": 1}
    kernels["expert_down"]["decode_loop"]["barriers"] = 0
    assert decode_loop_barriers(kernels) == {}


def test_modelled_bandwidth_follows_the_bytes_in_flight():
    info = dict(registers=128, threads=256, grid=[8, 6, 8], decode_loop=dict(vector_loads_before_first_fma=8))
    model = modelled_decode_bandwidth(info)
    assert model["programs"] == 384 and model["programs_per_sm"] == 2  # 65536 registers / (128 x 256)
    assert model["bytes_in_flight"] == 264 * 256 * 16 * 8
    fewer = modelled_decode_bandwidth(dict(info, decode_loop=dict(vector_loads_before_first_fma=1)))
    assert fewer["modelled_GBps"] < model["modelled_GBps"]
    assert modelled_decode_bandwidth(dict(info, decode_loop=None)) is None
