from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

# One BLAS and OpenMP thread per process (numpy's and scipy's OpenBLAS, torch's intra-op pool): the
# suite runs a process per core (pytest-xdist) beside the processes tests start, so those libraries'
# own threads only contend with them, spinning where they wait (GPTQ's calibrated conversion of the
# tiny model took 57 s beside another busy process, 28 s with one BLAS thread). Set before numpy and
# torch are first imported, which is when they read it; the processes tests start inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Eight CPU devices (before any backend starts), for the expert-parallel tests' meshes; everything
# else runs on the first, as on a one-device machine.
TEST_CPU_DEVICES = 8
jax.config.update("jax_num_cpu_devices", TEST_CPU_DEVICES)

# Most of the suite's time is XLA:CPU compiling its many small steps, which at the suite's shapes
# run in microseconds. LLVM at -O0 (XLA's default is -O2) with XLA:CPU's elemental emitters rather
# than its MLIR fusion emitters compiles a 2-layer model's step about 3x faster (1.5 -> 0.5 s here)
# and runs it within 2x. Numeric work that runs long by itself (conversion's quantizers and
# calibration, the reference dequantization) asks for full optimisation per jit
# (kernel_formats/optimised.py). LLVM's code generation in one piece rather than split for parallel
# threads: on two cores that both run a test the split only adds work (a tiny-model generate compiled
# in 2.1-2.7 s instead of 3.1-3.6 s, about 10% less CPU for the whole process). Set before the backend
# starts; the processes tests start inherit it. Flags the caller gave are kept; these are added only
# where the suite runs on XLA:CPU (a GPU machine's run keeps XLA's defaults) and as many of them as
# this jaxlib knows, in order (XLA aborts on an unknown flag).
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1")


def _cpu_backend_takes(flags: list[str]) -> bool:
    """Whether jax, given these XLA_FLAGS, starts and runs on the CPU (asked in a process of its own:
    this one's backend must not start yet)."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import jax, sys; sys.exit(jax.default_backend() != 'cpu')"],
                           env=dict(os.environ, XLA_FLAGS=" ".join(flags)), capture_output=True)
    return probe.returncode == 0


if "JMOE_TEST_XLA_FLAGS" not in os.environ:  # decided once, by the controller; its workers inherit it
    given = os.environ.get("XLA_FLAGS", "").split()
    added = [f for f in SUITE_XLA_FLAGS if f.split("=")[0] not in " ".join(given)]
    while added and not _cpu_backend_takes(given + added):
        added = added[:-1]
    os.environ["XLA_FLAGS"] = " ".join(given + added)
    os.environ["JMOE_TEST_XLA_FLAGS"] = " ".join(added) or "none"

# The suite neither reads nor fills the user's persistent compilation cache (jmoe/runtime/compile_cache.py):
# it starts one of its own, empty, shared by this run's workers and the processes tests start, so a
# step that several tests build (same model, same shapes) compiles once per run; the controller
# removes it at the end. Tests of the cache give their own directory.
# (pytest-xdist's workers inherit the controller's environment, set here before they start.)
if "JMOE_TEST_RUN_CACHE" not in os.environ:
    os.environ["JMOE_TEST_RUN_CACHE"] = tempfile.mkdtemp(prefix="jmoe-test-xla-")
RUN_CACHE = Path(os.environ["JMOE_TEST_RUN_CACHE"])
os.environ["JMOE_COMPILATION_CACHE"] = str(RUN_CACHE)
# Nor the step cache (jmoe/runtime/step_cache.py): tests that patch what a step traces (a kernel made
# to fail, another backend) must trace it; tests/test_step_cache.py turns it on in a directory of its own.
os.environ.setdefault("JMOE_STEP_CACHE", "off")

ROOT = Path(__file__).resolve().parents[1]
TINY_HF = ROOT / "examples" / "tiny-qwen3-moe"
DATA = ROOT / "tests" / "data"  # slices of the training corpus (see tests/data/README.md)
CALIB_FILES = [str(DATA / f"{d}.train.txt") for d in ("prose", "code", "math")]


# XLA:CPU maps every executable's code; the whole suite's would pass the per-process limit on memory
# mappings (vm.max_map_count, 65530 by default), where compiling segfaults. One test module adds up
# to about 20,000, so past this many the compiled code is dropped (it recompiles on next use).
MAPPINGS_BEFORE_RELEASE = 30_000


def memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    yield
    if memory_mappings() > MAPPINGS_BEFORE_RELEASE:
        from convert import calibration
        from jmoe.decoding import engine

        calibration.clear_compiled()
        engine.clear_compiled()
        gc.collect()


@pytest.fixture
def small_key_blocks():
    """Attention over blocks of 16 keys (jmoe/layers/attention.py), so the suite's short caches take
    several blocks: the online softmax, the blocks a step skips and a last block overlapping the one
    before run in the tests that use this (the parity tests, against transformers). Compiled steps
    are forgotten before and after: they hold the block size they were traced with."""
    from jmoe.decoding import engine
    from jmoe.layers import attention

    saved = attention.MIN_KEY_BLOCK, attention.MAX_KEY_BLOCK
    engine.clear_compiled()
    attention.MIN_KEY_BLOCK = attention.MAX_KEY_BLOCK = 16
    yield 16
    attention.MIN_KEY_BLOCK, attention.MAX_KEY_BLOCK = saved
    engine.clear_compiled()


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without workers): after every test
        shutil.rmtree(RUN_CACHE, ignore_errors=True)


# Seconds each of the slower modules took on the 2-core CI machine (the run at fa85b3f, 2 workers).
# `make test` hands whole modules to its two workers in collection order (--dist loadfile
# --no-loadscope-reorder), so the suite is collected slowest module first and only quick modules are
# left for the end (by default xdist orders modules by their number of tests, which left a 5-test,
# 4-minute module for last). Measured, this bounds the end-of-run wait but did not shorten the run
# within the machine's noise (bench/results/suite_time). A module not listed is taken as quick.
MODULE_SECONDS = {
    "test_offload.py": 437, "test_cpu_kernels.py": 381, "test_kernels.py": 369, "test_speculative.py": 353,
    "test_family_deepseek.py": 352, "test_multiprocess.py": 278, "test_expert_parallel.py": 277,
    "test_quantized_model.py": 247, "test_serving_batcher.py": 215, "test_family_phimoe.py": 176,
    "test_family_gpt_oss.py": 165, "test_host_waits.py": 151, "test_dense_tier.py": 101, "test_family_parity.py": 101,
    "test_rope.py": 101, "test_sampling.py": 97, "test_serving_signals.py": 96, "test_host_memory.py": 93,
    "test_chat_and_bench.py": 92, "test_policies.py": 90, "test_seams.py": 83, "test_blocked_attention.py": 80,
    "test_serving_api.py": 73, "test_kv_int8.py": 68, "test_serving_load.py": 67, "test_quantizers.py": 65,
    "test_prefix_cache.py": 59, "test_concurrency.py": 55, "test_generation.py": 55, "test_convert.py": 41,
    "test_step_cache.py": 36, "test_tiny_model.py": 26, "test_expert_path.py": 25,
}


def slowest_module_first(items) -> None:
    """Reorder in place: modules by MODULE_SECONDS, slowest first; each module's tests stay together
    and in their order (a stable sort on a per-module key)."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.name, 0))


def pytest_collection_modifyitems(config, items):
    slowest_module_first(items)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hf_dir() -> Path:
    return TINY_HF


@pytest.fixture(scope="session")
def tiny_converted(tmp_path_factory) -> Path:
    from convert import convert_checkpoint

    return convert_checkpoint(TINY_HF, tmp_path_factory.mktemp("tiny") / "tiny", progress=False)


SHORT_LAYERS = 2


@pytest.fixture(scope="session")
def short_hf_dir(tmp_path_factory) -> Path:
    """The tiny model cut to its first SHORT_LAYERS decoder layers (their trained weights and routing,
    the final norm, the tokenizer). For tests of mechanics (offloading, policies, serving,
    speculation) that compare one way of running a model with another: their steps compile in a
    fraction of the 8-layer model's time. Quality and parity tests use the whole model."""
    import json

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("short") / "tiny-short"
    out.mkdir()
    tensors = load_file(TINY_HF / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < SHORT_LAYERS}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((TINY_HF / "config.json").read_text())
    config["num_hidden_layers"] = SHORT_LAYERS
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY_HF / name, out / name)
    return out


@pytest.fixture(scope="session")
def short_converted(short_hf_dir, tmp_path_factory) -> Path:
    from convert import convert_checkpoint

    return convert_checkpoint(short_hf_dir, tmp_path_factory.mktemp("short") / "short", progress=False)


@pytest.fixture(scope="session")
def short_model(short_converted):
    import jmoe

    return jmoe.load(short_converted, compute_dtype="float32")


@pytest.fixture(scope="session")
def tiny_model(tiny_converted):
    import jmoe

    return jmoe.load(tiny_converted, compute_dtype="float32")


@pytest.fixture(scope="session")
def tiny_hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_HF, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_HF)


def dev_text(domain: str) -> str:
    """The start of a domain's dev split (bundled under tests/data)."""
    return (DATA / f"{domain}.dev.txt").read_text()
