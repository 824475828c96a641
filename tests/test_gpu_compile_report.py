"""bench.gpu_compile reads ptxas' report and names compile failures (the compile itself needs the CUDA plugin)."""

from __future__ import annotations

from bench.gpu_compile import (branches_and_loops, command_buffers, decode_loop_barriers, decode_loop_check,
                                expected_fetches, failure_kind, host_arrays_in_entry_layout, host_async_slices,
                                host_compute, modelled_decode_bandwidth, offload_canary_caught, offload_checks,
                                parse_ptxas, parse_thunks, read_offloaded_step, slice_launches, step_pairs)

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


def test_steps_in_turn_compile_every_case_and_every_model_once_at_least():
    models, cases = ["a", "b", "c", "d"], tuple(f"case {i}" for i in range(6))
    every = step_pairs(models, cases, in_turn=False)
    assert len(every) == 24 and len(set(every)) == 24
    in_turn = step_pairs(models, cases, in_turn=True)
    assert [case for _, case in in_turn] == list(cases)
    assert {name for name, _ in in_turn} == set(models)
    assert set(in_turn) <= set(every)
    assert {name for name, _ in step_pairs(models, cases[:3], in_turn=True)} == {"a", "b", "c"}


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


# An offloaded step as XLA prints it after optimization: one host store (S(5)) sliced twice (an
# async computation and an async fusion), a Triton kernel while both are in flight, and a copy of
# device memory that is no host slice.
OFFLOADED_HLO = """\
HloModule jit__decode, is_scheduled=true, input_output_alias={ {0}: (2, {}, may-alias) }, \
entry_computation_layout={(u8[8,4096]{1,0:S(5)}, s32[2]{0}, u8[4,4096]{1,0})->(u8[4,4096]{1,0}, f32[8]{0})}, \
frontend_attributes={xla.sdy.meshes={empty_mesh = #sdy.mesh<[]>}}

%async_computation (param_0: u8[8,4096], param_1: s32[], param_2: s32[]) -> u8[1,4096] {
  %param_0 = u8[8,4096]{1,0:S(5)} parameter(0)
  %param_1 = s32[] parameter(1)
  %param_2 = s32[] parameter(2)
  ROOT %wrapped_dynamic-slice = u8[1,4096]{1,0} fusion(%param_0, %param_1, %param_2), kind=kLoop, calls=%slice
}

ENTRY %main.1 (store: u8[8,4096], ids: s32[2], pool: u8[4,4096]) -> (u8[4,4096], f32[8]) {
  %store = u8[8,4096]{1,0:S(5)} parameter(0)
  %ids = s32[2]{0} parameter(1)
  %pool = u8[4,4096]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %dynamic-slice-start.1 = ((u8[8,4096]{1,0:S(5)}, s32[], s32[]), u8[1,4096]{1,0}, u32[]) async-start(%store, %zero, %zero), calls=%async_computation
  %dynamic-slice-start.2 = ((u8[8,4096]{1,0:S(5)}, s32[], s32[]), u8[1,4096]{1,0}, u32[]) fusion-start(%store, %zero, %zero), kind=kLoop, calls=%slice
  %pallas_call.1 = f32[8]{0} custom-call(%pool), custom_call_target="__gpu$xla.gpu.triton"
  %dynamic-slice-done.1 = u8[1,4096]{1,0} async-done(%dynamic-slice-start.1)
  %copy-start.3 = (u8[4,4096]{1,0}, u8[4,4096]{1,0}, u32[]) copy-start(%pool)
  %copy-done.3 = u8[4,4096]{1,0} copy-done(%copy-start.3)
  %dynamic-slice-done.2 = u8[1,4096]{1,0} fusion-done(%dynamic-slice-start.2)
  %written = u8[4,4096]{1,0} fusion(%copy-done.3, %dynamic-slice-done.1, %dynamic-slice-done.2), kind=kLoop, calls=%write
  ROOT %tuple = (u8[4,4096]{1,0}, f32[8]{0}) tuple(%written, %pallas_call.1)
}
"""

# The thunk sequence after XLA's thunk passes: the whole step in one command buffer.
ONE_COMMAND_BUFFER = """\
000: kCommandBuffer [source | sink] 
    001: kCustomKernel [source       | next=003 (1)] loop_select_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    003: kAsyncStart   [prev=001 (1) | next=006 (3)] stream=computation_stream[1], async_id=3
        002: kCustomKernel [source | sink] wrapped_dynamic_slice grid: [32, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    004: kAsyncDone    [source       | sink        ] async_id=3
    005: kCustomKernel [prev=003 (3) | sink        ] wrapped_concatenate grid: [32, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""


def offloaded_step(hlo=OFFLOADED_HLO, thunks=ONE_COMMAND_BUFFER, log=""):
    return read_offloaded_step(dict(hlo=hlo, thunks=thunks), log)


def test_host_arrays_are_read_from_the_entry_layout():
    assert host_arrays_in_entry_layout(OFFLOADED_HLO) == dict(parameters=1, results=0)
    host_result = OFFLOADED_HLO.replace("->(u8[4,4096]{1,0}", "->(u8[4,4096]{1,0:S(5)}")
    assert host_arrays_in_entry_layout(host_result) == dict(parameters=1, results=1)


def test_async_slices_of_host_memory_are_counted_in_the_schedule():
    slices = host_async_slices(OFFLOADED_HLO)
    assert slices["started"] == slices["done"] == 2  # the copy of device memory is not one
    assert slices["most_in_flight"] == 2
    assert slices["spans"] == [[4, 7, 1], [5, 10, 1]]  # schedule positions, Triton kernels in between
    assert slices["instructions_between"] == [2, 4] and slices["triton_kernels_between"] == [1, 1]
    done = "  %dynamic-slice-done.1 = u8[1,4096]{1,0} async-done(%dynamic-slice-start.1)\n"
    one_at_a_time = OFFLOADED_HLO.replace(done, "")
    one_at_a_time = one_at_a_time.replace("  %dynamic-slice-start.2", done + "  %dynamic-slice-start.2")
    assert host_async_slices(one_at_a_time)["most_in_flight"] == 1


def test_host_compute_is_found_in_the_hlo_and_the_log():
    assert host_compute(OFFLOADED_HLO, "") == []
    marked = OFFLOADED_HLO.replace('calls=%write', 'calls=%write, frontend_attributes={_xla_compute_type="host"}')
    assert len(host_compute(marked, "")) == 1
    moved = OFFLOADED_HLO.replace('custom_call_target="__gpu$xla.gpu.triton"', 'custom_call_target="MoveToHost"')
    assert len(host_compute(moved, "")) == 1
    log = ('W1125 20:08:24.961850 host_offloader.cc:180] Found an instruction ("dynamic-slice.3") which does '
           "device compute in host memory space. Converting into host compute. This is likely to have a very slow "
           "execution time.\nI1125 20:08:25.000000 ptxas info    : 0 bytes gmem\n")
    assert len(host_compute(OFFLOADED_HLO, log)) == 1


def test_conditionals_and_loops_without_a_trip_count_are_counted():
    assert branches_and_loops(OFFLOADED_HLO) == dict(conditionals=0, whiles=0, whiles_without_known_trip_count=0)
    loops = OFFLOADED_HLO.replace("  ROOT %tuple", """\
  %loop = (s32[], f32[8]{0}) while(%state), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %spin = (s32[], f32[8]{0}) while(%state), condition=%cond, body=%body
  %branch = f32[8]{0} conditional(%pred, %a, %b), branch_computations={%yes, %no}
  ROOT %tuple""")
    assert branches_and_loops(loops) == dict(conditionals=1, whiles=2, whiles_without_known_trip_count=1)


def test_command_buffers_are_read_from_the_thunk_sequence():
    assert command_buffers(ONE_COMMAND_BUFFER) == dict(command_buffers=1, top_level={"kCommandBuffer": 1})
    unwrapped = "\n".join(line[4:] for line in ONE_COMMAND_BUFFER.splitlines()[1:])
    assert command_buffers(unwrapped) == dict(command_buffers=0, top_level={"kCustomKernel": 2, "kAsyncStart": 1,
                                                                            "kAsyncDone": 1})


def test_slice_kernels_and_their_streams_are_read_from_the_thunk_sequence():
    launches = slice_launches(ONE_COMMAND_BUFFER)
    assert launches["async_streams"] == ["computation_stream[1]"]
    # the kernels before and after the slice run on the step's own stream
    assert launches["async_kernels"] == {"wrapped_dynamic_slice": dict(grid=[32, 1, 1], threads=128,
                                                                       dynamic_smem_bytes=0)}


def test_expected_fetches_follow_the_fetch_spec():
    assert expected_fetches(tiers=1, moe_layers=2, requests=0, lookahead=0, misses=2) == 4
    assert expected_fetches(tiers=1, moe_layers=2, requests=0, lookahead=2, misses=2) == 6  # none predicts layer 0
    assert expected_fetches(tiers=2, moe_layers=2, requests=2, lookahead=2, misses=2) == 20
    assert expected_fetches(tiers=1, moe_layers=1, requests=0, lookahead=1, misses=1) == 1


def failed(found, fetches=2, stores=1) -> list[str]:
    return [name for name, ok in offload_checks(found, fetches, stores).items() if not ok]


def test_offload_checks_name_what_the_step_lacks():
    assert failed(offloaded_step()) == []
    assert failed(offloaded_step(), fetches=3) == ["async_host_slices"]
    assert failed(offloaded_step(), stores=2) == ["stores_in_host_memory"]
    log = "Found an instruction which does device compute in host memory space. Converting into host compute."
    assert failed(offloaded_step(log=log)) == ["no_host_compute"]
    two = ONE_COMMAND_BUFFER + "006: kCommandBuffer [source | sink] \n"
    assert failed(offloaded_step(thunks=two)) == ["one_command_buffer"]
    outside = ONE_COMMAND_BUFFER + "006: kCustomKernel [source | sink] loop_fusion grid: [1, 1, 1]\n"
    assert failed(offloaded_step(thunks=outside)) == ["one_command_buffer"]
    branch = OFFLOADED_HLO.replace("  ROOT %tuple", "  %b = f32[8]{0} conditional(%p, %x, %y)\n  ROOT %tuple")
    assert failed(offloaded_step(hlo=branch)) == ["no_conditional"]
    spin = OFFLOADED_HLO.replace("  ROOT %tuple", "  %w = (s32[]) while(%s), condition=%c, body=%b\n  ROOT %tuple")
    assert failed(offloaded_step(hlo=spin)) == ["known_trip_counts"]


# A chain of two conditional fetches: its outer conditional between two command buffers, the inner
# one inside its branch (the slices themselves sit in the branches; here in the entry, as counted anywhere).
CHAIN = OFFLOADED_HLO.replace("  ROOT %tuple", "  %c0 = u8[2,4096]{1,0} conditional(%p, %x, %y)\n"
                              "  %c1 = u8[1,4096]{1,0} conditional(%q, %x, %y)\n  ROOT %tuple")
CHAIN_THUNKS = ONE_COMMAND_BUFFER + "006: kConditional [source | sink] \n007: kCommandBuffer [source | sink] \n"


def test_chained_fetches_are_checked_against_their_plan():
    def chained_failures(hlo=CHAIN, thunks=CHAIN_THUNKS, chains=1, links=2):
        checks = offload_checks(offloaded_step(hlo=hlo, thunks=thunks), 2, 1, chains, links)
        return [name for name, ok in checks.items() if not ok]

    assert chained_failures() == []
    assert "no_conditional" not in offload_checks(offloaded_step(hlo=CHAIN, thunks=CHAIN_THUNKS), 2, 1, 1, 2)
    assert chained_failures(links=3) == ["fetches_in_chains"]  # a conditional too few
    per_fetch = CHAIN_THUNKS + "008: kConditional [source | sink] \n"
    assert chained_failures(thunks=per_fetch) == ["fetches_in_chains"]  # a top-level conditional per fetch
    assert chained_failures(chains=0) == ["no_conditional", "one_command_buffer"]  # held to fixed slots


def test_the_offload_canary_must_fail_its_checks():
    # guarded fetches: a conditional per fetch at the top level, where a chained step has one per chain
    thunks = CHAIN_THUNKS + "008: kConditional [source | sink] \n"
    caught = dict(checks=offload_checks(offloaded_step(hlo=CHAIN, thunks=thunks), 2, 1, chains=1, links=2))
    assert offload_canary_caught(caught)
    proper = offload_checks(offloaded_step(hlo=CHAIN, thunks=CHAIN_THUNKS), 2, 1, chains=1, links=2)
    assert not offload_canary_caught(dict(checks=proper))
    assert not offload_canary_caught(dict(status="compile error"))


def test_the_offloaded_steps_inputs_are_what_the_step_takes():
    """bench.gpu_compile spells out engine._decode's abstract inputs for the H100 check: traced here
    on the CPU, so a changed step signature fails the suite, not only `make gpu-compile`."""
    import functools

    import jax

    from bench.gpu_compile import STEP_LAYERS, offload_spec, offloaded_decode_inputs
    from bench.lib.random_checkpoint import model_named
    from jmoe.decoding.engine import _decode
    from jmoe.models import config_from_hf
    from jmoe.policies import make_policy

    cfg = config_from_hf(model_named("qwen3-30b-a3b").config_for(STEP_LAYERS))
    spec = offload_spec(cfg, make_policy("lru+prefetch", "int4"), jax.devices("cpu")[0])
    graphdef, args = offloaded_decode_inputs(cfg, spec, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct)
    nxt = jax.eval_shape(functools.partial(_decode, graphdef, greedy=False), *args)[0]
    assert nxt.shape == (1,)
