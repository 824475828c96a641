"""Shared benchmark helpers: machine description, timing, result files (bench/results/<benchmark>/)."""

from __future__ import annotations

import argparse

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
TINY_HF = ROOT / "examples" / "tiny-qwen3-moe"
CORPUS = ROOT.parent / "shared" / "corpus"
DOMAINS = ("prose", "code", "math")
CALIB_FILES = [CORPUS / f"{d}.train.txt" for d in DOMAINS]  # calibration: the train splits


def dev_tokens(tokenizer, domain: str, max_tokens: int | None = None) -> np.ndarray:
    """A domain's dev split (every quality figure is measured there), optionally cut short."""
    ids = np.asarray(tokenizer.encode((CORPUS / f"{domain}.dev.txt").read_text()), np.int32)
    return ids[:max_tokens] if max_tokens else ids


def dev_prompts(tokenizer, n_tokens: int = 48) -> list[list[int]]:
    """One prompt per domain: n_tokens from the middle of its dev text."""
    return [tokenizer.encode((CORPUS / f"{d}.dev.txt").read_text()[5000:12000])[:n_tokens] for d in DOMAINS]


def machine() -> dict:
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    family = model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "cpu family":
                family = int(value)
            elif key == "model":
                model = int(value)
            elif key == "model name":
                cpu = value
                break
    except (OSError, ValueError):
        pass
    from cpu_kernels import native

    return {
        "backend": jax.default_backend(),
        "device": dev.device_kind,
        "cpu": cpu,
        # a VM may name only the brand ("AMD EPYC"): the family and the kernels' instruction set
        # tell one generation from another
        "cpu_family": family,
        "cpu_model": model,  # with the family, the generation (6/207: Xeon Emerald Rapids; 25/17: EPYC Zen 4)
        "cpu_kernels_isa": native.isa(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def jmoe_bench_rows(model: Path, *flags: str, env: dict | None = None) -> list[dict]:
    """`jmoe bench MODEL FLAGS --json` in its own process (its own thread pool and compile): its rows."""
    cmd = [sys.executable, "-m", "jmoe.cli", "bench", str(model), *flags, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT,
                         env=None if env is None else {**os.environ, **env}).stdout
    return json.loads(out[out.index("["):])


def timed(fn, *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds; fn must block until its result is ready. Whatever it
    compiles, it compiles in the warm-up: a compile in the timed calls raises
    (jmoe.serving.compiles.CompiledInTimedWindow)."""
    from jmoe.serving.compiles import no_compiles

    for _ in range(warmup):
        fn()
    times = []
    with no_compiles(getattr(fn, "__name__", "a timed call")):
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def in_graph_seconds(fn, args, *, calls: int = 20, repeat: int = 5) -> float:
    """Seconds per call of fn(rows, *rest) inside one jitted chain of `calls` dependent calls (each
    call's output is the next call's rows): what the call costs within a step, without the per-call
    dispatch and host synchronisation that timing a lone call adds (tens of microseconds on a GPU)."""
    def chain(rows, *rest):
        for _ in range(calls):
            rows = fn(rows, *rest).astype(rows.dtype)
        return rows

    chained = jax.jit(chain)
    return timed(lambda: jax.block_until_ready(chained(*args)), repeat=repeat, warmup=1) / calls


def spread(values) -> dict:
    """A measurement's median and range, as the results record them."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def staging_bytes(path: Path) -> int:
    """What load() reserves for transfers in flight, at most: 2 top-k of the largest record."""
    from jmoe.manifest import read_manifest

    manifest = read_manifest(path)
    return 2 * manifest["config"]["top_k"] * max(t["record_nbytes"] for t in manifest["tiers"].values())


def planned_budget(path: Path, share: float, **plan_kw) -> int:
    """A device budget of every reservation jmoe.memory_plan(path, **plan_kw) names plus `share` of
    its "all_experts" bytes: pools holding that share of the experts."""
    from jmoe.runtime.loader import memory_plan

    plan = memory_plan(path, **plan_kw)
    experts = plan.pop("all_experts")
    return sum(plan.values()) + int(share * experts)


def dymoe_ratios(value: str) -> list[float]:
    """An argparse type for comma-separated DyMoE ratios r, each checked by the policy itself."""
    from jmoe.errors import InputError
    from jmoe.policies import DyMoE

    try:
        ratios = [float(x) for x in value.split(",") if x.strip()]
        for r in ratios:
            DyMoE(r=r)
    except (ValueError, InputError) as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None
    if not ratios:
        raise argparse.ArgumentTypeError("no ratio given")
    return ratios


def result_name(value: str) -> str:
    """An argparse type for a result's name: a file name, checked when the command starts rather
    than when a long run has its results to write (a path would land under bench/results)."""
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise argparse.ArgumentTypeError(f"{value!r} is not a file name (the result is written to "
                                         "bench/results/BENCH/NAME_cpu.json)")
    return value


def result_path(bench: str, name: str) -> Path:
    """bench/results/BENCH/NAME_cpu.json (or _gpu): each benchmark's results in a folder named after
    it (bench/BENCH.py); the file names keep their benchmark's prefix."""
    tag = "gpu" if jax.default_backend() == "gpu" else "cpu"
    return RESULTS / bench / f"{name}_{tag}.json"


def write_result(bench: str, name: str, payload: dict) -> Path:
    """The payload and the machine that ran it, to result_path(bench, name)."""
    path = result_path(bench, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
