"""Real size, real speed: jmoe on a real model's exact layer shapes, beside llama.cpp, on the CPU.

Writes a random-weight Hugging Face checkpoint with a named model's exact shapes cut to --layers
layers (bench/lib/random_checkpoint.py), converts it with `jmoe convert --tiers <tiers> --method rtn`
(and, where `jmoe convert` has --dense-tier, once more with every dense weight at int4; with
--mixed, a third time with int4 and int2 experts, for the per-token mixed mode: DyMoE int4/int2
without a budget, both tiers resident, each token's least important experts read at int2), and
measures, each configuration in its own fresh process so its peak memory is its own:

- conversion time and peak RSS (jmoe, and llama.cpp's GGUF conversion and quantization);
- load time, prefill tok/s (a 512-token prompt), decode tok/s (128 tokens at depth 0 and after
  the 512-token prompt), peak RSS overall and while decoding, beside the bytes the model loads;
  per tier, all-resident and offloaded (device budget from jmoe.memory_plan so the pools hold 50%
  and 25% of the experts, policy lru+prefetch), each tier with each --cpu-dots setting
  (load's cpu_dot: float inputs, or inputs rounded to int8 per group as llama.cpp's Q8 dot does, to
  bf16 for bf16 experts as its BF16 dot does);
- a fresh process's load and first-token time with a cold and a warm XLA compilation cache
  (JMOE_COMPILATION_CACHE pointed at a new directory, then at the same one again);
- where llama.cpp is found (bench/lib/llama_cpp.py: JMOE_LLAMA_CPP or PATH, and how to build it), the
  same checkpoint as GGUF BF16, Q8_0, Q4_K_M and Q4_0 under `llama-bench -t 2 -p 512 -n 128`.

Every round runs each configuration once, jmoe and llama.cpp alternating (the order rotates by
round); results are medians with [min-max] over rounds, and each jmoe / llama.cpp ratio is taken
within a round. Writes bench/results/real_shapes/real_shapes_cpu.json (or --out) and a PNG beside it; prints
the markdown tables (also: python -m bench.lib.real_shapes_report).

    python -m bench.real_shapes --model qwen3-30b-a3b --layers 8 --rounds 3 --data ~/bench-data
    python -m bench.real_shapes --quick --skip-llama        # tiny token counts, 1 layer: checks the bench

Generated checkpoints and conversions go under --data (default $JMOE_BENCH_DATA, else
~/.cache/jmoe-bench); an 8-layer Qwen3-30B-A3B slice needs about 30 GB there and 10+ GiB of RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib import llama_cpp
from bench.lib.common import RESULTS, ROOT, dymoe_ratios, machine
from bench.lib.random_checkpoint import MODELS, checkpoint_bytes, model_named, write_checkpoint
from bench.lib.real_shapes_report import markdown, plot, ratios, summarize
from jmoe.layers.refined_head import DEFAULT_TOP
from jmoe.policies.dymoe import DEFAULT_R

# --placements names: all-resident, or pools holding that share of the experts
PLACEMENTS = {"resident": None, "50%": 0.5, "25%": 0.25}
OFFLOAD_POLICY = "lru+prefetch"
CHILD_TIMEOUT_S = 3 * 3600
TIER_ORDER = ("bf16", "int8", "int4", "int3", "int2")
DENSE_INT4_TIERS = ("int4", "int3", "int2")  # expert tiers the dense-int4 conversion holds, where asked


DOT_SUFFIX = {"float": "", "int8": ", int8 dot"}  # label suffix per load(cpu_dot=...)
BF16_DOT_SUFFIX = ", bf16 dot"  # the bf16 tier under cpu_dot="int8": its experts' inputs rounded to bf16


def dot_suffix(tier: str, dot: str) -> str:
    """A run's label suffix for its tier and load(cpu_dot=...)."""
    return BF16_DOT_SUFFIX if tier == "bf16" and dot == "int8" else DOT_SUFFIX[dot]

# --mixed: the per-token mixed mode (DyMoE int4/int2, both tiers resident)
MIXED = "jmoe dense int4, experts int4 + int2"
MIXED_LABEL = "jmoe DyMoE int4/int2 + dense int4 resident"


def mixed_label(r: float) -> str:
    """The mixed mode's label at DyMoE mean ratio r (the default r keeps the label earlier runs used)."""
    return MIXED_LABEL if r == DEFAULT_R else f"jmoe DyMoE int4/int2 r={r:g} + dense int4 resident"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="layers to keep (default 8; 1 with --quick)")
    p.add_argument("--tiers", default="bf16,int4", help="expert tiers to convert and run (default bf16,int4)")
    p.add_argument("--cpu-dots", default="float,int8",
                   help="load(cpu_dot=...) settings to run each tier with (default float,int8; int8 rounds a bf16 "
                        "tier's expert inputs to bf16)")
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help=f"comma-separated: {', '.join(PLACEMENTS)} (default all)".replace("%", "%%"))
    p.add_argument("--llama-types", default=",".join(llama_cpp.QUANT_TYPES),
                   help=f"GGUF types for llama.cpp (default {','.join(llama_cpp.QUANT_TYPES)}; also "
                        f"{','.join(sorted(set(llama_cpp.JMOE_TIER_OF) - set(llama_cpp.QUANT_TYPES)))})")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3; 1 with --quick)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; 64 with --quick)")
    p.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 128; 16 with --quick)")
    p.add_argument("--mixed", action="store_true",
                   help="also the per-token mixed mode: DyMoE int4/int2 without a budget, dense int4 (its own conversion)")
    p.add_argument("--mixed-r", type=dymoe_ratios, default=f"{DEFAULT_R:g}",
                   help="DyMoE mean shares of experts at int4 for --mixed, comma-separated, each in [0.5, 1] "
                        f"(default {DEFAULT_R:g}, DyMoE's; lower reads more experts at int2)")
    p.add_argument("--head-tier", choices=("bf16", "int8", "int6", "int4"), default=None,
                   help="LM head tier of the dense-int4 and mixed conversions (default: the converter's, int8 beside "
                        "dense int4; directories named ...-head-<tier>)")
    p.add_argument("--head-group-size", type=int, choices=(32, 64, 128), default=None,
                   help="the LM head's group size along K in those conversions (default: the head tier's; "
                        "directories named ...-head-<tier>-g<size>)")
    p.add_argument("--refine-head", type=int, nargs="?", const=DEFAULT_TOP, default=None, metavar="TOP",
                   help=f"convert those with `jmoe convert --refine-head TOP` (default {DEFAULT_TOP}): the head's "
                        "TOP largest logits a token computed again from int8 rows (directories named ...-refined<TOP>)")
    p.add_argument("--cpu-layout", action="store_true",
                   help="convert jmoe's models with --cpu-layout (their directories named ...-cpu)")
    p.add_argument("--quick", action="store_true", help="tiny token counts, 1 layer, 1 round: checks the bench")
    p.add_argument("--skip-llama", action="store_true", help="jmoe only")
    p.add_argument("--llama-threads", type=int, default=2,
                   help="llama-bench -t (default 2, the cores of the machine the targets were set on)")
    p.add_argument("--skip-startup", action="store_true", help="no cold/warm compilation-cache runs")
    p.add_argument("--dense-int4-only", action="store_true",
                   help="only the dense-int4 conversion's runs (each of --tiers' int4, int3, int2 experts beside "
                        "dense int4), the equal-bits comparison with llama.cpp's quantized types: no bf16-dense "
                        "conversion, runs or start-up")
    p.add_argument("--reuse", action="store_true",
                   help="keep conversions already under --data (their times are then not measured)")
    p.add_argument("--data", type=Path, default=Path(os.environ.get("JMOE_BENCH_DATA", "~/.cache/jmoe-bench")),
                   help="where checkpoints and conversions are written")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default bench/results/real_shapes/real_shapes_cpu.json)")
    args = p.parse_args(argv)
    q = args.quick
    args.layers = args.layers or (1 if q else 8)
    args.rounds = args.rounds or (1 if q else 3)
    args.prompt = args.prompt or (64 if q else 512)
    args.new_tokens = args.new_tokens or (16 if q else 128)
    args.data = args.data.expanduser()
    args.tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    args.placements = [x.strip() for x in args.placements.split(",") if x.strip()]
    args.cpu_dots = [x.strip() for x in args.cpu_dots.split(",") if x.strip()]
    args.llama_types = [x.strip() for x in args.llama_types.split(",") if x.strip()]
    bad = ([f"tier {t!r}" for t in args.tiers if t not in TIER_ORDER]
           + [f"placement {x!r}" for x in args.placements if x not in PLACEMENTS]
           + [f"llama type {x!r}" for x in args.llama_types if x not in llama_cpp.JMOE_TIER_OF]
           + [f"cpu dot {x!r}" for x in args.cpu_dots if x not in ("float", "int8")])
    if bad:
        p.error("unknown " + ", ".join(bad))
    if args.dense_int4_only and "int4" not in args.tiers:
        p.error("--dense-int4-only needs int4 among --tiers")
    if (not args.tiers or not args.cpu_dots or args.rounds < 1 or args.prompt < 1 or args.new_tokens < 2
            or args.llama_threads < 1):
        p.error("need at least one tier, one round, a prompt and 2 new tokens")
    try:
        model_named(args.model).config_for(args.layers)
    except ValueError as e:
        p.error(str(e))
    return args


def jmoe_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jmoe.cli", *args]


def dense_tier_supported() -> bool:
    """Whether this jmoe's converter can store dense weights at a tier (`--dense-tier`)."""
    proc = subprocess.run(jmoe_cli("convert", "--help"), capture_output=True, text=True, cwd=ROOT)
    return "--dense-tier" in proc.stdout


def checkpoint(args) -> Path:
    """The random checkpoint, reused when one with the same model, layers and seed is there."""
    path = args.data / f"hf-{args.model}-{args.layers}L"
    meta = path / "random_checkpoint.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        if m.get("layers") == args.layers and m.get("model") == model_named(args.model).name:
            return path
    print(f"writing {path} ...", flush=True)
    return write_checkpoint(args.model, path, layers=args.layers)


def convert_jmoe(src: Path, out: Path, tiers: list[str], extra: list[str], reuse: bool, log: Path) -> dict:
    """`jmoe convert` in its own process: seconds and peak RSS (None when an earlier output holding
    every tier asked for, with the dense formats this converter writes, is reused), and the dense and
    head tiers and formats it holds."""
    manifest = out / "manifest.json"
    if reuse and manifest.is_file() and set(tiers) <= set(json.loads(manifest.read_text())["tiers"]):
        stale = stale_dense_formats(out, extra)
        if not stale:
            return {"path": str(out), "seconds": None, "peak_rss_bytes": None, "bytes": tree_bytes(out),
                    **dense_tiers(out)}
        print(f"not reusing {out}: {stale}", flush=True)
    print(f"jmoe convert -> {out} ...", flush=True)
    cmd = jmoe_cli("convert", str(src), "-o", str(out), "--tiers", ",".join(tiers), "--method", "rtn",
                   "--force", "--no-progress", *extra)
    _, seconds, rss = llama_cpp.run_measured(cmd, cwd=ROOT, log=log)
    return {"path": str(out), "seconds": seconds, "peak_rss_bytes": rss, "bytes": tree_bytes(out), **dense_tiers(out)}


def dense_tiers(path: Path) -> dict:
    """The conversion's dense tier and its LM head's (a manifest without a head tier: the dense tier),
    with their formats (None: bf16)."""
    dense = json.loads((path / "manifest.json").read_text())["dense"]
    tier = dense.get("tier", "bf16")
    return {"dense_tier": tier, "head_tier": dense.get("head_tier", tier), "dense_format": dense.get("format"),
            "head_format": dense.get("head_format", dense.get("format")), "head_rows": dense.get("head_rows")}


def stale_dense_formats(path: Path, extra: list[str]) -> str | None:
    """Why a conversion made with the `extra` convert options is not what this converter writes for
    them (a dense or head format from an earlier default, say another group size), or None."""
    from convert.dense import default_head_tier, dense_format

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dense-tier", default="bf16")
    parser.add_argument("--head-tier", default=None)
    parser.add_argument("--head-group-size", type=int, default=None)
    parser.add_argument("--refine-head", type=int, default=None)
    known, _ = parser.parse_known_args(extra)
    head_tier = known.head_tier or default_head_tier(known.dense_tier)
    held = dense_tiers(path)
    top = (held["head_rows"] or {}).get("top")
    if top != known.refine_head:
        return f"its head refines {top or 'no'} logits a token, not {known.refine_head or 'none'}"
    strip = lambda fmt: None if fmt is None else {k: v for k, v in fmt.items() if k != "tiled"}  # noqa: E731
    for what, tier, fmt, group in (("dense", known.dense_tier, held["dense_format"], None),
                                   ("head", head_tier, held["head_format"], known.head_group_size)):
        want = dense_format(tier, group_size=group)
        if strip(fmt) != strip(None if want is None else want.to_json()):
            return f"its {what} format is {fmt}, this converter writes {tier} as {want}"
    return None


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def budget_for(path: Path, tier: str, fraction: float | None, max_seq_len: int) -> int | None:
    """A device budget whose pools hold `fraction` of the experts at `tier`: everything load()
    reserves before experts (from jmoe.memory_plan, plus transfer staging where the plan leaves it
    out), and that fraction of all the expert bytes."""
    if fraction is None:
        return None
    import jmoe
    from bench.lib.common import staging_bytes

    plan = jmoe.memory_plan(path, tier=tier, max_seq_len=max_seq_len, policy=OFFLOAD_POLICY)
    fixed = sum(v for k, v in plan.items() if k not in ("all_experts", "draft"))
    if "staging" not in plan:
        fixed += staging_bytes(path)
    return int(fixed + fraction * plan["all_experts"])


def loaded_bytes(path: Path, tier: str | tuple[str, ...], max_seq_len: int) -> int:
    """What a loaded model holds by design: dense weights, every expert at `tier` (at each of several
    tiers: the mixed mode holds them all), KV cache and workspace; peak RSS is judged against this."""
    import jmoe

    tiers = (tier,) if isinstance(tier, str) else tier
    plan = jmoe.memory_plan(path, tier=tiers[0], max_seq_len=max_seq_len)
    experts = sum(jmoe.memory_plan(path, tier=t, max_seq_len=max_seq_len)["all_experts"] for t in tiers[1:])
    return int(sum(v for k, v in plan.items() if k in ("dense", "kv_cache", "workspace", "all_experts")) + experts)


def run_jmoe_child(spec: dict, env: dict | None, log: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.lib.real_shapes_child", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    log.write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["peak_rss_bytes"] = max(out.get("load_peak_rss_bytes") or 0, out.get("decode_peak_rss_bytes") or 0) or None
    return out


def plan_configs(args, conversions: dict, llama_ggufs: dict) -> tuple[list[dict], list[dict], list[tuple]]:
    """(measured configurations, start-up configurations, jmoe/llama.cpp pairs for ratios)."""
    max_seq_len = args.prompt + args.new_tokens + 8
    base = {"prompt": args.prompt, "new_tokens": args.new_tokens, "max_seq_len": max_seq_len, "mode": "speed"}
    main = Path(conversions["jmoe"]["path"]) if "jmoe" in conversions else None  # none with --dense-int4-only
    jmoe_runs = []
    for tier in args.tiers if main else []:
        for placement in args.placements:
            fraction = PLACEMENTS[placement]
            policy = "resident" if fraction is None else OFFLOAD_POLICY
            where = "resident" if fraction is None else f"pools {placement}"
            for dot in args.cpu_dots:
                spec = dict(base, path=str(main), tier=tier, policy=policy, cpu_dot=dot,
                            budget=budget_for(main, tier, fraction, max_seq_len))
                jmoe_runs.append({"kind": "jmoe", "label": f"jmoe {tier} {where}{dot_suffix(tier, dot)}", "spec": spec,
                                  "loaded_bytes": loaded_bytes(main, tier, max_seq_len)})
    if "jmoe dense int4" in conversions:
        dense = Path(conversions["jmoe dense int4"]["path"])
        for tier in dense_int4_tiers(args.tiers):
            for dot in args.cpu_dots:
                spec = dict(base, path=str(dense), tier=tier, policy="resident", budget=None, cpu_dot=dot)
                jmoe_runs.append({"kind": "jmoe", "label": f"jmoe {tier} + dense int4 resident{DOT_SUFFIX[dot]}",
                                  "spec": spec, "loaded_bytes": loaded_bytes(dense, tier, max_seq_len)})
    if MIXED in conversions:  # DyMoE without a budget: int4 and int2 whole, each token's experts split between them
        mixed = Path(conversions[MIXED]["path"])
        for r in args.mixed_r:
            for dot in args.cpu_dots:
                spec = dict(base, path=str(mixed), tier="int4", policy="dymoe", policy_options={"r": r}, budget=None,
                            cpu_dot=dot)
                jmoe_runs.append({"kind": "jmoe", "label": f"{mixed_label(r)}{DOT_SUFFIX[dot]}", "spec": spec,
                                  "loaded_bytes": loaded_bytes(mixed, ("int4", "int2"), max_seq_len)})
    llama_runs = [{"kind": "llama.cpp", "label": f"llama.cpp {q}", "gguf": llama_ggufs[q]["path"],
                   "loaded_bytes": llama_ggufs[q]["bytes"]} for q in args.llama_types if q in llama_ggufs]
    # alternate: each jmoe configuration followed by a llama.cpp one while both last
    measured = []
    for i in range(max(len(jmoe_runs), len(llama_runs))):
        measured += jmoe_runs[i:i + 1] + llama_runs[i:i + 1]
    startup = []
    if not args.skip_startup and main:
        tier = max(args.tiers, key=TIER_ORDER.index)  # the fewest bits
        spec = dict(base, path=str(main), tier=tier, policy="resident", budget=None, mode="startup")
        startup = [{"kind": "startup", "label": f"jmoe {tier} resident, {c} compilation cache", "spec": spec,
                    "cache": c} for c in ("cold", "warm")]
    labels = {r["label"] for r in jmoe_runs}
    pairs = []
    for suffix in (*DOT_SUFFIX.values(), BF16_DOT_SUFFIX):
        pairs += [(f"jmoe {llama_cpp.JMOE_TIER_OF[q]} resident{suffix}", f"llama.cpp {q}") for q in args.llama_types
                  if q in llama_ggufs and f"jmoe {llama_cpp.JMOE_TIER_OF[q]} resident{suffix}" in labels]
        mixed = [f"{mixed_label(r)}{suffix}" for r in args.mixed_r]
        dense = [f"jmoe {t} + dense int4 resident{suffix}" for t in dense_int4_tiers(args.tiers)]
        for ours in (*dense, *mixed):  # int4 dense too
            if ours in labels:
                pairs += [(ours, f"llama.cpp {q}") for q in ("Q4_0", "Q4_K_M", "Q3_K_M") if q in llama_ggufs]
    return measured, startup, pairs


def dense_int4_tiers(tiers: list[str]) -> list[str]:
    """The expert tiers of the dense-int4 conversion: int4, and int3 and int2 where asked."""
    return [t for t in DENSE_INT4_TIERS if t in tiers] if "int4" in tiers else []


def cpus_busy(seconds: float = 1.0) -> float | None:
    """How many CPUs' worth of time the machine spent busy over the next `seconds` (/proc/stat; None
    without it), while this process only waits: other work, right before a timed run. (The 1-minute
    load average it replaces counted the bench's own runs of the last minute, so it read "busy" before
    every round on a 2-core machine.)"""
    def busy_and_total():
        # user nice system idle iowait irq softirq steal (guest time follows, already counted in user)
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)
    try:
        b0, t0 = busy_and_total()
        time.sleep(seconds)
        b1, t1 = busy_and_total()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def run_one(cfg: dict, round_no: int, args, llama, logs: Path, cache_dir: Path | None) -> dict:
    tag = cfg["label"].replace(" ", "_").replace("%", "pct").replace(",", "").replace("+", "plus").replace("/", "-")
    log = logs / f"r{round_no}-{tag}.log"
    record = {"kind": cfg["kind"], "label": cfg["label"], "round": round_no, "loaded_bytes": cfg.get("loaded_bytes"),
              "cpus_busy_before": cpus_busy()}  # other work on the machine skews timings
    t = time.perf_counter()
    try:
        if cfg["kind"] == "llama.cpp":
            record.update(llama_cpp.bench(llama, Path(cfg["gguf"]), threads=args.llama_threads, prompt=args.prompt,
                                          gen=args.new_tokens, depths=(0, args.prompt), log=log))
        else:
            env = dict(os.environ, JMOE_COMPILATION_CACHE=str(cache_dir)) if cache_dir else None
            record.update(run_jmoe_child(cfg["spec"], env, log))
    except Exception as e:  # one failing configuration (out of memory, say) does not end the run
        record["error"] = str(e)[:500]
    record["wall_s"] = time.perf_counter() - t
    if record.get("peak_rss_bytes") and record.get("loaded_bytes"):
        record["rss_over_loaded"] = record["peak_rss_bytes"] / record["loaded_bytes"]
    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()
             if k not in ("stats", "memory", "kind")}
    print(json.dumps(shown), flush=True)
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = model_named(args.model)
    args.data.mkdir(parents=True, exist_ok=True)
    logs = args.data / "logs"
    logs.mkdir(exist_ok=True)
    t_start = time.perf_counter()
    llama = None
    if not args.skip_llama:
        try:
            llama = llama_cpp.find_llama_cpp()
        except llama_cpp.LlamaCppMissing as e:
            print(f"llama.cpp skipped: {e}", flush=True)

    src = checkpoint(args)
    name = f"{args.model}-{args.layers}L"
    layout, suffix = (["--cpu-layout"], "-cpu") if args.cpu_layout else ([], "")
    head, head_suffix = (["--head-tier", args.head_tier], f"-head-{args.head_tier}") if args.head_tier else ([], "")
    if args.head_group_size:
        head, head_suffix = [*head, "--head-group-size", str(args.head_group_size)], f"{head_suffix}-g{args.head_group_size}"
    if args.refine_head:
        head, head_suffix = [*head, "--refine-head", str(args.refine_head)], f"{head_suffix}-refined{args.refine_head}"
    conversions = {}
    if not args.dense_int4_only:
        conversions["jmoe"] = convert_jmoe(src, args.data / f"jmoe-{name}{suffix}", args.tiers, layout, args.reuse,
                                           logs / "convert-jmoe.log")
    dense = dense_int4_tiers(args.tiers)
    if dense and dense_tier_supported():
        # named by its expert tiers beyond int4, as the mixed mode's int4 + int2 conversion is
        experts = "".join(f"-{t}" for t in dense[1:])
        conversions["jmoe dense int4"] = convert_jmoe(
            src, args.data / f"jmoe-{name}-dense-int4{experts}{head_suffix}{suffix}", dense,
            ["--dense-tier", "int4", *head, *layout], args.reuse, logs / "convert-jmoe-dense-int4.log")
    if args.mixed and dense_tier_supported():
        path = args.data / f"jmoe-{name}-dense-int4-int2{head_suffix}{suffix}"
        same = conversions.get("jmoe dense int4", {}).get("path") == str(path)  # --tiers int4,int2: one conversion
        conversions[MIXED] = conversions["jmoe dense int4"] if same else convert_jmoe(
            src, path, ["int4", "int2"], ["--dense-tier", "int4", *head, *layout], args.reuse,
            logs / "convert-jmoe-mixed.log")
    ggufs = {}
    if llama is not None:
        work = args.data / f"gguf-{name}"
        if not args.reuse:
            for f in work.glob("model-*.gguf"):
                f.unlink()
        try:
            print(f"GGUF conversion -> {work} ...", flush=True)
            ggufs = llama_cpp.convert(llama, src, work, args.llama_types)
        except (llama_cpp.LlamaCppMissing, RuntimeError) as e:
            print(f"llama.cpp skipped: {e}", flush=True)
            llama = None
        for q, entry in ggufs.items():
            conversions[f"llama.cpp {q}"] = entry

    measured, startup, pairs = plan_configs(args, conversions, ggufs)
    runs = []
    for r in range(args.rounds):
        shift = r % len(measured) if measured else 0
        for cfg in measured[shift:] + measured[:shift]:
            runs.append(run_one(cfg, r, args, llama, logs, None))
        if startup:
            with tempfile.TemporaryDirectory(prefix="jmoe-xla-cache-") as cache_dir:
                for cfg in startup:  # cold (empty directory), then warm (the same directory)
                    runs.append(run_one(cfg, r, args, llama, logs, Path(cache_dir)))

    ok = [r for r in runs if "error" not in r]
    result = {
        "machine": machine(),
        "model": {"name": spec.name, "hub_id": spec.hub_id, "layers": args.layers, "notes": spec.notes,
                  "checkpoint_bytes": checkpoint_bytes(src), "config": spec.config_for(args.layers)},
        "settings": {"tiers": args.tiers, "placements": args.placements, "offload_policy": OFFLOAD_POLICY,
                     "rounds": args.rounds, "prompt": args.prompt, "new_tokens": args.new_tokens,
                     "llama_threads": args.llama_threads,
                     "quick": args.quick, "method": "rtn", "cpu_layout": args.cpu_layout, "head_tier": args.head_tier,
                     "head_group_size": args.head_group_size, "refine_head": args.refine_head,
                     "mixed_r": args.mixed_r if args.mixed else None,
                     "llama_cpp": llama.version() if llama else None},
        "conversions": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in conversions.items()},
        "summary": summarize(ok),
        "ratios": ratios(ok, pairs, ("prefill_tok_s", "decode_tok_s@0", f"decode_tok_s@{args.prompt}")),
        "failures": [{k: r[k] for k in ("label", "round", "error")} for r in runs if "error" in r],
        "runs": runs,
        "total_s": time.perf_counter() - t_start,
    }
    out = args.out or RESULTS / "real_shapes" / "real_shapes_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {png} ({result['total_s'] / 60:.1f} min)\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
