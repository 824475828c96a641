"""Quality of the quantized tiers: perplexity of the bundled tiny model per dev domain.

Converts the model once per method (RTN, GPTQ, HAQ; weights only, and with a W8A8 int8 tier),
calibrating GPTQ/HAQ on the train splits, then scores every tier on ../shared/corpus/*.dev.txt.

    python -m bench.quality [--max-tokens N] [--window 256]
    python -m bench.quality --cpu-dot int8 --methods rtn,gptq   # the tiers under load(cpu_dot="int8")
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jmoe
from bench.common import CALIB_FILES, DOMAINS, TINY_HF, dev_tokens, write_result
from convert import convert_checkpoint

TIERS = ("int8", "int4", "int2")


def perplexities(path: Path, tier: str, tokens: dict, window: int, cpu_dot: str = "float") -> dict[str, float]:
    model = jmoe.load(path, tier=tier, compute_dtype="float32", cpu_dot=cpu_dot)
    return {domain: jmoe.perplexity(model, ids, window=window) for domain, ids in tokens.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N dev tokens per domain")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--calib-sequences", type=int, default=64)
    parser.add_argument("--methods", default="rtn,gptq,haq", help="quantizers to convert with (default all three)")
    parser.add_argument("--cpu-dot", default="float", choices=["float", "int8"],
                        help="load(cpu_dot=...) for the quantized tiers; int8 writes quality_tiny_int8_dot_cpu.json "
                             "without the W8A8 variants")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    rows, timings = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = [(m, w8a8) for w8a8 in ((False,) if args.cpu_dot == "int8" else (False, True)) for m in methods]
        tokens = None
        for method, w8a8 in variants:
            name = f"{method}{'-w8a8' if w8a8 else ''}"
            tiers = ("bf16", *TIERS) if not w8a8 else ("int8",)
            t = time.perf_counter()
            out = convert_checkpoint(TINY_HF, Path(tmp) / name, tiers=",".join(tiers), method=method, w8a8=w8a8,
                                     calib=None if method == "rtn" else [str(p) for p in CALIB_FILES],
                                     calib_sequences=args.calib_sequences, progress=False)
            timings[name] = {"convert_s": time.perf_counter() - t}
            if tokens is None:
                tokenizer = jmoe.load(out, compute_dtype="float32").tokenizer
                tokens = {d: dev_tokens(tokenizer, d, args.max_tokens) for d in DOMAINS}
                rows.append({"method": "-", "tier": "bf16", "activations": "bf16/f32",
                             **perplexities(out, "bf16", tokens, args.window)})
            for tier in tiers:
                if tier == "bf16":
                    continue
                t = time.perf_counter()
                activations = "int8 per token" if w8a8 else "int8 per group (cpu_dot)" if args.cpu_dot == "int8" \
                    else "float"
                row = {"method": method, "tier": tier, "activations": activations,
                       **perplexities(out, tier, tokens, args.window, args.cpu_dot)}
                timings[name][f"eval_{tier}_s"] = time.perf_counter() - t
                rows.append(row)
                print(f"{method:5s} {tier:5s} {'W8A8' if w8a8 else '    '} " +
                      "  ".join(f"{d} {row[d]:8.3f}" for d in DOMAINS), flush=True)
    payload = {
        "model": "tiny-qwen3-moe",
        "window": args.window,
        "dev_tokens": {d: int(len(ids)) for d, ids in tokens.items()},
        "calibration": {"files": [p.name for p in CALIB_FILES], "sequences": args.calib_sequences, "seq_len": 256},
        "rows": rows,
        "seconds": timings,
    }
    write_result("quality_tiny" if args.cpu_dot == "float" else "quality_tiny_int8_dot", payload)


if __name__ == "__main__":
    main()
