"""The GPU suite (`make gpu`): everything a lent GPU should check and measure, in one command.

Needs no network and no ../shared (prompts come from tests/data, models are generated):

1. `pytest -m gpu` (the compiled Pallas kernels against the reference, on the GPU);
2. bandwidths: device-to-device copy (the roofline the kernels are judged against) and
   host-to-device from pinned host memory (what offloading pays per byte);
3. decode TPOT of a synthetic Qwen3-30B-A3B-shaped model with every expert resident, at int4 and
   bf16, against its floor (bytes a token reads / copy bandwidth);
4. offloaded TPOT of that model at 25 / 50 / 75% expert budgets with the policies;
5. paged attention at Qwen3-30B-A3B's heads over a 32K cache: the Pallas kernel against XLA's
   loop over blocks of keys (what a GPU step ran before the kernel), for a decode token and for
   512-token prompt chunks near the start and near the end of the context;
6. last, expert kernels at Qwen3-30B-A3B, Mixtral-8x7B and Qwen1.5-MoE decode and prefill shapes,
   bf16 / int8 / int4 / int2: achieved bytes/s, also as a fraction of the copy bandwidth, stopping
   where --budget-s (default 540 s: a lent GPU's 15 minutes include its start) runs out.

Decode timings warm up on the whole workload first, report the median time between tokens with
its spread, the host's reads / executions per token and its main thread's CPU time per token
(what bounds a step whose device time is short), and fail if anything compiles while timed.

Writes bench/results/gpu_suite/gpu_suite_<device>.json (gpu_suite_h200.json on an H200). `--dry-run` runs
every part at toy sizes on whatever backend there is (CPU: kernels in interpret mode), to check the
suite itself; its JSON goes to gpu_suite_dry_run_<backend>.json and its numbers mean nothing.

    python -m bench.gpu_suite [--dry-run] [--layers 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from bench.lib.common import RESULTS, ROOT, machine, planned_budget, timed
from bench.lib.synthetic import QWEN3_30B_A3B, write_checkpoint
from convert import convert_checkpoint
from jmoe.runtime.host_store import host_sharding
from jmoe.serving.compiles import no_compiles

PROMPTS = ROOT / "tests" / "data"
TOY = dict(hidden=256, moe_intermediate=128, experts=16, top_k=4, heads=4, kv_heads=2, head_dim=64)
POLICIES = ("lru", "lru+prefetch", "dymoe")
PARTS = ("tests", "bandwidth", "kernels", "resident", "offloaded", "attention")


def device_slug(kind: str) -> str:
    """A file name's part for a device kind: its model number ("NVIDIA H100 80GB HBM3" -> "h100"), else "gpu"."""
    model = re.search(r"\b([A-Z]{0,3}\d{1,4}[A-Z]?)\b", kind)
    return model.group(1).lower() if model else "gpu"


def gpu_test_files() -> list[str]:
    """The test modules that hold GPU tests: collecting only these keeps the run free of the other
    modules' imports (the serving extras, say), which a GPU machine's image may lack."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def run_gpu_tests(dry_run: bool, workers: int) -> dict:
    """`pytest -m gpu`, in `workers` processes sharing the GPU where pytest-xdist is there: the tests are
    small and mostly compile time (Triton and Mosaic compile on the host's cores), and a lent GPU's
    minutes are few. Each process allocates what it uses instead of most of the GPU's memory."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           *gpu_test_files()]
    if dry_run:
        cmd.append("--collect-only")
    elif workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:]
    return {"command": " ".join(cmd[1:]), "returncode": done.returncode, "summary": tail,
            "failures": [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))],
            # what failed, and where (a lent GPU's run is not repeated to read its tracebacks)
            "output_tail": done.stdout[-6000:] if done.returncode not in (0, 5) else "",
            "seconds": time.perf_counter() - t}


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device GB/s: read and write of an nbytes buffer."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 1)  # not elided: reads and writes every byte
    seconds = timed(lambda: jax.block_until_ready(copy(x)), repeat=10, warmup=2)
    return 2 * nbytes / seconds / 1e9


def h2d_bandwidth(nbytes: int) -> dict:
    device = jax.devices()[0]
    sharding, kind = host_sharding(device)
    host = jax.device_put(np.ones(nbytes, np.uint8), sharding)
    target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    seconds = timed(lambda: jax.block_until_ready(jax.device_put(host, target)), repeat=10, warmup=2)
    return {"gb_per_s": nbytes / seconds / 1e9, "bytes": nbytes, "host_memory_kind": kind}


def kernels(dry_run: bool, copy_gbps: float, progress=lambda cases: None, time_left=lambda: float("inf")) -> list[dict]:
    """Every model x phase x tier case; `progress(cases so far)` after each; stops early once
    `time_left()` is under a minute (the cases run so far are kept)."""
    from bench import kernels as kb

    on_gpu = jax.default_backend() == "gpu" and not dry_run
    models = ["qwen3-30b-a3b"] if dry_run else list(kb.MODELS)
    tiers = ["bf16", "int4"] if dry_run else ["bf16", "int8", "int4", "int2"]
    phases = [("decode", 1)] if dry_run else [("decode", 1), ("prefill", kb.GPU_PREFILL_TOKENS)]
    cases = []
    for model in models:
        for phase, tokens in phases:
            for tier in tiers:
                if time_left() < 60:
                    print(f"kernels: stopped at the time budget after {len(cases)} cases", flush=True)
                    return cases
                r = kb.run_case(model, phase, tier, tokens, on_gpu, repeat=20)
                if "kernel_unique_GBps" in r:
                    r["fraction_of_copy_bandwidth"] = r["kernel_unique_GBps"] / copy_gbps
                print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), flush=True)
                cases.append(r)
                progress(cases)
    return cases


def attention(dry_run: bool) -> list[dict]:
    """Median ms of the Pallas paged attention and of XLA's blocked loop (every block of the cache,
    as a GPU step lowers it) over one row's cache: a decode token at the context's end, and prompt
    chunks at two depths. Dry run: toy sizes, the kernel in interpret mode, on any backend."""
    from jmoe.layers.attention import AttentionMeta, blocked_attention
    from pallas_kernels.decode_attention import decode_attention

    K, G, w, page, slots = (2, 4, 64, 16, 512) if dry_run else (4, 8, 128, 64, 32768)
    cases = [(1, slots - 1), (32, 64), (32, slots - 32)] if dry_run else [(1, slots - 1), (512, 3584),
                                                                          (512, slots - 512)]
    dtype = jnp.float32 if dry_run else jnp.bfloat16
    rng = np.random.default_rng(0)
    pool = lambda: jnp.asarray(rng.normal(size=(slots // page, K, page, w)), dtype)  # noqa: E731
    keys, values = pool(), pool()
    table = jnp.asarray(rng.permutation(slots // page)[None], jnp.int32)
    rows = []
    for tokens, position in cases:
        q = jnp.asarray(rng.normal(size=(1, K, G * tokens, w)), dtype)
        start, key_start = jnp.asarray([position], jnp.int32), jnp.zeros(1, jnp.int32)
        rope = jnp.zeros((1, tokens, 2), jnp.float32)
        meta = AttentionMeta(start, key_start, rope, rope, table)
        kw = dict(groups=G, scale=w**-0.5, window=None)
        kernel = jax.jit(lambda q, k, v: decode_attention(q, k, v, start, key_start, table, interpret=dry_run, **kw)[0])
        loop = jax.jit(lambda q, k, v: blocked_attention((q,), (k,), v, meta, precision=None, reachable_only=False,
                                                         **kw)[0])
        row = {"tokens": tokens, "position": position, "slots": slots, "heads": f"{K * G} on {K}, width {w}",
               "cache": jnp.dtype(dtype).name}
        for name, fn in (("kernel", kernel), ("xla_loop", loop)):
            row[f"{name}_ms"] = 1e3 * timed(lambda fn=fn: jax.block_until_ready(fn(q, keys, values)), repeat=10,
                                            warmup=2)
        row["kernel_speedup"] = row["xla_loop_ms"] / row["kernel_ms"]
        print("attention", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def synthetic_model(root: Path, layers: int, shape: dict, tiers: str) -> Path:
    src = write_checkpoint(root / "hf", layers=layers, **shape)
    return convert_checkpoint(src, root / "model", tiers=tiers, progress=False)


def prompts(tokenizer, n_tokens: int = 32) -> list[list[int]]:
    return [tokenizer.encode((PROMPTS / f"{d}.dev.txt").read_text()[:4000])[:n_tokens] for d in ("prose", "code")]


def decode_tpot(model, items, new_tokens: int, temperature: float = 0.0) -> dict:
    """Median seconds per decode token (between streamed tokens, after each prompt's first) with its
    spread, after a warm-up that runs the whole workload once (every shape it meets compiled);
    fails if anything compiles while timing. Sampled (temperature > 0) with a fixed seed: random
    weights route greedy tokens almost alike, so offloading is measured on sampled ones too. Also
    returns the timed run's tokens ("texts"), to compare an offloaded model's output with the resident one's."""
    def token_gaps():
        gaps, cpus, texts = [], [], []
        for i, ids in enumerate(items):
            last, last_cpu, pieces = None, 0.0, []
            for piece in jmoe.generate(model, ids, max_new_tokens=new_tokens, stream=True, temperature=temperature,
                                       seed=i):
                now, cpu = time.perf_counter(), time.thread_time()
                if last is not None:
                    gaps.append(now - last)
                    cpus.append(cpu - last_cpu)
                last, last_cpu = now, cpu
                pieces.append(piece)
            texts.append(pieces)  # token ids (the prompts are ids)
        return gaps, cpus, texts

    token_gaps()  # warm-up: the same prompts and lengths as the timed run
    before = jmoe.stats(model)
    with no_compiles("the decode run"):
        gaps, host_cpu, texts = token_gaps()
    after = jmoe.stats(model)
    tokens = max(after["decode_tokens"] - before["decode_tokens"], 1)
    host = {k: (after["host"].get("decode", {}).get(k, 0) - before["host"].get("decode", {}).get(k, 0)) / tokens
            for k in ("reads", "executions", "transfers", "transfer_bytes", "dispatch_s", "read_wait_s")}
    # where a token's time went, on average: the step's dispatch (which waits for the device where a
    # conditional inside the step reads its predicate back), the blocked read of its output, the rest
    # (the host's own work: the books, sampling, Python)
    mean = float(np.mean(gaps))
    host["other_s"] = mean - host["dispatch_s"] - host["read_wait_s"]
    return {"temperature": temperature, "tpot_s": float(np.median(gaps)), "tpot_mean_s": mean,
            "tpot_min_s": float(np.min(gaps)),
            "tpot_max_s": float(np.max(gaps)), "tpot_p90_s": float(np.percentile(gaps, 90)),
            "decode_tokens": len(gaps), "host_per_decode_token": host, "texts": texts,
            # the main thread's CPU time between tokens: its work, and any wait that spins
            "host_cpu_s": float(np.median(host_cpu))}


def resident_decode(path: Path, copy_gbps: float, new_tokens: int, dtype) -> dict:
    from jmoe.runtime.budget import tree_nbytes

    out = {}
    for tier in ("int4", "bf16"):
        model = jmoe.load(path, tier=tier, compute_dtype=dtype, max_seq_len=512)
        items = prompts(model.tokenizer)
        timing = decode_tpot(model, items, new_tokens)
        if tier == "int4":  # the offloaded runs' sampled baseline
            timing["sampled"] = decode_tpot(model, items, new_tokens, temperature=1.0)
        tpot = timing["tpot_s"]
        cfg = model.config
        per_token = tree_nbytes(model.dense) + cfg.num_moe_layers * cfg.top_k * model.store.record_nbytes(tier)
        floor = per_token / (copy_gbps / 2 * 1e9)  # the copy reads and writes: reading alone runs at half its time
        out[tier] = {**timing, "bytes_per_token": per_token, "floor_s": floor, "tpot_over_floor": tpot / floor}
        print("resident", tier, json.dumps(out[tier]), flush=True)
    return out


def offloaded_decode(path: Path, new_tokens: int, dtype, resident: dict | None = None,
                     progress=lambda rows: None) -> list[dict]:
    """Each budget x policy, greedy then sampled, beside the resident int4 model of the same run where
    `resident` holds it (its ratio, and whether the greedy and sampled texts are the resident's: the
    exact policies' must be). `progress(rows so far)` after each row: a run cut short keeps them."""
    rows = []
    for fraction in (0.5, 0.25, 0.75):  # the two budgets first
        for policy in POLICIES:
            # every fixed term load() reserves for this policy (fetch slots and staging included)
            budget = planned_budget(path, fraction, tier="int4", compute_dtype=dtype, max_seq_len=512, policy=policy)
            try:
                model = jmoe.load(path, tier="int4", compute_dtype=dtype, max_seq_len=512, policy=policy,
                                  device_budget=budget)
            except jmoe.BudgetError as e:
                rows.append({"budget_fraction": fraction, "policy": policy, "skipped": str(e)})
                continue
            items = prompts(model.tokenizer)
            timing = decode_tpot(model, items, new_tokens)
            timing["sampled"] = decode_tpot(model, items, new_tokens, temperature=1.0)
            if resident is not None:
                base = resident["int4"]
                timing["x_resident"] = base["tpot_s"] / timing["tpot_s"]
                timing["same_texts_as_resident"] = timing["texts"] == base["texts"]
                timing["sampled"]["x_resident"] = base["sampled"]["tpot_s"] / timing["sampled"]["tpot_s"]
                timing["sampled"]["same_texts_as_resident"] = timing["sampled"]["texts"] == base["sampled"]["texts"]
            stats = jmoe.stats(model)
            rows.append({"budget_fraction": fraction, "policy": policy, **timing,
                         "hit_rate": stats["hit_rate"], "bytes_h2d_per_token": stats["bytes_h2d_per_token"],
                         "in_step_fetches": stats["in_step_fetches"], "in_step_misses": stats["in_step_misses"],
                         "degraded": stats["degraded"], "replays": stats["replays"], "tokens": stats["tokens"]})
            print("offloaded", json.dumps(rows[-1]), flush=True)
            progress(rows)
            del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on any backend: checks the suite itself")
    parser.add_argument("--layers", type=int, default=4, help="layers of the synthetic Qwen3-30B-A3B model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"a subset of {','.join(PARTS)} (a subset writes gpu_suite_<parts>_<device>.json)")
    parser.add_argument("--test-workers", type=int, default=4, help="pytest-xdist processes for the GPU tests")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds the run may take (a lent GPU's time is short): the kernel timings, last, "
                             "stop where it runs out (0: no limit)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    dry = args.dry_run
    backend = jax.default_backend()
    if backend != "gpu" and not dry:
        parser.error(f"no GPU here (jax backend {backend!r}); use --dry-run to check the suite on this machine")
    dtype = "bfloat16" if backend == "gpu" else "float32"
    started = time.perf_counter()
    time_left = (lambda: float("inf")) if not args.budget_s else (lambda: args.budget_s - (time.perf_counter() - started))
    result = {"machine": machine(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "dry_run": dry, "parts": parts}
    (RESULTS / "gpu_suite").mkdir(parents=True, exist_ok=True)
    name = "gpu_suite" if parts == list(PARTS) else "gpu_suite_" + "_".join(parts)
    device = device_slug(result["device"])
    out = RESULTS / "gpu_suite" / (f"{name}_{device}.json" if not dry else f"{name}_dry_run_{backend}.json")

    def save(complete: bool = False) -> None:
        """Written after every part: a run cut short (a lent GPU's time is short) keeps what it measured."""
        result["seconds"], result["complete"] = time.perf_counter() - started, complete
        out.write_text(json.dumps(result, indent=2) + "\n")

    if "tests" in parts:
        result["gpu_tests"] = run_gpu_tests(dry, args.test_workers)
        save()
    copy_gbps = copy_bandwidth(8 << 20 if dry else 1 << 30)  # every later part is judged against it
    result["bandwidth"] = {"device_copy_gb_per_s": copy_gbps}
    if "bandwidth" in parts:
        result["bandwidth"]["h2d"] = h2d_bandwidth(8 << 20 if dry else 1 << 30)
    print("bandwidth", json.dumps(result["bandwidth"]), flush=True)
    save()
    if "resident" in parts or "offloaded" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            path = synthetic_model(Path(tmp), 2 if dry else args.layers, TOY if dry else QWEN3_30B_A3B,
                                   "bf16,int4,int2")
            new_tokens = 4 if dry else args.new_tokens
            if "resident" in parts:
                result["resident_decode"] = resident_decode(path, copy_gbps, new_tokens, dtype)
                save()
            if "offloaded" in parts:
                def offloaded_so_far(rows: list) -> None:
                    result["offloaded_decode"] = rows
                    save()

                offloaded_decode(path, new_tokens, dtype, result.get("resident_decode"), offloaded_so_far)
    if "attention" in parts:
        result["attention"] = attention(dry)
        save()
    if "kernels" in parts:  # last: measured on earlier leases, and it can stop at any case
        def kernels_so_far(cases: list) -> None:
            result["kernels"] = cases
            save()

        result["kernels"] = kernels(dry, copy_gbps, kernels_so_far, time_left)
    save(complete=True)
    print(f"wrote {out.relative_to(ROOT)} in {result['seconds']:.0f} s")
    if "tests" in parts and result["gpu_tests"]["returncode"] not in (0, 5):  # 5: no tests collected
        sys.exit(1)


if __name__ == "__main__":
    main()
