"""Decode speed of several converted models (or one model under several settings) against each
other, in alternating rounds: `jmoe bench` of each in its own process, every round in another order.

    python -m bench.decode_ab NAME=MODEL[:ENV=VALUE,...] NAME=MODEL ... [--rounds 4] [--new-tokens 96]
                              [--tier int4] [--cpu-dot int8] [--result NAME]

Each case's tok/s per round and the median, and each case's ratio to the first within every round
(median [min-max]): on a machine whose memory bandwidth moves from minute to minute, only ratios
taken within a round compare. Writes bench/results/kernels/decode_ab_RESULT_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.lib.common import jmoe_bench_rows, result_name, write_result


def parse_case(text: str) -> tuple[str, Path, dict]:
    """NAME=MODEL[:ENV=VALUE,...] -> (name, model, environment additions)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"bench.decode_ab: a case is NAME=MODEL[:ENV=VALUE,...], not {text!r}")
    model, _, env = rest.partition(":")
    extra = dict(kv.split("=", 1) for kv in env.split(",") if "=" in kv)
    return name, Path(model).expanduser(), extra


def decode_tok_s(model: Path, env: dict, args) -> float:
    rows = jmoe_bench_rows(model, "--cpu-dot", args.cpu_dot, "-p", "16", "-n", str(args.new_tokens), "-r", "5",
                           *(["--tier", args.tier] if args.tier else []), env=env)
    return next(r["tokens_per_s"] for r in rows if r["test"].startswith("tg"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="NAME=MODEL[:ENV=VALUE,...]; the first is the reference")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--tier", default=None)
    parser.add_argument("--cpu-dot", default="int8", choices=("float", "int8"))
    parser.add_argument("--result", type=result_name, default="cases", help="result file name")
    args = parser.parse_args(argv)
    cases = [parse_case(c) for c in args.cases]
    runs: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in range(args.rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]  # rotate who goes first
        for name, model, env in order:
            runs[name].append(decode_tok_s(model, env, args))
            print(f"round {r + 1}, {name}: {runs[name][-1]:.1f} tok/s", flush=True)
    first = cases[0][0]
    summary = {}
    for name, values in runs.items():
        ratios = [v / b for v, b in zip(values, runs[first])]
        summary[name] = {"decode_tok_s": statistics.median(values),
                         f"over {first}": {"median": statistics.median(ratios), "min": min(ratios),
                                           "max": max(ratios)}}
        print(f"{name}: {summary[name]['decode_tok_s']:.1f} tok/s, x{statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] of {first}")
    write_result("kernels", f"decode_ab_{args.result}", {
        "cases": {name: {"model": model.name, "env": env} for name, model, env in cases},
        "jmoe_bench": f"-p 16 -n {args.new_tokens} -r 5, cpu_dot {args.cpu_dot}, tier {args.tier or 'default'}",
        "rounds": args.rounds, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
