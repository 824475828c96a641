"""Speculative decoding with the model's own low-precision draft (MoE-SpeQ), judged by acceptance,
routing fidelity, hits at verification and time (measured on this machine, modelled for a GPU).

1. Bundled model (GPTQ tiers bf16 + int4 + int2 calibrated on the train splits), bf16 target with
   every expert resident: per dev domain and draft tier, acceptance rate (overall and per drafted
   position), tokens per cycle and draft routing fidelity (share of the experts verification routed
   to that the lookahead buffer held), greedy, k = 4.
2. Bundled model under a budget (fixed + the int4 draft + 25% of the bf16 experts): the speculative
   run's hit rate at verification against plain LRU + prefetch at the same total budget, bytes
   moved per token, measured CPU TPOT and modelled GPU TPOT.
3. TPOT against k (fixed 1..8 and the governor's "auto"), all resident, both drafts: measured CPU
   TPOT and modelled GPU TPOT (plot).
4. Synthetic Qwen3-30B-A3B-shaped model (4 layers, random weights), int4 target, int2 draft, at a
   budget holding 25% of the int4 experts besides the draft: modelled GPU TPOT speculative vs
   plain LRU + prefetch, both at the same total budget and at the same target pool.

Every GPU time here is modelled (bench/lib/gpu_model.py replays the run's trace), never measured.

    python -m bench.speculative [--prompts 4] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import jmoe
from bench.lib.common import CALIB_FILES, CORPUS, DOMAINS, RESULTS, TINY_HF, dev_prompts, staging_bytes, write_result
from bench.lib.gpu_model import GpuParams, dense_bytes_of, modelled_tpot, replay
from convert import convert_checkpoint
from jmoe.decoding.speculative import DEFAULT_K_MAX
from jmoe.serving.compiles import no_compiles

PROMPT_TOKENS = 32


def domain_prompts(tokenizer, domain: str, n: int) -> list[list[int]]:
    ids = tokenizer.encode((CORPUS / f"{domain}.dev.txt").read_text()[:200_000])
    starts = np.linspace(0, len(ids) - PROMPT_TOKENS - 1, n, dtype=int)
    return [ids[s : s + PROMPT_TOKENS] for s in starts]


def warm_up(model, prompt, new_tokens: int, speculative) -> None:
    """Compile every shape the timed generations can take: a prompt of theirs at their length, and
    with a draft each draft length a cycle may run (the governor's choice, or fewer at a
    generation's end), from 1 to k (or k_max)."""
    jmoe.generate(model, prompt, max_new_tokens=new_tokens, speculative=speculative)
    if speculative is None:
        return
    k = speculative.get("k", "auto")
    top = k if isinstance(k, int) else speculative.get("k_max", DEFAULT_K_MAX)
    for j in range(1, top + 1):
        jmoe.generate(model, prompt, max_new_tokens=j + 2, speculative={**speculative, "k": j})


def run(model, prompts, new_tokens: int, speculative=None) -> dict:
    """Greedy generation of every prompt (after one warm-up call): stats, measured and modelled time."""
    warm_up(model, prompts[0], new_tokens, speculative)
    model.residency.reset_stats()
    for draft in model.drafts.values():
        draft.reset_stats()
    if model.trace is not None:
        model.trace.clear()
    outputs = []
    with no_compiles(f"{len(prompts)} prompts, speculative={speculative}"):
        t = time.perf_counter()
        for ids in prompts:
            outputs.append(jmoe.generate(model, ids, max_new_tokens=new_tokens, speculative=speculative))
        seconds = time.perf_counter() - t
    stats = jmoe.stats(model)
    out = {"outputs": outputs, "cpu_s_per_token_measured": seconds / stats["tokens"],
           "cpu_tpot_s_measured": stats["tpot_s"], "hit_rate": stats["hit_rate"],
           "bytes_h2d_per_token": stats["bytes_h2d_per_token"], "speculative": stats.get("speculative")}
    if model.trace is not None:
        modelled = replay(model.trace.records(), dense_bytes=dense_bytes_of(model),
                          num_layers=model.config.num_layers)
        out["gpu_tpot_s_modelled"] = modelled_tpot(modelled, stats["tokens"] - len(prompts))
        out["gpu_seconds_by_phase_modelled"] = modelled["modelled_seconds_by_phase"]
    return out


def budget_of(path: Path, tier: str, draft: str | None, fraction: float) -> int:
    plan = jmoe.memory_plan(path, tier=tier, compute_dtype="float32", draft=draft)
    fixed = plan["dense"] + plan["kv_cache"] + plan["workspace"] + plan.get("draft", 0) + staging_bytes(path)
    return int(fixed + fraction * plan["all_experts"])


def acceptance_by_domain(path: Path, n: int, new_tokens: int) -> dict:
    model = jmoe.load(path, compute_dtype="float32", tier="bf16")
    out = {}
    for domain in DOMAINS:
        prompts = domain_prompts(model.tokenizer, domain, n)
        for draft in ("int4", "int2"):
            result = run(model, prompts, new_tokens, {"draft": draft, "k": 4})
            spec = result["speculative"]
            out[f"{domain} {draft}"] = {k: spec[k] for k in ("acceptance_rate", "acceptance_by_position",
                                                             "tokens_per_cycle", "draft_routing_fidelity")}
            print(domain, draft, out[f"{domain} {draft}"], flush=True)
    return out


def under_budget(path: Path, n: int, new_tokens: int, fraction: float = 0.25) -> dict:
    tokenizer = jmoe.load(path, tier="int2").tokenizer
    prompts = [p for d in DOMAINS for p in domain_prompts(tokenizer, d, max(1, n // 2))]
    budget = budget_of(path, "bf16", "int4", fraction)
    plain = jmoe.load(path, compute_dtype="float32", tier="bf16", policy="lru+prefetch", device_budget=budget,
                      trace=True)
    spec = jmoe.load(path, compute_dtype="float32", tier="bf16", policy="lru+prefetch", device_budget=budget,
                     trace=True, draft="int4")
    rows = {"plain lru+prefetch (same budget)": run(plain, prompts, new_tokens),
            "speculative int4, k auto": run(spec, prompts, new_tokens, {"draft": "int4", "k": "auto"})}
    assert rows["plain lru+prefetch (same budget)"]["outputs"] == rows["speculative int4, k auto"]["outputs"]
    s = rows["speculative int4, k auto"]["speculative"]
    summary = {"budget_bytes": budget, "target_pool_slots": {"plain": plain.residency.slots,
                                                             "speculative": spec.residency.slots},
               "plain_hit_rate": rows["plain lru+prefetch (same budget)"]["hit_rate"],
               "verify_hit_rate": s["verify_hit_rate"], "draft_routing_fidelity": s["draft_routing_fidelity"],
               "identical_greedy_outputs": True}
    for row in rows.values():
        row.pop("outputs")
    print("under budget", summary, flush=True)
    return {"summary": summary, "rows": rows}


def tpot_vs_k(path: Path, n: int, new_tokens: int) -> dict:
    tokenizer = jmoe.load(path, tier="int2").tokenizer
    prompts = [p for d in DOMAINS for p in domain_prompts(tokenizer, d, max(1, n // 2))]
    model = jmoe.load(path, compute_dtype="float32", tier="bf16", trace=True)
    out = {"plain": run(model, prompts, new_tokens)}
    reference = out["plain"].pop("outputs")
    for draft in ("int4", "int2"):
        for k in (1, 2, 3, 4, 6, 8, "auto"):
            row = run(model, prompts, new_tokens, {"draft": draft, "k": k})
            assert row.pop("outputs") == reference
            out[f"{draft} k={k}"] = row
            print(draft, k, {x: row[x] for x in ("cpu_tpot_s_measured", "gpu_tpot_s_modelled")}, flush=True)
    return out


def synthetic(root: Path, new_tokens: int, fraction: float = 0.25) -> dict:
    from bench.lib.synthetic import QWEN3_30B_A3B, write_checkpoint

    src = write_checkpoint(root / "synthetic-hf", layers=4, **QWEN3_30B_A3B)
    path = convert_checkpoint(src, root / "synthetic", tiers="int4,int2", progress=False)
    plan = jmoe.memory_plan(path, tier="int4", compute_dtype="float32", max_seq_len=512, draft="int2")
    budget = budget_of(path, "int4", "int2", fraction)  # 25% of the int4 experts besides the draft
    kw = dict(compute_dtype="float32", tier="int4", policy="lru+prefetch", max_seq_len=512, trace=True)
    items = None
    rows = {}
    for name, extra, speculative in (
        ("plain lru+prefetch, same total budget", dict(device_budget=budget), None),
        ("plain lru+prefetch, same target pool", dict(device_budget=budget - plan["draft"]), None),
        ("speculative int2, k=4", dict(device_budget=budget, draft="int2"), {"draft": "int2", "k": 4}),
        ("speculative int2, k auto", dict(device_budget=budget, draft="int2"), {"draft": "int2", "k": "auto"}),
    ):
        model = jmoe.load(path, **kw, **extra)
        items = items or [ids[:16] for ids in dev_prompts(model.tokenizer)]
        rows[name] = run(model, items, new_tokens, speculative)
        rows[name].pop("outputs")
        rows[name]["target_pool_slots"] = model.residency.slots
        print(name, {x: rows[name][x] for x in ("cpu_tpot_s_measured", "gpu_tpot_s_modelled", "hit_rate")},
              flush=True)
    base = rows["plain lru+prefetch, same total budget"]["gpu_tpot_s_modelled"]
    best = min(rows[k]["gpu_tpot_s_modelled"] for k in rows if k.startswith("speculative"))
    return {"budget_bytes": budget, "draft_bytes": plan["draft"], "int4_experts_bytes": plan["all_experts"],
            "rows": rows, "modelled_gpu_speedup_vs_same_budget": base / best,
            "modelled_gpu_speedup_vs_same_pool": rows["plain lru+prefetch, same target pool"]["gpu_tpot_s_modelled"]
            / best}


def plot_k(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ks = [1, 2, 3, 4, 6, 8]
    for ax, key, label in ((axes[0], "cpu_tpot_s_measured", "CPU TPOT, measured (ms)"),
                           (axes[1], "gpu_tpot_s_modelled", "GPU TPOT, modelled (ms)")):
        for draft in ("int4", "int2"):
            ax.plot(ks, [rows[f"{draft} k={k}"][key] * 1e3 for k in ks], marker="o", label=f"draft {draft}")
            ax.scatter([9], [rows[f"{draft} k=auto"][key] * 1e3], marker="*", s=80)
        ax.axhline(rows["plain"][key] * 1e3, color="grey", ls="--", label="no speculation")
        ax.set_xticks([*ks, 9], [*map(str, ks), "auto"])
        ax.set_xlabel("drafted tokens per cycle (k)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("Speculative decoding, bundled model, bf16 target, every expert resident")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=4, help="dev prompts per domain")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--calib-sequences", type=int, default=64)
    parser.add_argument("--skip-synthetic", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = convert_checkpoint(TINY_HF, root / "tiny", tiers="bf16,int4,int2", method="gptq",
                                  calib=[str(p) for p in CALIB_FILES], calib_sequences=args.calib_sequences,
                                  progress=False)
        result = {"model": "tiny-qwen3-moe (bf16 target; GPTQ int4 / int2 drafts)",
                  "gpu_params_modelled": GpuParams().__dict__,
                  "acceptance_by_domain": acceptance_by_domain(path, args.prompts, args.new_tokens),
                  "under_budget_25pct": under_budget(path, args.prompts, args.new_tokens)}
        by_k = tpot_vs_k(path, args.prompts, args.new_tokens)
        result["tpot_vs_k"] = by_k
        (RESULTS / "speculative").mkdir(parents=True, exist_ok=True)
        plot_k(by_k, RESULTS / "speculative" / "speculative_k_cpu.png")
        if not args.skip_synthetic:
            result["synthetic_qwen3_30b_a3b_4L_25pct"] = synthetic(root, min(args.new_tokens, 32))
    write_result("speculative", "speculative", result)


if __name__ == "__main__":
    main()
