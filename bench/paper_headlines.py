"""Each paper's headline comparison at one budget on one machine, with the paper's own figure beside ours.

Model: the bundled tiny Qwen3-MoE (8 layers, 32 experts, top-4; trained, so its routing is skewed
and domain-dependent), converted with the bf16, int4 and int2 tiers (RTN), computed in float32.
Budget: every fixed term of jmoe.memory_plan for the policy (dense weights, KV cache, workspace,
staging, fetch slots, draft) plus --share of the bf16 expert bytes (bench.lib.common.planned_budget).

Comparisons, baseline -> method, both at that budget:
- DyMoE: lru at bf16 (exact: every routed expert at bf16, misses fetched) -> DyMoE bf16/int4 (its
  default degrade mode and look-ahead prefetch): TTFT, TPOT, perplexity.
- MoE-SpeQ: lru+prefetch at bf16 -> speculative decoding with the model's own int4 draft on
  lru+prefetch: TPOT, acceptance, perplexity unchanged (verification is exact).
- DynaExq: a static hi/lo split (int4 for the experts the calibration text routes to most, the rest
  int2, never changed) -> DynaExq int4/int2 (hotness tracked at run time): perplexity over a
  prose -> code -> math shift, beside the resident model at int4 and at int2, and TPOT. Both keep
  every expert's int2 copy resident; the budget holds those besides --share of the int4 bytes.
  (int4/int2, not bf16/int4: on this model int4 is within 2% of bf16, so only int2 shows a gap.)
- HAQ: lru at bf16 (a miss is copied to the device) -> lru+cpu (a miss's decode tokens run on the
  host CPU; critical token count forced to 1, since here the "device" is this CPU and the measured
  cost model never prefers it).
Every pair is also traced on the sampled workload and replayed as an H100 on PCIe Gen5
(bench/lib/gpu_model.py; labelled modelled, nothing ran on a GPU): the papers' claims are about a
device behind a slow link, and on this CPU a "transfer" is a memcpy.

Workload: three prompts (the first --prompt-tokens tokens of the prose, code and math dev texts),
--new-tokens new tokens each, greedy and sampled (temperature 1, --seed).
Protocol: baseline and method are loaded side by side, warmed up on the whole workload twice
(every shape compiled), then timed in --rounds rounds alternating their order. TTFT = mean over
the prompts of the time to the first streamed token; TPOT = decode ms per token after the first.
Medians over rounds with [min-max]; the speed-up (baseline / method) is taken within each round.
The run fails if anything compiles in a timed window. Perplexity: jmoe.perplexity(mode="decode")
on the first --ppl-tokens tokens of each dev split, in the order prose, code, math, one model per
policy (so a policy's state carries across the shift, as a server's would).

--qwen-layers N runs the same pairs at Qwen3-30B-A3B's exact shapes cut to N layers (random weights,
bench/offload_decode.py's conversion: int4 and int2 experts, int4 dense), hi/lo = int4/int2, with
random-id prompts and calibration; no perplexity (random weights). There the bytes an expert moves
are a real model's.

    python -m bench.paper_headlines [--rounds 3] [--new-tokens 48] [--share 0.25] [--qwen-layers 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

import jmoe
from bench.lib.common import (CALIB_FILES, DOMAINS, RESULTS, TINY_HF, dev_tokens, planned_budget, result_path,
                              spread, write_result)
from bench.decode_io import busy_seconds, other_cores, wait_for_quiet
from bench.lib.gpu_model import GpuParams, dense_bytes_of, modelled_tpot, replay
from bench.lib.paper_claims import PAPERS, markdown
from bench.offload_decode import host_counts, per_token, streamed
from jmoe import trace_routing
from jmoe.policies import DyMoE, DynaExq
from jmoe.policies.placement import routed_counts
from jmoe.serving.compiles import no_compiles

MAX_SEQ_LEN = 512


class StaticHiLo(DynaExq):
    """A fixed hi/lo split: each layer's experts that the calibration text routes to most are kept at
    hi, the rest at lo; the split never changes (DynaExq's sizing and tables, no run-time hotness)."""

    def __init__(self, calibration_counts: np.ndarray, **kw):
        super().__init__(name="static-hi/lo", **kw)
        self.calibration_counts = np.asarray(calibration_counts, np.float64)

    def _start(self, num_layers: int, num_experts: int, n_hi: int) -> None:
        super()._start(num_layers, num_experts, n_hi)
        counts = self.calibration_counts
        self.hot = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        self._update_members()

    def observe_experts(self, counts, gate, tokens: int) -> None:
        pass  # static: what run time routes changes nothing


# ---------------------------------------------------------------- model, policies, budgets

@dataclass
class Setup:
    """The model a run compares on, its hi/lo tiers, workload and calibration routing."""
    name: str
    path: Path
    hi: str
    lo: str
    prompts: list
    calibration: np.ndarray  # [L, E] routed counts of calibration text
    quality: bool  # perplexity is meaningful (trained weights)
    precision_tiers: tuple[str, str]  # the DynaExq pair's hi and lo: where their quality differs


def convert_tiny(root: Path) -> Path:
    from convert import convert_checkpoint

    out = root / "tiny-bf16-int4-int2"
    convert_checkpoint(TINY_HF, out, tiers="bf16,int4,int2", method="rtn")
    return out


def routed(path: Path, tier: str, ids: np.ndarray) -> np.ndarray:
    """[L, E] routed counts of `ids` through the resident model at `tier`."""
    model = jmoe.load(path, tier=tier, compute_dtype="float32", max_seq_len=MAX_SEQ_LEN)
    return routed_counts(trace_routing(model, ids), model.config.num_experts)


def tiny_setup(root: Path, args) -> Setup:
    """The bundled trained model at bf16/int4: dev-text prompts, calibration on the train splits."""
    path = convert_tiny(root)
    tokenizer = jmoe.load(path, tier="int4", compute_dtype="float32").tokenizer
    calib = np.concatenate([np.asarray(tokenizer.encode(f.read_text()[:40000]), np.int32)[:args.calib_tokens // 3]
                            for f in CALIB_FILES])
    prompts = [dev_tokens(tokenizer, d, args.prompt_tokens).tolist() for d in DOMAINS]
    return Setup("tiny-qwen3-moe (bf16, int4, int2; RTN)", path, "bf16", "int4", prompts, routed(path, "bf16", calib),
                 quality=True, precision_tiers=("int4", "int2"))


def qwen_setup(args) -> Setup:
    """Qwen3-30B-A3B's shapes cut to --qwen-layers layers (random weights) at int4/int2: random-id prompts."""
    from bench.offload_decode import converted

    path = converted(argparse.Namespace(model=None, data=args.data, layers=args.qwen_layers))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, 4000, args.prompt_tokens).tolist() for _ in range(3)]
    calib = rng.integers(10, 4000, args.calib_tokens).astype(np.int32)
    return Setup(f"{path.name} (random weights)", path, "int4", "int2", prompts, routed(path, "int4", calib),
                 quality=False, precision_tiers=("int4", "int2"))


@dataclass(frozen=True)
class Variant:
    """One side of a comparison: its policy (a factory: each load gets a fresh one), the tier it
    loads at, extra load and generate keywords, and whether every lo copy is resident (then the
    budget holds all of them besides the hi share)."""
    make_policy: object
    tier: str
    load_kw: dict = field(default_factory=dict)
    gen_kw: dict = field(default_factory=dict)
    all_lo: str | None = None


def variants(setup: Setup) -> dict:
    hi, lo = setup.hi, setup.lo
    p_hi, p_lo = setup.precision_tiers
    return {
        "lru": Variant(lambda: "lru", hi),
        "dymoe": Variant(lambda: DyMoE(hi=hi, lo=lo), hi),
        "lru+prefetch": Variant(lambda: "lru+prefetch", hi),
        "speculative": Variant(lambda: "lru+prefetch", hi, {"draft": lo}, {"speculative": lo}),
        "static-hi/lo": Variant(lambda: StaticHiLo(setup.calibration, hi=p_hi, lo=p_lo), p_hi, all_lo=p_lo),
        "dynaexq": Variant(lambda: DynaExq(hi=p_hi, lo=p_lo), p_hi, all_lo=p_lo),
        "lru+cpu": Variant(lambda: "lru+cpu", hi, {"cpu_critical_tokens": 1}),
    }


COMPARISONS = {  # paper: (baseline, method)
    "dymoe": ("lru", "dymoe"),
    "moe_speq": ("lru+prefetch", "speculative"),
    "dynaexq": ("static-hi/lo", "dynaexq"),
    "haq": ("lru", "lru+cpu"),
}


def load(setup: Setup, variant: Variant, share: float, **extra):
    """(model, budget): pools holding `share` of the variant's tier's expert bytes (and every lo copy
    where the variant keeps them all) beside every fixed reservation."""
    plan_kw = dict(compute_dtype="float32", max_seq_len=MAX_SEQ_LEN, draft=variant.load_kw.get("draft"))
    budget = planned_budget(setup.path, share, tier=variant.tier, policy=variant.make_policy(), **plan_kw)
    if variant.all_lo:
        budget += jmoe.memory_plan(setup.path, tier=variant.all_lo, **plan_kw)["all_experts"]
    return jmoe.load(setup.path, tier=variant.tier, compute_dtype="float32", max_seq_len=MAX_SEQ_LEN,
                     policy=variant.make_policy(), device_budget=budget, **variant.load_kw, **extra), budget


# ---------------------------------------------------------------- timing

def timed_workload(model, prompts, kw) -> tuple[float, float]:
    """(mean TTFT ms over the prompts, decode ms per token after each prompt's first)."""
    runs = [streamed(model, ids, kw) for ids in prompts]
    return 1e3 * sum(r[0] for r in runs) / len(runs), 1e3 * sum(r[1] for r in runs) / max(sum(r[2] for r in runs), 1)


def time_pair(name: str, models: dict, gen: dict, prompts, args, temperature: float) -> dict:
    """Baseline and method warmed up, then timed in alternating rounds."""
    kw = {side: {"max_new_tokens": args.new_tokens, "temperature": temperature, "seed": args.seed, **gen[side]}
          for side in models}
    for _ in range(2):
        for side, model in models.items():
            timed_workload(model, prompts, kw[side])
    before = {side: host_counts(model) for side, model in models.items()}
    spec_before = {side: jmoe.stats(model).get("speculative") for side, model in models.items()}
    times = {side: {"ttft_ms": [], "tpot_ms": []} for side in models}
    rounds = []
    sides = list(models)
    for r in range(args.rounds):
        waited = wait_for_quiet(args.max_wait)
        busy, start = busy_seconds(), time.perf_counter()
        with no_compiles(name):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                ttft, tpot = timed_workload(models[side], prompts, kw[side])
                times[side]["ttft_ms"].append(ttft)
                times[side]["tpot_ms"].append(tpot)
        rounds.append({side: {k: v[-1] for k, v in times[side].items()} for side in sides}
                      | {"waited_for_quiet_s": waited,
                         "other_processes_cores": other_cores(busy, busy_seconds(), time.perf_counter() - start)})
    base, method = sides
    out = {side: {"ttft_ms": spread(times[side]["ttft_ms"]), "tpot_ms": spread(times[side]["tpot_ms"]),
                  **per_token(before[side], host_counts(models[side]))} for side in sides}
    for side in sides:
        spec = jmoe.stats(models[side]).get("speculative")
        if spec:
            drafted = spec["drafted_tokens"] - ((spec_before[side] or {}).get("drafted_tokens", 0))
            accepted = spec["accepted_tokens"] - ((spec_before[side] or {}).get("accepted_tokens", 0))
            out[side]["acceptance_rate"] = accepted / drafted if drafted else None
    out["tpot_speedup"] = spread([b / m for b, m in zip(times[base]["tpot_ms"], times[method]["tpot_ms"])])
    out["ttft_speedup"] = spread([b / m for b, m in zip(times[base]["ttft_ms"], times[method]["ttft_ms"])])
    out["rounds"] = rounds
    s, t = out["tpot_speedup"], out["ttft_speedup"]
    print(f"  T={temperature:g} {name:9s} {base} -> {method}: TPOT {out[base]['tpot_ms']['median']:.2f} -> "
          f"{out[method]['tpot_ms']['median']:.2f} ms (x{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]), "
          f"TTFT {out[base]['ttft_ms']['median']:.1f} -> {out[method]['ttft_ms']['median']:.1f} ms "
          f"(x{t['median']:.2f}), hit {out[base]['hit_rate']:.3f} -> {out[method]['hit_rate']:.3f}", flush=True)
    return out


def perplexities(model, args) -> dict:
    """Per domain, in the order of the shift (the policy's state carries from one to the next)."""
    return {d: jmoe.perplexity(model, dev_tokens(model.tokenizer, d, args.ppl_tokens), window=args.ppl_tokens,
                               mode="decode") for d in DOMAINS}


def modelled_h100(setup: Setup, variant: Variant, share: float, args) -> dict:
    """The sampled workload traced once more and replayed as an H100 on PCIe (modelled, not measured)."""
    model, _ = load(setup, variant, share, trace=True)
    kw = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "seed": args.seed, **variant.gen_kw}
    timed_workload(model, setup.prompts[:1], kw)
    model.trace.steps.clear()
    before = host_counts(model)["decode_tokens"]
    timed_workload(model, setup.prompts, kw)
    tokens = max(host_counts(model)["decode_tokens"] - before, 1)
    steps = replay(model.trace.records(), dense_bytes=dense_bytes_of(model), num_layers=model.config.num_layers)
    return {"modelled_tpot_ms": 1e3 * modelled_tpot(steps, tokens),
            "modelled_ttft_ms": 1e3 * steps["modelled_prefill_s"] / len(setup.prompts)}


# ---------------------------------------------------------------- the run

def resident_perplexity(setup: Setup, tier: str, args, known: dict) -> dict:
    """The resident model's perplexities at `tier` (computed once per run)."""
    if tier not in known:
        model = jmoe.load(setup.path, tier=tier, compute_dtype="float32", max_seq_len=MAX_SEQ_LEN)
        known[tier] = perplexities(model, args)
        del model
        gc.collect()
    return known[tier]


def run_comparison(paper: str, setup: Setup, args, references: dict | None) -> dict:
    """Both sides timed, then (references: a dict to keep resident perplexities in, None: no quality)
    their perplexities beside the resident model's at each tier they use, then modelled."""
    base, method = COMPARISONS[paper]
    specs = variants(setup)
    share = args.share
    models, budgets = {}, {}
    for side in (base, method):
        models[side], budgets[side] = load(setup, specs[side], share)
    gen = {side: specs[side].gen_kw for side in models}
    tiers = {side: specs[side].tier for side in (base, method)}
    out = {"baseline": base, "method": method, "tiers": tiers, "every_lo_copy_resident": specs[method].all_lo,
           "share_of_the_tiers_expert_bytes": share, "budget_bytes": budgets,
           "paper": PAPERS[paper]}
    for t in (0.0, 1.0):
        out[f"temperature_{t:g}"] = time_pair(paper, models, gen, setup.prompts, args, t)
    del models
    gc.collect()
    if references is not None:
        used = [setup.hi, *tiers.values(), specs[method].all_lo]
        out["perplexity"] = {f"resident {t}": resident_perplexity(setup, t, args, references)
                             for t in dict.fromkeys(used) if t}
        top = resident_perplexity(setup, setup.hi, args, references)
        for side in (base, method):
            model, _ = load(setup, specs[side], share)
            out["perplexity"][side] = {d: {"ppl": v, f"vs_resident_{setup.hi}": v / top[d] - 1}
                                       for d, v in perplexities(model, args).items()}
            del model
            gc.collect()
        print(f"  {paper}: perplexity vs resident {setup.hi} " + ", ".join(
            f"{side} " + "/".join(f"{e[f'vs_resident_{setup.hi}']:+.2%}" for e in out["perplexity"][side].values())
            for side in (base, method)), flush=True)
    if not args.no_model:
        m = {side: modelled_h100(setup, specs[side], share, args) for side in (base, method)}
        m.update(label="modelled, not measured", params=GpuParams().__dict__,
                 tpot_speedup=m[base]["modelled_tpot_ms"] / m[method]["modelled_tpot_ms"],
                 ttft_speedup=m[base]["modelled_ttft_ms"] / m[method]["modelled_ttft_ms"])
        out["modelled_h100"] = m
        print(f"  {paper}: modelled H100 TPOT {base} {m[base]['modelled_tpot_ms']:.3f} ms -> "
              f"{method} {m[method]['modelled_tpot_ms']:.3f} ms (x{m['tpot_speedup']:.2f}), TTFT "
              f"x{m['ttft_speedup']:.2f}", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["comparisons"])
    bars = {f"measured here, T={t}": [result["comparisons"][n][f"temperature_{t}"]["tpot_speedup"]["median"]
                                      for n in names] for t in ("0", "1")}
    if all("modelled_h100" in result["comparisons"][n] for n in names):
        bars["modelled H100, T=1"] = [result["comparisons"][n]["modelled_h100"]["tpot_speedup"] for n in names]
    bars["the paper's headline"] = [PAPERS[n]["paper_tpot_speedup"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        ax.bar(np.arange(len(names)) + (i - (len(bars) - 1) / 2) * width, values, width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(names)), [f"{n}\n{' vs '.join(COMPARISONS[n][::-1])}" for n in names], fontsize=8)
    ax.set_ylabel("TPOT speed-up over the baseline")
    ax.set_title(f"{result['model']}: each paper's comparison at one budget", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--papers", default=",".join(COMPARISONS))
    parser.add_argument("--qwen-layers", type=int, help="Qwen3-30B-A3B's shapes at this many layers instead of "
                                                          "the tiny model (random weights, int4/int2, no perplexity)")
    parser.add_argument("--data", help="where the Qwen3 checkpoint and its conversion go (bench/offload_decode.py)")
    parser.add_argument("--share", type=float, default=0.25, help="share of the hi tier's expert bytes in pools")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--ppl-tokens", type=int, default=384)
    parser.add_argument("--calib-tokens", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait", type=float, default=30.0)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--no-model", action="store_true", help="skip the modelled H100 replay")
    parser.add_argument("--out", help="result name under bench/results/paper_headlines "
                                      "(default paper_headlines_tiny or _qwen3)")
    parser.add_argument("--report", action="store_true", help="print the README's tables from the result files")
    args = parser.parse_args()
    if args.report:
        for name in ("paper_headlines_tiny", "paper_headlines_qwen3"):
            if (RESULTS / "paper_headlines" / f"{name}_cpu.json").exists():
                result = json.loads((RESULTS / "paper_headlines" / f"{name}_cpu.json").read_text())
                print(f"{result['model']}, pools {result['share']:.0%}:\n\n{markdown(result)}\n")
        return
    papers = args.papers.split(",")
    if unknown := [p for p in papers if p not in COMPARISONS]:
        parser.error(f"unknown papers {unknown}; choose from {list(COMPARISONS)}")
    out_name = args.out or ("paper_headlines_qwen3" if args.qwen_layers else "paper_headlines_tiny")
    with tempfile.TemporaryDirectory() as tmp:
        setup = qwen_setup(args) if args.qwen_layers else tiny_setup(Path(tmp), args)
        references = {} if setup.quality and not args.skip_quality else None
        result = {"model": setup.name, "hi": setup.hi, "lo": setup.lo, "share": args.share,
                  "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
                  "ppl_tokens": args.ppl_tokens, "device": str(jax.devices()[0].device_kind), "comparisons": {}}
        earlier = result_path("paper_headlines", out_name)
        if set(papers) != set(COMPARISONS) and earlier.exists():  # a run of some pairs updates those
            result["comparisons"] = json.loads(earlier.read_text()).get("comparisons", {})
        for paper in papers:
            result["comparisons"][paper] = run_comparison(paper, setup, args, references)
            path = write_result("paper_headlines", out_name, result)
    if set(result["comparisons"]) == set(COMPARISONS):
        plot(result, path.with_suffix(".png"))
    print(json.dumps({p: c["temperature_1"]["tpot_speedup"] for p, c in result["comparisons"].items()}))


if __name__ == "__main__":
    main()
