"""Load time and memory of a loaded model on the CPU, resident and offloaded, each in a fresh process.

Writes a random Qwen3-MoE checkpoint (bench/lib/synthetic.py; default hidden 1024, 64 experts, 4
layers), converts it to bf16 + int4 (RTN), then per case starts a new Python process that loads the
model and generates 64 tokens, reading its peak RSS (VmHWM) from /proc/self/status after the load
and after generating. The ratio compares the peak's growth with what the model needs: the bytes
`load` reserves (dense weights, KV cache, workspace, experts or pools, transfer staging). Growth is
counted from after the libraries load imports, a tokenizer and one compile (their own memory,
"libraries_rss_bytes", is not the model's); the "raw" ratios count from before them, as the first
measurement did. The generate peak includes XLA's compiled steps.

    python -m bench.load_memory [--work DIR] [--hidden 1024] [--experts 64] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.common import ROOT, write_result

CASES = [  # (name, tier, policy, share of every expert the pools hold)
    ("resident bf16", "bf16", "resident", None),
    ("resident int4", "int4", "resident", None),
    ("lru+prefetch int4 25%", "int4", "lru+prefetch", 0.25),
    ("lru+prefetch+cpu int4 25%", "int4", "lru+prefetch+cpu", 0.25),
    ("lru+prefetch bf16 25%", "bf16", "lru+prefetch", 0.25),
]
NEW_TOKENS = 64
MAX_SEQ_LEN = 256


def proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_case(model_dir: str, tier: str, policy: str, share: float | None) -> dict:
    """One case in this process (the child): load, generate, peak RSS."""
    import jax

    import jmoe

    jax.devices()  # the backend's own memory is not the model's
    raw_base = proc_status_bytes("VmRSS")
    warm_libraries(model_dir)
    base = proc_status_bytes("VmRSS")
    budget = None
    if share is not None:
        plan = jmoe.memory_plan(model_dir, tier=tier, compute_dtype="float32", max_seq_len=MAX_SEQ_LEN, policy=policy)
        fixed = sum(v for k, v in plan.items() if k != "all_experts")
        budget = int(fixed + share * plan["all_experts"])
    t = time.perf_counter()
    model = jmoe.load(model_dir, tier=tier, policy=policy, device_budget=budget, compute_dtype="float32",
                      max_seq_len=MAX_SEQ_LEN)
    load_s = time.perf_counter() - t
    after_load = proc_status_bytes("VmHWM") - base
    raw_after_load = proc_status_bytes("VmHWM") - raw_base
    rss_load = proc_status_bytes("VmRSS") - base
    ids = list(range(5, 37))
    t = time.perf_counter()
    jmoe.generate(model, ids, max_new_tokens=1)
    first_token_s = time.perf_counter() - t
    t = time.perf_counter()
    jmoe.generate(model, ids, max_new_tokens=NEW_TOKENS)
    generate_s = time.perf_counter() - t
    reserved = sum(model.memory.values())
    peak = proc_status_bytes("VmHWM")
    return {
        "load_s": load_s, "first_token_s": first_token_s, "generate_64_s": generate_s,
        "reserved_bytes": reserved, "memory": model.memory,
        "libraries_rss_bytes": base - raw_base,
        "peak_rss_load_bytes": after_load, "rss_after_load_bytes": rss_load,
        "peak_rss_generate_bytes": peak - base,
        "peak_rss_load_ratio": after_load / reserved,
        "peak_rss_generate_ratio": (peak - base) / reserved,
        # as the first run measured: from before orbax, transformers and a tokenizer were loaded
        "raw_peak_rss_load_ratio": raw_after_load / reserved,
        "raw_peak_rss_generate_ratio": (peak - raw_base) / reserved,
        "rss_anon_bytes": proc_status_bytes("RssAnon"), "rss_file_bytes": proc_status_bytes("RssFile"),
    }


def warm_libraries(model_dir: str) -> None:
    """Import what load imports, load the tokenizer and compile one function, so that the
    libraries' own code and tables are not counted as the model's memory."""
    import jax
    import orbax.checkpoint  # noqa: F401

    from jmoe.manifest import read_manifest
    from jmoe.tokenizer import load_tokenizer

    tokenizer = read_manifest(Path(model_dir))["tokenizer"]
    load_tokenizer(None if tokenizer is None else Path(model_dir) / tokenizer)
    x = jax.numpy.ones((8, 8))
    jax.jit(lambda a: (a @ a.T).sum())(x).block_until_ready()


def child(args) -> None:
    print(json.dumps(run_case(args.model, args.tier, args.policy, args.share)))


def prepare(work: Path, hidden: int, experts: int, layers: int) -> Path:
    from bench.lib.synthetic import write_checkpoint
    from convert import convert_checkpoint

    hf, out = work / "hf", work / "m"
    if not (out / "manifest.json").exists():
        if not (hf / "config.json").exists():
            write_checkpoint(hf, layers=layers, hidden=hidden, moe_intermediate=768, experts=experts, top_k=8,
                             heads=16, kv_heads=4, head_dim=64)
        convert_checkpoint(hf, out, tiers=("bf16", "int4"), method="rtn", progress=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("/tmp/jmoe_load_memory"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--label", default="after")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tier", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--share", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    model = prepare(args.work, args.hidden, args.experts, args.layers)
    results = {}
    for name, tier, policy, share in CASES:
        cmd = [sys.executable, "-m", "bench.load_memory", "--child", "--model", str(model), "--tier", tier,
               "--policy", policy] + ([] if share is None else ["--share", str(share)])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            results[name] = {"error": done.stderr[-500:]}
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"{name:28s} load {r['load_s']:6.2f} s  first token {r['first_token_s']:6.2f} s  "
              f"64 tokens {r['generate_64_s']:6.2f} s  reserved {r['reserved_bytes'] / 2**20:8.1f} MiB  "
              f"peak RSS load {r['peak_rss_load_ratio']:.2f}x  generate {r['peak_rss_generate_ratio']:.2f}x  "
              f"(raw {r['raw_peak_rss_load_ratio']:.2f}x / {r['raw_peak_rss_generate_ratio']:.2f}x)", flush=True)
    write_result("load_memory", f"load_memory_{args.label}", {
        "model": {"hidden": args.hidden, "experts": args.experts, "layers": args.layers, "tiers": ["bf16", "int4"]},
        "new_tokens": NEW_TOKENS, "max_seq_len": MAX_SEQ_LEN, "cases": results,
    })


if __name__ == "__main__":
    main()
