"""Orchestration overhead of offloading when nothing needs to move.

With a device budget that holds every expert but an offloading policy (lru+prefetch), every
expert use hits once the cache is warm, so any decode time above the all-resident model's is the
runtime's own overhead (routing read-back, bookkeeping, host syncs). Reports decode TPOT per
execution path and its ratio to the all-resident TPOT: every round measures each variant once
(rotating order), the ratio is taken within the round, and the median over rounds is reported;
also the hit rate and host syncs per generated token.

    python -m bench.overhead [--new-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jmoe
from bench.lib.common import TINY_HF, result_name, write_result
from convert import convert_checkpoint
from jmoe.serving.compiles import no_compiles

PROMPT = "def fibonacci(n):\n    "


def decode_times(model, new_tokens: int) -> list[float]:
    """Seconds between consecutive streamed tokens (the first token, after prefill, excluded)."""
    stamps = []
    for _ in jmoe.generate(model, PROMPT, max_new_tokens=new_tokens, stream=True):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


def full_budget(path: Path) -> int:
    """Dense weights, KV cache, workspace, every expert and transfer staging, with room to spare."""
    plan = jmoe.memory_plan(path, compute_dtype="float32")
    return int(sum(plan.values()) * 1.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", type=result_name, default="overhead_tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = convert_checkpoint(TINY_HF, Path(tmp) / "tiny", progress=False)
        models = {"resident": jmoe.load(out, compute_dtype="float32")}
        budget = full_budget(out)
        for path in ("auto", "layerwise", "resident"):
            try:
                models[f"lru+prefetch/{path}"] = jmoe.load(out, compute_dtype="float32", device_budget=budget,
                                                           policy="lru+prefetch", execution=path)
            except jmoe.JmoeError:  # a path this version of jmoe does not have
                continue
        for model in models.values():  # compile, and fill the caches
            decode_times(model, args.new_tokens)
            decode_times(model, args.new_tokens)
            model.residency.reset_stats()
        rounds: list[dict[str, float]] = []
        names = list(models)
        with no_compiles("the timed rounds"):
            for r in range(args.repeats):  # rotating order; each round's ratios are taken within the round
                tpot = {}
                for name in names[r % len(names):] + names[:r % len(names)]:
                    decode_times(models[name], args.new_tokens)  # after switching models, one run to settle in
                    tpot[name] = statistics.median(decode_times(models[name], args.new_tokens))
                rounds.append(tpot)
        tpot = {name: statistics.median(r[name] for r in rounds) for name in names}
        ratio = {name: statistics.median(r[name] / r["resident"] for r in rounds) for name in names}
        result = {"model": "tiny-qwen3-moe", "dtype": "float32", "new_tokens": args.new_tokens,
                  "repeats": args.repeats, "device_budget": budget, "variants": {}}
        for name, model in models.items():
            stats = jmoe.stats(model)
            entry = {"tpot_ms": 1e3 * tpot[name], "ratio_to_resident": ratio[name],
                     "hit_rate": stats.get("hit_rate") if name != "resident" else None}
            if "host_syncs" in stats:
                entry["host_syncs_per_token"] = stats["host_syncs"] / max(stats["tokens"], 1)
            result["variants"][name] = entry
            print(f"{name:28s} TPOT {entry['tpot_ms']:.2f} ms  x{entry['ratio_to_resident']:.2f}  "
                  f"hit rate {entry['hit_rate']}  syncs/token {entry.get('host_syncs_per_token')}")
    write_result("overhead", args.name, result)


if __name__ == "__main__":
    main()
