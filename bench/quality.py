"""Quality of the quantized tiers: perplexity of the bundled tiny model per dev domain.

Converts the model once per method (RTN, GPTQ, HAQ; weights only, and with a W8A8 int8 tier),
calibrating GPTQ/HAQ on the train splits, then scores every tier on ../shared/corpus/*.dev.txt.

    python -m bench.quality [--max-tokens N] [--window 256]
    python -m bench.quality --cpu-dot int8 --methods rtn,gptq   # the tiers under load(cpu_dot="int8")

With --server, it instead evaluates a running `jmoe serve` with EleutherAI's lm-evaluation-harness
(`pip install 'lm-eval[api]'`, in the test extra) through its `local-completions` model, the path
tests/test_lm_eval.py checks: loglikelihoods as completions with echo and logprobs, generate_until as
greedy completions with stop strings. --tasks names lm-eval tasks (default: the two tiny ones
bundled in tests/data/lm_eval; --include-path adds other task directories, and lm-eval's own tasks
download their data, so they need network). --tokenizer is the served model's Hugging Face
tokenizer (a converted model's directory will do: its tokenizer/ is used), which lm-eval needs to
split loglikelihood requests; the model's id and context are asked of the server (/v1/models,
/tokenizer_info). A server started with --api-key wants it in $OPENAI_API_KEY.

    jmoe serve out/tiny-qwen3-moe --port 8000 &
    python -m bench.quality --server http://127.0.0.1:8000 --tokenizer out/tiny-qwen3-moe [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import jmoe
from bench.lib.common import CALIB_FILES, DOMAINS, ROOT, TINY_HF, dev_tokens, write_result
from convert import convert_checkpoint

TIERS = ("int8", "int4", "int2")
LM_EVAL_TASKS = ROOT / "tests" / "data" / "lm_eval"  # jmoe_choice (multiple choice), jmoe_complete (generate_until)


def ask(server: str, path: str) -> dict:
    """GET the server's `path`, with $OPENAI_API_KEY as the key where it is set (local-completions
    sends it too)."""
    headers = {}
    if os.environ.get("OPENAI_API_KEY"):
        headers["authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    request = urllib.request.Request(f"{server.rstrip('/')}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def evaluate_server(server: str, tokenizer: str | Path, tasks=("jmoe_choice", "jmoe_complete"), model=None,
                    include_path=(), concurrent: int = 1, batch_size: int = 1, limit=None) -> dict:
    """lm_eval.simple_evaluate over a running jmoe serve at `server` (its base URL): local-completions
    with a local Hugging Face tokenizer, greedy, every document's requests and answers logged
    (results["samples"]). The model's id and context (lm-eval cuts prompts to it) are the server's."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tokenizer = Path(tokenizer)
    if (tokenizer / "tokenizer").is_dir():  # a converted model's directory
        tokenizer = tokenizer / "tokenizer"
    model = model or ask(server, "/v1/models")["data"][0]["id"]
    args = dict(base_url=f"{server.rstrip('/')}/v1/completions", model=model,
                tokenizer_backend="huggingface", tokenizer=str(tokenizer),
                max_length=ask(server, "/tokenizer_info")["model_max_length"],
                num_concurrent=concurrent, batch_size=batch_size, max_retries=1)
    paths = [str(LM_EVAL_TASKS), *map(str, include_path)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not set(tasks) <= set(manager.all_tasks):  # lm-eval's own tasks too (indexing them takes seconds)
        manager = TaskManager(include_path=paths)
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=list(tasks),
                                   task_manager=manager, log_samples=True, bootstrap_iters=0, limit=limit)


def server_main(args) -> None:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    t = time.perf_counter()
    results = evaluate_server(args.server, args.tokenizer, tasks, model=args.model, include_path=args.include_path,
                              concurrent=args.concurrent, batch_size=args.batch_size, limit=args.limit)
    seconds = time.perf_counter() - t
    metrics = {task: {k: v for k, v in row.items() if "," in k and "stderr" not in k}
               for task, row in results["results"].items()}
    for task, row in metrics.items():
        print(f"{task:24s} " + "  ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in row.items()))
    print(f"{seconds:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"server": args.server, "model": results["config"]["model_args"],
                                              "tasks": tasks, "metrics": metrics, "seconds": seconds},
                                             indent=2, default=str) + "\n")


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
    server = parser.add_argument_group("through a running server (lm-evaluation-harness)")
    server.add_argument("--server", help="evaluate the jmoe serve at this base URL (http://HOST:PORT) instead")
    server.add_argument("--tokenizer", help="the served model's tokenizer: a converted model's directory, or a "
                                            "Hugging Face tokenizer's")
    server.add_argument("--tasks", default="jmoe_choice,jmoe_complete", help="lm-eval tasks, comma-separated")
    server.add_argument("--include-path", action="append", default=[], help="another lm-eval task directory")
    server.add_argument("--model", help="the served model's id (default: asked of /v1/models)")
    server.add_argument("--concurrent", type=int, default=1, help="requests at once")
    server.add_argument("--batch-size", type=int, default=1, help="prompts per request")
    server.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    server.add_argument("--out", help="write the metrics to this JSON file")
    args = parser.parse_args()
    if args.server:
        if not args.tokenizer:
            parser.error("--server needs --tokenizer")
        return server_main(args)
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
    write_result("quality", "quality_tiny" if args.cpu_dot == "float" else "quality_tiny_int8_dot", payload)


if __name__ == "__main__":
    main()
