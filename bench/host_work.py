"""The host's own work per decode token: what bounds offloaded decode beside a fast device.

On a lent H200 the offloaded step ran at 0.2-0.35x of the resident one with one read and one
execution per token and a token's misses worth well under a millisecond of PCIe time
(bench/results/gpu_suite/gpu_suite_h200.json): what a GPU waits for there is the host thread
between steps. This measures that thread's work on any machine: the main thread's CPU time per
decode token (time.thread_time), less the time inside the step's dispatch (the backend's own,
which differs on a GPU), with each step run to completion before the host goes on.

The host's books depend on the routing's shape (layers, experts, top-k, pool slots), not on the
weights' widths, so the model has Qwen3-30B-A3B's routing (128 experts, top-8) at small widths: its
steps take well under a millisecond on a CPU and leave the host's caches as warm as a GPU's steps
would (a real-width step streams a gigabyte through them first, and the host's work measured after
it would be that of a cold machine).

Cases: the resident model and exact `lru` / `lru+prefetch` with pools holding a share of the
experts (random weights, int4 experts), sampled tokens (temperature 1, fixed seeds); rounds
alternate the cases, medians over rounds with their spread.

    python -m bench.host_work [--layers 4] [--rounds 3] [--name host_work]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import jmoe
from bench.lib.common import planned_budget, result_name, write_result
from bench.lib.synthetic import QWEN3_30B_A3B, write_checkpoint
from convert import convert_checkpoint
from jmoe.runtime import step_cache

# Qwen3-30B-A3B's routing (experts, top-k) at small widths
ROUTING_SHAPE = {**QWEN3_30B_A3B, "hidden": 256, "moe_intermediate": 64, "heads": 4, "kv_heads": 2, "head_dim": 64}
CASES = (("resident", None), ("lru", 0.5), ("lru", 0.25), ("lru+prefetch", 0.5), ("lru+prefetch", 0.25))


class StepClock:
    """Times the main thread's CPU inside every step dispatch, and makes each step finish before
    the host goes on (the host's work then has the machine to itself)."""

    def __init__(self):
        self.inside = 0.0
        self._call = step_cache.CachedStep.__call__

    def __enter__(self):
        clock, call = self, self._call

        def timed_call(step, *args, **kwargs):
            started = time.thread_time()
            out = jax.block_until_ready(call(step, *args, **kwargs))
            clock.inside += time.thread_time() - started
            return out

        step_cache.CachedStep.__call__ = timed_call
        return self

    def __exit__(self, *exc):
        step_cache.CachedStep.__call__ = self._call


def host_ms_per_token(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Main-thread CPU ms per decode token outside the step dispatches (each prompt's first token,
    which its prefill produces, excluded)."""
    spent, tokens = 0.0, 0
    with StepClock() as clock:
        for seed, ids in enumerate(prompts):
            stream = jmoe.generate(model, ids, max_new_tokens=new_tokens, stream=True, temperature=1.0, seed=seed)
            next(stream)
            clock.inside, started = 0.0, time.thread_time()
            tokens += sum(1 for _ in stream)
            spent += time.thread_time() - started - clock.inside
    return spent / max(tokens, 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, help="a converted int4 model to use instead (its own widths)")
    parser.add_argument("--name", type=result_name, default="host_work")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            src = write_checkpoint(Path(tmp) / "hf", layers=args.layers, **ROUTING_SHAPE)
            path = convert_checkpoint(src, Path(tmp) / "model", tiers="int4", progress=False)
        rng = np.random.default_rng(0)
        models = {}
        for policy, share in CASES:
            kw = dict(tier="int4", compute_dtype="float32", max_seq_len=512)
            if policy != "resident":
                kw.update(policy=policy, device_budget=planned_budget(path, share, policy=policy, **kw))
            models[(policy, share)] = jmoe.load(path, **kw)
        prompts = [rng.integers(0, 4000, 32).tolist() for _ in range(2)]
        for model in models.values():  # warm-up: every shape compiled
            host_ms_per_token(model, prompts, args.new_tokens)
        runs = {case: [] for case in CASES}
        for r in range(args.rounds):
            for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
                runs[case].append(host_ms_per_token(models[case], prompts, args.new_tokens))
                print(case, f"{runs[case][-1]:.3f} ms", flush=True)
    rows = {}
    for (policy, share), values in runs.items():
        label = policy if share is None else f"{policy}@{share:.0%}"
        rows[label] = {"host_ms_per_token": {"median": statistics.median(values), "min": min(values),
                                             "max": max(values)}, "rounds": values}
    write_result("host_work", args.name, {"note": args.note, "layers": args.layers, "new_tokens": args.new_tokens,
                                          "prompts": len(prompts), "rounds": args.rounds, "cases": rows})


if __name__ == "__main__":
    main()
