"""Quality of the quantized tiers: perplexity of the bundled tiny model per dev domain.

Converts the model once per method (RTN, GPTQ, HAQ; weights only, and with a W8A8 int8 tier),
calibrating GPTQ/HAQ on the train splits, then scores every tier on ../shared/corpus/*.dev.txt.

    python -m bench.quality [--max-tokens N] [--window 256]
    python -m bench.quality --cpu-dot int8 --methods rtn,gptq   # the tiers under load(cpu_dot="int8")
    python -m bench.quality --tiers int2 --no-w8a8               # one tier's methods: quality_tiny_int2_cpu.json
    python -m bench.quality --tiers int3 --no-w8a8               # quality_tiny_int3_cpu.json

With --llama-cpp, it scores the same model beside llama.cpp: the tiny model converted to GGUF
(its own tokenizer; llama-tokenize must give jmoe's token ids, or the run stops) and quantized to
Q8_0, Q4_0, Q4_K_M and Q3_K_M by llama-quantize (and Q4_0 for the routed experts alone, the rest
BF16, as jmoe's expert tiers leave it), each scored by llama-perplexity, and jmoe's
tiers (RTN), int4 and int3 with dense int4 under the int8 dot, and the per-token mixed mode (DyMoE int4/int2,
both tiers whole, scored token by token as it decodes), RTN and GPTQ (experts and LM head, calibrated
on the train splits), with the LM head at int8 (the default beside dense int4), int6 (the bytes a token
reads of llama.cpp's Q6_K output matrix; also in groups of 64, 6.25 bits read) or int4, scored by jmoe on the
same windows with the same rule: windows of --ctx tokens, each scoring its second half (jmoe.perplexity(..., context=ctx // 2)).
The rows "GPTQ experts with dense bf16" are every expert tier and precision policy of one GPTQ conversion:
int4, int3 and int2, DyMoE int4/int2 per token, and DynaExq (one version an expert, and its lo
versions kept under 8 int4 copies a layer) in the device budget of every expert at int2 and 8 int4
copies a layer, the policies token by token. Every row is also scored on a shifting stream: the
start of the prose, code and math dev texts in turn, --stream-tokens of each, in the same windows.
Each side's figures are relative to its own bf16. Needs a llama.cpp build with llama-perplexity and
llama-tokenize (bench/lib/llama_cpp.py says how; build those two targets beside llama-bench).

    python -m bench.quality --llama-cpp [--chunks 200] [--work DIR] [--mixed-r 0.75,0.625,0.5]
    python -m bench.quality --llama-cpp --rows int3 --llama-types Q4_0,Q3_K_M --result-name NAME
    python -m bench.quality --llama-cpp --rows "GPTQ experts with dense bf16" --llama-types Q4_0,Q4_K_M,Q3_K_M \
        --chunks 100 --result-name quality_policies_vs_llama_cpp

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
import functools
import inspect
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import jmoe
from bench.lib.common import CALIB_FILES, CORPUS, DOMAINS, ROOT, TINY_HF, dev_tokens, dymoe_ratios, write_result
from bench.lib.common import result_name as checked_name
from convert import convert_checkpoint
from convert.quantizers.expert import METHODS
from jmoe.manifest import read_manifest
from jmoe.policies.dymoe import DEFAULT_R

TIERS = ("int8", "int4", "int3", "int2")
CALIB_SEQUENCES = inspect.signature(convert_checkpoint).parameters["calib_sequences"].default  # the converter's
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


# The rows scored beside llama.cpp: label -> (conversion, load keywords, mode).
POLICY_ROWS = "GPTQ experts with dense bf16"  # every tier and precision policy of one conversion (--rows picks them)
BESIDE_LLAMA = {
    "bf16": ("rtn", dict(tier="bf16"), "prefill"),
    "int8 experts": ("rtn", dict(tier="int8"), "prefill"),
    "int4 experts": ("rtn", dict(tier="int4"), "prefill"),
    "int2 experts": ("rtn", dict(tier="int2"), "prefill"),
    "DyMoE int4/int2 experts, per token": ("rtn", dict(policy="mixed"), "decode"),
    "int4 experts + dense int4 (int8 head), int8 dot": ("dense-int4", dict(tier="int4", cpu_dot="int8"), "prefill"),
    "DyMoE int4/int2 + dense int4 (int8 head), int8 dot, per token": ("dense-int4", dict(policy="mixed",
                                                                                         cpu_dot="int8"), "decode"),
    "int4 experts + dense int4 (int4 head), int8 dot": ("dense-int4-head-int4", dict(tier="int4", cpu_dot="int8"),
                                                        "prefill"),
    "GPTQ: int4 experts + dense int4 (int8 head), int8 dot": ("gptq-dense-int4", dict(tier="int4", cpu_dot="int8"),
                                                             "prefill"),
    "GPTQ: DyMoE int4/int2 + dense int4 (int8 head), int8 dot, per token": ("gptq-dense-int4",
                                                                           dict(policy="mixed", cpu_dot="int8"),
                                                                           "decode"),
    "GPTQ: int4 experts + dense int4 (int4 head), int8 dot": ("gptq-dense-int4-head-int4",
                                                             dict(tier="int4", cpu_dot="int8"), "prefill"),
    "int4 experts + dense int4 (int6 head), int8 dot": ("dense-int4-head-int6", dict(tier="int4", cpu_dot="int8"),
                                                        "prefill"),
    "GPTQ: int4 experts + dense int4 (int6 head), int8 dot": ("gptq-dense-int4-head-int6",
                                                             dict(tier="int4", cpu_dot="int8"), "prefill"),
    "GPTQ: DyMoE int4/int2 + dense int4 (int6 head), int8 dot, per token": ("gptq-dense-int4-head-int6",
                                                                           dict(policy="mixed", cpu_dot="int8"),
                                                                           "decode"),
    # the int6 head in groups of 64 (6.25 bits a weight read): what the default's groups of 32 buy
    "GPTQ: int4 experts + dense int4 (int6 head in groups of 64), int8 dot": (
        "gptq-dense-int4-head-int6-g64", {"tier": "int4", "cpu_dot": "int8"}, "prefill"),
    # the int4 head refined per token (its 256 largest logits again from int8 rows): 2 bits a
    # weight fewer than the int6 head, the refined head's quality side
    "GPTQ: int4 experts + dense int4 (int4 head, refined), int8 dot": (
        "gptq-dense-int4-head-int4-refined", {"tier": "int4", "cpu_dot": "int8"}, "prefill"),
    "GPTQ: DyMoE int4/int2 + dense int4 (int4 head, refined), int8 dot, per token": (
        "gptq-dense-int4-head-int4-refined", {"policy": "mixed", "cpu_dot": "int8"}, "decode"),
    "GPTQ: DyMoE int4/int2 r=0.625 + dense int4 (int4 head, refined), int8 dot, per token": (
        "gptq-dense-int4-head-int4-refined", {"policy": "mixed", "cpu_dot": "int8", "r": 0.625}, "decode"),
    # three-bit experts with Q4_0's other bytes: the quality side of reading fewer expert bytes (Q3_K_M's)
    "int3 experts + dense int4 (int6 head), int8 dot": ("dense-int4-head-int6", dict(tier="int3", cpu_dot="int8"),
                                                        "prefill"),
    "GPTQ: int3 experts + dense int4 (int6 head), int8 dot": ("gptq-dense-int4-head-int6",
                                                             dict(tier="int3", cpu_dot="int8"), "prefill"),
    # every expert tier and precision policy of one GPTQ conversion (the rest bf16), the policies
    # token by token; DynaExq in the budget of every expert at int2 and 8 int4 copies a layer
    f"{POLICY_ROWS}: int4": ("gptq", {"tier": "int4"}, "prefill"),
    f"{POLICY_ROWS}: int3": ("gptq", {"tier": "int3"}, "prefill"),
    f"{POLICY_ROWS}: int2": ("gptq", {"tier": "int2"}, "prefill"),
    f"{POLICY_ROWS}: DyMoE int4/int2 (r=0.75), per token": ("gptq", {"policy": "mixed"}, "decode"),
    f"{POLICY_ROWS}: DynaExq int4/int2, one version an expert (DynaExq 8/32's budget), per token": (
        "gptq", {"policy": "dynaexq"}, "decode"),
    f"{POLICY_ROWS}: DynaExq int2 + 8 int4 copies a layer (keep_lo), per token": (
        "gptq", {"policy": "dynaexq-keep-lo"}, "decode"),
}
MIXED_AT_OTHER_R = "GPTQ: DyMoE int4/int2 + dense int4 (int6 head), int8 dot, per token"


def beside_llama_rows(mixed_r: list[float]) -> dict:
    """BESIDE_LLAMA, and the GPTQ per-token row with Q4_0's head bytes at each further DyMoE ratio r
    (fewer experts at int4 as r falls: the quality side of reading fewer bytes than Q4_0)."""
    rows = dict(BESIDE_LLAMA)
    conversion, kwargs, mode = BESIDE_LLAMA[MIXED_AT_OTHER_R]
    for r in mixed_r:
        if r != DEFAULT_R:
            label = MIXED_AT_OTHER_R.replace("int4/int2", f"int4/int2 r={r:g}")
            rows[label] = (conversion, dict(kwargs, r=r), mode)
    return rows


CALIBRATED = dict(method="gptq", calib=[str(p) for p in CALIB_FILES])  # the experts and the LM head (convert/head.py)
CONVERSIONS = {  # each with the converter's defaults otherwise
    "rtn": dict(tiers="bf16,int8,int4,int2"),
    "gptq": {"tiers": "int4,int3,int2", **CALIBRATED},
    "dense-int4": dict(tiers="int4,int2", dense_tier="int4"),
    "dense-int4-head-int4": dict(tiers="int4", dense_tier="int4", head_tier="int4"),
    "gptq-dense-int4": dict(tiers="int4,int2", dense_tier="int4", **CALIBRATED),
    "gptq-dense-int4-head-int4": dict(tiers="int4", dense_tier="int4", head_tier="int4", **CALIBRATED),
    "dense-int4-head-int6": dict(tiers="int4,int3", dense_tier="int4", head_tier="int6"),
    "gptq-dense-int4-head-int6": dict(tiers="int4,int3,int2", dense_tier="int4", head_tier="int6", **CALIBRATED),
    "gptq-dense-int4-head-int4-refined": dict(tiers="int4,int2", dense_tier="int4", head_tier="int4", refine_head=256,
                                              **CALIBRATED),
    "gptq-dense-int4-head-int6-g64": dict(tiers="int4", dense_tier="int4", head_tier="int6", head_group_size=64,
                                          **CALIBRATED),
}
# K-quants need rows of 256: on the tiny model (rows of 96 and 128) llama-quantize falls back to
# other types for those tensors (Q2_K becomes Q4_0 throughout), so their bits are read from the GGUF.
LLAMA_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q3_K_M", "Q4_0-experts")


def expert_bits(cfg, tier: str) -> float:
    """Bits per expert weight at a tier, from the record layout (bench/tier_bytes.py's table)."""
    from bench.tier_bytes import tier_table

    return tier_table(cfg)["tiers"][tier]["bits_per_weight"]


def mixed_bits(cfg, policy) -> float:
    """Bits per expert weight a decode token reads under DyMoE: in layer l, ceil(r(l) k) of its k
    experts at hi, the rest at lo (the policy's rule at batch 1)."""
    from jmoe.policies.dymoe import critical_share

    share_hi = critical_share(cfg.num_layers, cfg.top_k, policy.lam)
    return share_hi * expert_bits(cfg, policy.hi) + (1 - share_hi) * expert_bits(cfg, policy.lo)


def reuse_or_convert(out: Path, **options) -> Path:
    """The tiny model converted to out, or what a run with the same --work left there (converted
    again where it lacks a tier these options ask for)."""
    manifest = out / "manifest.json"
    if manifest.is_file() and set(options["tiers"].split(",")) <= set(read_manifest(out)["tiers"]):
        return out
    return convert_checkpoint(TINY_HF, out, progress=False, overwrite=manifest.is_file(), **options)


def chosen_rows(rows: dict, words: str | None) -> dict:
    """The rows whose label holds one of the comma-separated words (all without --rows), and bf16,
    which every other row is judged against."""
    wanted = [w.strip() for w in (words or "").split(",") if w.strip()]
    chosen = {label: row for label, row in rows.items()
              if not wanted or label == "bf16" or any(w in label for w in wanted)}
    if wanted and len(chosen) == 1:
        raise SystemExit(f"--rows {words!r} names none of the rows: {', '.join(rows)}")
    return chosen


def beside_llama_main(args) -> None:
    from bench.lib import llama_cpp

    llama = llama_cpp.find_llama_cpp()
    types = [t.strip() for t in args.llama_types.split(",") if t.strip()]
    half = args.ctx // 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        ggufs = llama_cpp.convert(llama, TINY_HF, work / "gguf", ["BF16", *types], pretokenizer="gpt-2")
        rows_wanted = chosen_rows(beside_llama_rows(args.mixed_r), args.rows)
        conversions = {name: reuse_or_convert(work / f"jmoe-{name}", **CONVERSIONS[name])
                       for name in dict.fromkeys(["rtn", *(c for c, _, _ in rows_wanted.values())])}
        tokenizer = jmoe.load(conversions["rtn"], compute_dtype="float32").tokenizer
        windows, tokens = {}, {}
        for domain in DOMAINS:
            ids = dev_tokens(tokenizer, domain)
            theirs = llama_cpp.tokenize(llama, Path(ggufs["BF16"]["path"]), CORPUS / f"{domain}.dev.txt")
            if theirs != ids.tolist():
                raise SystemExit(f"llama.cpp tokenizes {domain}.dev.txt differently from jmoe: the perplexities "
                                 "would not be of the same tokens")
            windows[domain] = min(len(ids) // args.ctx, args.chunks or len(ids))
            tokens[domain] = ids[: windows[domain] * args.ctx]
        stream_file = work / "stream.txt"
        stream_file.write_text(stream_text(tokenizer, args.stream_tokens))
        stream = np.asarray(tokenizer.encode(stream_file.read_text()), np.int32)
        if llama_cpp.tokenize(llama, Path(ggufs["BF16"]["path"]), stream_file) != stream.tolist():
            raise SystemExit("llama.cpp tokenizes the stream differently from jmoe")
        stream_windows = len(stream) // args.ctx
        stream = stream[: stream_windows * args.ctx]

        rows = []
        for qtype in ["BF16", *types]:
            gguf = Path(ggufs[qtype]["path"])
            row = {"runtime": "llama.cpp", "label": qtype, **llama_cpp.weight_bits(llama, gguf)}
            for domain in DOMAINS:
                got = llama_cpp.perplexity(llama, gguf, CORPUS / f"{domain}.dev.txt", ctx=args.ctx,
                                           chunks=windows[domain], log=work / f"perplexity-{qtype}-{domain}.log")
                if got["chunks"] != windows[domain]:
                    raise SystemExit(f"llama-perplexity scored {got['chunks']} windows of {domain}, "
                                     f"not {windows[domain]}")
                row[domain] = got["ppl"]
            got = llama_cpp.perplexity(llama, gguf, stream_file, ctx=args.ctx, chunks=stream_windows,
                                       log=work / f"perplexity-{qtype}-stream.log")
            if got["chunks"] != stream_windows:
                raise SystemExit(f"llama-perplexity scored {got['chunks']} windows of the stream, not {stream_windows}")
            row["stream"] = got["ppl"]
            rows.append(row)
            print(f"llama.cpp {qtype:7s} " + "  ".join(f"{d} {row[d]:8.4f}" for d in (*DOMAINS, "stream")),
                  flush=True)

        for label, (conversion, kwargs, mode) in rows_wanted.items():
            path = conversions[conversion]
            row = {"runtime": "jmoe", "label": label, "mode": mode,
                   "dense": CONVERSIONS[conversion].get("dense_tier", "bf16"),
                   "method": CONVERSIONS[conversion].get("method", "rtn")}
            t = time.perf_counter()
            for domain, ids in [*tokens.items(), ("stream", stream)]:  # each from a fresh load: a policy's own start
                model = jmoe.load(path, compute_dtype="float32", **row_load_options(path, kwargs))
                row[domain] = jmoe.perplexity(model, ids, window=args.ctx, mode=mode, context=half)
            row["expert_bits"] = row_expert_bits(model, kwargs)
            row["seconds"] = time.perf_counter() - t
            rows.append(row)
            del model
            print(f"jmoe {label:50s} " + "  ".join(f"{d} {row[d]:8.4f}" for d in (*DOMAINS, "stream")), flush=True)

    for row in rows:  # each runtime against its own bf16
        base = next(r for r in rows if r["runtime"] == row["runtime"] and r["label"] in ("bf16", "BF16"))
        row["over_bf16"] = {d: row[d] / base[d] - 1 for d in (*DOMAINS, "stream")}
    write_result("quality", args.result_name, {
        "model": "tiny-qwen3-moe", "ctx": args.ctx, "scored": "the second half of each window",
        "windows": windows, "scored_tokens": {d: windows[d] * (args.ctx - 1 - half) for d in DOMAINS},
        "stream": {"order": list(STREAM_ORDER), "tokens_per_domain": args.stream_tokens, "windows": stream_windows,
                   "scored_tokens": stream_windows * (args.ctx - 1 - half)},
        "llama_cpp": llama.version(), "rows": rows})


STREAM_ORDER = ("prose", "code", "math")  # the shifting stream: each domain's dev text in turn


def stream_text(tokenizer, tokens_per_domain: int) -> str:
    """The start of each domain's dev text in STREAM_ORDER, about `tokens_per_domain` tokens of each,
    cut at a line's end: a workload that shifts, as text both runtimes tokenize (checked)."""
    parts = []
    for domain in STREAM_ORDER:
        text = (CORPUS / f"{domain}.dev.txt").read_text()
        chars = len(text) * tokens_per_domain // max(len(tokenizer.encode(text)), 1)
        cut = text.rfind("\n", 0, chars) + 1 or chars
        parts.append(text[:cut])
    return "".join(parts)


def row_load_options(path: Path, kwargs: dict) -> dict:
    """jmoe.load's keywords for a row: its tier, or its policy (DyMoE int4/int2, both tiers whole;
    DynaExq in the device budget of every expert at int2 and 8 int4 copies a layer)."""
    from bench.policies import EIGHT_COPIES, ONE_VERSION_OPTIONS
    from jmoe.policies import DyMoE, DynaExq

    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", None)
    if policy == "mixed":
        kwargs["policy"] = DyMoE(hi="int4", lo="int2", r=kwargs.pop("r", DEFAULT_R))
    elif policy in ("dynaexq", "dynaexq-keep-lo"):
        options = EIGHT_COPIES if policy == "dynaexq-keep-lo" else ONE_VERSION_OPTIONS
        kwargs.update(policy=DynaExq(**options), device_budget=budget_of(path))
    return kwargs


@functools.cache
def budget_of(path: Path) -> int:
    """DynaExq 8/32's device budget for a conversion (bench/policies.py: checked by loading it)."""
    from bench.policies import dynaexq_budget

    return dynaexq_budget(path)


def row_expert_bits(model, kwargs: dict) -> float | None:
    """Bits per expert weight a row's decode token reads: its tier's, DyMoE's mix; None for DynaExq
    (what its hi experts serve moves with the routing)."""
    policy = kwargs.get("policy")
    if policy == "mixed":
        return mixed_bits(model.config, model.policy)
    return None if policy else expert_bits(model.config, kwargs["tier"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N dev tokens per domain")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--calib-sequences", type=int, default=CALIB_SEQUENCES)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="quantizers to convert with (default all three; fewer write a result of their own)")
    parser.add_argument("--tiers", default=",".join(TIERS),
                        help="integer tiers to score (default all; fewer write a result of their own)")
    parser.add_argument("--no-w8a8", action="store_true", help="skip the W8A8 int8 variants")
    parser.add_argument("--cpu-dot", default="float", choices=["float", "int8"],
                        help="load(cpu_dot=...) for the quantized tiers; int8 writes quality_tiny_int8_dot_cpu.json "
                             "without the W8A8 variants")
    beside = parser.add_argument_group("beside llama.cpp (llama-perplexity on the same tokens and windows)")
    beside.add_argument("--llama-cpp", action="store_true", help="score jmoe's modes beside llama.cpp's GGUF types")
    beside.add_argument("--ctx", type=int, default=256, help="window (default 256, the tiny model's training length)")
    beside.add_argument("--chunks", type=int, default=200, help="windows per domain (0: the whole dev split)")
    beside.add_argument("--llama-types", default=",".join(LLAMA_TYPES), help="GGUF types beside BF16")
    beside.add_argument("--mixed-r", type=dymoe_ratios, default=f"{DEFAULT_R:g}",
                        help="DyMoE ratios r (each in [0.5, 1]) of the GPTQ per-token row with the int6 head, "
                             f"comma-separated (default {DEFAULT_R:g}, DyMoE's; the other per-token rows stay at it)")
    beside.add_argument("--rows", help="score only jmoe's rows whose label holds one of these comma-separated "
                                       "words (bf16 always), e.g. int3")
    beside.add_argument("--result-name", type=checked_name, default="quality_vs_llama_cpp",
                        help="the result's name under bench/results/quality (_cpu.json added)")
    beside.add_argument("--stream-tokens", type=int, default=1024,
                        help="tokens of each domain in the shifting prose -> code -> math stream (default 1024)")
    beside.add_argument("--work", help="keep the GGUFs, conversions and logs here (reused when present)")
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
    if args.llama_cpp:
        return beside_llama_main(args)
    if args.server:
        if not args.tokenizer:
            parser.error("--server needs --tokenizer")
        return server_main(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    scored = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    if not scored or set(scored) - set(TIERS):
        parser.error(f"--tiers takes some of {','.join(TIERS)}")
    w8a8_variants = (False,) if args.cpu_dot == "int8" or args.no_w8a8 or "int8" not in scored else (False, True)

    rows, timings = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = [(m, w8a8) for w8a8 in w8a8_variants for m in methods]
        tokens = None
        for method, w8a8 in variants:
            name = f"{method}{'-w8a8' if w8a8 else ''}"
            tiers = ("bf16", *scored) if not w8a8 else ("int8",)
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
                       "format": read_manifest(out)["tiers"][tier]["format"],
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
    write_result("quality", result_name(args.cpu_dot, args.calib_sequences, methods, scored, w8a8_variants), payload)


def result_name(cpu_dot: str, calib_sequences: int, methods: list[str], tiers=TIERS,
                w8a8_variants=(False, True)) -> str:
    """quality_tiny[_int8_dot] for the full table; a run with other calibration, fewer methods or
    tiers, or without the W8A8 rows gets a name of its own, so it never replaces the full table's rows."""
    name = "quality_tiny" if cpu_dot == "float" else "quality_tiny_int8_dot"
    if calib_sequences != CALIB_SEQUENCES:
        name += f"_calib{calib_sequences}"
    if sorted(methods) != sorted(METHODS):
        name += "_" + "_".join(methods)
    if sorted(tiers) != sorted(TIERS):
        name += "_" + "_".join(tiers)
    elif cpu_dot == "float" and len(w8a8_variants) == 1:
        name += "_no_w8a8"
    return name


if __name__ == "__main__":
    main()
