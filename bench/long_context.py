"""Long context under a budget: what load reserves for the KV cache and the attention workspace at
long contexts (jmoe.memory_plan's terms), and the decode step's cost as the context grows.

Plan: the KV cache and workspace reservations (jmoe/runtime/loader.py, fixed_memory) of the bundled
tiny model (float32) and of an 8-layer Qwen3-30B-A3B slice (bf16; its real config, no weights
needed), at the contexts and batch sizes of issue 32's table, with a KV cache of the compute dtype
and an int8 one.

Quality (`--quality`): the tiny model's perplexity on each dev text (../shared/corpus where it is,
else the bundled starts under tests/data) over windows of its whole 2,048-token context, and the
greedy tokens after a 1,900-token prompt of each, with the compute-dtype and the int8 KV cache.

Depth: the tiny model (bf16 tier) loaded with max_seq_len 16,384; for each depth, a prompt of that
many tokens (a training-text slice of tests/data, repeated) and `--new-tokens` greedy tokens: the
time to the first token (the prompt's prefill) and the decode time per token after it (medians over
`--rounds`, with their spread; every shape is warmed first and a compile inside a timed window
fails the run), for each of `--kv-dtypes` in alternating rounds. generate sizes its cache to a power
of two above prompt + new tokens; a server's rows hold max_seq_len slots, of which a CPU decode step
reads only the blocks up to the row's position.

Compiled (`--compiled PATH`): a converted model loaded at `--max-seq-len` for each of
`--compiled-batches` rows, with prompts of a whole 512-token prefill chunk and part of another (the
step cache on, in a directory of its own, so the executables can be read): the temporary buffers of
each compiled step (XLA's buffer assignment) beside the workspace jmoe.memory_plan reserves.

    python -m bench.long_context [--rounds 3] [--new-tokens 32] [--depths 512,4096,16000]
                                 [--kv-dtypes compute,int8] [--quality] [--compiled PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.lib.common import ROOT, result_name, write_result

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
        int8 = fixed_memory(cfg, state, jnp.dtype(dtype), seq, batch, jnp.int8)
        rows.append({"model": name, "dtype": dtype, "max_seq_len": seq, "max_batch": batch,
                     "kv_cache_bytes": memory["kv_cache"], "int8_kv_cache_bytes": int8["kv_cache"],
                     "workspace_bytes": memory["workspace"]})
        print(f"{name:18s} {dtype:8s} {seq:6d} x {batch:2d}: KV {memory['kv_cache'] / 2**20:9.1f} MiB "
              f"(int8 {int8['kv_cache'] / 2**20:9.1f} MiB), workspace {memory['workspace'] / 2**20:9.1f} MiB",
              flush=True)
    return rows


def tiny_converted(work: Path) -> Path:
    from convert import convert_checkpoint

    converted = work / "tiny"
    if not (converted / "manifest.json").exists():
        convert_checkpoint(TINY_HF, converted, progress=False)
    return converted


def kv_option(name: str):
    return None if name == "compute" else name


def dev_text(domain: str) -> str:
    shared = ROOT.parent / "shared" / "corpus" / f"{domain}.dev.txt"
    return (shared if shared.exists() else ROOT / "tests" / "data" / f"{domain}.dev.txt").read_text()


def quality_rows(args) -> dict:
    """Perplexity over whole-context windows and greedy agreement after a long prompt, per KV dtype."""
    import jmoe
    from jmoe.decoding.evaluate import perplexity

    converted = tiny_converted(Path(args.work))
    kv_dtypes = args.kv_dtypes.split(",")
    models = {kv: jmoe.load(converted, compute_dtype="float32", kv_dtype=kv_option(kv), max_seq_len=2048)
              for kv in kv_dtypes}
    first = models[kv_dtypes[0]]
    window, prompt_len, new_tokens = first.max_seq_len, 1900, 64
    out = {"window": window, "tokens_per_domain": args.quality_tokens, "prompt_tokens": prompt_len,
           "new_tokens": new_tokens}
    for domain in ("prose", "code", "math"):
        ids = first.tokenizer.encode(dev_text(domain))
        row = {"perplexity": {kv: perplexity(m, ids[: args.quality_tokens], window=window) for kv, m in models.items()}}
        greedy = {kv: jmoe.generate(m, ids[:prompt_len], max_new_tokens=new_tokens) for kv, m in models.items()}
        reference = greedy[kv_dtypes[0]]  # token ids in, token ids out
        for kv in kv_dtypes[1:]:
            tokens = greedy[kv]
            same = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(reference),
                                                                                               len(tokens)))
            row.setdefault("greedy_tokens_equal_before_first_difference", {})[kv] = same
        out[domain] = row
        print(f"{domain:6s} perplexity " + ", ".join(f"{kv} {p:.4f}" for kv, p in row["perplexity"].items())
              + f"; greedy tokens equal before the first difference {row.get('greedy_tokens_equal_before_first_difference')}",
              flush=True)
    return out


def compiled_rows(args) -> list[dict]:
    """Per row count: the plan's workspace and each compiled step's temporaries after a generate."""
    import os
    import tempfile

    import jax.numpy as jnp
    import numpy as np

    os.environ["JMOE_STEP_CACHE"] = tempfile.mkdtemp(prefix="jmoe-steps-")  # read before the first step
    import jmoe
    from jmoe.decoding import engine

    rows = []
    for batch in (int(b) for b in args.compiled_batches.split(",")):
        engine.clear_compiled()
        options = dict(max_seq_len=args.max_seq_len, max_batch=batch, policy="resident")
        plan = jmoe.memory_plan(args.compiled, **options)
        model = jmoe.load(args.compiled, **options)
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(3, 1000, 700 - 97 * row)] for row in range(batch)]
        jmoe.generate(model, prompts if batch > 1 else prompts[0], max_new_tokens=3)
        steps = engine.compiled_temp_bytes()
        rows.append({"model": Path(args.compiled).name, "max_seq_len": args.max_seq_len, "max_batch": batch,
                     "compute_dtype": str(jnp.dtype(model.compute_dtype)), "prompt_tokens": [len(p) for p in prompts],
                     "workspace_bytes": plan["workspace"], "temp_bytes": steps})
        print(f"{batch} rows: workspace {plan['workspace'] / 2**20:.1f} MiB; temporaries (MiB) "
              + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in steps.items()), flush=True)
        del model
    return rows


def depth_rows(args) -> dict:
    import jmoe
    from bench.lib.common import spread
    from bench.offload_decode import streamed
    from jmoe.serving.compiles import no_compiles

    converted = tiny_converted(Path(args.work))
    kv_dtypes = args.kv_dtypes.split(",")
    models = {kv: jmoe.load(converted, max_seq_len=args.max_seq_len, kv_dtype=kv_option(kv)) for kv in kv_dtypes}
    text = (ROOT / "tests" / "data" / "prose.train.txt").read_text()
    ids = models[kv_dtypes[0]].tokenizer.encode(text)
    depths = [int(d) for d in args.depths.split(",")]
    prompts = {d: (ids * (d // len(ids) + 1))[:d] for d in depths}
    never_stop = {eos: -100.0 for eos in models[kv_dtypes[0]].config.eos_token_ids}  # every timed run makes all its tokens
    kw = dict(max_new_tokens=args.new_tokens, temperature=0.0, logit_bias=never_stop)

    def timed(model, prompt) -> tuple[float, float]:
        """(seconds to the first token: the prompt's prefill, ms per token after it)."""
        first, rest, tokens = streamed(model, prompt, kw)
        return first, 1e3 * rest / max(tokens, 1)

    cases = [(kv, d) for d in depths for kv in kv_dtypes]
    for kv, d in cases:  # warm every shape a timed round uses
        timed(models[kv], prompts[d])
    ttft, decode = {c: [] for c in cases}, {c: [] for c in cases}
    for _ in range(args.rounds):
        for kv, d in cases:
            with no_compiles(f"depth {d}, {kv} KV"):
                first, per_token = timed(models[kv], prompts[d])
            ttft[kv, d].append(first)
            decode[kv, d].append(per_token)
    out = {}
    for kv, d in cases:
        times, firsts = decode[kv, d], ttft[kv, d]
        row = {"decode_ms_per_token": spread(times), "ttft_s": spread(firsts)}
        if kv == kv_dtypes[0]:
            out[str(d)] = row
        else:
            out.setdefault(f"{kv}_kv", {})[str(d)] = row
        print(f"depth {d:6d}, {kv:7s} KV: decode {statistics.median(times):.2f} ms/token "
              f"[{min(times):.2f}-{max(times):.2f}], time to first token {statistics.median(firsts):.2f} s "
              f"[{min(firsts):.2f}-{max(firsts):.2f}]", flush=True)
    return {"model": "tiny-qwen3-moe, bf16 tier", "max_seq_len": args.max_seq_len, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "kv_dtypes": kv_dtypes, "decode": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/jmoe-long-context")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=16384)
    parser.add_argument("--depths", default="512,4096,16000")
    parser.add_argument("--kv-dtypes", default="compute,int8",
                        help="KV caches to time and score: compute (the compute dtype's) and/or int8")
    parser.add_argument("--quality", action="store_true", help="also the perplexity and greedy agreement per KV dtype")
    parser.add_argument("--quality-tokens", type=int, default=16384, help="dev tokens scored per domain")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--compiled", help="a converted model: its compiled steps' temporaries against the plan "
                                           "(and nothing else)")
    parser.add_argument("--compiled-batches", default="1,4", help="row counts --compiled loads the model with")
    parser.add_argument("--no-depth", action="store_true", help="skip the timed depth runs")
    parser.add_argument("--name", type=result_name, default="long_context",
                        help="the result file's name (_cpu.json added)")
    args = parser.parse_args()
    if args.compiled:
        print(write_result("long_context", args.name, {"compiled": compiled_rows(args)}))
        return
    payload = {"plan": plan_rows()}
    if args.quality and not args.plan_only:
        payload["quality"] = quality_rows(args)
    if not args.plan_only and not args.no_depth:
        payload["depth"] = depth_rows(args)
    print(write_result("long_context", args.name, payload))


if __name__ == "__main__":
    main()
