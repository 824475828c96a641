"""The GPU expert kernels compiled for an H100 on a machine without a GPU: registers, spills, barriers.

Deviceless ahead-of-time compilation: with the CUDA plugin wheels that match the installed jax
(`make gpu-compile` builds them into .venv-gpu-aot) and JAX_PLATFORMS=cpu,
`jax.experimental.topologies.get_topology_desc` gives a compile-only H100 (bench/gpu_aot/
h100_target_config.pbtxt: sm_90, 132 SMs, 227 KB of opt-in shared memory per block). A jitted
function whose inputs are ShapeDtypeStructs on it runs `.lower().compile()` through XLA's real GPU
pipeline: its Triton, PTX, and ptxas for sm_90a. Nothing runs; every figure here is what the
compiler reports, never a measurement.

For every real model shape (Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-20B with biases and the clamped
SwiGLU, DeepSeek-V2-Lite), every expert tier (bf16, and the converter's int8 / int4 / int2 formats)
and both kernel plans (decode: one row per block; prefill: the runtime's 32-row blocks), for two
tiers in one decode launch (bf16+int4, int8+int2: a tier index per block), and for the test
suite's lowering matrix (every format, float32 and bf16 rows, toy widths), it compiles
`expert_ffn_pallas_tiers` with `--xla_gpu_fail_ptx_compilation_on_register_spilling=true` and records,
per kernel, what ptxas says (registers, spill bytes, barriers, shared memory), the launch grid,
threads and dynamic shared memory XLA gives it, and for decode kernels a static check of the K
loop in their PTX (barriers and global loads per loop iteration, and how many of the iteration's
vector loads are issued before its first multiply-add); or why compilation failed (register
spilling, shared memory over the limit, anything else). A decode kernel with a barrier inside its
K loop fails its case too.

Whole steps, too: the jitted forward step (engine._forward: every layer, attention, router, the
expert kernels and the LM head) of a 2-layer slice of each model, with abstract weights on the
compile-only H100: decode with every expert resident at int4 (Triton kernels, and the Mosaic GPU
ones), and decode, 512-token prefill and the speculative verify step (4 drafts) with a DyMoE
plan's two pools (bf16 and int4, a quarter of the experts each, as an offloaded ExpertState holds
them; decode runs both in one launch per stage).

The int4 decode kernels written for Pallas' Mosaic GPU backend (kernel_backend="mosaic") compile
at every real shape they support (not GPT-OSS-20B's 2880-wide projections); their PTX comes from
Mosaic GPU's own dump, and their modelled bandwidth from the TMA copies they keep in flight.

A canary case compiles a block that is known to spill (float32 rows on the dot path, which
`supports()` sends to the XLA reference); it must fail with "register spilling", or the spill
check itself is broken and the run fails.

    make gpu-compile                         # builds .venv-gpu-aot once, then runs this
    python -m bench.gpu_compile --out bench/results/gpu_compile_h100.json

Exits 1 when any case fails to compile or has a barrier in a decode K loop, or the canary compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_CONFIG = HERE / "gpu_aot" / "h100_target_config.pbtxt"

# hidden D, expert width F, top_k, and whether the family adds biases and the clamped SwiGLU
MODELS = {
    "qwen3-30b-a3b": dict(D=2048, F=768, top_k=8, gpt_oss=False),
    "mixtral-8x7b": dict(D=4096, F=14336, top_k=2, gpt_oss=False),
    "gpt-oss-20b": dict(D=2880, F=2880, top_k=4, gpt_oss=True),
    "deepseek-v2-lite": dict(D=2048, F=1408, top_k=6, gpt_oss=False),
}
# The test suite's lowering matrix (tests/test_kernels.py): every format the converter can write,
# float32 and bf16 rows, at toy widths (K = 192 pads to a group of 128).
MATRIX_SHAPE = dict(D=128, F=192, top_k=4, gpt_oss=False)
MATRIX_FORMATS = {
    "bf16": None,
    "int8-g128": dict(bits=8, group_size=128, symmetric=True),
    "int8-g32-asym": dict(bits=8, group_size=32, symmetric=False),
    "int4-g64-asym": dict(bits=4, group_size=64, symmetric=False),
    "int4-g32": dict(bits=4, group_size=32, symmetric=True),
    "int2-g64-asym": dict(bits=2, group_size=64, symmetric=False),
    "int2-g32": dict(bits=2, group_size=32, symmetric=True),
    "int2-g128": dict(bits=2, group_size=128, symmetric=True),
    "int4-smooth": dict(bits=4, group_size=64, symmetric=False, smooth=True),
    "w8a8-smooth": dict(bits=8, group_size=128, symmetric=True, act_bits=8, smooth=True),
}
# Several pools in one decode launch (a tier index per block), as a DyMoE or DynaExq step runs them.
TIER_MIXES = ("bf16+int4", "int8+int2")
POOL_SLOTS = 16  # the pool's slot count does not change the kernels, only their base offsets
PREFILL_BLOCKS = 16


def _setup_environment() -> None:
    """Before jax is imported: CPU as the only runtime platform, spills fail compilation, ptxas -v logged."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "fail_ptx_compilation_on_register_spilling" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_fail_ptx_compilation_on_register_spilling=true").strip()
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["JMOE_CPU_KERNELS"] = "off"  # dense products as on a GPU (jnp.dot), not the host's FFI kernels
    os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=3"
    # Mosaic GPU kernels compile outside XLA's pipeline: their PTX goes to a directory of their own
    os.environ["MOSAIC_GPU_DUMP_TO"] = tempfile.mkdtemp(prefix="jmoe-mosaic-gpu-")
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"


@contextmanager
def captured_stderr():
    """Everything written to file descriptor 2 (XLA's C++ logging) while inside, as a list of one string."""
    sys.stderr.flush()
    saved = os.dup(2)
    out = []
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace"))


PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas -v output -> {entry function: registers, spill stores/loads, stack, barriers, static smem}."""
    kernels, current = {}, None
    for line in log.splitlines():
        if m := PTXAS_ENTRY.search(line):
            current = kernels.setdefault(m.group(1), {})
        elif current is not None and (m := PTXAS_SPILLS.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and (m := PTXAS_USED.search(line)):
            current.update(registers=int(m.group(1)), barriers=int(m.group(2) or 0),
                           static_smem_bytes=int(m.group(3) or 0))
    return kernels


THUNK_KERNEL = re.compile(r"kCustomKernel .*?\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
                          r"shared_memory: (\d+) bytes")


def parse_thunks(text: str) -> dict[str, dict]:
    """XLA's thunk sequence -> {kernel: grid, threads, dynamic shared memory} (the last launch of a name)."""
    launches = {}
    for m in THUNK_KERNEL.finditer(text):
        launches[m.group(1)] = dict(grid=[int(g) for g in m.group(2, 3, 4)], threads=int(m.group(5)),
                                    dynamic_smem_bytes=int(m.group(8)))
    return launches


PTX_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
PTX_BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def ptx_loops(ptx: str) -> list[list[str]]:
    """The bodies of the loops of a PTX function: the lines from a label to a later branch back to it."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := PTX_LABEL.match(line))}
    loops = []
    for i, line in enumerate(lines):
        if (m := PTX_BRANCH.search(line)) and labels.get(m.group(1), i) < i:
            loops.append(lines[labels[m.group(1)]:i])
    return loops


def decode_loop_check(ptx: str) -> dict | None:
    """Static check of a decode kernel's K loop (its longest loop; a launch over several tiers has
    one per tier): barriers (the most in any loop), global loads (all, and 16-byte vector loads of
    weight tiles), and the vector loads issued before the first multiply-add, i.e. how many loads
    are in flight before the iteration waits on any of them."""
    loops = ptx_loops(ptx)
    if not loops:
        return None
    body = max(loops, key=len)
    first_fma = next((i for i, line in enumerate(body) if line.startswith("fma.")), len(body))
    vector = [i for i, line in enumerate(body) if "ld.global.v4" in line]
    barriers = max(sum("bar.sync" in line for line in loop) for loop in loops)
    return dict(loops=len(loops), loop_ptx_lines=len(body), barriers=barriers,
                tma_copies=sum("cp.async.bulk.tensor" in line for line in ptx.splitlines()),
                global_loads=sum("ld.global" in line for line in body), vector_loads=len(vector),
                vector_loads_before_first_fma=sum(i < first_fma for i in vector))


def decode_loop_barriers(kernels: dict) -> dict[str, int]:
    """{kernel: bar.sync per iteration} for the decode kernels with a barrier inside their K loop:
    each one stalls every warp of the program until the slowest has its loads back."""
    return {k: v["decode_loop"]["barriers"] for k, v in kernels.items()
            if (v.get("decode_loop") or {}).get("barriers")}


# What the model of a decode kernel's bandwidth assumes about an H100 SXM (not measured here).
H100_SMS, H100_REGISTERS_PER_SM, H100_THREADS_PER_SM = 132, 65536, 2048
H100_HBM_BYTES_PER_S = 3.35e12  # the datasheet's peak
H100_SMEM_PER_SM = 228 * 1024
HBM_LATENCY_S = 700e-9  # a load's round trip to HBM under load, roughly


def modelled_decode_bandwidth(info: dict) -> dict | None:
    """MODELLED, never measured: a decode kernel's weight bandwidth from the bytes it has in flight.
    Each resident program issues its loop iteration's 16-byte vector loads before their first use;
    programs per SM are bounded by registers, threads and the grid; Little's law turns the bytes in
    flight over the HBM latency into bytes per second, capped at the datasheet's peak."""
    loop, grid, threads, registers = info.get("decode_loop"), info.get("grid"), info.get("threads"), info.get("registers")
    if not (loop and grid and threads and registers):
        return None
    programs = grid[0] * grid[1] * grid[2]
    per_sm = min(H100_REGISTERS_PER_SM // (registers * threads), H100_THREADS_PER_SM // threads,
                 -(-programs // H100_SMS))
    in_flight = min(programs, per_sm * H100_SMS) * threads * 16 * loop["vector_loads_before_first_fma"]
    return dict(programs=programs, programs_per_sm=per_sm, bytes_in_flight=in_flight,
                modelled_GBps=round(min(H100_HBM_BYTES_PER_S, in_flight / HBM_LATENCY_S) / 1e9),
                assumptions=f"{HBM_LATENCY_S * 1e9:.0f} ns HBM latency, {H100_HBM_BYTES_PER_S / 1e12} TB/s peak")


def dumped_kernels(dump_dir: str) -> tuple[dict, dict]:
    """From an --xla_dump_to directory: ({kernel: launch}, {kernel: PTX text}) for the expert kernels."""
    launches, ptx = {}, {}
    for path in Path(dump_dir).iterdir():
        if path.name.endswith("thunk_sequence.txt"):
            launches.update(parse_thunks(path.read_text()))
        elif path.suffix == ".ptx":
            text = path.read_text()
            for name in re.findall(r"\.entry (expert_\w+)\(", text):
                ptx[name] = text
    return launches, ptx


def failure_kind(message: str) -> str:
    if "register spilling" in message:
        return "register spilling"
    if "Shared memory size limit exceeded" in message:
        return "shared memory over the limit"
    return "compile error"


def abstract_h100():
    """An abstract mesh naming an H100: from jax 0.11 the Pallas Triton lowering asks for the GPU it
    targets even when the inputs already sit on a compile-only device; jax 0.10 takes it as well."""
    import jax

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100))


def compile_only_device():
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG.read_text(),
                                            topology="1x1x1")
    return topology.devices[0], jax


def tier_format(tier: str):
    """A tier name (the converter's defaults) or a MATRIX_FORMATS name -> QuantFormat, None for bf16."""
    from jmoe.tiers import DEFAULT_FORMATS
    from pallas_kernels.qarray import QuantFormat

    if tier in DEFAULT_FORMATS:
        return DEFAULT_FORMATS[tier]
    return None if MATRIX_FORMATS[tier] is None else QuantFormat(**MATRIX_FORMATS[tier])


def case_inputs(model: dict, tier: str, block_rows: int, device, rows_dtype="bfloat16"):
    """ShapeDtypeStructs on `device` for expert_ffn_pallas at a model's shapes."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.qarray import template

    sharding = jax.sharding.SingleDeviceSharding(device)
    on = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)  # noqa: E731
    D, F = model["D"], model["F"]
    fmt = tier_format(tier)
    if fmt is None:
        gate_up = jax.ShapeDtypeStruct((POOL_SLOTS, D, 2 * F), jnp.bfloat16)
        down = jax.ShapeDtypeStruct((POOL_SLOTS, F, D), jnp.bfloat16)
    else:  # smoothing scales the gate/up inputs only
        gate_up = template(fmt, D, 2 * F, (POOL_SLOTS,))
        down = template(dataclasses.replace(fmt, smooth=False), F, D, (POOL_SLOTS,))
    blocks = model["top_k"] if block_rows == 1 else PREFILL_BLOCKS
    rows = jax.ShapeDtypeStruct((blocks * block_rows, D), jnp.dtype(rows_dtype))
    block_slot = jax.ShapeDtypeStruct((blocks,), jnp.int32)
    biases = {}
    if model["gpt_oss"]:
        biases = dict(gate_up_bias=jax.ShapeDtypeStruct((POOL_SLOTS, 2 * F), jnp.float32),
                      down_bias=jax.ShapeDtypeStruct((POOL_SLOTS, D), jnp.float32))
    args = jax.tree.map(on, (rows, block_slot, gate_up, down))
    return args, jax.tree.map(on, biases)


def compile_case(name: str, model: dict, tier: str, block_rows: int, device, rows_dtype="bfloat16") -> dict:
    """One tier's kernels, or with tier "a+b" the decode kernels that run several tiers in one launch."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.expert_ffn_pallas import expert_ffn_pallas_tiers, supports_tiers
    from pallas_kernels.glu import SILU, GatedActivation

    tiers = []
    for one in tier.split("+"):
        (rows, block_slot, gate_up, down), biases = case_inputs(model, one, block_rows, device, rows_dtype)
        tiers.append((gate_up, down, biases.get("gate_up_bias"), biases.get("down_bias")))
    block_tier = None if len(tiers) == 1 else jax.ShapeDtypeStruct(block_slot.shape, jnp.int32,
                                                                   sharding=block_slot.sharding)
    activation = GatedActivation("clamped_swiglu") if model["gpt_oss"] else SILU
    record = dict(model=name, tier=tier, plan="decode" if block_rows == 1 else "prefill", block_rows=block_rows,
                  rows=rows.shape[0], rows_dtype=rows_dtype)
    if not supports_tiers(rows, tiers, block_rows):
        return dict(record, status="unsupported")
    f = functools.partial(expert_ffn_pallas_tiers, block_rows=block_rows, activation=activation)
    return dict(record, **compile_and_read(jax.jit(f), (rows, block_tier, block_slot, tiers), decode=block_rows == 1))


def compile_mosaic_case(name: str, model: dict, device) -> dict:
    """The int4 decode kernels on Pallas' Mosaic GPU backend (kernel_backend="mosaic"): TMA copies
    into shared memory, every K step of a program in flight at once. Modelled bandwidth from those bytes."""
    import jax

    from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic, launch_plan, supports_mosaic
    from pallas_kernels.glu import SILU, GatedActivation

    (rows, block_slot, gate_up, down), biases = case_inputs(model, "int4", 1, device)
    activation = GatedActivation("clamped_swiglu") if model["gpt_oss"] else SILU
    record = dict(model=name, tier="int4", plan="decode, mosaic", block_rows=1, rows=rows.shape[0],
                  rows_dtype="bfloat16")
    if not supports_mosaic(rows, gate_up, down, 1, **biases):
        return dict(record, status="unsupported")
    f = functools.partial(expert_ffn_mosaic, activation=activation)
    result = compile_and_read(jax.jit(lambda r, s, gu, dn, b: f(r, s, gu, dn, **b)),
                              (rows, block_slot, gate_up, down, biases), decode=True)
    plans = {"expert_gate_up_mosaic": launch_plan(rows.shape[0], gate_up),
             "expert_down_mosaic": launch_plan(rows.shape[0], down)}
    for kernel, info in result.get("kernels", {}).items():
        plan = plans.get(kernel.removesuffix("_mosaic_gpu_kernel"))
        if plan:
            info.update(grid=list(plan["grid"]), threads=128, pipeline_stages=plan["steps"],
                        step_bytes=plan["step_bytes"])
            info["modelled"] = modelled_tma_bandwidth(info)
    return dict(record, **result)


def modelled_tma_bandwidth(info: dict) -> dict | None:
    """MODELLED, never measured: a Mosaic GPU decode kernel's weight bandwidth from its TMA copies in
    flight (pipeline stages x bytes per K step per resident program), as modelled_decode_bandwidth."""
    grid, registers = info.get("grid"), info.get("registers")
    if not (grid and registers):
        return None
    programs = grid[0] * grid[1] * grid[2]
    smem = info["pipeline_stages"] * info["step_bytes"]
    per_sm = min(H100_REGISTERS_PER_SM // (registers * 128), H100_THREADS_PER_SM // 128, H100_SMEM_PER_SM // smem,
                 -(-programs // H100_SMS))
    in_flight = min(programs, per_sm * H100_SMS) * smem
    return dict(programs=programs, programs_per_sm=per_sm, bytes_in_flight=in_flight,
                modelled_GBps=round(min(H100_HBM_BYTES_PER_S, in_flight / HBM_LATENCY_S) / 1e9),
                assumptions=f"{HBM_LATENCY_S * 1e9:.0f} ns HBM latency, {H100_HBM_BYTES_PER_S / 1e12} TB/s peak")


def compile_and_read(jitted, args, decode: bool, whole_step: bool = False) -> dict:
    """Compile for the H100; what ptxas, the thunk sequence and (decode) the PTX's K loop say.

    A whole step also holds XLA's own fusions; a spill there fails the step's compile only when
    it is in an expert kernel (XLA's are listed as xla_fusion_spills: not this project's code)."""
    start = time.perf_counter()
    mosaic_dump = Path(os.environ["MOSAIC_GPU_DUMP_TO"])
    for old in mosaic_dump.iterdir():  # only this case's Mosaic GPU kernels
        old.unlink()
    with tempfile.TemporaryDirectory() as dump, captured_stderr() as log:
        options = {"xla_dump_to": dump}
        if whole_step:
            options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = False
        try:
            with abstract_h100():  # the Pallas Triton lowering asks for the GPU it targets (jax 0.11)
                lowered = jitted.trace(*args).lower()
            lowered.compile(compiler_options=options)
            error = None
        except Exception as e:  # noqa: BLE001 - every compile failure is a result here
            error = f"{type(e).__name__}: {e}"
        launches, ptx = dumped_kernels(dump)
        ptx.update(dumped_kernels(str(mosaic_dump))[1])
    record = dict(compile_s=round(time.perf_counter() - start, 2))
    # the expert kernels, and any other kernel of the step that spills
    record["kernels"] = kernels = {k: v for k, v in parse_ptxas(log[0]).items()
                                   if k.startswith("expert_") or v.get("spill_store_bytes")}
    for name, info in kernels.items():
        info.update(launches.get(name, {}))
        if decode and name in ptx:
            info["decode_loop"] = decode_loop_check(ptx[name])
            info["modelled"] = modelled_decode_bandwidth(info)
    if error:
        return dict(record, status=failure_kind(error), error=error.splitlines()[0][:300])
    if any(v.get("spill_store_bytes") for k, v in kernels.items() if k.startswith("expert_") and not whole_step):
        return dict(record, status="register spilling")  # Mosaic GPU runs its own ptxas, without XLA's flag
    if loop_barriers := decode_loop_barriers(kernels):
        return dict(record, status="barrier in the decode loop", error=f"bar.sync per K loop iteration: {loop_barriers}")
    if whole_step:
        record["xla_fusion_spills"] = {k: v["spill_store_bytes"] for k, v in kernels.items()
                                       if not k.startswith("expert_")}
        if any(v.get("spill_store_bytes") for k, v in kernels.items() if k.startswith("expert_")):
            return dict(record, status="register spilling")
    return dict(record, status="ok")


STEP_LAYERS = 2
STEP_CASES = (  # (name, phase, pools: tier -> fraction of the experts in its pool, kernel backend)
    ("decode, resident int4", "decode", {"int4": 1.0}, "pallas"),
    ("decode, resident int4, Mosaic GPU", "decode", {"int4": 1.0}, "mosaic"),
    ("decode, DyMoE pools", "decode", {"bf16": 0.25, "int4": 0.25}, "pallas"),
    ("prefill 512, DyMoE pools", "prefill", {"bf16": 0.25, "int4": 0.25}, "pallas"),
    ("verify 4 drafts, DyMoE pools", "verify", {"bf16": 0.25, "int4": 0.25}, "pallas"),
)


def compile_step(model: str, case: str, phase: str, pool_fractions: dict, backend: str, device) -> dict:
    """The model's jitted forward step for a 2-layer slice, abstract weights on `device`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.random_checkpoint import model_named
    from jmoe.decoding.engine import _forward, new_cache
    from jmoe.layers.experts import ExpertState, Selection
    from jmoe.layers.transformer import abstract_model
    from jmoe.models import config_from_hf
    from jmoe.tiers import expert_template

    sharding = jax.sharding.SingleDeviceSharding(device)
    on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    cfg = config_from_hf(model_named(model).config_for(STEP_LAYERS))
    graphdef, state = nnx.split(abstract_model(cfg, jnp.bfloat16))
    dense = jax.tree.map(lambda s: on(s.shape, s.dtype), nnx.to_pure_dict(state))
    layers, experts = cfg.num_moe_layers, cfg.num_experts
    pools = {tier: jax.tree.map(lambda s, n=max(1, round(f * experts)): on((n, *s.shape), s.dtype),
                                expert_template(cfg, tier, tier_format(tier)))
             for tier, f in pool_fractions.items()}
    tables = {tier: on((layers, experts), jnp.int32) for tier in pools}
    selection = Selection(on((layers, experts), jnp.int32), on((layers, experts), jnp.int32), on((layers,), jnp.float32),
                          on((), jnp.float32))
    state = ExpertState(tables, pools, selection, backend).for_phase(phase)
    tokens = {"decode": on((1,), jnp.int32), "prefill": on((1, 512), jnp.int32), "verify": on((1, 5), jnp.int32)}[phase]
    cache = jax.tree.map(lambda s: on(s.shape, s.dtype), jax.eval_shape(lambda: new_cache(cfg, 1, 1024, jnp.bfloat16)))
    start, key_start = on((1,), jnp.int32), on((1,), jnp.int32)
    step = jax.jit(functools.partial(_forward, graphdef, last_only=phase == "prefill", want_importance=False))
    record = dict(model=model, tier="+".join(pools), plan=f"step: {case}", layers=STEP_LAYERS,
                  pool_slots={t: jax.tree.leaves(p)[0].shape[0] for t, p in pools.items()})
    return dict(record, **compile_and_read(step, (dense, state, tokens, cache, start, key_start),
                                           decode=phase == "decode", whole_step=True))


def spill_canary(device) -> dict:
    """Compiles a block known to spill: float32 rows on the dot path (HIGHEST-precision dots), the
    test matrix's int2-g128 down projection, bypassing supports(). Must fail with register spilling."""
    import jax

    from pallas_kernels.expert_ffn_pallas import _grouped_matmul

    (rows, block_slot, _, down), _ = case_inputs(MATRIX_SHAPE, "int2-g128", 32, device, "float32")
    h = jax.ShapeDtypeStruct((rows.shape[0], MATRIX_SHAPE["F"]), rows.dtype, sharding=rows.sharding)
    f = functools.partial(_grouped_matmul, n_out=MATRIX_SHAPE["D"], up_offset=None, out_dtype=rows.dtype,
                          block_rows=32, interpret=False)
    record = dict(model="canary", tier="int2-g128", plan="prefill", block_rows=32, rows_dtype="float32",
                  expected="register spilling")
    return dict(record, **compile_and_read(jax.jit(f), (h, None, block_slot, [down]), decode=False))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tiers", default="bf16,int8,int4,int2")
    parser.add_argument("--no-matrix", dest="matrix", action="store_false",
                        help="leave out the test suite's lowering matrix (toy widths, float32 and bf16 rows)")
    parser.add_argument("--no-steps", dest="steps", action="store_false",
                        help="leave out the whole jitted steps of 2-layer model slices")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_compile_h100.json"))
    args = parser.parse_args(argv)
    _setup_environment()
    device, jax = compile_only_device()
    cases = [(name, MODELS[name], tier, block_rows, "bfloat16") for name in args.models.split(",")
             for tier in args.tiers.split(",") for block_rows in (1, 32)]
    cases += [(name, MODELS[name], mix, 1, "bfloat16") for name in args.models.split(",") for mix in TIER_MIXES]
    if args.matrix:
        cases += [("test-matrix", MATRIX_SHAPE, tier, block_rows, dtype) for tier in MATRIX_FORMATS
                  for block_rows in (1, 32) for dtype in ("float32", "bfloat16")]
    results = []
    runs = [functools.partial(compile_case, *case[:4], device, case[4]) for case in cases]
    runs += [functools.partial(compile_mosaic_case, name, MODELS[name], device) for name in args.models.split(",")]
    if args.steps:
        runs += [functools.partial(compile_step, name, *case, device) for name in args.models.split(",")
                 for case in STEP_CASES]
    for run in runs:
        r = run()
        results.append(r)
        regs = ", ".join(f"{k} {v.get('registers')} regs, {v.get('spill_store_bytes', 0)} B spilled"
                         + (f", loop: {v['decode_loop']['barriers']} bar.sync, "
                            f"{v['decode_loop']['vector_loads_before_first_fma']}/{v['decode_loop']['vector_loads']} "
                            "vector loads before the first fma" if v.get("decode_loop") else "")
                         for k, v in sorted(r.get("kernels", {}).items()))
        print(f"{r['model']:17s} {r['tier']:13s} {r.get('rows_dtype', ''):8s} {r['plan']:8s} {r['status']:22s} {regs}",
              flush=True)
    failed = [r for r in results if r["status"] not in ("ok", "unsupported")]
    canary = spill_canary(device)
    canary_ok = canary["status"] == canary["expected"]
    print(f"canary (a block known to spill): {canary['status']}" + ("" if canary_ok else " -- the spill check is broken"))
    out = dict(device=str(device.device_kind), jax=jax.__version__, target_config=TARGET_CONFIG.name,
               xla_flags=os.environ["XLA_FLAGS"], failed=len(failed), canary=canary, cases=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}: {len(results)} cases, {len(failed)} failed to compile")
    return 1 if failed or not canary_ok else 0


if __name__ == "__main__":
    sys.exit(main())
