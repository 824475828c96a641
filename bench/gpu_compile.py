"""The GPU expert kernels compiled for an H100 on a machine without a GPU: registers, spills, barriers.

Deviceless ahead-of-time compilation: with the CUDA plugin wheels that match the installed jax
(`make gpu-compile` builds them into .venv-gpu-aot) and JAX_PLATFORMS=cpu,
`jax.experimental.topologies.get_topology_desc` gives a compile-only H100 (bench/lib/gpu_aot/
h100_target_config.pbtxt: sm_90, 132 SMs, 227 KB of opt-in shared memory per block). A jitted
function whose inputs are ShapeDtypeStructs on it runs `.lower().compile()` through XLA's real GPU
pipeline: its Triton, PTX, and ptxas for sm_90a. Nothing runs; every figure here is what the
compiler reports, never a measurement.

For every real model shape (Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-20B with biases and the clamped
SwiGLU, DeepSeek-V2-Lite), every expert tier (bf16, and the converter's int8 / int4 / int3 / int2 formats)
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

The decode-attention kernel over the paged KV cache (pallas_kernels/decode_attention.py, with the
merge of its shares after it) at a 32K context in pages of 64 slots, for Qwen3-30B-A3B's heads (32
query heads on 4 cache heads of 128: bfloat16 and int8 caches, decode and 8 tokens verified) and
GPT-OSS-20B's (64 on 8 of 64, sinks, a 128-slot window): registers and spills as for the expert
kernels (a spill fails the case; its loop holds tl.dot's barriers, so it has no decode loop check).

Whole steps, too: the jitted forward step (engine._forward: every layer, attention, router, the
expert kernels and the LM head) of a 2-layer slice of each model, with abstract weights on the
compile-only H100: decode with every expert resident at int4 (Triton kernels, and the Mosaic GPU
ones), and decode, 512-token prefill and the speculative verify step (4 drafts) with a DyMoE
plan's two pools (bf16 and int4, a quarter of the experts each, as an offloaded ExpertState holds
them; decode runs both in one launch per stage), and decode at resident int4 with the dense weights
at int4 and the LM head at int6 (its two planes' dequantize-and-dot; the record's temporaries show
whether a dequantized copy was materialised). Decode and verify steps run attention in the
decode-attention kernel (DeepSeek-V2-Lite's latent attention, two score terms, in XLA's loop); a
spill in any of this project's kernels fails a step, one in XLA's own fusions is only listed.

The offloaded decode step (engine._decode as Engine.decode jits it, sampling, with the experts
fetched inside the step from pinned-host stores: jmoe/layers/fetch.py) of each 2-layer slice, with
the fetch slots an accelerator's steps get (jmoe.runtime.fetching.fetch_slots): an LRU cache (misses
only), LRU with prefetch (look-ahead too), DyMoE over bf16 and int4 pools (degrade mode: requests,
look-ahead and misses) and DynaExq over the same pools (requests only: every expert keeps a
version). The compile-only H100 reports no memories, so these are traced with CPU shardings that
keep the stores' pinned_host memory kind, lowered for CUDA and compiled with the topology's client.
Each must compile to: its stores in host memory in the entry layout (S(5)), one asynchronous slice
of host memory per fetch slot (as many as its FetchSpec implies), nothing run on the host (no
host-compute annotations left, no "converted into host compute" warning), no conditional, the
whole step in one command buffer, and no while loop without a known trip count.
These steps share XLA's kernel cache: a kernel is compiled, and its registers read, in the first
step that has it.

The int4 decode kernels written for Pallas' Mosaic GPU backend (kernel_backend="mosaic") compile
at every real shape they support (not GPT-OSS-20B's 2880-wide projections); their PTX comes from
Mosaic GPU's own dump, and their modelled bandwidth from the TMA copies they keep in flight.

A canary case compiles a block that is known to spill (float32 rows on the dot path, which
`supports()` sends to the XLA reference); it must fail with "register spilling", or the spill
check itself is broken and the run fails.

    make gpu-compile                         # builds .venv-gpu-aot once, then runs this
    make gpu-compile GPU_COMPILE_ARGS="--steps-in-turn --out gpu-compile.json"   # what `make test` runs
    python -m bench.gpu_compile --out bench/results/gpu_compile/gpu_compile_h100.json

    python -m bench.gpu_compile --only-offload --models qwen3-30b-a3b --out /tmp/offload.json
    python -m bench.gpu_compile --only-attention --out /tmp/attention.json

Exits 1 when any case fails to compile or has a barrier in a decode K loop, an offloaded decode step
fails one of its checks, or the canary compiles.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import glob
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_CONFIG = HERE / "lib" / "gpu_aot" / "h100_target_config.pbtxt"

# the models whose expert shapes (jmoe/kernels/shapes.py) the kernel cases compile at
MODEL_NAMES = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v2-lite")


def kernel_shapes() -> dict:
    """Hidden D, expert width F, top_k, and whether the family adds biases and the clamped SwiGLU,
    per model of MODEL_NAMES (imported once the environment is set: importing jmoe imports jax)."""
    from jmoe.kernels.shapes import EXPERT_SHAPES

    return {name: dict(D=s.hidden, F=s.inner, top_k=s.top_k, gpt_oss=s.biased)
            for name, s in ((name, EXPERT_SHAPES[name]) for name in MODEL_NAMES)}
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
    "int2-g32-s8": dict(bits=2, group_size=32, symmetric=False, scale_bits=8),  # the int2 tier's default
    "int3-g32-s8": dict(bits=3, group_size=32, symmetric=False, scale_bits=8),  # the int3 tier's default
    "int3-g64": dict(bits=3, group_size=64, symmetric=True),
    "int4-smooth": dict(bits=4, group_size=64, symmetric=False, smooth=True),
    "w8a8-smooth": dict(bits=8, group_size=128, symmetric=True, act_bits=8, smooth=True),
}
# Several pools in one decode launch (a tier index per block), as a DyMoE or DynaExq step runs them.
TIER_MIXES = ("bf16+int4", "int8+int2")
POOL_SLOTS = 16  # the pool's slot count does not change the kernels, only their base offsets
PREFILL_BLOCKS = 16


MOSAIC_TEMP = "/tmp/mosaic-gpu-??????"


def _clean_up(scratch: str, before: set, started: float) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    for path in set(glob.glob(MOSAIC_TEMP)) - before:
        if os.stat(path).st_mtime >= started and os.stat(path).st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _setup_environment() -> None:
    """Before jax is imported: CPU as the only runtime platform, spills fail compilation, ptxas -v logged."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "fail_ptx_compilation_on_register_spilling" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_fail_ptx_compilation_on_register_spilling=true").strip()
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["JMOE_CPU_KERNELS"] = "off"  # dense products as on a GPU (jnp.dot), not the host's FFI kernels
    os.environ["JMOE_TRACE_GPU_KERNELS"] = "1"  # steps traced here are lowered for CUDA: trace the GPU kernels
    os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=3"
    # Every temporary file of this run goes under one directory, removed when the run ends; the CUDA
    # plugin's Mosaic GPU compiler ignores TMPDIR (/tmp/mosaic-gpu-XXXXXX, one per kernel, left behind):
    # those this run made go too.
    scratch = tempfile.mkdtemp(prefix="jmoe-gpu-compile-")
    atexit.register(_clean_up, scratch, set(glob.glob(MOSAIC_TEMP)), time.time())
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    # Mosaic GPU kernels compile outside XLA's pipeline: their PTX goes to a directory of their own
    os.environ["MOSAIC_GPU_DUMP_TO"] = tempfile.mkdtemp(prefix="mosaic-gpu-ptx-")
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


def dumped_step(dump_dir: str) -> dict[str, str]:
    """From an --xla_dump_to directory: the optimized HLO ("hlo") and the thunk sequence after XLA's
    thunk passes, command buffers included ("thunks"), of the (last) module compiled there."""
    texts = {}
    for key, suffix in (("hlo", "_gpu_after_optimizations.txt"), ("thunks", "thunk_sequence_after_thunk_passes.txt")):
        paths = sorted(Path(dump_dir).glob(f"*{suffix}"))
        texts[key] = paths[-1].read_text() if paths else ""
    return texts


def failure_kind(message: str) -> str:
    if "register spilling" in message:
        return "register spilling"
    if "Shared memory size limit exceeded" in message:
        return "shared memory over the limit"
    return "compile error"


def abstract_h100():
    """An abstract mesh naming an H100: from jax 0.11 the Pallas Triton lowering asks for the GPU it
    targets even when the inputs already sit on a compile-only device; jax 0.10 takes it as well.
    Its axis is Auto (jax 0.10's default; 0.11's is Explicit, which would give an array the step
    moves to device memory a sharding on this mesh that its unsharded pools lack)."""
    import jax

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=h100)
    return jax.sharding.use_abstract_mesh(mesh)


def compile_only_device():
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG.read_text(),
                                            topology="1x1x1")
    return topology.devices[0], jax


def tier_format(tier: str):
    """A tier name (the converter's defaults) or a MATRIX_FORMATS name -> QuantFormat, None for bf16."""
    from jmoe.tiers import DEFAULT_FORMATS
    from kernel_formats.qarray import QuantFormat

    if tier in DEFAULT_FORMATS:
        return DEFAULT_FORMATS[tier]
    return None if MATRIX_FORMATS[tier] is None else QuantFormat(**MATRIX_FORMATS[tier])


def case_inputs(model: dict, tier: str, block_rows: int, device, rows_dtype="bfloat16"):
    """ShapeDtypeStructs on `device` for expert_ffn_pallas at a model's shapes."""
    import jax
    import jax.numpy as jnp

    from kernel_formats.qarray import template

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

    from kernel_formats.glu import SILU, GatedActivation
    from pallas_kernels.expert_ffn_pallas import expert_ffn_pallas_tiers, supports_tiers

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


# Decode attention over the paged KV cache (pallas_kernels/decode_attention.py) at each model's heads
# (cache heads, query heads per cache head, head width, sliding window, sinks), for each case of
# (current tokens, cache dtype): one row at a 32K context in pages of 64 slots.
ATTENTION_MODELS = {
    "qwen3-30b-a3b": dict(heads=4, groups=8, width=128, window=None, sink=False),
    "gpt-oss-20b": dict(heads=8, groups=8, width=64, window=128, sink=True),
}
ATTENTION_CASES = ((1, "bfloat16"), (1, "int8"), (1, "float8_e4m3fn"), (8, "bfloat16"),  # decode; verifying 7 drafts
                   (512, "bfloat16"), (512, "int8"))  # a prompt chunk, in tiles
ATTENTION_CONTEXT, ATTENTION_PAGE = 32768, 64


def compile_attention_case(name: str, tokens: int, cache: str, device) -> dict:
    """The paged-attention kernel (and the merge of its shares) at a model's heads over a 32K context:
    a few current tokens in one tile, or a prompt chunk in tiles."""
    import jax
    import jax.numpy as jnp

    from jmoe.layers.attention import QuantizedRows
    from pallas_kernels.decode_attention import decode_attention, supports

    m = ATTENTION_MODELS[name]
    sharding = jax.sharding.SingleDeviceSharding(device)
    on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    K, G, w, n = m["heads"], m["groups"], m["width"], ATTENTION_CONTEXT // ATTENTION_PAGE
    pool_shape = (n, K, ATTENTION_PAGE, w)
    if cache == "int8":
        pool = QuantizedRows(on(pool_shape, jnp.int8), on((*pool_shape[:3], 1), jnp.float32))
    else:
        pool = on(pool_shape, jnp.dtype(cache))
    q = on((1, K, G * tokens, w), jnp.bfloat16)
    row, table = on((1,), jnp.int32), on((1, n), jnp.int32)
    sink = on((K, G), jnp.float32) if m["sink"] else None
    record = dict(model=name, tier=f"{cache} KV", plan=f"attention, {tokens} token{'s' * (tokens > 1)}", rows=1,
                  rows_dtype="bfloat16", context=ATTENTION_CONTEXT, page=ATTENTION_PAGE, window=m["window"],
                  sink=m["sink"])
    if not supports(q, pool, pool, G):
        return dict(record, status="unsupported")

    def attend(q, keys, values, start, key_start, table, sink):
        return decode_attention(q, keys, values, start, key_start, table, groups=G, scale=w**-0.5, window=m["window"],
                                sink=sink)

    return dict(record, **compile_and_read(jax.jit(attend), (q, pool, pool, row, row, table, sink), decode=False))


def compile_mosaic_case(name: str, model: dict, device) -> dict:
    """The int4 decode kernels on Pallas' Mosaic GPU backend (kernel_backend="mosaic"): TMA copies
    into shared memory, every K step of a program in flight at once. Modelled bandwidth from those bytes."""
    import jax

    from kernel_formats.glu import SILU, GatedActivation
    from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic, launch_plan, supports_mosaic

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


def lower_and_compile(jitted, args, options: dict):
    """Lower with inputs on the compile-only H100 and compile there (XLA's debug options `options`)."""
    with abstract_h100():  # the Pallas Triton lowering asks for the GPU it targets (jax 0.11)
        lowered = jitted.trace(*args).lower()
    return lowered.compile(compiler_options=options)


def temp_bytes(compiled) -> int | None:
    """The executable's temporary buffers (XLA's buffer assignment), where the client reports them."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a compile-only client may not: the record just lacks it
        return None


OUR_KERNELS = ("expert_", "decode_attention")  # this project's kernels, by the names their launches carry


def compile_and_read(jitted, args, decode: bool, whole_step: bool = False, *, build=None,
                     read_dump=None) -> dict:
    """Compile for the H100; what ptxas, the thunk sequence and (decode) the PTX's K loop say.

    A whole step also holds XLA's own fusions; a spill there fails the step's compile only when
    it is in one of this project's kernels (XLA's are listed as xla_fusion_spills: not this
    project's code).
    `build(options)` compiles in place of lower_and_compile; `read_dump(dumped_step's texts, log)`
    reads what else the record holds (as "dump") from XLA's dump and log."""
    start = time.perf_counter()
    mosaic_dump = Path(os.environ["MOSAIC_GPU_DUMP_TO"])
    for old in mosaic_dump.iterdir():  # only this case's Mosaic GPU kernels
        old.unlink()
    build = build or functools.partial(lower_and_compile, jitted, args)
    with tempfile.TemporaryDirectory() as dump, captured_stderr() as log:
        options = {"xla_dump_to": dump}
        if whole_step:
            options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = False
        try:
            compiled = build(options)
            error = None
        except Exception as e:  # noqa: BLE001 - every compile failure is a result here
            error = f"{type(e).__name__}: {e}"
        launches, ptx = dumped_kernels(dump)
        ptx.update(dumped_kernels(str(mosaic_dump))[1])
        step_texts = dumped_step(dump) if read_dump is not None else {}
    record = dict(compile_s=round(time.perf_counter() - start, 2))
    if whole_step and not error and (temp := temp_bytes(compiled)) is not None:
        record["temp_bytes"] = temp
    if read_dump is not None and not error:
        record["dump"] = read_dump(step_texts, log[0])
    # this project's kernels, and any other kernel of the step that spills
    record["kernels"] = kernels = {k: v for k, v in parse_ptxas(log[0]).items()
                                   if k.startswith(OUR_KERNELS) or v.get("spill_store_bytes")}
    for name, info in kernels.items():
        info.update(launches.get(name, {}))
        if decode and name in ptx:
            info["decode_loop"] = decode_loop_check(ptx[name])
            info["modelled"] = modelled_decode_bandwidth(info)
    if error:
        return dict(record, status=failure_kind(error), error=error.splitlines()[0][:300])
    if any(v.get("spill_store_bytes") for k, v in kernels.items() if k.startswith(OUR_KERNELS) and not whole_step):
        return dict(record, status="register spilling")  # Mosaic GPU runs its own ptxas, without XLA's flag
    if loop_barriers := decode_loop_barriers(kernels):
        return dict(record, status="barrier in the decode loop", error=f"bar.sync per K loop iteration: {loop_barriers}")
    if whole_step:
        record["xla_fusion_spills"] = {k: v["spill_store_bytes"] for k, v in kernels.items()
                                       if not k.startswith(OUR_KERNELS)}
        if any(v.get("spill_store_bytes") for k, v in kernels.items() if k.startswith(OUR_KERNELS)):
            return dict(record, status="register spilling")
    return dict(record, status="ok")


STEP_LAYERS = 2
REFINED_INT4 = "int4, refined"  # a head tier of STEP_CASES: int4 refined from int8 rows
STEP_CACHE = 1024
STEP_CASES = (  # (name, phase, pools: tier -> fraction of the experts in its pool, kernel backend, cache slots,
    # KV cache dtype)
    ("decode, resident int4", "decode", {"int4": 1.0}, "pallas", STEP_CACHE, "bfloat16"),
    ("decode, resident int4, Mosaic GPU", "decode", {"int4": 1.0}, "mosaic", STEP_CACHE, "bfloat16"),
    ("decode, DyMoE pools", "decode", {"bf16": 0.25, "int4": 0.25}, "pallas", STEP_CACHE, "bfloat16"),
    ("prefill 512, DyMoE pools", "prefill", {"bf16": 0.25, "int4": 0.25}, "pallas", STEP_CACHE, "bfloat16"),
    ("verify 4 drafts, DyMoE pools", "verify", {"bf16": 0.25, "int4": 0.25}, "pallas", STEP_CACHE, "bfloat16"),
    # attention over blocks of keys (jmoe/layers/attention.py) at a long context: a known trip count
    ("prefill 512 at a 32K context, resident int4", "prefill", {"int4": 1.0}, "pallas", 32768, "bfloat16"),
    ("decode at a 32K context, resident int4", "decode", {"int4": 1.0}, "pallas", 32768, "bfloat16"),
    # the int8 KV cache (int8 values, a scale per slot and head) read by the same blocked attention
    ("prefill 512 at a 32K context, int8 KV, resident int4", "prefill", {"int4": 1.0}, "pallas", 32768, "int8"),
    ("decode at a 32K context, int8 KV, resident int4", "decode", {"int4": 1.0}, "pallas", 32768, "int8"),
    # the fp8 KV cache (float8_e4m3fn, no scale): widened as its blocks are read, natively on an H100
    ("decode at a 32K context, fp8 KV, resident int4", "decode", {"int4": 1.0}, "pallas", 32768, "float8_e4m3fn"),
    # integer dense weights (jmoe/layers/linear.py): dense int4 and the int6 head's two planes
    ("decode, resident int4, dense int4, int6 head", "decode", {"int4": 1.0}, "pallas", STEP_CACHE, "bfloat16",
     ("int4", "int6")),
    # the refined head (jmoe/layers/refined_head.py): the int4 head, then its top logits from int8 rows
    ("decode, resident int4, dense int4, refined int4 head", "decode", {"int4": 1.0}, "pallas", STEP_CACHE,
     "bfloat16", ("int4", REFINED_INT4)),
)


def compile_step(model: str, case: str, phase: str, pool_fractions: dict, backend: str, cache_len: int,
                 kv_dtype: str, dense_tiers: tuple[str, str] | None = None, *, device) -> dict:
    """The model's jitted forward step for a 2-layer slice and a `cache_len`-slot cache of `kv_dtype`,
    abstract weights on `device`; dense_tiers: (dense tier, head tier) as the converter stores them
    (default bf16 throughout)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.lib.random_checkpoint import model_named
    from convert.dense import dense_format
    from jmoe.decoding.engine import _forward, new_cache
    from jmoe.layers.experts import ExpertState, Selection
    from jmoe.layers.refined_head import RefinedHead
    from jmoe.layers.transformer import abstract_model
    from jmoe.models import config_from_hf
    from jmoe.tiers import expert_template

    sharding = jax.sharding.SingleDeviceSharding(device)
    on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    cfg = config_from_hf(model_named(model).config_for(STEP_LAYERS))
    formats = (None, None) if dense_tiers is None else tuple(
        RefinedHead(dense_format("int4")) if t == REFINED_INT4 else dense_format(t) for t in dense_tiers)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.bfloat16, *formats))
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
    cache = jax.tree.map(lambda s: on(s.shape, s.dtype),
                         jax.eval_shape(lambda: new_cache(cfg, 1, cache_len, jnp.dtype(kv_dtype))))
    start, key_start = on((1,), jnp.int32), on((1,), jnp.int32)
    step = jax.jit(functools.partial(_forward, graphdef, last_only=phase == "prefill", want_importance=False))
    record = dict(model=model, tier="+".join(pools), plan=f"step: {case}", layers=STEP_LAYERS,
                  pool_slots={t: jax.tree.leaves(p)[0].shape[0] for t, p in pools.items()})
    return dict(record, **compile_and_read(step, (dense, state, tokens, cache, start, key_start),
                                           decode=phase == "decode", whole_step=True))


# -- The offloaded decode step: experts fetched from pinned-host stores inside the step
# (jmoe/layers/fetch.py), read back from XLA's optimized HLO, thunk sequence and log.

OFFLOAD_CASES = (  # (name, policy, its tier, its options): fetch slots as an accelerator's steps get them
    ("offloaded decode, lru int4", "lru", "int4", {}),
    ("offloaded decode, lru+prefetch int4", "lru+prefetch", "int4", {}),
    ("offloaded decode, DyMoE bf16+int4", "dymoe", "bf16", {"lo": "int4"}),
    ("offloaded decode, DynaExq bf16+int4", "dynaexq", "bf16", {"lo": "int4"}),
)
OFFLOAD_CACHE_SHARE = 0.25  # each tier's pool caches a quarter of the slice's experts
HOST_MEMORY_SPACE = "S(5)"  # how XLA's layouts mark host memory


def braced(text: str, opening: int) -> str:
    """What lies between the brace at text[opening] and its matching closing brace."""
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1:i]
    raise ValueError("unbalanced braces")


def host_arrays_in_entry_layout(hlo: str) -> dict[str, int]:
    """Parameters and results the compiled module's entry layout places in host memory."""
    key = "entry_computation_layout="
    layout = braced(hlo, hlo.index(key) + len(key))
    parameters, results = layout.split(")->", 1)
    return dict(parameters=parameters.count(HOST_MEMORY_SPACE), results=results.count(HOST_MEMORY_SPACE))


def entry_schedule(hlo: str) -> list[str]:
    """The entry computation's instructions in their scheduled order (a scheduled module prints them so)."""
    lines = hlo[hlo.index("\nENTRY "):].splitlines()[2:]
    return [line.strip() for line in itertools.takewhile(lambda line: line != "}", lines)]


ASYNC_START = re.compile(r"^(?:ROOT )?%(\S+) = (.*?) (?:async|fusion|copy)-start\(")
ASYNC_DONE = re.compile(r" (?:async|fusion|copy)-done\(%([^,)\s]+)")
TRITON_KERNEL = "__gpu$xla.gpu.triton"  # the custom call of a Pallas Triton kernel


def host_async_slices(hlo: str) -> dict:
    """The entry computation's asynchronous computations, fusions and copies that read host memory
    (a start whose operand shapes hold S(5)): how many start and are waited on, the most in flight
    at once, and where they sit in the schedule (instructions and Triton kernels between a start
    and its done)."""
    schedule = entry_schedule(hlo)
    started, spans, in_flight, most = {}, [], 0, 0
    for i, line in enumerate(schedule):
        if (m := ASYNC_START.match(line)) and HOST_MEMORY_SPACE in m.group(2):
            started[m.group(1)] = i
            in_flight += 1
            most = max(most, in_flight)
        elif (m := ASYNC_DONE.search(line)) and m.group(1) in started:
            begin = started[m.group(1)]
            spans.append((begin, i, sum(TRITON_KERNEL in between for between in schedule[begin + 1:i])))
            in_flight -= 1
    between = [done - begin - 1 for begin, done, _ in spans]
    kernels = [k for _, _, k in spans]
    return dict(started=len(started), done=len(spans), most_in_flight=most, schedule_length=len(schedule),
                first_start=min(started.values(), default=None), last_done=max((d for _, d, _ in spans), default=None),
                instructions_between=[min(between, default=0), max(between, default=0)],
                triton_kernels_between=[min(kernels, default=0), max(kernels, default=0)],
                spans=[list(span) for span in spans])  # [start, done, Triton kernels between] per slice


HOST_COMPUTE_HLO = ('_xla_compute_type="host"', '"MoveToHost"', '"MoveToDevice"', "annotate_device_placement")
HOST_COMPUTE_LOG = re.compile(r"into host compute", re.IGNORECASE)


def host_compute(hlo: str, log: str) -> list[str]:
    """What the compiled step runs on the host: instructions marked for host compute or host
    offloading left in the optimized HLO, and XLA's warnings that it turned device compute on host
    memory into host compute."""
    marked = [line.strip()[:200] for line in hlo.splitlines() if any(mark in line for mark in HOST_COMPUTE_HLO)]
    return marked + [line.strip()[:300] for line in log.splitlines() if HOST_COMPUTE_LOG.search(line)]


def branches_and_loops(hlo: str) -> dict[str, int]:
    """Conditionals and while loops in the optimized HLO, and the loops without a known trip count."""
    whiles = [line for line in hlo.splitlines() if " while(" in line]
    return dict(conditionals=sum(" conditional(" in line for line in hlo.splitlines()), whiles=len(whiles),
                whiles_without_known_trip_count=sum("known_trip_count" not in line for line in whiles))


THUNK_LINE = re.compile(r"^(\s*)\d+: (k\w+)")


def command_buffers(thunks: str) -> dict:
    """From the thunk sequence after XLA's thunk passes: command buffers (at any depth) and the
    top-level thunks by kind (a step run as one command buffer has exactly one there)."""
    buffers, top_level = 0, {}
    for line in thunks.splitlines():
        if m := THUNK_LINE.match(line):
            buffers += m.group(2) == "kCommandBuffer"
            if not m.group(1):
                top_level[m.group(2)] = top_level.get(m.group(2), 0) + 1
    return dict(command_buffers=buffers, top_level=top_level)


ASYNC_STREAM = re.compile(r"kAsyncStart .*?stream=([\w\[\]]+)")


def slice_launches(thunks: str) -> dict:
    """What the thunk sequence's asynchronous starts run: the streams they start on and the
    kernels nested in them (a slice of host memory is a kernel reading it, not a copy engine's)."""
    streams, kernels, start_depth = set(), {}, None
    for line in thunks.splitlines():
        depth = len(line) - len(line.lstrip())
        if m := ASYNC_STREAM.search(line):
            streams.add(m.group(1))
            start_depth = depth
        elif start_depth is not None and depth > start_depth:
            kernels.update(parse_thunks(line))
        else:
            start_depth = None
    return dict(async_streams=sorted(streams), async_kernels=kernels)


def host_async_starts_anywhere(hlo: str) -> int:
    """Asynchronous starts reading host memory in every computation (a conditional's branches too)."""
    return sum(bool((m := ASYNC_START.match(line.strip())) and HOST_MEMORY_SPACE in m.group(2))
               for line in hlo.splitlines())


def read_offloaded_step(texts: dict[str, str], log: str) -> dict:
    """Everything the offload checks read, from dumped_step's texts and the compile's log."""
    return dict(host_arrays=host_arrays_in_entry_layout(texts["hlo"]), async_slices=host_async_slices(texts["hlo"]),
                async_slices_anywhere=host_async_starts_anywhere(texts["hlo"]),
                host_compute=host_compute(texts["hlo"], log), **branches_and_loops(texts["hlo"]),
                **command_buffers(texts["thunks"]), **slice_launches(texts["thunks"]))


def expected_fetches(tiers: int, moe_layers: int, requests: int, lookahead: int, misses: int) -> int:
    """Host slices one step makes (each fetch slot moves a record every step on an accelerator):
    per MoE layer and tier its requests and misses, and its look-ahead from the second MoE layer on
    (the previous layer predicts it; nothing predicts the first)."""
    return tiers * (moe_layers * (requests + misses) + max(0, moe_layers - 1) * lookahead)


def expected_chains(spec, moe_layers: int, lookahead: int) -> tuple[int, int]:
    """(chains, conditionals) of a step whose misses and look-ahead are chains of conditional
    fetches: a chain per (MoE layer, tier) for its misses and, from the second MoE layer on, for its
    look-ahead; a conditional per fetch."""
    from jmoe.runtime.fetching import step_fetches

    _, chains, links = step_fetches(moe_layers, spec.requests, spec.misses, lookahead, max(0, moe_layers - 1), True)
    return len(spec.tiers) * chains, len(spec.tiers) * links


def offload_checks(found: dict, fetches: int, stores: int, chains: int = 0, links: int = 0) -> dict[str, bool]:
    """What an offloaded decode step must compile to on an H100 (read_offloaded_step's `found`).
    With fixed fetch slots only: one command buffer, no conditional, every slice in the entry
    computation. With `chains` chains of conditional fetches (`links` fetches in all): each chain
    one top-level conditional (the command buffers run between them), `links` conditionals in all,
    and every slice asynchronous wherever it sits."""
    slices = found["async_slices"]
    checks = dict(
        stores_in_host_memory=found["host_arrays"] == dict(parameters=stores, results=0),
        async_host_slices=found["async_slices_anywhere"] == fetches
        and (chains > 0 or slices["started"] == slices["done"] == fetches),
        no_host_compute=not found["host_compute"],
        known_trip_counts=found["whiles_without_known_trip_count"] == 0,
    )
    if chains:
        checks["fetches_in_chains"] = (found["conditionals"] == links
                                       and found["top_level"].get("kConditional", 0) == chains)
    else:
        checks["no_conditional"] = found["conditionals"] == 0
        checks["one_command_buffer"] = found["command_buffers"] == 1 and found["top_level"] == {"kCommandBuffer": 1}
    return checks


def compile_from_cpu_trace(jitted, args, device, options: dict) -> None:
    """The compile-only H100 reports no memories (a pinned_host input there silently becomes device
    memory), so: trace with CPU shardings that keep their memory kinds, lower with the GPU's rules,
    and compile the module with the compile-only topology's client."""
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client

    with abstract_h100():
        lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
    compile_options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                                   device_assignment=np.array([[device]]),
                                                   env_options_overrides=options)
    devices = xla_client.DeviceList((device,)) if hasattr(xla_client, "DeviceList") else [device]
    device.client.compile(lowered.compiler_ir("stablehlo"), executable_devices=devices,
                          compile_options=compile_options)


def offload_spec(cfg, policy, device):
    """The FetchSpec an accelerator's Offloaded residency would give `policy`'s decode steps (one
    row; jmoe.runtime.fetching.InStepFetch's sizes), each tier caching OFFLOAD_CACHE_SHARE of the experts."""
    from jmoe.format import RecordLayout
    from jmoe.layers.fetch import FetchSpec
    from jmoe.runtime.fetching import LANDING_SHARE, fetch_slots
    from jmoe.tiers import expert_template

    slots = fetch_slots(cfg, policy, device, 1, "decode" in policy.degrade_phases)
    tiers = tuple(policy.pools())
    cache = tuple(max(1, round(OFFLOAD_CACHE_SHARE * cfg.num_moe_layers * cfg.num_experts)) for _ in tiers)
    landing = max(1, min(cfg.num_moe_layers * (slots.lookahead + slots.misses), min(cache) // LANDING_SHARE))
    layouts = tuple(RecordLayout.from_template(expert_template(cfg, t, tier_format(t))) for t in tiers)
    # FetchSlots' fields (fetch counts, guarded, degrade, predict) are FetchSpec's of the same names,
    # but `decode` (a draft's plain-step sizes: these slots are drawn without a draft)
    fields = {k: v for k, v in dataclasses.asdict(slots).items() if k != "decode"}
    return FetchSpec(tiers, layouts, cache, cfg.num_experts, landing=landing, land=policy.cache, **fields)


def offloaded_decode_inputs(cfg, spec, on, in_host):
    """The model's graphdef and engine._decode's abstract inputs after it, for one row: (dense,
    experts, pools, tokens, cache, positions, seen, rng, then the sampling parameters);
    `in_host` places the stores, `on` everything else."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jmoe.decoding.engine import new_cache
    from jmoe.decoding.sampling import HISTORY_DTYPE, SamplingOptions
    from jmoe.layers.experts import ExpertState, Selection
    from jmoe.layers.fetch import FetchInputs
    from jmoe.layers.transformer import abstract_model
    from jmoe.tiers import expert_template

    L, E, T = cfg.num_moe_layers, cfg.num_experts, len(spec.tiers)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.bfloat16))
    dense = jax.tree.map(lambda s: on(s.shape, s.dtype), nnx.to_pure_dict(state))
    stores = {t: tuple(in_host((E, layout.nbytes), jnp.uint8) for _ in range(L))
              for t, layout in zip(spec.tiers, spec.layouts)}
    packed = on((T * L * E + 2 * T * L * spec.requests + 3 * T * spec.landing,), jnp.int32)  # FetchSpec.pack
    fetch = FetchInputs(stores, packed, on((T, spec.landing), jnp.int32))
    selection = Selection(on((L, E), jnp.int32), on((L, E), jnp.int32), on((L,), jnp.float32), on((), jnp.float32))
    experts = ExpertState({}, None, selection, "pallas", fetch=fetch, fetch_spec=spec).for_phase("decode")
    pools = {t: jax.tree.map(lambda s, n=n + spec.extra_slots(): on((n, *s.shape), s.dtype),
                             expert_template(cfg, t, tier_format(t)))
             for t, n in zip(spec.tiers, spec.cache_slots)}
    cache = jax.tree.map(lambda s: on(s.shape, s.dtype),
                         jax.eval_shape(lambda: new_cache(cfg, 1, STEP_CACHE, jnp.bfloat16)))
    rng = jax.eval_shape(lambda: jax.random.key(0))
    # the sampling parameters as the step takes them (SamplingOptions.device_params: their shapes and dtypes)
    params = tuple(on(p.shape, p.dtype) for p in SamplingOptions().device_params(cfg.vocab_size))
    return graphdef, (dense, experts, pools, on((1,), jnp.int32), cache, on((2, 1), jnp.int32),
                      on((1, cfg.vocab_size), HISTORY_DTYPE), on(rng.shape, rng.dtype), *params)


def compile_offloaded_step(model: str, case: str, policy_name: str, tier: str, options: dict, device,
                           greedy: bool = False, guarded: bool = False) -> dict:
    """engine._decode of a 2-layer slice whose experts come from pinned-host stores inside the step,
    as Engine.decode jits it (sampling, by default, rather than greedy), compiled for the H100 with
    its stores kept in host memory; then checked (offload_checks). `guarded`: each fetch in a
    conditional, as on the CPU (the offload canary)."""
    import jax

    from bench.lib.random_checkpoint import model_named
    from jmoe.decoding.engine import _decode
    from jmoe.models import config_from_hf
    from jmoe.policies import make_policy

    cpu = jax.devices("cpu")[0]
    placed = lambda kind: lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(cpu, memory_kind=kind))
    cfg = config_from_hf(model_named(model).config_for(STEP_LAYERS))
    spec = offload_spec(cfg, make_policy(policy_name, tier, **options), device)
    spec = dataclasses.replace(spec, guarded=True) if guarded else spec
    graphdef, args = offloaded_decode_inputs(cfg, spec, placed("device"), placed("pinned_host"))
    step = jax.jit(functools.partial(_decode, graphdef, greedy=greedy), donate_argnames=("cache", "pools"))
    lookahead = spec.lookahead if spec.predict else 0  # else only a speculative draft's hint looks ahead
    fetches = expected_fetches(len(spec.tiers), cfg.num_moe_layers, spec.requests, lookahead, spec.misses)
    # the canary (guarded) is held to a chained step's plan: its conditionals are per fetch instead
    chains, links = expected_chains(spec, cfg.num_moe_layers, lookahead) if spec.chained else (0, 0)
    record = dict(model=model, tier="+".join(spec.tiers), plan=f"step: {case}", layers=STEP_LAYERS,
                  moe_layers=cfg.num_moe_layers, greedy=greedy,
                  fetch_spec=dict(requests=spec.requests, lookahead=spec.lookahead, misses=spec.misses,
                                  landing=spec.landing, guarded=spec.guarded, chained=spec.chained,
                                  degrade=spec.degrade,
                                  predict=spec.predict,
                                  record_bytes={t: l.nbytes for t, l in zip(spec.tiers, spec.layouts)}),
                  pool_slots={t: n + spec.extra_slots() for t, n in zip(spec.tiers, spec.cache_slots)},
                  expected_fetches=fetches, expected_chains=chains, expected_conditionals=links)
    # XLA's kernel cache, shared by this run's offloaded steps: a model's three steps share most of
    # their fusions, each otherwise a ptxas process of its own (about 270 a step); its checks read
    # the HLO and the thunks. A cached kernel's register count was read, and checked, where it was
    # first compiled; a record's `kernels` lists those it compiled.
    options = {"xla_gpu_kernel_cache_file": os.path.join(tempfile.gettempdir(), "offloaded-steps.kernels")}
    build = lambda extra: compile_from_cpu_trace(step, args, device, dict(extra, **options))  # noqa: E731
    result = compile_and_read(step, args, decode=True, whole_step=True, build=build, read_dump=read_offloaded_step)
    if "dump" not in result:
        return dict(record, **result)
    found = result.pop("dump")
    checks = offload_checks(found, fetches, len(spec.tiers) * cfg.num_moe_layers, chains, links)
    if result["status"] == "ok" and not all(checks.values()):
        result["status"] = "offload checks failed"
    return dict(record, **result, checks=checks, found=found)


# What the CPU's fetches (each in a conditional of its own, around its pool write) compile to on an
# H100: checks that must fail (a conditional per fetch at the top level, not one per chain).
OFFLOAD_CANARY_FAILS = ("fetches_in_chains",)


def offload_canary(device) -> dict:
    """Qwen3-30B-A3B's LRU step with the CPU's guarded fetches, which read a predicate back to the
    host per fetch: its checks OFFLOAD_CANARY_FAILS must fail, or the offload checks are broken."""
    record = compile_offloaded_step("qwen3-30b-a3b", "offload canary: guarded fetches", *OFFLOAD_CASES[0][1:], device,
                                    guarded=True)
    return dict(record, expected_to_fail=list(OFFLOAD_CANARY_FAILS))


def offload_canary_caught(canary: dict) -> bool:
    return "checks" in canary and not any(canary["checks"][name] for name in OFFLOAD_CANARY_FAILS)


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


def kernel_line(r: dict) -> str:
    regs = ", ".join(f"{k} {v.get('registers')} regs, {v.get('spill_store_bytes', 0)} B spilled"
                     + (f", loop: {v['decode_loop']['barriers']} bar.sync, "
                        f"{v['decode_loop']['vector_loads_before_first_fma']}/{v['decode_loop']['vector_loads']} "
                        "vector loads before the first fma" if v.get("decode_loop") else "")
                     for k, v in sorted(r.get("kernels", {}).items()))
    temp = f", {r['temp_bytes'] / 2**20:.0f} MiB of temporaries" if "temp_bytes" in r else ""
    return f"{r['model']:17s} {r['tier']:13s} {r.get('rows_dtype', ''):8s} {r['plan']:8s} {r['status']:22s} {regs}{temp}"


def offload_line(r: dict) -> str:
    head = f"{r['model']:17s} {r['tier']:13s} {r['plan']}: {r['status']}"
    if "found" not in r:
        return f"{head} {r.get('error', '')}"
    f, slices = r["found"], r["found"]["async_slices"]
    failed = [name for name, ok in r["checks"].items() if not ok]
    return (f"{head}, {f['async_slices_anywhere']}/{r['expected_fetches']} async host slices "
            f"({slices['started']} in the entry computation, {slices['done']} done there, "
            f"at most {slices['most_in_flight']} in flight), "
            f"{f['host_arrays']['parameters']} host stores in S(5), "
            f"{f['command_buffers']} command buffer(s) (top level: {f['top_level']}), "
            f"{f['conditionals']} conditionals ({r.get('expected_chains', 0)} chains planned), {f['whiles']} whiles "
            f"({f['whiles_without_known_trip_count']} without a known trip count), "
            f"{len(f['host_compute'])} host-compute marks, {r['compile_s']} s"
            + (f"; failed: {', '.join(failed)}" if failed else ""))


def kernel_and_step_runs(args, models: list[str], device) -> list:
    shapes = kernel_shapes()
    cases = [(name, shapes[name], tier, block_rows, "bfloat16") for name in models
             for tier in args.tiers.split(",") for block_rows in (1, 32)]
    cases += [(name, shapes[name], mix, 1, "bfloat16") for name in models for mix in TIER_MIXES]
    if args.matrix:
        cases += [("test-matrix", MATRIX_SHAPE, tier, block_rows, dtype) for tier in MATRIX_FORMATS
                  for block_rows in (1, 32) for dtype in ("float32", "bfloat16")]
    runs = [functools.partial(compile_case, *case[:4], device, case[4]) for case in cases]
    runs += [functools.partial(compile_mosaic_case, name, shapes[name], device) for name in models]
    runs += attention_runs(models, device)
    if args.steps:
        runs += [functools.partial(compile_step, name, *case, device=device)
                 for name, case in step_pairs(models, STEP_CASES, args.steps_in_turn)]
    return runs


def step_pairs(models: list[str], cases: tuple, in_turn: bool) -> list[tuple[str, tuple]]:
    """(model, case) for every whole-step case: for every model, or (in_turn) each case for one
    model, the models taken in turn, so every case and every model is still compiled at least once."""
    if not in_turn:
        return [(name, case) for name in models for case in cases]
    return [(models[i % len(models)], case) for i, case in enumerate(cases)]


def attention_runs(models: list[str], device) -> list:
    return [functools.partial(compile_attention_case, name, tokens, cache, device) for name in models
            if name in ATTENTION_MODELS for tokens, cache in ATTENTION_CASES]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODEL_NAMES))
    parser.add_argument("--tiers", default="bf16,int8,int4,int3,int2")
    parser.add_argument("--no-matrix", dest="matrix", action="store_false",
                        help="leave out the test suite's lowering matrix (toy widths, float32 and bf16 rows)")
    parser.add_argument("--no-steps", dest="steps", action="store_false",
                        help="leave out the whole jitted steps of 2-layer model slices")
    parser.add_argument("--no-offload", dest="offload", action="store_false",
                        help="leave out the offloaded decode steps (experts fetched from pinned-host stores)")
    parser.add_argument("--steps-in-turn", action="store_true",
                        help="compile each whole-step and offloaded-step case for one model, the models in "
                             "turn, rather than for every model (the kernel cases stay at every shape): "
                             "what `make test` runs, a quarter of the steps' compile time")
    parser.add_argument("--only-offload", action="store_true",
                        help="only the offloaded decode steps (no kernel cases, other steps or spill canary)")
    parser.add_argument("--only-attention", action="store_true",
                        help="only the decode-attention kernel cases (no expert kernels, steps or canaries)")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_compile" / "gpu_compile_h100.json"))
    args = parser.parse_args(argv)
    _setup_environment()
    device, jax = compile_only_device()
    models = args.models.split(",")
    if args.only_attention:
        runs = attention_runs(models, device)
    else:
        runs = [] if args.only_offload else kernel_and_step_runs(args, models, device)
    if (args.offload or args.only_offload) and not args.only_attention:
        runs += [functools.partial(compile_offloaded_step, name, *case, device)
                 for name, case in step_pairs(models, OFFLOAD_CASES, args.steps_in_turn)]
    results = []
    for run in runs:
        r = run()
        results.append(r)
        print(offload_line(r) if "expected_fetches" in r else kernel_line(r), flush=True)
    failed = [r for r in results if r["status"] not in ("ok", "unsupported")]
    canary, canary_ok = None, True
    if not (args.only_offload or args.only_attention):
        canary = spill_canary(device)
        canary_ok = canary["status"] == canary["expected"]
        print(f"canary (a block known to spill): {canary['status']}"
              + ("" if canary_ok else " -- the spill check is broken"))
    offload_canary_record, offload_canary_ok = None, True
    if (args.offload or args.only_offload) and not args.only_attention:
        offload_canary_record = offload_canary(device)
        offload_canary_ok = offload_canary_caught(offload_canary_record)
        print(f"offload canary (guarded fetches): {offload_line(offload_canary_record)}"
              + ("" if offload_canary_ok else " -- the offload checks are broken"))
    out = dict(device=str(device.device_kind), jax=jax.__version__, target_config=TARGET_CONFIG.name,
               xla_flags=os.environ["XLA_FLAGS"], failed=len(failed), canary=canary,
               offload_canary=offload_canary_record, cases=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}: {len(results)} cases, {len(failed)} failed")
    return 1 if failed or not canary_ok or not offload_canary_ok else 0

if __name__ == "__main__":
    sys.exit(main())
