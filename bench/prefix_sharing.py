"""Shared prompt prefixes in the serving engine: 16 concurrent requests whose prompts start with
the same 1,000-token system prompt, with and without the prefix cache (jmoe/decoding/prefixes.py).

The bundled tiny model (bf16 tier, float32 compute), one BatchEngine of 16 rows per mode (warmed up
first: a compile inside a timed window fails the run), in alternating rounds. Each round submits
the 16 requests at once (a system prompt from the prose dev text, then a question of its own) for
`--new-tokens` greedy tokens, with an empty prefix store, so the first request prefills the system
prompt and the others may reuse it. Reported per mode: the median (and 90th percentile) time to
first token over the 16 requests of a round, the round's wall time, the prompt tokens reused, the
most KV pages of 64 slots held at once (rows sharing the system prompt's pages hold them once);
and whether both modes gave the same tokens.

    python -m bench.prefix_sharing [--rounds 3] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.lib.common import ROOT, TINY_HF, result_name, write_result

REQUESTS = 16
SYSTEM_TOKENS = 1000


class FirstTokens:
    """The engine's observer: each stream's time from submit to its first token, and the most KV
    pages the engine's pool had handed out at a decode step."""

    def __init__(self, pool):
        self.ttft: dict[int, float] = {}
        self.pool, self.peak_pages = pool, 0

    def step(self, seconds: float, rows: int) -> None:
        self.peak_pages = max(self.peak_pages, self.pool.pages - self.pool.free)

    def token(self, stream, seconds: float) -> None:
        self.ttft.setdefault(id(stream), seconds)

    def finished(self, stream) -> None:
        pass


def run_round(engine, model, prompts, new_tokens: int) -> dict:
    from jmoe.serving import Request
    from jmoe.serving.compiles import no_compiles

    if engine.prefixes is not None:  # an empty store: the first request prefills the system prompt
        engine.prefixes.clear()
    reused_before = model.prefixes.stats.reused_tokens if model.prefixes is not None else 0
    observer = engine.observer = FirstTokens(engine.pool)
    with no_compiles(f"{len(prompts)} requests"):
        start = time.perf_counter()
        streams = [engine.submit(Request(p, max_tokens=new_tokens, as_text=False)) for p in prompts]
        outputs = [list(s) for s in streams]
        wall = time.perf_counter() - start
    ttft = sorted(observer.ttft[id(s)] for s in streams)
    reused = model.prefixes.stats.reused_tokens - reused_before if model.prefixes is not None else 0
    return {"ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "wall_s": wall, "reused_prompt_tokens": reused, "peak_kv_pages_held": observer.peak_pages,
            "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/jmoe-prefix-sharing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--name", type=result_name, default="prefix_sharing",
                        help="the result file's name (_cpu.json added)")
    args = parser.parse_args()

    import jmoe
    from convert import convert_checkpoint
    from jmoe.serving import BatchEngine

    converted = Path(args.work) / "tiny"
    if not (converted / "manifest.json").exists():
        convert_checkpoint(TINY_HF, converted, progress=False)
    context = 2048
    models = {mode: jmoe.load(converted, max_seq_len=context, max_batch=REQUESTS,
                              prefix_cache="auto" if mode == "shared" else None) for mode in ("alone", "shared")}
    tokenizer = models["alone"].tokenizer
    system = tokenizer.encode((ROOT / "tests" / "data" / "prose.dev.txt").read_text())[:SYSTEM_TOKENS]
    prompts = [system + tokenizer.encode(f"\n\nQuestion {i}: what comes after {i * 7}?\nAnswer:")
               for i in range(REQUESTS)]
    engines = {mode: BatchEngine(m, max_batch=REQUESTS, context=context, warm_up=True) for mode, m in models.items()}
    try:
        for mode in engines:  # the workload once untimed: every shape it meets compiled
            run_round(engines[mode], models[mode], prompts, args.new_tokens)
        rounds = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode in engines:
                rounds[mode].append(run_round(engines[mode], models[mode], prompts, args.new_tokens))
                r = rounds[mode][-1]
                print(f"{mode:6s}: time to first token median {r['ttft_median_s']:.2f} s, p90 {r['ttft_p90_s']:.2f} s, "
                      f"wall {r['wall_s']:.2f} s, reused prompt tokens {r['reused_prompt_tokens']}, "
                      f"peak KV pages {r['peak_kv_pages_held']}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    same = all(a["outputs"] == s["outputs"] for a, s in zip(rounds["alone"], rounds["shared"]))
    ratios = [a["ttft_median_s"] / s["ttft_median_s"] for a, s in zip(rounds["alone"], rounds["shared"])]
    print(f"median time to first token, alone / shared, per round: {[round(r, 2) for r in ratios]}; "
          f"same tokens: {same}")
    summary = {mode: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for mode, rs in rounds.items()}
    write_result("prefix_sharing", args.name, {
        "model": "tiny-qwen3-moe, bf16 tier, float32 compute", "requests": REQUESTS, "system_tokens": SYSTEM_TOKENS,
        "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens, "rounds": summary,
        "ttft_median_ratio_alone_over_shared": ratios, "same_tokens": same})


if __name__ == "__main__":
    main()
