"""Start-up of `jmoe generate` on the bundled model, with warm caches: wall time of the whole
command, and where a process's seconds go (import, load, the first generate), with the step
cache (jmoe/runtime/step_cache.py) on and off.

The bundled model is converted once into a temporary directory; each case runs in fresh processes
with caches of their own in that directory (jax's persistent compilation cache shared by both
modes, the step cache only with it on), warmed by one untimed run, then timed in --rounds rounds
alternating the modes' order. Medians with [min-max].

    python -m bench.startup [--rounds 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.common import ROOT, TINY_HF, write_result

PROMPT = "def fibonacci(n):"
BUDGETS = {"resident": None, "32MiB budget": "32MiB"}  # the second as `make demo` runs it
_PARTS = """
import json, sys, time
t0 = time.perf_counter()
import jmoe
t1 = time.perf_counter()
model = jmoe.load(sys.argv[1], device_budget=None if sys.argv[2] == "none" else sys.argv[2])
t2 = time.perf_counter()
jmoe.generate(model, sys.argv[3], max_new_tokens=int(sys.argv[4]))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_generate_s": t3 - t2}))
"""


def _env(work: Path, step_cache: bool) -> dict:
    return dict(os.environ, JMOE_COMPILATION_CACHE=str(work / "xla"),
                JMOE_STEP_CACHE=str(work / "steps") if step_cache else "off")


def run_command(model: Path, budget: str | None, tokens: int, env: dict) -> float:
    cmd = [str(Path(sys.executable).parent / "jmoe"), "generate", str(model), PROMPT, "--max-new-tokens", str(tokens)]
    if budget:
        cmd += ["--device-budget", budget]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return time.perf_counter() - start


def run_parts(model: Path, budget: str | None, tokens: int, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PARTS, str(model), budget or "none", PROMPT, str(tokens)],
                          check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from convert import convert_checkpoint

    with tempfile.TemporaryDirectory(prefix="jmoe-startup-") as tmp:
        work = Path(tmp)
        model = convert_checkpoint(TINY_HF, work / "tiny-qwen3-moe", progress=False)
        modes = {"step cache on": True, "step cache off": False}
        result = {}
        for case, budget in BUDGETS.items():
            for on in modes.values():  # warm both caches
                run_command(model, budget, args.tokens, _env(work, on))
            walls = {m: [] for m in modes}
            parts = {m: [] for m in modes}
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(modes)[::-1]
                for m in order:
                    walls[m].append(run_command(model, budget, args.tokens, _env(work, modes[m])))
                    parts[m].append(run_parts(model, budget, args.tokens, _env(work, modes[m])))
            result[case] = {m: {"command_wall_s": summary(walls[m]),
                                **{k: summary([p[k] for p in parts[m]]) for k in parts[m][0]}} for m in modes}
            for m in modes:
                row = result[case][m]
                print(f"{case:14s} {m:15s} command {row['command_wall_s']['median']:.2f} s "
                      f"[{row['command_wall_s']['min']:.2f}-{row['command_wall_s']['max']:.2f}]  "
                      + "  ".join(f"{k} {row[k]['median']:.2f}" for k in ("import_s", "load_s", "first_generate_s")))
    write_result("startup", "startup", {
        "command": f"jmoe generate <bundled model> {PROMPT!r} --max-new-tokens {args.tokens} [--device-budget]",
        "rounds": args.rounds, "cases": result,
        "note": "warm caches (one untimed run per mode first); each timed run a fresh process; medians [min-max]"})


if __name__ == "__main__":
    main()
