"""The papers' headline claims and the table that sets a bench/paper_headlines.py result beside them
(no jax: docs/gen_tables.py writes the docs' tables with it)."""

from __future__ import annotations

# The papers' own headline figures as their abstracts state them, with the setting they name.
PAPERS = {
    "dymoe": {
        "paper": "DyMoE (arXiv 2603.19172)",
        "claim": "TTFT 3.44x-22.7x lower and TPOT up to 14.58x faster than state-of-the-art offloading baselines",
        "setting": "commercial edge hardware (a 24 GB consumer GPU on PCIe Gen3, Mixtral-8x7B and Qwen3-30B-A3B)",
        "paper_tpot_speedup": 14.58,
        "short": "TPOT up to 14.58x, TTFT 3.44–22.7x vs offloading baselines (24 GB GPU, PCIe Gen3)",
    },
    "moe_speq": {
        "paper": "MoE-SpeQ (arXiv 2511.14102)",
        "claim": "at most 2.34x speed-up over the state-of-the-art offloading framework, Phi-MoE",
        "setting": "one A100 40 GB, PCIe 4.0; FP16 target, GPTQ INT4 draft",
        "paper_tpot_speedup": 2.34,
        "short": "up to 2.34x vs the best offloading framework (Phi-MoE, A100 40 GB, PCIe 4.0)",
    },
    "dynaexq": {
        "paper": "DynaExq (arXiv 2511.15015)",
        "claim": "accuracy up to 4.03 points above static low-precision baselines (v2); "
                 "up to 2.73x throughput over offloading/prefetch baselines at batch 32 (v3)",
        "setting": "single RTX 5090 and A6000 GPUs (v2 abstract)",
        "paper_tpot_speedup": None,
        "short": "up to 4.03 accuracy points over static low precision (RTX 5090, A6000)",
    },
    "haq": {
        "paper": "HAQ + CPU-GPU collaboration (arXiv 2508.07329)",
        "claim": "GPU memory about 60% lower, latency 'significantly improved' (no figure in the abstract); "
                 "Fiddler (arXiv 2402.07033), the critical-token cost model's origin: 1.26x single-batch decode",
        "setting": "Fiddler: Mixtral-8x7B 16-bit, Quadro RTX 6000 24 GB on PCIe Gen3",
        "paper_tpot_speedup": 1.26,
        "short": "no latency figure (HAQ); Fiddler's CPU execution: 1.26x decode (Mixtral, PCIe Gen3)",
    },
}


def markdown(result: dict) -> str:
    """The README's table of one result file: each pair's speed-ups (measured, modelled), its
    critical-path fetches and quality, beside the paper's claim."""
    def ratio(x: dict) -> str:
        return f"{x['median']:.2f}x [{x['min']:.2f}–{x['max']:.2f}]"

    def ppl(c: dict, side: str) -> str:
        if "perplexity" not in c:
            return ""
        return " / ".join(f"{e['ppl']:.2f}" for e in c["perplexity"][side].values())

    lines = ["| paper: method vs baseline | TPOT speed-up, greedy / sampled | TTFT speed-up, greedy / sampled "
             "| modelled H100 TPOT speed-up | critical-path fetches / token, baseline → method (sampled) "
             "| perplexity prose / code / math, baseline → method | the paper's headline |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in result["comparisons"].items():
        base, method = c["baseline"], c["method"]
        greedy, sampled = c["temperature_0"], c["temperature_1"]
        modelled = c.get("modelled_h100", {}).get("tpot_speedup")
        misses = f"{sampled[base]['in_step_misses_per_token']:.1f} → {sampled[method]['in_step_misses_per_token']:.1f}"
        quality = f"{ppl(c, base)} → {ppl(c, method)}" if "perplexity" in c else "(random weights)"
        tiers = "/".join(dict.fromkeys(c.get("tiers", {}).values())) or result["hi"]
        lines.append(f"| {name}: {method} vs {base} ({tiers}) | {ratio(greedy['tpot_speedup'])} / "
                     f"{ratio(sampled['tpot_speedup'])} | {greedy['ttft_speedup']['median']:.2f}x / "
                     f"{sampled['ttft_speedup']['median']:.2f}x | "
                     f"{'' if modelled is None else f'{modelled:.2f}x'} | {misses} | {quality} | "
                     f"{PAPERS[name]['short']} |")
    return "\n".join(lines)
