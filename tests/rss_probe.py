"""Run in a fresh process by tests/test_host_memory.py: load a model, generate, report resident memory.

    python tests/rss_probe.py '{"path": ..., "tier": ..., "policy": ..., "share": 0.25, "tokens": [8, 200]}'

("prompt_tokens": the prompt's length, default 8; "reset_peak": each call's peak from the RSS before
it, call_peak: the C heap's free pages given back, then /proc/self/clear_refs resets VmHWM.)

Prints one JSON line: the bytes load reserved (model.memory), RSS growth from load (peak and after),
and after each generate call of `tokens` the RSS and peak, all relative to the process before
load (jax, jmoe, orbax and transformers imported, one function compiled and a tokenizer loaded, so the
libraries' own code and tables are not counted).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    args = json.loads(sys.argv[1])
    import jax
    import orbax.checkpoint  # noqa: F401  (its import is not the model's memory)
    from transformers import AutoTokenizer  # noqa: F401

    import jmoe
    from jmoe.manifest import read_manifest
    from jmoe.runtime.host_memory import process_memory, release_free_heap
    from jmoe.tokenizer import load_tokenizer

    x = jax.numpy.ones((8, 8))  # jax's own code pages (the compiler's, mapped once per process)
    jax.jit(lambda a: (a @ a.T).sum())(x).block_until_ready()
    tokenizer = read_manifest(args["path"])["tokenizer"]  # the tokenizer library's own code and tables
    load_tokenizer(None if tokenizer is None else Path(args["path"]) / tokenizer)
    budget = None
    if args.get("share") is not None:
        plan = jmoe.memory_plan(args["path"], tier=args["tier"], compute_dtype="float32", policy=args["policy"],
                                max_seq_len=args.get("max_seq_len"))
        budget = sum(v for k, v in plan.items() if k != "all_experts") + int(args["share"] * plan["all_experts"])
    base = process_memory()
    model = jmoe.load(args["path"], tier=args["tier"], policy=args["policy"], device_budget=budget,
                      compute_dtype="float32", max_seq_len=args.get("max_seq_len"),
                      cpu_critical_tokens=args.get("cpu_critical_tokens"))
    loaded = process_memory()
    out = {"reserved": model.memory, "load_peak": loaded["VmHWM"] - base["VmRSS"],
           "load_rss": loaded["VmRSS"] - base["VmRSS"], "after": []}
    prompt = [3 + i % 64 for i in range(args.get("prompt_tokens", 8))]
    for n in args.get("tokens", []):
        if args.get("reset_peak"):
            # What an earlier call freed can stay resident in the C heap, where this call reuses it
            # without the resident set growing: given back first, the call's peak is its own.
            release_free_heap()
        before = process_memory()
        if args.get("reset_peak"):  # the peak of this call alone, not the compiles of one before it
            Path("/proc/self/clear_refs").write_text("5")
        jmoe.generate(model, prompt, max_new_tokens=n)
        now = process_memory()
        out["after"].append({"tokens": n, "rss": now["VmRSS"] - base["VmRSS"], "peak": now["VmHWM"] - base["VmRSS"],
                             "call_peak": now["VmHWM"] - before["VmRSS"],
                             "anon": now["RssAnon"] - base["RssAnon"], "stats": {
                                 k: v for k, v in jmoe.stats(model).items() if isinstance(v, (int, float))}})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
