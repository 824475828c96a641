"""The serving engine's paged KV cache: many rows in the KV bytes of a few contexts.

Sixteen greedy requests (prompts of `--prompt` dev tokens, `--tokens` new tokens each) through an
engine of 16 rows of the model's whole context, over KV pools of several sizes: 16 whole contexts
(what every row needed before the cache was paged), a few, and one. Per pool, in alternating rounds
after an untimed round that compiles: aggregate tokens/s, mean time to first token, requests set
aside for want of pages, and whether every answer is the one `jmoe.generate` gives its prompt
alone (greedy). A round that compiles anything fails the run. Also the budget `jmoe serve --max-batch 16`
needs before any expert with each pool (`jmoe.memory_plan`).

    python -m bench.kv_pages [--rounds 3] [--pools 16 2 1]

Writes bench/results/kv_pages/kv_pages_cpu.json (or _gpu).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax

import jmoe
from bench.lib.common import TINY_HF, write_result
from bench.serve import prompts as dev_windows
from convert import convert_checkpoint
from jmoe.decoding.engine import KV_PAGE, cache_nbytes
from jmoe.serving import BatchEngine, Request
from jmoe.serving.compiles import no_compiles

ROWS = 16


def run(engine: BatchEngine, prompts: list[list[int]], tokens: int) -> dict:
    """One round: every prompt submitted at once; aggregate tokens/s, mean TTFT, the answers."""
    set_aside = engine.preemptions
    started = time.perf_counter()
    streams = [engine.submit(Request(p, tokens, as_text=False)) for p in prompts]
    answers = [list(s) for s in streams]
    wall = max(s.finished_at for s in streams) - started
    return {"tokens_per_s": sum(map(len, answers)) / wall,
            "ttft_s": statistics.mean(s.first_token_at - started for s in streams),
            "set_aside": engine.preemptions - set_aside, "answers": answers}


def summary(rounds: list[dict]) -> dict:
    def spread(key):
        values = [r[key] for r in rounds]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"tokens_per_s": spread("tokens_per_s"), "ttft_s": spread("ttft_s"),
            "set_aside_per_round": [r["set_aside"] for r in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pools", type=float, nargs="+", default=[16, 2, 1],
                        help="KV pool sizes in whole contexts (at least 1)")
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--name", default="kv_pages")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = convert_checkpoint(TINY_HF, Path(tmp) / "tiny", progress=False)
        model = jmoe.load(path, compute_dtype="float32")
        context = model.max_seq_len
        row_pages = -(-context // KV_PAGE)
        prompts = [list(p) for p in dev_windows(model, ROWS, args.prompt)]
        alone = [list(jmoe.generate(model, p, max_new_tokens=args.tokens)) for p in prompts]  # ids in, ids out
        engines = {pool: BatchEngine(model, max_batch=ROWS, context=context, kv_pages=int(pool * row_pages),
                                     warm_up=True) for pool in args.pools}
        try:
            for engine in engines.values():
                run(engine, prompts, args.tokens)  # compiles whatever the warm-up did not
            rounds = {pool: [] for pool in args.pools}
            for _ in range(args.rounds):
                for pool, engine in engines.items():
                    with no_compiles(f"a round over a pool of {pool} contexts"):
                        result = run(engine, prompts, args.tokens)
                    rounds[pool].append(result)
        finally:
            for engine in engines.values():
                engine.close()
        page_bytes = cache_nbytes(model.config, 1, KV_PAGE, model.kv_dtype)
        out = {}
        for pool in args.pools:
            kv_bytes = int(pool * row_pages) * page_bytes
            plan = jmoe.memory_plan(path, compute_dtype="float32", max_batch=ROWS, kv_cache=kv_bytes,
                                    prefix_cache="auto")
            label = f"{pool:g} context" + ("s" if pool != 1 else "")
            out[label] = {
                "kv_pages": int(pool * row_pages), "kv_bytes": kv_bytes,
                "budget_before_experts": sum(v for k, v in plan.items() if k != "all_experts"),
                "answers_are_generates": all(r["answers"] == alone for r in rounds[pool]),
                **summary(rounds[pool])}
            print(label, {k: v for k, v in out[label].items() if k != "set_aside_per_round"}, flush=True)
    write_result("kv_pages", args.name, {
        "model": "tiny-qwen3-moe (bf16 experts, float32 compute)", "rows": ROWS, "context": context,
        "page_tokens": KV_PAGE, "prompt_tokens": args.prompt, "new_tokens": args.tokens, "rounds": args.rounds,
        "device": str(jax.devices()[0]), "pools": out})


if __name__ == "__main__":
    main()
