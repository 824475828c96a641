"""Offloading under a device budget: policies x budgets on the tiny model and a synthetic
Qwen3-30B-A3B-shaped model (random weights, skewed router, fewer layers).

For each budget (25%, 50%, 75% of the expert bytes, on top of the dense weights, KV cache and
workspace) and mode (on-demand, LRU, LRU + look-ahead prefetch, LRU + CPU execution of cold
experts), a fresh load generates from domain prompts after a compile warm-up, and the run's
counters are recorded: hit rate, bytes moved per token, prefetch accuracy, predictor recall,
stalls, TTFT and TPOT. Every run's tokens are checked against the all-resident model (exact).
Also measures host -> device copy bandwidth of expert records. Writes JSON and a PNG plot.

    python -m bench.offload [--synthetic-layers 4] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import jmoe
from bench.common import CORPUS, RESULTS, TINY_HF, write_result
from bench.synthetic import QWEN3_30B_A3B, write_checkpoint
from convert import convert_checkpoint
from jmoe.runtime.host_store import host_sharding
from jmoe.runtime.loader import memory_plan

BUDGETS = (0.25, 0.5, 0.75)
# "lru+cpu@1" forces a critical token count of 1 (decode tokens of a missing expert run on the CPU):
# where the "device" is the CPU itself the measured cost model never prefers the CPU path.
MODES = ("ondemand", "lru", "lru+prefetch", "lru+cpu", "lru+cpu@1")
MAX_SEQ_LEN = 512


def prompts(tokenizer, n_tokens: int = 48) -> list[list[int]]:
    out = []
    for domain in ("prose", "code", "math"):
        text = (CORPUS / f"{domain}.dev.txt").read_text()[5000:12000]
        out.append(tokenizer.encode(text)[:n_tokens])
    return out


def generate_all(model, items, new_tokens):
    return [jmoe.generate(model, ids, max_new_tokens=new_tokens) for ids in items]


def run_case(path: Path, tier: str, mode: str, fraction: float, items, new_tokens: int, reference) -> dict:
    plan = memory_plan(path, tier=tier, compute_dtype="float32", max_seq_len=MAX_SEQ_LEN)
    fixed = plan["dense"] + plan["kv_cache"] + plan["workspace"]
    budget = int(fixed + fraction * plan["all_experts"])
    t = time.perf_counter()
    policy, _, forced = mode.partition("@")
    model = jmoe.load(path, tier=tier, device_budget=budget, policy=policy, compute_dtype="float32",
                      max_seq_len=MAX_SEQ_LEN, cpu_critical_tokens=int(forced) if forced else None)
    load_s = time.perf_counter() - t
    jmoe.generate(model, items[0][:8], max_new_tokens=4)  # compile the step shapes
    model.residency.reset_stats()
    outputs = generate_all(model, items, new_tokens)
    stats = jmoe.stats(model)
    totals = np.sort(model.residency.counters.total, axis=1)[:, ::-1]
    quarter = max(1, totals.shape[1] // 4)
    concentration = (totals[:, :quarter].sum(1) / np.maximum(totals.sum(1), 1)).round(3).tolist()
    return {
        "mode": mode,
        "budget_fraction": fraction,
        "budget_bytes": budget,
        "pool_slots": model.residency.slots,
        "critical_tokens": getattr(model.residency, "critical_tokens", None),
        "exact": outputs == reference,
        "load_s": load_s,
        "top_quarter_share_per_layer": concentration,  # routing skew: share of uses on the busiest 25% of experts
        **{k: stats[k] for k in ("hit_rate", "late_rate", "miss_rate", "bytes_h2d_per_token", "transfers", "stalls",
                                 "stall_seconds", "prefetch_accuracy", "predictor_recall", "cpu_expert_runs",
                                 "cpu_tokens", "ttft_s", "tpot_s", "tokens")},
    }


def h2d_bandwidth(path: Path, tier: str, count: int = 32) -> dict:
    """Copy `count` expert records host -> device at once; GB/s over the whole batch."""
    model = jmoe.load(path, tier=tier, policy="lru", compute_dtype="float32", max_seq_len=MAX_SEQ_LEN)
    host = model.residency.host
    records = [host.record(tier, i % host.store.num_layers, i // host.store.num_layers % host.store.num_experts)
               for i in range(count)]
    target = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    jax.block_until_ready([jax.device_put(r, target) for r in records[:4]])  # warm up
    t = time.perf_counter()
    jax.block_until_ready([jax.device_put(r, target) for r in records])
    seconds = time.perf_counter() - t
    nbytes = sum(r.nbytes for r in records)
    return {"records": count, "bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
            "host_memory_kind": host_sharding(jax.devices()[0])[1]}


def bench_model(name: str, path: Path, tier: str, new_tokens: int) -> dict:
    reference_model = jmoe.load(path, tier=tier, compute_dtype="float32", max_seq_len=MAX_SEQ_LEN)
    items = prompts(reference_model.tokenizer)
    reference = generate_all(reference_model, items, new_tokens)
    del reference_model
    cases = []
    for fraction in BUDGETS:
        for mode in MODES:
            case = run_case(path, tier, mode, fraction, items, new_tokens, reference)
            print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in case.items()}), flush=True)
            cases.append(case)
    return {"model": name, "tier": tier, "new_tokens": new_tokens, "prompts": len(items),
            "h2d": h2d_bandwidth(path, tier), "cases": cases}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("hit_rate", "hit rate"), ("bytes_h2d_per_token", "MiB moved per token"),
               ("tpot_s", f"TPOT (ms, {jax.default_backend().upper()})"), ("predictor_recall", "recall / prefetch accuracy")]
    fig, axes = plt.subplots(len(results), len(metrics), figsize=(17, 3.6 * len(results)), squeeze=False)
    for row, result in enumerate(results):
        for col, (key, label) in enumerate(metrics):
            ax = axes[row][col]
            if key == "predictor_recall":  # only the prefetching mode has these
                cases = [c for c in result["cases"] if c["mode"] == "lru+prefetch"]
                xs = [100 * c["budget_fraction"] for c in cases]
                ax.plot(xs, [c["predictor_recall"] for c in cases], marker="o", color="C2", label="look-ahead recall")
                ax.plot(xs, [c["prefetch_accuracy"] for c in cases], marker="s", ls="--", color="C2",
                        label="prefetch accuracy")
                ax.set_ylim(0, 1.05)
                ax.legend(fontsize=8)
                ax.set_title(f"{result['model']} ({result['tier']}): {label}", fontsize=9)
                ax.set_xlabel("expert budget (% of all expert bytes)")
                ax.grid(alpha=0.3)
                continue
            for mode in MODES:
                cases = [c for c in result["cases"] if c["mode"] == mode]
                xs = [100 * c["budget_fraction"] for c in cases]
                ys = [c[key] for c in cases]
                ys = [y / 2**20 for y in ys] if key == "bytes_h2d_per_token" else ys
                ys = [y * 1e3 for y in ys] if key == "tpot_s" else ys
                ax.plot(xs, ys, marker="o", label=mode)
            ax.set_title(f"{result['model']} ({result['tier']}): {label}", fontsize=9)
            ax.set_xlabel("expert budget (% of all expert bytes)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--synthetic-layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON")
    args = parser.parse_args()
    tag = "gpu" if jax.default_backend() == "gpu" else "cpu"
    if args.replot:
        saved = json.loads((RESULTS / f"offload_{tag}.json").read_text())
        plot(saved["models"], RESULTS / saved["plot"])
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = convert_checkpoint(TINY_HF, tmp / "tiny", tiers="bf16", progress=False)
        results.append(bench_model("tiny-qwen3-moe", tiny, "bf16", args.new_tokens))
        src = write_checkpoint(tmp / "synthetic-hf", layers=args.synthetic_layers, **QWEN3_30B_A3B)
        synthetic = convert_checkpoint(src, tmp / "synthetic", tiers="int4", progress=False)
        name = f"synthetic-qwen3-30b-a3b-{args.synthetic_layers}L"
        results.append(bench_model(name, synthetic, "int4", args.new_tokens))
    png = RESULTS / f"offload_{tag}.png"
    plot(results, png)
    write_result("offload", {"note": "times are this machine's; on CPU the 'device' is the CPU too",
                             "budgets": BUDGETS, "modes": MODES, "models": results, "plot": png.name})


if __name__ == "__main__":
    main()
