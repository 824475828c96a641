"""Perplexity of the bundled tiny model on each ../shared/corpus/*.dev.txt, jmoe vs transformers.

Non-overlapping windows (default 256 tokens, the model's training length) over the whole dev
split; both sides score exactly the same windows in float32.

    python -m bench.perplexity [--window 256] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np

import jmoe
from bench.lib.common import DOMAINS, TINY_HF, dev_tokens, write_result
from convert import convert_checkpoint
from jmoe.decoding.evaluate import window_nll


def hf_window_nll(model, ids: np.ndarray, window: int) -> tuple[float, int]:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start : start + window], dtype=torch.long)[None]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens per domain")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TINY_HF, dtype=torch.float32).eval()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = jmoe.load(convert_checkpoint(TINY_HF, Path(tmp) / "tiny", progress=False), compute_dtype="float32")
        for domain in DOMAINS:
            ids = dev_tokens(model.tokenizer, domain, args.max_tokens)
            t = time.perf_counter()
            ours, n = window_nll(model, ids, args.window)
            t_ours = time.perf_counter() - t
            t = time.perf_counter()
            theirs, n_hf = hf_window_nll(hf, ids, args.window)
            t_hf = time.perf_counter() - t
            assert n == n_hf
            rows[domain] = {
                "tokens_scored": n,
                "jmoe_ppl": math.exp(ours / n),
                "transformers_ppl": math.exp(theirs / n),
                "relative_difference": abs(ours - theirs) / theirs,
                "seconds": {"jmoe": t_ours, "transformers": t_hf},
            }
            print(f"{domain}: jmoe {rows[domain]['jmoe_ppl']:.4f}  transformers {rows[domain]['transformers_ppl']:.4f}  "
                  f"({n} tokens)")
    write_result("perplexity", "perplexity_tiny",
                 {"model": "tiny-qwen3-moe", "dtype": "float32", "window": args.window, "domains": rows})


if __name__ == "__main__":
    main()
