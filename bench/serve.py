"""Concurrent requests: the continuously batched engine (what `jmoe serve` runs) against the same
model shared by threads that each call `jmoe.generate`, at 1, 4 and 16 concurrent streams.

Per mode and stream count: aggregate generated tokens/s (all streams' tokens over the wall time
from the first submit to the last token), mean per-stream decode tokens/s (after each stream's
first token) and mean time to first token. Each mode runs once untimed first (compiles; a compile
while timing fails the run). Prompts are windows of tests/data's dev text, `--tokens` new tokens
each, greedy.

    python -m bench.serve                                 # the bundled tiny model, resident and offloaded
    python -m bench.serve --model DIR --tier int4 --label qwen3-30b-a3b-2L   # e.g. a bench/real_shapes slice

Writes bench/results/serve/serve_<label>_cpu.json (or _gpu).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import jmoe
from bench.lib.common import ROOT, write_result
from jmoe.serving import BatchEngine, Request
from jmoe.serving.compiles import no_compiles

DEV = ROOT / "tests" / "data"


def prompts(model, count: int, tokens: int = 48) -> list[list[int]]:
    text = "".join((DEV / f"{d}.dev.txt").read_text()[:20000] for d in ("prose", "code", "math"))
    ids = model.tokenizer.encode(text)
    step = max(1, (len(ids) - tokens) // count)
    return [ids[i * step:i * step + tokens] for i in range(count)]


def summarize(started: float, firsts: list[float], ends: list[float], counts: list[int]) -> dict:
    wall = max(ends) - started
    per_stream = [(n - 1) / (e - f) for n, f, e in zip(counts, firsts, ends) if n > 1 and e > f]
    return dict(aggregate_tokens_per_s=sum(counts) / wall, per_stream_tokens_per_s=statistics.mean(per_stream),
                ttft_s=statistics.mean(f - started for f in firsts), wall_s=wall, tokens=sum(counts))


def batched(engine: BatchEngine, items: list[list[int]], new_tokens: int) -> dict:
    started = time.perf_counter()
    streams = [engine.submit(Request(p, new_tokens, as_text=False)) for p in items]
    counts = [len(list(s)) for s in streams]
    ends = [s.finished_at for s in streams]
    return summarize(started, [s.first_token_at for s in streams], ends, counts)


def threaded(model, items: list[list[int]], new_tokens: int) -> dict:
    firsts, ends, counts = [0.0] * len(items), [0.0] * len(items), [0] * len(items)

    def run(i: int) -> None:
        for _ in jmoe.generate(model, items[i], max_new_tokens=new_tokens, stream=True):
            if not counts[i]:
                firsts[i] = time.perf_counter()
            counts[i] += 1
        ends[i] = time.perf_counter()

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(started, firsts, ends, counts)


def measure(model, streams: list[int], new_tokens: int) -> list[dict]:
    rows = []
    with BatchEngine(model, max_batch=max(streams), context=256) as engine:
        for n in streams:
            items = prompts(model, n)
            # compile, at the timed lengths (a generate's cache is a power of two above prompt + new tokens)
            batched(engine, items, new_tokens)
            threaded(model, items[:1], new_tokens)
            with no_compiles(f"{n} streams"):
                b, t = batched(engine, items, new_tokens), threaded(model, items, new_tokens)
            row = dict(streams=n, batched=b, threaded=t,
                       aggregate_speedup=b["aggregate_tokens_per_s"] / t["aggregate_tokens_per_s"])
            print(f"{n:3d} streams: batched {b['aggregate_tokens_per_s']:8.1f} tok/s, threads "
                  f"{t['aggregate_tokens_per_s']:8.1f} tok/s ({row['aggregate_speedup']:.2f}x), TTFT "
                  f"{b['ttft_s']:.3f} / {t['ttft_s']:.3f} s", flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a converted model (default: the bundled tiny one)")
    p.add_argument("--tier", default=None)
    p.add_argument("--cpu-dot", default="float", choices=["float", "int8"],
                   help="how the CPU kernels multiply quantized weights (jmoe.load's cpu_dot)")
    p.add_argument("--label", default="tiny")
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--offloaded", type=float, default=1 / 3,
                   help="also run with this fraction of the experts' bytes as the budget (0: resident only)")
    args = p.parse_args(argv)
    path = args.model
    if path is None:
        from convert import convert_checkpoint

        path = convert_checkpoint(ROOT / "examples" / "tiny-qwen3-moe", ROOT / "out" / "bench-serve-tiny",
                                  overwrite=True, progress=False)
    streams = [int(s) for s in args.streams.split(",")]
    runs = {}
    for placement in ["resident"] + (["offloaded"] if args.offloaded else []):
        kw = dict(tier=args.tier, max_seq_len=256, max_batch=max(streams))
        if placement == "offloaded":
            plan = jmoe.memory_plan(path, **kw)
            kw["device_budget"] = (plan["dense"] + plan["kv_cache"] + plan["workspace"]
                                   + int(plan["all_experts"] * args.offloaded))
        model = jmoe.load(path, **kw, cpu_dot=args.cpu_dot)
        print(f"{args.label}, {placement}:", flush=True)
        runs[placement] = measure(model, streams, args.tokens)
        del model
    write_result("serve", f"serve_{args.label}",
                 dict(model=args.label, tier=args.tier, cpu_dot=args.cpu_dot, new_tokens=args.tokens, runs=runs))


if __name__ == "__main__":
    main()
