"""Decode at depth beside llama.cpp, on the CPU, at a real model's shapes.

A random-weight checkpoint with a named model's exact shapes cut to --layers layers
(bench/lib/random_checkpoint.py), converted by `jmoe convert --tiers int4 --dense-tier int4` and by
llama.cpp to GGUF Q4_0 (the same weights). For each depth, jmoe prefills a prompt of that many
random tokens and decodes --new-tokens greedy tokens (EOS banned), timing the decode after the
first token; llama.cpp runs `llama-bench -fa 1 -p 0 -n <new tokens> -d <depths>` (flash attention,
which llama.cpp needs for a quantised V cache). KV types side by side: jmoe's float32 cache (its
default on the CPU) and its bfloat16 cache (the same bytes) against llama.cpp's f16 (its default),
and jmoe's int8 cache against llama.cpp's q8_0 (both 8-bit with a scale per block). jmoe multiplies through the int8 dot (`cpu_dot="int8"`, llama.cpp's Q8 dot).

Every round runs each configuration once, jmoe and llama.cpp alternating (the order rotates by
round); ratios are taken within a round, medians with [min-max] reported. Only on an idle machine:
under load llama.cpp's spinning threads collapse and the ratio means nothing.

    python -m bench.depth_vs_llama [--model qwen3-30b-a3b] [--layers 2] [--depths 4096,16384] [--rounds 2]

Needs llama.cpp (bench/lib/llama_cpp.py says where it is found and how to build it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench.lib import llama_cpp
from bench.lib.common import ROOT, result_name, write_result
from bench.lib.q4_slice import int4_slice_and_q4_0
from bench.lib.random_checkpoint import model_named

KV_PAIRS = {"float32 / f16": (None, "f16"), "bfloat16 / f16": ("bfloat16", "f16"),
            "int8 / q8_0": ("int8", "q8_0")}  # jmoe kv_dtype, llama.cpp cache type


def jmoe_depths(path: Path, kv_dtype: str | None, depths: list[int], new_tokens: int) -> dict:
    """In this process: jmoe's decode tok/s after a prompt of each depth (each run once untimed first)."""
    import numpy as np

    import jmoe
    from bench.offload_decode import streamed
    from jmoe.serving.compiles import no_compiles

    model = jmoe.load(path, tier="int4", cpu_dot="int8", kv_dtype=kv_dtype, max_seq_len=max(depths) + new_tokens + 1)
    rng = np.random.default_rng(0)
    never_stop = {eos: -100.0 for eos in model.config.eos_token_ids}
    kw = dict(max_new_tokens=new_tokens, temperature=0.0, logit_bias=never_stop)
    out = {}
    for d in depths:
        prompt = rng.integers(10, model.config.vocab_size - 10, size=d).tolist()
        streamed(model, prompt, kw)  # every shape compiled (the cache's length follows the prompt's)
        with no_compiles(f"depth {d}"):
            first, rest, tokens = streamed(model, prompt, kw)
        out[str(d)] = {"decode_tok_s": tokens / rest, "prefill_s": first}
    return out


def run_jmoe(path: Path, kv_dtype: str | None, depths: list[int], new_tokens: int, log: Path) -> dict:
    """jmoe in a fresh process (its memory and compile cache its own)."""
    code = ("import json, sys; from pathlib import Path; from bench.depth_vs_llama import jmoe_depths; "
            f"print(json.dumps(jmoe_depths(Path({str(path)!r}), {kv_dtype!r}, {depths!r}, {new_tokens})))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out, _, rss = llama_cpp.run_measured([sys.executable, "-c", code], env=env, cwd=ROOT, log=log)
    return {"depths": json.loads(out.strip().splitlines()[-1]), "peak_rss_bytes": rss}


def run_llama(llama, gguf: Path, cache_type: str, depths: list[int], new_tokens: int, log: Path) -> dict:
    cmd = [str(llama.bench), "-m", str(gguf), "-t", "2", "-fa", "1", "-p", "0", "-n", str(new_tokens),
           "-d", ",".join(map(str, depths)), "-ctk", cache_type, "-ctv", cache_type, "-r", "1", "-o", "json"]
    out, _, rss = llama_cpp.run_measured(cmd, log=log)
    return {"depths": {str(t["n_depth"]): {"decode_tok_s": t["avg_ts"]} for t in json.loads(out)},
            "peak_rss_bytes": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--depths", default="4096,16384")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("JMOE_BENCH_DATA", "~/.cache/jmoe-bench")))
    parser.add_argument("--name", type=result_name, default=None, help="the result file's name (_cpu.json added)")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    data = args.data.expanduser()

    _, converted, gguf, llama = int4_slice_and_q4_0(args.model, args.layers, data)

    logs = data / "depth-logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs = {pair: {"jmoe": [], "llama.cpp": []} for pair in KV_PAIRS}
    for r in range(args.rounds):
        order = [("jmoe", p) for p in KV_PAIRS] + [("llama.cpp", p) for p in KV_PAIRS]
        turn = r % 2 * len(KV_PAIRS)
        for who, pair in order[turn:] + order[:turn]:  # rotate who goes first
            ours, theirs = KV_PAIRS[pair]
            result = (run_jmoe(converted, ours, depths, args.new_tokens, logs / f"jmoe-{r}.log") if who == "jmoe"
                      else run_llama(llama, gguf, theirs, depths, args.new_tokens, logs / f"llama-{r}.log"))
            runs[pair][who].append(result)
            print(f"round {r + 1}, {who:9s} {pair}: " + ", ".join(
                f"depth {d}: {v['decode_tok_s']:.1f} tok/s" for d, v in result["depths"].items()), flush=True)
    summary = {}
    for pair, by in runs.items():
        for d in map(str, depths):
            ratios = [j["depths"][d]["decode_tok_s"] / w["depths"][d]["decode_tok_s"]
                      for j, w in zip(by["jmoe"], by["llama.cpp"])]
            summary[f"{pair} @{d}"] = {
                "jmoe_tok_s": statistics.median(j["depths"][d]["decode_tok_s"] for j in by["jmoe"]),
                "llama_cpp_tok_s": statistics.median(w["depths"][d]["decode_tok_s"] for w in by["llama.cpp"]),
                "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
            print(f"{pair} @{d}: jmoe / llama.cpp {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
    write_result("long_context", args.name or f"depth_vs_llama_{args.model}_{args.layers}L", {
        "model": f"{model_named(args.model).name} shapes, {args.layers} layers, random weights",
        "jmoe": "int4 experts + dense int4, cpu_dot int8", "llama_cpp": f"Q4_0, -fa 1 -t 2 ({llama.version()})",
        "depths": depths, "new_tokens": args.new_tokens, "rounds": args.rounds, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
