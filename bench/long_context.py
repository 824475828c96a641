"""Long context under a budget: what load reserves for the KV cache and the attention workspace at
long contexts (jmoe.memory_plan's terms), and the decode step's cost as the context grows.

Plan: the KV cache and workspace reservations (jmoe/runtime/loader.py, fixed_memory) of the bundled
tiny model (float32) and of an 8-layer Qwen3-30B-A3B slice (bf16; its real config, no weights
needed), at the contexts and batch sizes of issue 32's table.

Depth: the tiny model (bf16 tier) loaded with max_seq_len 16,384; for each depth, a prompt of that
many tokens (a training-text slice of tests/data, repeated) and `--new-tokens` greedy tokens: the
time to the first token (the prompt's prefill) and the decode time per token after it (medians over
`--rounds`, with their spread; every shape is warmed first and a compile inside a timed window
fails the run). generate sizes its cache to a power of two above prompt + new tokens; a
server's rows hold max_seq_len slots, of which a CPU decode step reads only the blocks up to the
row's position.

    python -m bench.long_context [--rounds 3] [--new-tokens 32] [--depths 512,4096,16000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.lib.common import ROOT, write_result

TINY_HF = ROOT / "examples" / "tiny-qwen3-moe"
PLAN_CASES = [  # (model, compute dtype, max_seq_len, max_batch)
    ("tiny", "float32", 2048, 16),
    ("tiny", "float32", 8192, 16),
    ("qwen3-30b-a3b-8L", "bfloat16", 32768, 1),
    ("qwen3-30b-a3b-8L", "bfloat16", 32768, 8),
]


def config_of(name: str):
    from jmoe.models import config_from_hf

    if name == "tiny":
        return config_from_hf(json.loads((TINY_HF / "config.json").read_text()))
    from bench.lib.random_checkpoint import model_named

    return config_from_hf(model_named("qwen3-30b-a3b").config_for(8))


def plan_rows() -> list[dict]:
    import jax.numpy as jnp
    from flax import nnx

    from jmoe.layers.transformer import abstract_model
    from jmoe.runtime.loader import fixed_memory

    rows = []
    for name, dtype, seq, batch in PLAN_CASES:
        cfg = config_of(name)
        state = nnx.state(abstract_model(cfg, jnp.dtype(dtype)))
        memory = fixed_memory(cfg, state, jnp.dtype(dtype), seq, batch)
        rows.append({"model": name, "dtype": dtype, "max_seq_len": seq, "max_batch": batch,
                     "kv_cache_bytes": memory["kv_cache"], "workspace_bytes": memory["workspace"]})
        print(f"{name:18s} {dtype:8s} {seq:6d} x {batch:2d}: KV {memory['kv_cache'] / 2**20:9.1f} MiB, "
              f"workspace {memory['workspace'] / 2**20:9.1f} MiB", flush=True)
    return rows


def depth_rows(args) -> dict:
    import jmoe
    from convert import convert_checkpoint
    from bench.offload_decode import spread, streamed
    from jmoe.serving.compiles import CompileCounter

    work = Path(args.work)
    converted = work / "tiny"
    if not (converted / "manifest.json").exists():
        convert_checkpoint(TINY_HF, converted, progress=False)
    model = jmoe.load(converted, max_seq_len=args.max_seq_len)
    text = (ROOT / "tests" / "data" / "prose.train.txt").read_text()
    ids = model.tokenizer.encode(text)
    depths = [int(d) for d in args.depths.split(",")]
    prompts = {d: (ids * (d // len(ids) + 1))[:d] for d in depths}
    never_stop = {eos: -100.0 for eos in model.config.eos_token_ids}  # every timed run makes all its tokens
    kw = dict(max_new_tokens=args.new_tokens, temperature=0.0, logit_bias=never_stop)

    def timed(prompt) -> tuple[float, float]:
        """(seconds to the first token: the prompt's prefill, ms per token after it)."""
        first, rest, tokens = streamed(model, prompt, kw)
        return first, 1e3 * rest / max(tokens, 1)

    for d in depths:  # warm every shape a timed round uses
        timed(prompts[d])
    ttft, decode = {d: [] for d in depths}, {d: [] for d in depths}
    for _ in range(args.rounds):
        for d in depths:
            compiles = CompileCounter.count()
            first, per_token = timed(prompts[d])
            if CompileCounter.count() != compiles:
                sys.exit(f"depth {d}: {CompileCounter.count() - compiles} compilation(s) in the timed window")
            ttft[d].append(first)
            decode[d].append(per_token)
    out = {}
    for d in depths:
        out[str(d)] = {"decode_ms_per_token": spread(decode[d]), "ttft_s": spread(ttft[d])}
        print(f"depth {d:6d}: decode {statistics.median(decode[d]):.2f} ms/token "
              f"[{min(decode[d]):.2f}-{max(decode[d]):.2f}], time to first token {statistics.median(ttft[d]):.2f} s "
              f"[{min(ttft[d]):.2f}-{max(ttft[d]):.2f}]", flush=True)
    return {"model": "tiny-qwen3-moe, bf16 tier", "max_seq_len": args.max_seq_len, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "decode": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/jmoe-long-context")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=16384)
    parser.add_argument("--depths", default="512,4096,16000")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--name", default="long_context", help="the result file's name (_cpu.json added)")
    args = parser.parse_args()
    payload = {"plan": plan_rows()}
    if not args.plan_only:
        payload["depth"] = depth_rows(args)
    print(write_result("long_context", args.name, payload))


if __name__ == "__main__":
    main()
