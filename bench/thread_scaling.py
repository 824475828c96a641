"""Thread scaling on the CPU: prefill and decode tok/s at 1 and 2 threads (or --threads), jmoe beside
llama.cpp on the same weights, in alternating rounds.

A random-weight Qwen3-30B-A3B slice (--layers, default 2; bench/lib/random_checkpoint.py): jmoe int4
experts + dense int4 with `--cpu-dot int8`, through `jmoe bench --threads T` (JMOE_THREADS: the
process is pinned to T cores before its CPU backend sizes its pool), against GGUF Q4_0 under
`llama-bench -t T`, each `-p --prompt -n --new-tokens`. Medians of the rounds, ratios within a
round [min-max], and each side's scaling from the fewest threads to the most.

    python -m bench.thread_scaling [--threads 1,2] [--rounds 3] [--layers 2] [--head-tier int4] [--cpu-layout] [--tag T]

--head-tier converts the slice with that LM head (the converter's default beside dense int4 is
int8; llama.cpp's Q4_0 GGUF keeps its head at Q6_K); --cpu-layout converts it with the experts in
the CPU kernels' layout (`jmoe convert --cpu-layout`).

Needs llama.cpp (bench/lib/llama_cpp.py says where it is found and how to build it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench.lib import llama_cpp
from bench.lib.common import jmoe_bench_rows, write_result
from bench.lib.q4_slice import int4_slice_and_q4_0
from bench.lib.random_checkpoint import model_named


def run_jmoe(path: Path, threads: int, prompt: int, new_tokens: int) -> dict:
    """`jmoe bench` in its own process: prefill and decode tok/s (median of its repetitions)."""
    rows = jmoe_bench_rows(path, "--tier", "int4", "--cpu-dot", "int8", "--threads", str(threads), "-p", str(prompt),
                           "-n", str(new_tokens), "-r", "3")
    return {"prefill_tok_s": next(r["tokens_per_s"] for r in rows if r["test"].startswith("pp")),
            "decode_tok_s": next(r["tokens_per_s"] for r in rows if r["test"].startswith("tg"))}


def run_llama(llama, gguf: Path, threads: int, prompt: int, new_tokens: int) -> dict:
    result = llama_cpp.bench(llama, gguf, threads=threads, prompt=prompt, gen=new_tokens, depths=(0,))
    return {"prefill_tok_s": result["prefill_tok_s"], "decode_tok_s": result["decode_tok_s@0"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-tier", choices=("bf16", "int8", "int6", "int4"), default=None,
                        help="jmoe's LM head tier (default: the converter's, int8 beside dense int4)")
    parser.add_argument("--cpu-layout", action="store_true", help="convert the experts with --cpu-layout")
    parser.add_argument("--tag", default="", help="appended to the result's name (another machine's run beside the "
                                                  "recorded one, e.g. --tag zen5)")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("JMOE_BENCH_DATA", "~/.cache/jmoe-bench")))
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    if len(os.sched_getaffinity(0)) < max(counts):
        parser.error(f"this process may use {len(os.sched_getaffinity(0))} cores, fewer than {max(counts)}")
    data = args.data.expanduser()

    _, converted, gguf, llama = int4_slice_and_q4_0(args.model, args.layers, data, args.head_tier, args.cpu_layout)

    runs = {t: {"jmoe": [], "llama.cpp": []} for t in counts}
    for r in range(args.rounds):
        order = [(who, t) for t in counts for who in ("jmoe", "llama.cpp")]
        for who, t in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
            result = (run_jmoe(converted, t, args.prompt, args.new_tokens) if who == "jmoe"
                      else run_llama(llama, gguf, t, args.prompt, args.new_tokens))
            runs[t][who].append(result)
            print(f"round {r + 1}, {who:9s} {t} thread(s): prefill {result['prefill_tok_s']:.1f} tok/s, "
                  f"decode {result['decode_tok_s']:.1f} tok/s", flush=True)

    summary = {}
    for t, by in runs.items():
        for metric in ("prefill_tok_s", "decode_tok_s"):
            ratios = [j[metric] / w[metric] for j, w in zip(by["jmoe"], by["llama.cpp"])]
            summary[f"{metric} @{t}"] = {
                "jmoe": statistics.median(j[metric] for j in by["jmoe"]),
                "llama.cpp": statistics.median(w[metric] for w in by["llama.cpp"]),
                "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    lo, hi = min(counts), max(counts)
    scaling = {f"{who} {metric} {hi}/{lo} threads": summary[f"{metric} @{hi}"][who] / summary[f"{metric} @{lo}"][who]
               for who in ("jmoe", "llama.cpp") for metric in ("prefill_tok_s", "decode_tok_s")}
    for key, v in summary.items():
        print(f"{key}: jmoe {v['jmoe']:.1f}, llama.cpp {v['llama.cpp']:.1f} tok/s, jmoe / llama.cpp "
              f"{v['ratio']['median']:.2f} [{v['ratio']['min']:.2f}-{v['ratio']['max']:.2f}]")
    for key, v in scaling.items():
        print(f"{key}: {v:.2f}x")
    head = ((f"_head_{args.head_tier}" if args.head_tier else "") + ("_cpu_layout" if args.cpu_layout else "")
            + (f"_{args.tag}" if args.tag else ""))
    head_tier = json.loads((converted / "manifest.json").read_text())["dense"].get("head_tier")  # what it holds
    write_result("kernels", f"thread_scaling_{args.model}_{args.layers}L{head}", {
        "model": f"{model_named(args.model).name} shapes, {args.layers} layers, random weights",
        "jmoe": f"int4 experts{' (--cpu-layout)' if args.cpu_layout else ''} + dense int4 ({head_tier} LM head), "
                "cpu_dot int8, jmoe bench -r 3 --threads T",
        "llama_cpp": f"Q4_0, llama-bench -t T -r 1 ({llama.version()})", "threads": counts, "prompt": args.prompt,
        "new_tokens": args.new_tokens, "rounds": args.rounds, "runs": {str(t): v for t, v in runs.items()},
        "summary": summary, "scaling": scaling})


if __name__ == "__main__":
    main()
