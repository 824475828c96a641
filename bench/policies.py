"""Dynamic expert precision judged by quality, bytes and time: DyMoE, DynaExq, static placement.

1. Quality table, bundled model (GPTQ tiers int4 + int2 calibrated on the train splits): perplexity
   in decode mode (teacher-forced, token by token, so decode-phase policies decide per token) on
   the first `--tokens` tokens of each dev split, bytes moved per token, peak resident expert
   bytes, share of uses at int2, measured CPU time per token and modelled GPU time per token
   (bench/lib/gpu_model.py), for uniform int4, uniform int2, DyMoE 4/2 and 4/0 at several r, a
   random assignment of DyMoE 4/2's share of int2 uses (does importance beat chance?), DynaExq at
   several hi copies per layer, and static placement strategies (per-layer hit rates).
2. Workload shift: prose -> code -> math, `--shift-tokens` each, token by token; DynaExq (8 int4
   copies per layer on average), static placement and LRU at the same device budget, against uniform
   int4 and int2: perplexity and bytes over time (plot), and how much of the int2-to-int4 gap
   DynaExq closes.
3. DyMoE ablation (its Table 3) on a synthetic Qwen3-30B-A3B-shaped model at two budgets:
   on-demand, cache, +prefetch, +4/2, +4/2+prefetch, +4/0+prefetch.

4. With --streams N [N ...]: DynaExq on the three rotations of the domain order, each stream from
   its own place in the dev texts, N tokens per domain: the gap closed per stream and over all of
   them, at the default hotness horizon, two shorter ones, with router counts, with the shift
   detector (`shift`: a layer whose recent routing departs from its hotness takes it as its hotness)
   and with hi sets per layer (`allocation="layer"`) in place of the model-wide one.
   With --stream-offsets, the prose -> code -> math stream from each of several places in the dev
   texts instead: a stream of 250 tokens a domain is scored in three 256-token windows, so one
   stream's share moves by tens of points with the place it starts; the median over places says
   more. With --hindsight, also DynaExq told the routing of the next 64, 256 or 1,024 tokens at
   every interval: what no estimate from past routing can beat at this budget. With --int3-lo, the
   8/32 rows beside DynaExq in the same budget with every expert at int3 (the rest in int4 copies),
   uniform int3, and the same budget held as one version an expert (keep_lo=False, the policy's
   default) over int2 and over int3. The rows named "8/32" keep every int2 version under 8 int4
   copies a layer (keep_lo=True), as the policy did before one version an expert was its default.
5. With --one-version-cost ROUNDS: what one version an expert costs per decoded token beside the 8/32
   rows' two (decode time, bytes copied in, promotions and demotions) on the prose -> code -> math
   stream of --shift-tokens a domain, in alternating rounds.

    python -m bench.policies [--tokens 2048] [--shift-tokens 2048] [--skip-ablation]
    python -m bench.policies --streams 250 2048 [--streams-name dynaexq_streams]
    python -m bench.policies --streams 250 --stream-offsets 0 1500 3000 4500 6000 7500 \
        --streams-name dynaexq_stream_offsets
    python -m bench.policies --streams 250 2048 --int3-lo --streams-name dynaexq_int3_lo
    python -m bench.policies --one-version-cost 3 [--shift-tokens 2048] [--streams-name NAME]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import jmoe
from bench.lib.common import (CALIB_FILES, DOMAINS, RESULTS, TINY_HF, dev_prompts, dev_tokens, result_name,
                              staging_bytes, write_result)
from bench.lib.gpu_model import GpuParams, dense_bytes_of, replay
from convert import convert_checkpoint
from jmoe.decoding.evaluate import window_nll
from jmoe import trace_routing
from jmoe.policies import DyMoE, DynaExq, Plan, Policy, StaticPlacement
from jmoe.tiers import TIER_CODES

WINDOW = 256


class RandomLow(Policy):
    """Each step, every expert independently at int2 with probability `p`, else int4: the control
    for DyMoE's importance (the same share of uses at int2, chosen by chance)."""

    def __init__(self, p: float, seed: int = 0):
        super().__init__(name=f"random-int2-{p:.2f}", tier="int4", pool_shares=DyMoE().pools())
        self.p, self.rng = p, np.random.default_rng(seed)

    def plan(self, view):
        low = self.rng.random((view.num_layers, view.num_experts)) < self.p
        return Plan.wanting(np.where(low, TIER_CODES["int2"], TIER_CODES["int4"]))


def convert_tiny(root: Path, calib_sequences: int, tiers: str = "int4,int2") -> Path:
    return convert_checkpoint(TINY_HF, root / "tiny-gptq", tiers=tiers, method="gptq",
                              calib=[str(p) for p in CALIB_FILES], calib_sequences=calib_sequences, progress=False)


def fixed_bytes(path: Path) -> int:
    plan = jmoe.memory_plan(path, tier="int4", compute_dtype="float32")
    return plan["dense"] + plan["kv_cache"] + plan["workspace"]


def evaluate(path: Path, policy, ids: dict[str, np.ndarray], *, budget: int | None = None, tier: str | None = None,
             extra: dict | None = None) -> dict:
    """Decode-mode perplexity per domain and the run's books, for one policy."""
    model = jmoe.load(path, compute_dtype="float32", policy=policy, tier=tier, device_budget=budget, trace=True,
                      **(extra or {}))
    ppl, tokens = {}, 0
    t = time.perf_counter()
    for domain, toks in ids.items():
        ppl[domain] = jmoe.perplexity(model, toks, window=WINDOW, mode="decode")
        tokens += len(toks) - 1
    seconds = time.perf_counter() - t
    stats = jmoe.stats(model)
    uses = stats["uses_by_tier"]
    modelled = replay(model.trace.records(), dense_bytes=dense_bytes_of(model), num_layers=model.config.num_layers)
    return {
        "policy": repr(policy) if isinstance(policy, Policy) else policy,
        "perplexity": ppl,
        "geo_mean_perplexity": math.exp(np.mean([math.log(v) for v in ppl.values()])),
        "bytes_h2d_per_token": stats["bytes_h2d"] / tokens,
        "peak_resident_expert_bytes": stats["peak_resident_expert_bytes"],
        "int2_share_of_uses": uses.get("int2", 0) / max(1, sum(uses.values())),
        "skipped_uses": stats["skipped"],
        "uses_by_tier": uses,
        "hit_rate": stats["hit_rate"],
        "cpu_expert_runs": stats["cpu_expert_runs"],
        "cpu_s_per_token_measured": seconds / tokens,
        "gpu_s_per_token_modelled": modelled["modelled_tpot_s"],
        "promotions": stats["promotions"],
        "demotions": stats["demotions"],
    }


def placement_hit_rates(placed: np.ndarray, traces: np.ndarray) -> dict:
    """Per-layer share of expert uses (in `traces` [T, L, k]) that the placed set [L, E] serves."""
    T, L, k = traces.shape
    hits = placed[np.arange(L)[None, :, None], traces]  # [T, L, k]
    per_layer = hits.mean(axis=(0, 2))
    return {"per_layer": per_layer.round(4).tolist(), "mean": float(per_layer.mean()), "std": float(per_layer.std()),
            "max_min_gap": float(per_layer.max() - per_layer.min()), "overall": float(hits.mean())}


def quality_table(path: Path, tokens: int, calib_traces: np.ndarray, dev_traces: np.ndarray) -> dict:
    """Every policy but DynaExq runs under one budget: the fixed reservations plus half of all int4
    experts (uniform int2 does not fit whole either), so precision trades against transfers and a
    lower tier is not simply served by a resident higher one. DynaExq keeps every expert at int2
    and n per layer at int4, unbudgeted: its peak resident bytes say what it used."""
    ids = {d: dev_tokens(jmoe.load(path, tier="int2").tokenizer, d, tokens) for d in DOMAINS}
    budget = fixed_bytes(path) + staging_bytes(path) + 128 * model_slot_bytes(path, "int4")
    rows = {"uniform int4": evaluate(path, "lru", ids, tier="int4", budget=budget),
            "uniform int2": evaluate(path, "lru", ids, tier="int2", budget=budget)}
    for lo in ("int2", None):
        for r in (0.5, 0.75, 0.9, 1.0):
            label = f"DyMoE 4/{'2' if lo else '0'} r={r}"
            rows[label] = evaluate(path, DyMoE(lo=lo, r=r), ids, budget=budget)
            print(label, json.dumps(rows[label]["perplexity"]), flush=True)
    share = rows["DyMoE 4/2 r=0.75"]["int2_share_of_uses"]
    rows["random 4/2 (DyMoE r=0.75's int2 share)"] = evaluate(path, RandomLow(share), ids, budget=budget)
    rows.update(importance_vs_chance(path, ids))
    for n in (4, 8, 16):
        rows[f"DynaExq {n}/32 at int4 (unbudgeted)"] = evaluate(path, DynaExq(hi_per_layer=n, keep_lo=True), ids)
    placements = {}
    for strategy in ("frequency", "paths", "two-stage"):
        policy = StaticPlacement(calib_traces, strategy=strategy, tier="int4")
        rows[f"placement {strategy} (int4, rest on the CPU)"] = evaluate(path, policy, ids, budget=budget)
        placements[strategy] = placement_hit_rates(policy.placed, dev_traces)
    return {"rows": rows, "budget_bytes": budget, "tokens_per_domain": tokens, "placement_hit_rates_on_dev": placements}


def both_tiers_resident(policy: Policy) -> Policy:
    """Every expert preloaded at int4 and int2 and both kept: a wanted int2 then runs at int2 (the
    cheapest adequate version), so the policy's own choices run, without DyMoE's reuse of a resident
    int4 version (which, in decode, soon serves nearly every use at int4)."""
    policy.keep_lower = True
    policy.preload = lambda L, E: [((layer, e), tier) for tier in ("int2", "int4") for layer in range(L)
                                   for e in range(E)]
    return policy


def importance_vs_chance(path: Path, ids: dict) -> dict:
    """DyMoE 4/2 at r=0.75 against random int2 assignment of the same share of uses, both running
    exactly what they choose (both tiers resident, unbudgeted)."""
    rows = {"DyMoE 4/2 r=0.75, both tiers resident": evaluate(path, both_tiers_resident(DyMoE(r=0.75)), ids)}
    share = rows["DyMoE 4/2 r=0.75, both tiers resident"]["int2_share_of_uses"]
    rows["random 4/2, same int2 share, both tiers resident"] = evaluate(path, both_tiers_resident(RandomLow(share)),
                                                                        ids)
    return rows


def model_slot_bytes(path: Path, tier: str) -> int:
    from jmoe.manifest import read_manifest

    return read_manifest(path)["tiers"][tier]["record_nbytes"]


DYNAEXQ_HI = 8  # int4 copies per layer of "DynaExq 8/32"
# "DynaExq 8/32": every expert at int2 and 8 int4 copies a layer beside them (keep_lo, the policy's
# only mode before one version an expert became its default; the rows so named keep that meaning)
EIGHT_COPIES = {"hi_per_layer": DYNAEXQ_HI, "keep_lo": True}
# The same budget held as one version an expert (the policy's default), as many int4 experts as it buys
ONE_VERSION_OPTIONS = {"hi_per_layer": None, "keep_lo": False}


def dynaexq_budget(path: Path) -> int:
    """The device budget of DynaExq 8/32 on the tiny model: every reservation load makes for it
    (jmoe.memory_plan: dense, KV cache, workspace, staging, fetch slots), every expert at int2 and
    8 int4 copies per layer; checked by loading it (the pools it gets must be those)."""
    policy = DynaExq(hi_per_layer=DYNAEXQ_HI, keep_lo=True)
    plan = jmoe.memory_plan(path, compute_dtype="float32", policy=policy)
    layers, experts = plan_shape(path)
    budget = (sum(v for k, v in plan.items() if k != "all_experts") + layers * experts * model_slot_bytes(path, "int2")
              + layers * DYNAEXQ_HI * model_slot_bytes(path, "int4"))
    pools = jmoe.load(path, compute_dtype="float32", policy=policy, device_budget=budget).residency.pools
    got = {tier: pool.slots for tier, pool in pools.items()}
    if got != {"int2": layers * experts, "int4": layers * DYNAEXQ_HI}:
        raise SystemExit(f"DynaExq's budget {budget} gave pools of {got} slots, not every int2 expert and "
                         f"{DYNAEXQ_HI} int4 copies per layer")
    return budget


def plan_shape(path: Path) -> tuple[int, int]:
    """(MoE layers, experts per layer) of a converted model."""
    from jmoe.config import ModelConfig
    from jmoe.manifest import read_manifest

    cfg = ModelConfig.from_dict(read_manifest(path)["config"])
    return cfg.num_moe_layers, cfg.num_experts


def domain_stream(tokenizer, order, tokens: int, skip: int = 0) -> np.ndarray:
    """`tokens` dev tokens of each domain in `order`, each from its dev token `skip` on, one after another."""
    return np.concatenate([dev_tokens(tokenizer, d, skip + tokens)[skip:] for d in order])


def workload_shift(path: Path, tokens: int, calib_traces: np.ndarray) -> dict:
    tokenizer = jmoe.load(path, tier="int2").tokenizer
    stream = domain_stream(tokenizer, ("prose", "code", "math"), tokens)
    budget = dynaexq_budget(path)
    runs = {"uniform int4": ("lru", {"tier": "int4"}), "uniform int2": ("lru", {"tier": "int2"}),
            "DynaExq 8/32": (DynaExq(**EIGHT_COPIES), {"budget": budget}),
            "DynaExq 8/32, alpha 0.7": (DynaExq(**EIGHT_COPIES, alpha=0.7), {"budget": budget}),
            "DynaExq 8/32, count hotness": (DynaExq(**EIGHT_COPIES, hotness="count"), {"budget": budget}),
            "DynaExq 8/32, the previous defaults": (DynaExq(**EIGHT_COPIES, hotness="count", alpha=0.5, margin=0.01),
                                                    {"budget": budget}),
            "LRU int4 (same budget)": ("lru", {"tier": "int4", "budget": budget}),
            "placement two-stage int4 (same budget)": (StaticPlacement(calib_traces, tier="int4"), {"budget": budget})}
    out = {}
    for name, (policy, kw) in runs.items():
        model = jmoe.load(path, compute_dtype="float32", policy=policy, tier=kw.get("tier"),
                          device_budget=kw.get("budget"), trace=True)
        started = time.perf_counter()
        windows = score_stream(model, stream)
        seconds = time.perf_counter() - started
        modelled = replay(model.trace.records(), dense_bytes=dense_bytes_of(model), num_layers=model.config.num_layers)
        out[name] = {"windows": windows, "perplexity": stream_perplexity(windows), "stats": jmoe.stats(model),
                     "cpu_s_per_token_measured": seconds / (len(stream) - 1),
                     "gpu_s_per_token_modelled": modelled["modelled_tpot_s"]}
        print(name, round(out[name]["perplexity"], 3), flush=True)
    return {"tokens_per_domain": tokens, "budget_bytes": budget, "runs": out,
            "int2_to_int4_gap_closed": gap_closed({k: run["perplexity"] for k, run in out.items()})}


def score_stream(model, stream: np.ndarray) -> list[dict]:
    """Decode-mode perplexity, bytes moved and hit rate of each WINDOW-token window of the stream."""
    windows = []
    for start in range(0, len(stream) - 1, WINDOW):
        before = jmoe.stats(model)
        nll, count = window_nll(model, stream[start : start + WINDOW + 1], WINDOW + 1, mode="decode")
        after = jmoe.stats(model)
        windows.append({"start": start, "perplexity": math.exp(nll / count),
                        "bytes_h2d_per_token": (after["bytes_h2d"] - before["bytes_h2d"]) / count,
                        "hit_rate": (((after["hit_rate"] or 0.0) * after["expert_uses"]  # None before any use
                                      - (before["hit_rate"] or 0.0) * before["expert_uses"])
                                     / max(1, after["expert_uses"] - before["expert_uses"]))})
    return windows


def stream_perplexity(windows: list[dict]) -> float:
    """The windows' geometric mean perplexity."""
    return math.exp(sum(math.log(w["perplexity"]) for w in windows) / len(windows))


def gap_closed(perplexity: dict[str, float]) -> dict[str, float]:
    """How much of the uniform int2 -> uniform int4 perplexity gap each DynaExq run (and uniform int3,
    where it ran) closed."""
    p4, p2 = perplexity["uniform int4"], perplexity["uniform int2"]
    return {k: (p2 - p) / (p2 - p4) for k, p in perplexity.items() if k.startswith("DynaExq") or k == "uniform int3"}


# Streams of the three dev domains in each rotation of their order, each from its own place in the
# dev texts: the first is the prose -> code -> math from the start.
STREAMS = {"prose -> code -> math": (("prose", "code", "math"), 0),
           "code -> math -> prose": (("code", "math", "prose"), 3000),
           "math -> prose -> code": (("math", "prose", "code"), 5000)}
# With --int3-lo: the default beside the int3 tier in DynaExq 8/32's budget (every expert at int3, the
# budget's rest in int4 copies: 8 of the tiny model's 256) and uniform int3.
# With it also the same budget held as one version an expert (keep_lo=False, the default now): an
# int4 expert gives its int2 (or int3) slot back, so the budget holds more int4 experts.
INT3_LO = "DynaExq 8/32's budget, int3 lo"
ONE_VERSION = "DynaExq 8/32's budget, one version an expert"
INT3_POLICIES = {"DynaExq 8/32 (defaults)": {}, INT3_LO: {"lo": "int3", "hi_per_layer": None},
                 ONE_VERSION: ONE_VERSION_OPTIONS,
                 "DynaExq 8/32's budget, int3 lo, one version an expert": {"lo": "int3", **ONE_VERSION_OPTIONS}}
STREAM_POLICIES = {"DynaExq 8/32 (defaults)": {}, "DynaExq 8/32, alpha 0.7": dict(alpha=0.7),
                   "DynaExq 8/32, alpha 0.5": dict(alpha=0.5), "DynaExq 8/32, count hotness": dict(hotness="count"),
                   "DynaExq 8/32, shift 3": dict(shift=3.0),
                   "DynaExq 8/32, hi sets per layer": dict(allocation="layer")}


class Hindsight(DynaExq):
    """DynaExq told the future: at every interval its hotness is the routing of the next `horizon`
    tokens of the stream (router counts from `routing`, [T, L, k], in the order the policy sees the
    tokens), the rest of its machinery unchanged. No estimate from past routing can know more, so
    its share of the gap is a ceiling for DynaExq's hotness at this budget, not a policy to use.
    With `weights` ([T, L, k] combine weights), the hotness is the gate weight to come, as the
    default DynaExq's is the gate weight received."""

    def __init__(self, routing: np.ndarray, horizon: int, weights: np.ndarray | None = None, **options):
        super().__init__(**options)
        self.routing, self.weights, self.horizon, self.position = routing, weights, horizon, 0

    def _start(self, num_layers: int, num_experts: int, n_hi: int) -> None:
        super()._start(num_layers, num_experts, n_hi)
        self.position = 0
        self._look_ahead()  # the first hi set is the first tokens' experts (preload puts it in place)

    def _look_ahead(self) -> None:
        upcoming = self.routing[self.position : self.position + self.horizon]  # [H, L, k]
        mass = 1.0 if self.weights is None else self.weights[self.position : self.position + self.horizon].ravel()
        counts = np.zeros(self.hot.shape)
        layers = np.broadcast_to(np.arange(upcoming.shape[1])[None, :, None], upcoming.shape)
        np.add.at(counts, (layers.ravel(), upcoming.ravel()), mass)
        self.hot = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        self._update_members()

    def observe_experts(self, counts, gate, tokens: int) -> None:
        if self.hot is None:
            return
        self.position += tokens
        self.tokens += tokens
        if self.tokens >= self.interval:
            self.tokens = 0
            self._look_ahead()


HINDSIGHT_HORIZONS = (64, 256, 1024)  # tokens of the stream each hindsight ceiling looks ahead


def hindsight_name(horizon: int) -> str:
    return f"DynaExq 8/32, hindsight: the next {horizon} tokens"


def offset_streams(offsets: list[int]) -> dict:
    """The issue's prose -> code -> math stream from each of these dev-token offsets (STREAMS' form)."""
    return {f"prose -> code -> math from token {skip}": (("prose", "code", "math"), skip) for skip in offsets}


def shift_streams(path: Path, tokens: int, streams: dict | None = None, hindsight: bool = False,
                  int3_lo: bool = False) -> dict:
    """DynaExq's share of the int2 -> int4 gap on several shifting streams (STREAMS, or `streams`),
    beside uniform int4 and int2: how much one stream's figure says about another's, and how it
    moves with the hotness horizon. Also the gap closed over all streams together (the sum of what
    each closed over the sum of their gaps) and each policy's median and range over the streams.
    With `hindsight`, also the ceilings of Hindsight at HINDSIGHT_HORIZONS. With `int3_lo`, INT3_POLICIES
    and uniform int3 instead of STREAM_POLICIES (the model must hold int3)."""
    tokenizer = jmoe.load(path, tier="int2").tokenizer
    budget = dynaexq_budget(path)
    tracer = jmoe.load(path, compute_dtype="float32", tier="int4") if hindsight else None
    policies = INT3_POLICIES if int3_lo else STREAM_POLICIES
    names = [*(["uniform int3"] if int3_lo else []), *policies,
             *(hindsight_name(h) for h in HINDSIGHT_HORIZONS if hindsight)]
    out = {}
    for name, (order, skip) in (streams or STREAMS).items():
        stream = domain_stream(tokenizer, order, tokens, skip)
        runs = {"uniform int4": ("lru", "int4", None), "uniform int2": ("lru", "int2", None),
                **({"uniform int3": ("lru", "int3", None)} if int3_lo else {}),
                **{k: (DynaExq(**{**EIGHT_COPIES, **kw}), None, budget) for k, kw in policies.items()}}
        if hindsight:  # the windows score the stream in order, each WINDOW tokens from a fresh cache
            routing, weights = trace_routing(tracer, stream, WINDOW, with_weights=True)
            runs.update({hindsight_name(h): (Hindsight(routing, h, weights, **EIGHT_COPIES), None, budget)
                         for h in HINDSIGHT_HORIZONS})
        perplexity = {}
        for run, (policy, tier, device_budget) in runs.items():
            model = jmoe.load(path, compute_dtype="float32", policy=policy, tier=tier, device_budget=device_budget)
            perplexity[run] = stream_perplexity(score_stream(model, stream))
        out[name] = {"offset_tokens": skip, "perplexity": perplexity, "int2_to_int4_gap_closed": gap_closed(perplexity)}
        print(name, {k: round(v, 3) for k, v in out[name]["int2_to_int4_gap_closed"].items()}, flush=True)
    pooled = {k: sum(s["perplexity"]["uniform int2"] - s["perplexity"][k] for s in out.values())
              / sum(s["perplexity"]["uniform int2"] - s["perplexity"]["uniform int4"] for s in out.values())
              for k in names}
    each = {k: sorted(s["int2_to_int4_gap_closed"][k] for s in out.values()) for k in names}
    spread = {k: {"median": statistics.median(v), "min": v[0], "max": v[-1]} for k, v in each.items()}
    return {"tokens_per_domain": tokens, "budget_bytes": budget, "streams": out, "gap_closed_all_streams": pooled,
            "gap_closed_per_stream": spread}


def one_version_cost(path: Path, tokens: int, rounds: int) -> dict:
    """What one version an expert costs per decoded token beside keeping every lo version under 8 hi
    copies a layer, in DynaExq 8/32's budget, on the issue's prose -> code -> math stream: decode time
    (teacher-forced, token by token: every token a decode step), bytes copied in, promotions and
    demotions, alternating the two in each round after one unmeasured pass of each."""
    tokenizer = jmoe.load(path, tier="int2").tokenizer
    budget = dynaexq_budget(path)
    stream = domain_stream(tokenizer, ("prose", "code", "math"), tokens)
    variants = {"8 int4 copies a layer over every int2 version": EIGHT_COPIES,
                "one version an expert": ONE_VERSION_OPTIONS}
    runs = {name: [] for name in variants}
    for round_ in range(rounds + 1):
        for name, options in variants.items():
            model = jmoe.load(path, compute_dtype="float32", policy=DynaExq(**options), device_budget=budget)
            started = time.perf_counter()
            windows = score_stream(model, stream)
            seconds = time.perf_counter() - started
            stats = jmoe.stats(model)
            if round_:  # the first round compiles each step shape
                runs[name].append({"ms_per_token": 1e3 * seconds / (len(stream) - 1),
                                   "bytes_h2d_per_token": stats["bytes_h2d"] / (len(stream) - 1),
                                   "promotions": stats["promotions"], "demotions": stats["demotions"],
                                   "degraded": stats["degraded"], "perplexity": stream_perplexity(windows)})
        print(round_, {k: v[-1]["ms_per_token"] for k, v in runs.items() if v}, flush=True)
    summary = {name: {key: {"median": statistics.median(r[key] for r in rs), "min": min(r[key] for r in rs),
                            "max": max(r[key] for r in rs)} for key in rs[0]} for name, rs in runs.items()}
    return {"tokens_per_domain": tokens, "budget_bytes": budget, "rounds": rounds, "summary": summary, "runs": runs}


def plot_shift(shift: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, run in shift["runs"].items():
        x = [w["start"] for w in run["windows"]]
        if "budget" not in name and "LRU" not in name and "placement" not in name or "DynaExq" in name:
            a.plot(x, [w["perplexity"] for w in run["windows"]], label=name)
        if "same budget" in name or "DynaExq" in name:
            b.plot(x, [w["bytes_h2d_per_token"] / 1024 for w in run["windows"]], label=name)
    n = shift["tokens_per_domain"]
    for ax in (a, b):
        for boundary in (n, 2 * n):
            ax.axvline(boundary, color="grey", lw=0.5)
    a.set_ylabel("perplexity (256-token window)")
    b.set_ylabel("KiB moved host->device per token")
    b.set_xlabel("token of the stream (prose | code | math)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    a.set_title("Workload shift, bundled model, decode mode (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def ablation(root: Path, new_tokens: int) -> dict:
    from bench.lib.synthetic import QWEN3_30B_A3B, write_checkpoint

    src = write_checkpoint(root / "synthetic-hf", layers=4, **QWEN3_30B_A3B)
    path = convert_checkpoint(src, root / "synthetic", tiers="int4,int2", progress=False)
    plan = jmoe.memory_plan(path, tier="int4", compute_dtype="float32", max_seq_len=512)
    fixed = plan["dense"] + plan["kv_cache"] + plan["workspace"]
    modes = {"load on demand": lambda: "ondemand", "cache": lambda: "lru", "+prefetch": lambda: "lru+prefetch",
             "+4/2": lambda: no_prefetch(DyMoE()), "+4/2+prefetch": lambda: DyMoE(),
             "+4/0+prefetch": lambda: DyMoE(lo=None)}
    items = None
    out = {}
    for fraction in (0.25, 0.5):
        budget = int(fixed + fraction * plan["all_experts"])
        for name, make in modes.items():
            model = jmoe.load(path, tier="int4", compute_dtype="float32", policy=make(), device_budget=budget,
                              max_seq_len=512, trace=True)
            items = items or dev_prompts(model.tokenizer)
            jmoe.generate(model, items[0][:8], max_new_tokens=2)  # compile
            model.residency.reset_stats()
            model.trace.steps.clear()
            t = time.perf_counter()
            for ids in items:
                jmoe.generate(model, ids, max_new_tokens=new_tokens)
            seconds = time.perf_counter() - t
            stats = jmoe.stats(model)
            modelled = replay(model.trace.records(), dense_bytes=dense_bytes_of(model),
                              num_layers=model.config.num_layers)
            out[f"{name} @ {fraction:.0%}"] = {
                "budget_fraction": fraction, "cpu_s_per_token_measured": seconds / stats["tokens"],
                "cpu_tpot_s_measured": stats["tpot_s"], "gpu_tpot_s_modelled": modelled["modelled_tpot_s"],
                "bytes_h2d_per_token": stats["bytes_h2d_per_token"], "hit_rate": stats["hit_rate"],
                "degraded": stats["degraded"], "skipped": stats["skipped"], "replays": stats["replays"],
                "uses_by_tier": stats["uses_by_tier"]}
            print(name, fraction, json.dumps({k: v for k, v in out[f"{name} @ {fraction:.0%}"].items()
                                              if "tpot" in k or "bytes" in k}), flush=True)
    return out


def no_prefetch(policy: Policy) -> Policy:
    policy.prefetch = False
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048, help="dev tokens per domain for the quality table")
    parser.add_argument("--shift-tokens", type=int, default=2048)
    parser.add_argument("--calib-sequences", type=int, default=64)
    parser.add_argument("--ablation-tokens", type=int, default=32)
    parser.add_argument("--skip-ablation", action="store_true")
    parser.add_argument("--only-importance", action="store_true",
                        help="run DyMoE against its random control only, adding them to an existing policies JSON")
    parser.add_argument("--only-shift", action="store_true",
                        help="run the workload shift only, replacing it in an existing policies JSON")
    parser.add_argument("--only-quality", action="store_true",
                        help="run the quality table only, replacing it in an existing policies JSON")
    parser.add_argument("--streams", type=int, nargs="+", metavar="TOKENS",
                        help="DynaExq on several shifting streams instead, TOKENS per domain each "
                             "(results: policies/dynaexq_streams_cpu.json)")
    parser.add_argument("--streams-name", type=result_name, default="dynaexq_streams",
                        help="the --streams result's name (_cpu.json added)")
    parser.add_argument("--stream-offsets", type=int, nargs="+", metavar="TOKEN",
                        help="with --streams: the prose -> code -> math stream from each of these dev-token "
                             "offsets, in place of the three rotations of the order")
    parser.add_argument("--int3-lo", action="store_true",
                        help="with --streams: DynaExq's default beside every expert at int3 and int4 copies in the "
                             "same budget, and uniform int3 (converts int3 too)")
    parser.add_argument("--hindsight", action="store_true",
                        help="with --streams: also DynaExq told the routing of the tokens to come (a ceiling for "
                             "any hotness estimate at this budget)")
    parser.add_argument("--one-version-cost", type=int, metavar="ROUNDS",
                        help="DynaExq's decode time and bytes per token with one version an expert against 8 int4 "
                             "copies a layer over every int2 version, in alternating rounds (results: "
                             "policies/dynaexq_one_version_cost_cpu.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.one_version_cost:
            path = convert_tiny(root, args.calib_sequences)
            write_result("policies", args.streams_name if args.streams_name != "dynaexq_streams" else
                         "dynaexq_one_version_cost", {"model": "tiny-qwen3-moe (GPTQ int4 + int2)",
                                                      **one_version_cost(path, args.shift_tokens,
                                                                         args.one_version_cost)})
            return
        path = convert_tiny(root, args.calib_sequences, "int4,int3,int2" if args.int3_lo else "int4,int2")
        if args.streams:
            streams = offset_streams(args.stream_offsets) if args.stream_offsets else None
            tiers = "int4 + int3 + int2" if args.int3_lo else "int4 + int2"
            write_result("policies", args.streams_name, {"model": f"tiny-qwen3-moe (GPTQ {tiers})",
                                                          "runs": [shift_streams(path, n, streams, args.hindsight,
                                                                                 args.int3_lo)
                                                                   for n in args.streams]})
            return
        if args.only_importance:
            previous = json.loads((RESULTS / "policies" / "policies_cpu.json").read_text())
            previous.pop("machine", None)
            ids = {d: dev_tokens(jmoe.load(path, tier="int2").tokenizer, d, args.tokens) for d in DOMAINS}
            previous["quality"]["rows"] = {k: v for k, v in previous["quality"]["rows"].items() if "unbudgeted" not in
                                           k or "DynaExq" in k}
            previous["quality"]["rows"].update(importance_vs_chance(path, ids))
            write_result("policies", "policies", previous)
            return
        tracer = jmoe.load(path, compute_dtype="float32", tier="int4")
        calib_text = " ".join(p.read_text()[:60_000] for p in CALIB_FILES)
        calib_traces = trace_routing(tracer, tracer.tokenizer.encode(calib_text), WINDOW)
        dev_ids = np.concatenate([dev_tokens(tracer.tokenizer, d, args.tokens) for d in DOMAINS])
        dev_traces = trace_routing(tracer, dev_ids, WINDOW)
        del tracer
        if args.only_shift:
            previous = json.loads((RESULTS / "policies" / "policies_cpu.json").read_text())
            previous.pop("machine", None)
            previous["workload_shift"] = workload_shift(path, args.shift_tokens, calib_traces)
            plot_shift(previous["workload_shift"], RESULTS / "policies" / "policies_shift_cpu.png")
            write_result("policies", "policies", previous)
            return
        result = {"model": "tiny-qwen3-moe (GPTQ int4 + int2)", "gpu_params_modelled": GpuParams().__dict__,
                  "quality": quality_table(path, args.tokens, calib_traces, dev_traces)}
        if args.only_quality:
            previous = json.loads((RESULTS / "policies" / "policies_cpu.json").read_text())
            previous.pop("machine", None)
            write_result("policies", "policies", {**previous, **result})
            return
        shift = workload_shift(path, args.shift_tokens, calib_traces)
        plot = RESULTS / "policies" / "policies_shift_cpu.png"
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_shift(shift, plot)
        result["workload_shift"] = shift
        if not args.skip_ablation:
            result["dymoe_ablation_synthetic_qwen3_30b_a3b_4L"] = ablation(root, args.ablation_tokens)
    write_result("policies", "policies", result)


if __name__ == "__main__":
    main()
