"""Prefill and decode throughput of jmoe vs Hugging Face transformers on the bundled tiny model.

Both run in float32 on this machine, in the same process, on the same prompt; the ratios are
what to quote. Also reports jmoe's jit compile time for the prefill and decode shapes.

    python -m bench.speed_vs_transformers [--prompt-tokens 512] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from bench.lib.common import CORPUS, TINY_HF, timed, write_result
from convert import convert_checkpoint
from jmoe.decoding.engine import new_cache


def prompt_ids(tokenizer, n: int) -> list[int]:
    path = CORPUS / "code.dev.txt"
    text = path.read_text()[:200_000] if path.is_file() else (TINY_HF / "MODEL_CARD.md").read_text() * 50
    return tokenizer.encode(text)[:n]


def jmoe_speed(model, ids: list[int], new_tokens: int) -> dict:
    engine, cfg = model.engine, model.config
    P = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    key_start = jnp.zeros((1,), jnp.int32)
    experts = model.residency.expert_state()

    def prefill(cache):
        return engine.forward(model.dense, experts, tokens, cache, 0, key_start, last_only=True, want_importance=False)

    S = P + new_tokens
    cache_shape = new_cache(cfg, 1, S, model.kv_dtype)
    t = time.perf_counter()
    engine.forward.lower(model.dense, experts, tokens, cache_shape, 0, key_start, last_only=True,
                       want_importance=False).compile()
    compile_prefill = time.perf_counter() - t
    step_tokens = jnp.zeros((1, 1), jnp.int32)
    t = time.perf_counter()
    engine.forward.lower(model.dense, experts, step_tokens, cache_shape, P, key_start, last_only=True,
                       want_importance=False).compile()
    compile_decode = time.perf_counter() - t

    prefill_s = timed(lambda: jax.block_until_ready(prefill(new_cache(cfg, 1, S, model.kv_dtype))[0]))

    def decode_run():
        t0 = time.perf_counter()
        pieces = list(jmoe.generate(model, ids, max_new_tokens=new_tokens, stream=True))
        return pieces, time.perf_counter() - t0

    decode_run()  # compile the cache bucket used by generate
    runs = [decode_run() for _ in range(3)]
    generated = len(runs[0][0])
    total = float(np.median([r[1] for r in runs]))
    decode_s = max(total - prefill_s, 1e-9)
    return {
        "prefill_tokens_per_s": P / prefill_s,
        "decode_tokens_per_s": (generated - 1) / decode_s,
        "generated_tokens": generated,
        "compile_s": {"prefill": compile_prefill, "decode_step": compile_decode},
        "tokens": runs[0][0],
    }


def hf_speed(ids: list[int], new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_HF, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        prefill_s = timed(lambda: model(x))
        out = None

        def run():
            nonlocal out
            out = model.generate(x, max_new_tokens=new_tokens, do_sample=False)

        total = timed(run, repeat=3)
    generated = out.shape[1] - len(ids)
    return {
        "prefill_tokens_per_s": len(ids) / prefill_s,
        "decode_tokens_per_s": (generated - 1) / max(total - prefill_s, 1e-9),
        "generated_tokens": generated,
        "tokens": out[0, len(ids):].tolist(),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = convert_checkpoint(TINY_HF, Path(tmp) / "tiny", progress=False)
        model = jmoe.load(out, compute_dtype="float32")
        ids = prompt_ids(model.tokenizer, args.prompt_tokens)
        ours = jmoe_speed(model, ids, args.new_tokens)
    theirs = hf_speed(ids, args.new_tokens)
    same = ours.pop("tokens") == theirs.pop("tokens")
    result = {
        "model": "tiny-qwen3-moe",
        "dtype": "float32",
        "prompt_tokens": len(ids),
        "max_new_tokens": args.new_tokens,
        "same_greedy_tokens": same,
        "jmoe": ours,
        "transformers": theirs,
        "ratio_jmoe_over_transformers": {
            "prefill": ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"],
            "decode": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
        },
    }
    write_result("speed_vs_transformers", "speed_tiny", result)
    for k in ("prefill", "decode"):
        print(f"{k}: jmoe {ours[f'{k}_tokens_per_s']:.0f} tok/s, transformers {theirs[f'{k}_tokens_per_s']:.0f} tok/s, "
              f"ratio {result['ratio_jmoe_over_transformers'][k]:.2f}")
    print(f"compile: {ours['compile_s']}; same greedy tokens: {same}")


if __name__ == "__main__":
    main()
