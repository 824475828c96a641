"""Write the results tables of README.md and docs/*.md from bench/results/<benchmark>/*.json.

Each generated table sits between two markers in a markdown file:

    <!-- gen_tables: NAME -->
    ...written by this script...
    <!-- /gen_tables -->

and every table says which machine its figures came from (the JSON's "machine" field); figures
that a model of a GPU produced, not a GPU, say "modelled".

    python docs/gen_tables.py           # rewrite the tables in place
    python docs/gen_tables.py --check   # exit 1 if a table differs from what the JSON gives
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MARKER = re.compile(r"(<!-- gen_tables: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /gen_tables -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def machine(data: dict) -> str:
    """One line naming the machine a results file came from."""
    m = data["machine"]
    if m.get("backend") == "gpu":
        return f"{m['device']} (host: {m['cpu']}, {m['cpu_count']} cores; jax {m['jax']})"
    isa = f", {m['cpu_kernels_isa']} kernels" if m.get("cpu_kernels_isa") else ""  # recorded since the Zen 5 runs
    return f"{m['cpu']} CPU, {m['cpu_count']} cores{isa}, no GPU (jax {m['jax']})"


def source(*names: str) -> str:
    return ", ".join(f"`bench/results/{n}`" for n in names)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def f(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def med(stat: dict, digits: int = 1, spread: bool = True) -> str:
    """A {median, min, max} record as "median [min-max]"."""
    text = f(stat["median"], digits)
    if spread and stat.get("min") is not None and stat["min"] != stat["max"]:
        text += f" [{f(stat['min'], digits)}–{f(stat['max'], digits)}]"
    return text


def ratio(stat: dict) -> str:
    """A {median, min, max} speed ratio as "0.97x [0.95–0.98]"."""
    return f"{stat['median']:.2f}x [{stat['min']:.2f}–{stat['max']:.2f}]"


# --- the tables ---------------------------------------------------------------------------------

# Other families' shapes beside llama.cpp in the headline: (result, row label).
FAMILY_HEADLINES = [
    ("real_shapes/real_shapes_gpt_oss_many_rows_zen4_cpu.json",  # the newest run of each family on each machine
     ("GPT-OSS-20B shapes (2 of 24 layers), decode tok/s on an AVX-512 EPYC (Zen 4), int4 experts and dense weights, "
      "int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_mixtral_many_rows_zen4_cpu.json",
     ("Mixtral-8x7B shapes (2 of 32 layers), decode tok/s on an AVX-512 EPYC (Zen 4), int4 experts and dense weights, "
      "int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_gpt_oss_6L_zen5_cpu.json",
     ("GPT-OSS-20B shapes (6 of 24 layers), decode tok/s on an AVX-512 EPYC (Zen 5), int4 experts and dense weights, "
      "int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_mixtral_4L_six_bit_pass_zen5_cpu.json",
     ("Mixtral-8x7B shapes (4 of 32 layers), decode tok/s on an AVX-512 EPYC (Zen 5), int4 experts and dense weights, "
      "int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_deepseek_v2_lite_16L_six_bit_pass_zen5_cpu.json",
     ("DeepSeek-V2-Lite shapes (16 of 27 layers), decode tok/s on an AVX-512 EPYC (Zen 5), int4 experts and dense "
      "weights, int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_gpt_oss_after_load_trim_emr_cpu.json",
     ("GPT-OSS-20B shapes (2 of 24 layers), decode tok/s on an AVX-512 Xeon (Emerald Rapids), int4 experts and dense "
      "weights, int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_mixtral_after_load_trim_emr_cpu.json",
     ("Mixtral-8x7B shapes (2 of 32 layers), decode tok/s on an AVX-512 Xeon (Emerald Rapids), int4 experts and dense "
      "weights, int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
    ("real_shapes/real_shapes_deepseek_v2_lite_emr_cpu.json",
     ("DeepSeek-V2-Lite shapes (8 of 27 layers: latent attention, 2 shared experts), decode tok/s on an AVX-512 Xeon "
      "(Emerald Rapids), int4 experts and dense weights, int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0")),
]


def decode_row(run: dict, name: str, ours: str, theirs: str, what: str) -> list[str]:
    """A headline row: decode tok/s at depth 0 of `ours` beside `theirs` in one real_shapes run, and the
    median of their ratio taken within each round."""
    ratio = run["ratios"][f"{ours} / {theirs}"]["decode_tok_s@0"]["median"]
    mine, other = run["summary"][ours]["decode_tok_s@0"]["median"], run["summary"][theirs]["decode_tok_s@0"]["median"]
    return [what, f"{f(mine)} vs {f(other)} ({ratio:.2f}×)", machine(run), source(name)]


def quality_row(name: str, what: str, labels: list[tuple[str, str]]) -> list[str]:
    """A headline row from one `bench.quality --llama-cpp` run: the perplexity over its own runtime's
    bf16 (prose / code / math) of each (runtime, row label), in turn."""
    d = load(name)
    over = {(r["runtime"], r["label"]): r["over_bf16"] for r in d["rows"]}
    figures = "; ".join(" / ".join(f"{100 * over[key][dom]:+.2f}%" for dom in ("prose", "code", "math"))
                        for key in labels)
    return [what, figures, machine(d), source(name)]


def headline() -> str:
    ppl = load("perplexity/perplexity_tiny_cpu.json")
    quality = load("quality/quality_tiny_cpu.json")
    offload = load("offload_decode/offload_decode_qwen3_cpu.json")
    io = load("decode_io/decode_io_after_cpu.json")
    serve = load("serve/serve_tiny_cpu.json")
    gpu = load("gpu_suite/gpu_kernels_h100.json")

    prose = ppl["domains"]["prose"]
    rows = [[
        "Tiny Qwen3-MoE, prose perplexity, jmoe vs transformers (float32)",
        f"{prose['jmoe_ppl']:.4f} vs {prose['transformers_ppl']:.4f}",
        machine(ppl), source("perplexity/perplexity_tiny_cpu.json"),
    ]]
    by = {(r["method"], r["tier"], r["activations"]): r for r in quality["rows"]}
    base = by[("-", "bf16", "bf16/f32")]["prose"]
    int2 = load("quality/quality_tiny_int2_cpu.json")  # the int2 tier's format now (8-bit scales)
    int3 = load("quality/quality_tiny_int3_cpu.json")
    gptq4 = by[("gptq", "int4", "float")]["prose"]
    gptq3 = over_own_bf16(int3, "int3")["gptq"]["prose"]
    gptq2 = over_own_bf16(int2, "int2")["gptq"]["prose"]
    rows.append([
        ("Tiny Qwen3-MoE, prose perplexity over bf16, GPTQ int4 / int3 / int2 experts (4.50 / 3.55 / 2.55 bits per "
         "weight at Qwen3-30B-A3B's widths)"),
        f"+{100 * (gptq4 / base - 1):.2f}% / +{100 * gptq3:.2f}% / +{100 * gptq2:.1f}%",
        f"int4: {machine(quality)}; int3: {machine(int3)}; int2: {machine(int2)}",
        source("quality/quality_tiny_cpu.json", "quality/quality_tiny_int3_cpu.json",
               "quality/quality_tiny_int2_cpu.json"),
    ])
    rows.append(quality_row(  # the modes the Zen 4 speed rows time
        "quality/quality_vs_llama_cpp_mixed_r_zen4_cpu.json",
        ("Tiny Qwen3-MoE, perplexity over bf16 (prose / code / math) on the same tokens as llama.cpp: jmoe GPTQ int4 "
         "experts + dense int4 + int6 head (Q4_0's bytes); the same with DyMoE int4/int2 per token at r = 0.5; "
         "llama.cpp Q4_0"),
        [("jmoe", "GPTQ: int4 experts + dense int4 (int6 head), int8 dot"),
         ("jmoe", "GPTQ: DyMoE int4/int2 r=0.5 + dense int4 (int6 head), int8 dot, per token"), ("llama.cpp", "Q4_0")]))
    rows.append(quality_row(  # the mixed mode at Q4_0's quality
        "quality/quality_vs_llama_cpp_head_int6_s8_zen5_cpu.json",
        ("Tiny Qwen3-MoE, perplexity over bf16 (prose / code / math) on the same tokens as llama.cpp: jmoe GPTQ "
         "DyMoE int4/int2 per token at r = 0.75 and at r = 0.625, dense int4, int6 head (groups of 32, 8-bit "
         "scales: 6.5 bits a weight read); llama.cpp Q4_0 (its head at Q8_0 on this model)"),
        [("jmoe", "GPTQ: DyMoE int4/int2 + dense int4 (int6 head), int8 dot, per token"),
         ("jmoe", "GPTQ: DyMoE int4/int2 r=0.625 + dense int4 (int6 head), int8 dot, per token"),
         ("llama.cpp", "Q4_0")]))
    rows.append(quality_row(  # the mixed mode with the refined head (an int4 head's bytes)
        "quality/quality_vs_llama_cpp_refined_head_gnr_cpu.json",
        ("Tiny Qwen3-MoE, perplexity over bf16 (prose / code / math) on the same tokens as llama.cpp: jmoe GPTQ "
         "DyMoE int4/int2 per token at r = 0.75 and at r = 0.625, dense int4, int4 LM head with its 256 largest "
         "logits refined from int8 rows (4.5 bits a weight read); llama.cpp Q4_0"),
        [("jmoe", "GPTQ: DyMoE int4/int2 + dense int4 (int4 head, refined), int8 dot, per token"),
         ("jmoe", "GPTQ: DyMoE int4/int2 r=0.625 + dense int4 (int4 head, refined), int8 dot, per token"),
         ("llama.cpp", "Q4_0")]))
    # Decode beside llama.cpp at equal bits (int4 experts, dense int4 and the int6 head against Q4_0, which
    # keeps its output matrix at Q6_K) and in the mixed mode, the newest run of each per machine; every
    # other run is in docs/benchmarks.md.
    zen4_mixed = "real_shapes/real_shapes_mixed_r_zen4_cpu.json"
    zen5 = "real_shapes/real_shapes_mixed_qwen3_8L_head_int6_s8_zen5_cpu.json"
    emr = "real_shapes/real_shapes_mixed_r_emr_cpu.json"
    emr_g32 = "real_shapes/real_shapes_mixed_head_int6_g32_emr_cpu.json"  # the mixed mode with the quality row's head
    gnr_refined = "real_shapes/real_shapes_mixed_qwen3_8L_refined_head_gnr_cpu.json"
    gnr_int6 = "real_shapes/real_shapes_mixed_qwen3_8L_head_int6_gnr_cpu.json"
    for name, equal_name, where in [
        (zen4_mixed, "real_shapes/real_shapes_equal_bits_7_rounds_zen4_cpu.json", "on an AVX-512 EPYC (Zen 4)"),
        (zen5, zen5, "on an AVX-512 EPYC (Zen 5)"),
        (emr_g32, emr, "on an AVX-512 Xeon (Emerald Rapids)"),
        # the mixed mode with the refined head, the equal-bits row with the int6 head
        (gnr_refined, gnr_int6, "on an AVX-512 Xeon with AMX (Granite Rapids class)"),
    ]:
        run = load(name)
        r = run["settings"].get("mixed_r") or [0.75]
        mixed = "jmoe DyMoE int4/int2 + dense int4 resident, int8 dot" if r == [0.75] else \
            f"jmoe DyMoE int4/int2 r={min(r):g} + dense int4 resident, int8 dot"  # the most int2 a run timed
        at_r = "" if r == [0.75] else f" at r = {min(r):g}"
        equal = load(equal_name)
        for ours, label, from_run, from_name in [
            ("jmoe int4 + dense int4 resident, int8 dot", f"int4 experts and dense weights, {head_tier(equal)} LM head{head_groups(equal)}",
             equal, equal_name),
            (mixed, f"DyMoE int4/int2{at_r} per token (both tiers resident), {head_tier(run)} LM head{head_groups(run)}", run,
             name),
        ]:
            rows.append(decode_row(from_run, from_name, ours, "llama.cpp Q4_0", f"Qwen3-30B-A3B shapes (8 of 48 "
                                   f"layers), decode tok/s {where}, {label}, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0"))
    int3_name = "real_shapes/real_shapes_int3_zen4_cpu.json"  # three-bit experts at about Q3_K_M's bytes
    rows.append(decode_row(load(int3_name), int3_name, "jmoe int3 + dense int4 resident, int8 dot", "llama.cpp Q3_K_M",
                           "Qwen3-30B-A3B shapes (8 of 48 layers), decode tok/s on an AVX-512 EPYC (Zen 4), int3 experts "
                           "and dense int4, int6 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q3_K_M"))
    rows.append(quality_row(
        "quality/quality_vs_llama_cpp_dense_s8_zen4_cpu.json",
        ("Tiny Qwen3-MoE, perplexity over bf16 (prose / code / math) on the same tokens as llama.cpp: jmoe GPTQ int3 "
         "experts + dense int4 + int6 head; llama.cpp Q3_K_M"),
        [("jmoe", "GPTQ: int3 experts + dense int4 (int6 head), int8 dot"), ("llama.cpp", "Q3_K_M")]))
    for name, what in FAMILY_HEADLINES:
        rows.append(decode_row(load(name), name, "jmoe int4 + dense int4 resident, int8 dot", "llama.cpp Q4_0", what))
    avx2 = "kernels/thread_scaling_qwen3-30b-a3b_8L_head_int4_cpu_layout_cpu.json"
    scaled = load(avx2)
    dec = scaled["summary"]["decode_tok_s @2"]
    rows.append([("Qwen3-30B-A3B shapes (8 layers), decode tok/s on an AVX2 EPYC, int4 experts in the CPU layout "
                  "(`--cpu-layout`), dense int4, int4 LM head, `cpu_dot=\"int8\"`, vs llama.cpp Q4_0"),
                 f"{f(dec['jmoe'])} vs {f(dec['llama.cpp'])} ({dec['ratio']['median']:.2f}×)",
                 machine(scaled), source(avx2)])
    bf16_name = "real_shapes/real_shapes_bf16_zen5_cpu.json"
    rows.append(decode_row(load(bf16_name), bf16_name, "jmoe bf16 resident", "llama.cpp BF16",
                           "Qwen3-30B-A3B shapes (8 layers), decode tok/s on an AVX-512 EPYC (Zen 5), bf16 throughout, "
                           "projections and LM head in the CPU layout (`--cpu-layout`), vs llama.cpp BF16"))
    mixtral_bf16 = "real_shapes/real_shapes_mixtral_bf16_zen5_cpu.json"
    rows.append(decode_row(load(mixtral_bf16), mixtral_bf16, "jmoe bf16 resident", "llama.cpp BF16",
                           "Mixtral-8x7B shapes (2 of 32 layers), decode tok/s on an AVX-512 EPYC (Zen 5), bf16 "
                           "throughout, experts, projections and LM head in the CPU layout (`--cpu-layout`), vs "
                           "llama.cpp BF16"))
    lru = offload["runs"]["temperature_0"]["lru@25%"]
    rows.append([
        "Qwen3-30B-A3B shapes (8 layers, int4), decode with a quarter of the experts' bytes (`lru`), speed of resident",
        f"{lru['speed_vs_resident']['median']:.2f}×",
        machine(offload), source("offload_decode/offload_decode_qwen3_cpu.json"),
    ])
    case = io["cases"]["lru"]
    rows.append([
        "Tiny model offloaded (`lru`), blocking host reads per decode token; ms/token over resident",
        f"{case['counts']['decode']['blocking_reads']:.1f}; {case['timing']['ratio']['median']:.2f}×",
        machine(io), source("decode_io/decode_io_after_cpu.json"),
    ])
    top = serve["runs"]["resident"][-1]
    rows.append([
        f"`jmoe serve` engine, {top['streams']} streams, tiny model: tok/s, engine vs threads calling `generate`",
        f"{f(top['batched']['aggregate_tokens_per_s'], 0)} vs {f(top['threaded']['aggregate_tokens_per_s'], 0)} "
        f"({top['aggregate_speedup']:.2f}×)",
        machine(serve), source("serve/serve_tiny_cpu.json"),
    ])
    for depth_name, at in (("long_context/depth_vs_llama_qwen3-30b-a3b_2L_native_attention_zen5_cpu.json", 4096),
                           ("long_context/depth16k_vs_llama_qwen3-30b-a3b_2L_native_attention_zen5_cpu.json", 16384)):
        depth = load(depth_name)
        deep = depth["summary"][f"int8 / q8_0 @{at}"]
        rows.append([
            f"Qwen3-30B-A3B shapes (2 layers, int4 + dense int4), decode tok/s at {at:,} tokens of context, int8 KV vs "
            "llama.cpp Q4_0 with q8_0 KV",
            f"{f(deep['jmoe_tok_s'])} vs {f(deep['llama_cpp_tok_s'])} ({deep['ratio']['median']:.2f}×)",
            machine(depth), source(depth_name),
        ])
    prefix = load("prefix_sharing/prefix_sharing_cpu.json")
    pairs = list(zip(prefix["rounds"]["alone"], prefix["rounds"]["shared"]))
    alone, shared = (statistics.median(r[i]["ttft_median_s"] for r in pairs) for i in (0, 1))
    rows.append([
        f"`jmoe serve` engine, {prefix['requests']} requests sharing a {prefix['system_tokens']:,}-token system prompt, "
        "tiny model: median time to first token, prefix cache vs none",
        f"{f(shared, 2)} vs {f(alone, 2)} s ({statistics.median(prefix['ttft_median_ratio_alone_over_shared']):.1f}×)",
        machine(prefix), source("prefix_sharing/prefix_sharing_cpu.json"),
    ])
    pages = load("kv_pages/kv_pages_cpu.json")
    whole, paged = pages["pools"]["16 contexts"], pages["pools"]["2 contexts"]
    rows.append([
        f"`jmoe serve` engine, {pages['rows']} rows of {pages['context']:,} tokens, tiny model: KV cache reserved and "
        "tok/s, whole contexts vs a pool of pages holding two",
        f"{size(whole['kv_bytes'])} vs {size(paged['kv_bytes'])}; {f(whole['tokens_per_s']['median'], 0)} vs "
        f"{f(paged['tokens_per_s']['median'], 0)} tok/s",
        machine(pages), source("kv_pages/kv_pages_cpu.json"),
    ])
    k = next(k for k in gpu["kernels"] if k["model"] == "qwen3-30b-a3b" and k["phase"] == "decode" and k["tier"] == "int4")
    rows.append([
        "Qwen3-30B-A3B int4 expert kernels, one decode token, measured",
        f"{f(k['kernel_GBps'], 0)} GB/s",
        machine(gpu), source("gpu_suite/gpu_kernels_h100.json"),
    ])
    mg = load("offload_decode/offload_decode_qwen3_modelled_cpu.json")["modelled_gpu"]
    rows.append([
        "Offloaded decode (`lru`, a quarter of the experts, chained fetches) at Qwen3 shapes, 8 layers, on an H100 over"
        " PCIe: **modelled**",
        f"{mg['cases']['lru@25%']['modelled_tpot_ms']:.2f} ms/token (resident {mg['cases']['resident']['modelled_tpot_ms']:.2f}),"
        " modelled",
        f"modelled, not measured ({mg['params']['name']}), from traces recorded on a CPU",
        source("offload_decode/offload_decode_qwen3_modelled_cpu.json"),
    ])
    h200 = load("offload_decode/offload_decode_qwen3_2L_h200.json")
    speed = {run: [h200[run]["runs"][t]["lru@25%"]["speed_vs_resident"]["median"]
                   for t in ("temperature_0", "temperature_1")] for run in ("before", "after")}
    rows.append([
        "Offloaded decode, exact (`lru`, a quarter of the experts) at Qwen3 shapes, 2 layers, on an H200: **measured** "
        "speed of resident, greedy / sampled, 2 fixed miss slots a layer → misses fetched by chains of conditionals",
        "{:.2f}× / {:.2f}× → {:.2f}× / {:.2f}×".format(*speed["before"], *speed["after"]),
        machine(h200), source("offload_decode/offload_decode_qwen3_2L_h200.json"),
    ])
    suite = load("gpu_suite/gpu_suite_h200.json")
    lru = {r["budget_fraction"]: r for r in suite["offloaded_decode"] if r["policy"] == "lru"}
    rows.append([
        "Offloaded decode, exact (`lru`, half / a quarter of the experts) at Qwen3 shapes, 4 layers, on an H200 "
        "(`make gpu`): **measured** speed of resident, greedy; 1 blocking read and 1 execution per token",
        "{:.2f}× / {:.2f}×".format(lru[0.5]["x_resident"], lru[0.25]["x_resident"]),
        machine(suite), source("gpu_suite/gpu_suite_h200.json"),
    ])
    h100 = load("offload_decode/offload_decode_qwen3_2L_h100.json")
    after = {row["temperature"]: row for row in h100["after_run_again"]["rows"] if row["case"] == "lru@25%"}
    rows.append([
        "Offloaded decode (`lru`, a quarter of the experts, 2 miss slots a layer) at Qwen3 shapes, 2 layers, on an "
        "H100: **measured** speed of resident, greedy / sampled",
        f"{after[0.0]['speed_vs_resident']['median']:.2f}× / {after[1.0]['speed_vs_resident']['median']:.2f}×",
        machine(h100), source("offload_decode/offload_decode_qwen3_2L_h100.json"),
    ])
    return table(["what", "figure", "machine", "source"], rows)


def real_shapes() -> str:
    d = load("real_shapes/real_shapes_cpu.json")
    s = d["summary"]
    gib = 2 ** 30
    rows = []
    for key, label in [
        ("jmoe bf16 resident", "jmoe bf16 experts, bf16 dense"),
        ("llama.cpp BF16", "llama.cpp BF16"),
        ("jmoe int4 resident", "jmoe int4 experts, bf16 dense"),
        ("jmoe int4 + dense int4 resident", "jmoe int4 experts, `--dense-tier int4`"),
        ("jmoe int4 + dense int4 resident, int8 dot", "jmoe int4 experts, `--dense-tier int4`, `cpu_dot=\"int8\"`"),
        ("llama.cpp Q4_0", "llama.cpp Q4_0"),
        ("jmoe int4 pools 25%", "jmoe int4, pools holding 25% of the experts"),
        ("jmoe bf16 pools 25%", "jmoe bf16, pools holding 25% of the experts"),
    ]:
        r = s[key]
        rss = f"{r['peak_rss_bytes']['median'] / gib:.2f} / {r['loaded_bytes']['median'] / gib:.2f}"
        if r["kind"] == "jmoe" and r["rss_over_loaded"]["median"] >= 1:
            rss += f" ({r['rss_over_loaded']['median']:.2f}x)"
        rows.append([label, med(r["prefill_tok_s"]), med(r["decode_tok_s@0"], 2 if r["decode_tok_s@0"]["median"] < 10 else 1),
                     med(r["decode_tok_s@512"], 2 if r["decode_tok_s@512"]["median"] < 10 else 1), rss])
    out = table(["", "prefill tok/s (512)", "decode tok/s (depth 0)", "decode tok/s (depth 512)", "peak RSS / loaded GiB"], rows)
    return out + (f"\n\nMachine: {machine(d)}; {d['settings']['rounds']} rounds, median [min–max] "
                  f"({source('real_shapes/real_shapes_cpu.json')}).")


def real_shapes_avx2() -> str:
    name = "real_shapes/real_shapes_avx2_cpu.json"
    d = load(name)
    gib = 2 ** 30
    rows = []
    for key, label in [
        ("jmoe int4 resident", "jmoe int4 experts, bf16 dense"),
        ("jmoe int4 resident, int8 dot", "jmoe int4 experts, bf16 dense, `cpu_dot=\"int8\"`"),
        ("jmoe int4 + dense int4 resident", "jmoe int4 experts, `--dense-tier int4`"),
        ("jmoe int4 + dense int4 resident, int8 dot", "jmoe int4 experts, `--dense-tier int4`, `cpu_dot=\"int8\"`"),
        ("llama.cpp Q4_0", "llama.cpp Q4_0"),
    ]:
        r = d["summary"][key]
        rss = f"{r['peak_rss_bytes']['median'] / gib:.2f} / {r['loaded_bytes']['median'] / gib:.2f}"
        rows.append([label, med(r["prefill_tok_s"]), med(r["decode_tok_s@0"]), med(r["decode_tok_s@512"]), rss])
    out = table(["", "prefill tok/s (512)", "decode tok/s (depth 0)", "decode tok/s (depth 512)",
                 "peak RSS / loaded GiB"], rows)
    ratio = d["ratios"]["jmoe int4 + dense int4 resident, int8 dot / llama.cpp Q4_0"]
    out += "\n\n" + table(["jmoe int4 + dense int4, int8 dot / llama.cpp Q4_0", "prefill (512)", "decode (depth 0)",
                            "decode (depth 512)"],
                           [["within each round", med(ratio["prefill_tok_s"], 2), med(ratio["decode_tok_s@0"], 2),
                             med(ratio["decode_tok_s@512"], 2)]])
    return out + (f"\n\nMachine: {machine(d)}, AVX2 without AVX-512; {d['settings']['rounds']} rounds, "
                  f"median [min–max] ({source(name)}).")


XEON_LABELS = [  # summary key -> row label, in table order (rows a run lacks are left out)
    ("jmoe bf16 resident", "jmoe bf16 experts, bf16 dense"),
    # runs before bench.real_shapes ran bf16 with float inputs whatever --cpu-dots said (nothing of it is integer)
    ("jmoe bf16 resident, int8 dot", "jmoe bf16 experts, bf16 dense"),
    ("jmoe bf16 resident, bf16 dot", "jmoe bf16 experts on inputs rounded to bf16 (`cpu_dot=\"int8\"`), bf16 dense"),
    ("llama.cpp BF16", "llama.cpp BF16"),
    ("jmoe int4 resident, int8 dot", "jmoe int4 experts, bf16 dense, `cpu_dot=\"int8\"`"),
    ("jmoe int2 resident, int8 dot", "jmoe int2 experts, bf16 dense, `cpu_dot=\"int8\"`"),
    ("jmoe int4 + dense int4 resident, int8 dot", "jmoe int4 experts, `--dense-tier int4`, `cpu_dot=\"int8\"`"),
    ("jmoe int3 + dense int4 resident, int8 dot", "jmoe int3 experts, `--dense-tier int4`, `cpu_dot=\"int8\"`"),
    ("jmoe DyMoE int4/int2 + dense int4 resident, int8 dot",
     "jmoe DyMoE int4/int2 (both tiers whole), `--dense-tier int4`, `cpu_dot=\"int8\"`"),
    ("llama.cpp Q4_0", "llama.cpp Q4_0"),
    ("llama.cpp Q3_K_M", "llama.cpp Q3_K_M"),
]
LLAMA_ROWS = 2  # XEON_LABELS ends with llama.cpp's quantized rows


def mixed_ratio_labels(d: dict) -> list[tuple[str, str]]:
    """(summary key, row label) of a run's mixed mode at DyMoE ratios other than the default
    (bench.real_shapes --mixed-r), by falling r, placed before llama.cpp's row."""
    prefix = "jmoe DyMoE int4/int2 r="
    keys = sorted((k for k in d["summary"] if k.startswith(prefix)), key=lambda k: -float(k[len(prefix):].split()[0]))
    return [(k, f"jmoe DyMoE int4/int2 at r = {k[len(prefix):].split()[0]} (both tiers whole), `--dense-tier int4`, "
                "`cpu_dot=\"int8\"`") for k in keys]


def head_tier(d: dict) -> str:
    """The LM head's tier in a real-shapes run's dense-int4 conversions (runs from before the head had
    a tier of its own held it at the dense tier)."""
    return d["conversions"].get("jmoe dense int4", {}).get("head_tier", "int4")


def head_groups(d: dict) -> str:
    """" in groups of G" where a real-shapes run set the LM head's group size (--head-group-size), or
    its head had 8-bit scales (the int6 head's default since groups of 32)."""
    fmt = d["conversions"].get("jmoe dense int4", {}).get("head_format") or {}
    group = d["settings"].get("head_group_size")
    top = d["settings"].get("refine_head")  # the refined head (jmoe/layers/refined_head.py)
    refined = f", its {top} largest logits refined from int8 rows" if top else ""
    if fmt.get("scale_bits") == 8:
        return f" in groups of {group or fmt['group_size']}, 8-bit scales{refined}"
    return (f" in groups of {group}" if group else "") + refined


def shapes_on_avx512(name: str, layout: str = "`--cpu-layout`") -> str:
    """A real-shapes run on an AVX-512 machine: every configuration it has, then its ratios to llama.cpp
    (layout: how jmoe's rows name a --cpu-layout conversion)."""
    d = load(name)
    gib = 2 ** 30
    rows = []
    for key, label in XEON_LABELS[:-LLAMA_ROWS] + mixed_ratio_labels(d) + XEON_LABELS[-LLAMA_ROWS:]:  # llama.cpp last
        if key not in d["summary"]:
            continue
        label = label.replace("`--dense-tier int4`", f"`--dense-tier int4` ({head_tier(d)} head{head_groups(d)})")
        if d["settings"].get("cpu_layout") and key.startswith("jmoe"):
            label += ", " + layout
        r = d["summary"][key]
        rss = f"{r['peak_rss_bytes']['median'] / gib:.2f} / {r['loaded_bytes']['median'] / gib:.2f}"
        rows.append([label, med(r["prefill_tok_s"]), med(r["decode_tok_s@0"]), med(r["decode_tok_s@512"]), rss])
    out = table(["", "prefill tok/s (512)", "decode tok/s (depth 0)", "decode tok/s (depth 512)",
                 "peak RSS / loaded GiB"], rows)
    ratios = [[key.split(" / ")[0].removeprefix("jmoe ") + " / " + key.split(" / ")[1], med(r["prefill_tok_s"], 2),
               med(r["decode_tok_s@0"], 2), med(r["decode_tok_s@512"], 2)]
              for key, r in d["ratios"].items()
              if key.split(" / ")[1] in ("llama.cpp Q4_0", "llama.cpp BF16", "llama.cpp Q3_K_M")]
    out += "\n\n" + table(["jmoe / llama.cpp, within each round", "prefill (512)", "decode (depth 0)",
                            "decode (depth 512)"], ratios)
    return out + (f"\n\n{d['model']['name']} shapes, {d['model']['layers']} layers, random weights. Machine: "
                  f"{machine(d)}; {d['settings']['rounds']} rounds, median [min–max] ({source(name)}).")


def head_formats(name: str = "kernels/head_formats_zen5_cpu.json") -> str:
    """The int6 head's formats timed alone (bench/head_formats.py)."""
    d = load(name)
    base = next(k for k in d["formats"][0] if k.endswith("within a round"))
    rows = [[r["format"], f"{r['read_mb']:.1f}", f"{r['stored_mb']:.1f}", med(r["ms"], 2), f"{r['gb_s']:.1f}",
             med(r[base], 3)] for r in d["formats"]]
    return table(["Qwen3-30B-A3B's int6 head, one row, int8 dot", "MB read", "MB stored", "ms",
                  "GB/s read", base.replace(" time over this, within a round", ": its time over this one's")],
                 rows) + (f"\n\n{d['rounds']} alternating rounds, each a jitted chain of {d['calls']} dependent "
                          f"calls, median [min–max]. Machine: {machine(d)} ({source(name)}).")


def router_matmul() -> str:
    """bench.router_matmul before and after the narrow-tile path: each family's router, one token."""
    before, after = (load(f"router_matmul/router_matmul{tag}_zen5_cpu.json") for tag in ("_before", ""))
    old = {r["model"]: r for r in before["rows"]}
    rows = [[r["model"], f"{r['hidden']:,} x {r['experts']}", f"{old[r['model']]['native_us']:.1f}",
             f"{r['native_us']:.1f}", f"{r['xla_dot_us']:.1f}", "XLA's dot" if r["experts"] < 64 else "native"]
            for r in after["rows"]]
    return table(["model", "router [D, E], bf16", "native kernel before (us)", "native kernel now (us)",
                  "XLA's dot (us)", "the step uses"], rows) + (
        f"\n\nOne token, inside a jitted chain of {after['calls']} dependent calls, median of {after['repeat']}. "
        f"Machine: {machine(after)} ({source('router_matmul/router_matmul_before_zen5_cpu.json')}, "
        f"{source('router_matmul/router_matmul_zen5_cpu.json')}).")


def thread_scaling() -> str:
    name = "kernels/thread_scaling_qwen3-30b-a3b_2L_cpu.json"
    d = load(name)
    rows = []
    for t in d["threads"]:
        for metric, label in (("prefill_tok_s", f"prefill ({d['prompt']})"), ("decode_tok_s", "decode")):
            r = d["summary"][f"{metric} @{t}"]
            rows.append([t, label, f(r["jmoe"]), f(r["llama.cpp"]), med(r["ratio"], 2)])
    lo, hi = min(d["threads"]), max(d["threads"])
    sc = d["scaling"]
    gain = lambda who, metric: f"{sc[f'{who} {metric} {hi}/{lo} threads']:.2f}x"  # noqa: E731
    rows.append([f"{hi} over {lo}", "prefill / decode",
                 f"{gain('jmoe', 'prefill_tok_s')} / {gain('jmoe', 'decode_tok_s')}",
                 f"{gain('llama.cpp', 'prefill_tok_s')} / {gain('llama.cpp', 'decode_tok_s')}", ""])
    out = table(["threads", "", "jmoe tok/s", "llama.cpp tok/s", "jmoe / llama.cpp"], rows)
    return out + (f"\n\n{d['model']}; jmoe {d['jmoe']}; llama.cpp {d['llama_cpp']}; {d['rounds']} alternating "
                  f"rounds, medians, ratios within a round [min–max]. Machine: {machine(d)} ({source(name)}).")


ZEN5_LAYOUTS = {  # the 8-layer slice on the AVX-512 EPYC (Zen 5): bench.thread_scaling --cpu-layout --tag ...
    "experts tiled (the earlier `--cpu-layout` and kernels)":
        "kernels/thread_scaling_qwen3-30b-a3b_8L_head_int4_cpu_layout_zen5_before_cpu.json",
    "experts and LM head tiled (the earlier kernels)":
        "kernels/thread_scaling_qwen3-30b-a3b_8L_head_int4_cpu_layout_zen5_head_cpu.json",
    "experts, dense weights and LM head tiled (`--cpu-layout` and kernels now)":
        "kernels/thread_scaling_qwen3-30b-a3b_8L_head_int4_cpu_layout_zen5_cpu.json",
}


def thread_scaling_table(names: dict[str, str], first_header: str, *, machine_note: str = "",
                         rounds_column: bool = False) -> str:
    """Rows of 8-layer bench.thread_scaling results at 2 threads (label -> results file), beside llama.cpp."""
    rows = []
    for label, name in names.items():
        d = load(name)
        pre, dec = d["summary"]["prefill_tok_s @2"], d["summary"]["decode_tok_s @2"]
        rows.append([label, f(pre["jmoe"]), f(pre["llama.cpp"]), med(pre["ratio"], 2), f(dec["jmoe"]),
                     f(dec["llama.cpp"]), med(dec["ratio"], 2)] + ([str(d["rounds"])] if rounds_column else []))
    out = table([first_header, f"prefill ({d['prompt']}) tok/s", "llama.cpp", "ratio", "decode tok/s", "llama.cpp",
                 "ratio"] + (["rounds"] if rounds_column else []), rows)
    each = "" if rounds_column else f"each file {d['rounds']} "
    return out + (f"\n\n{d['model']}; jmoe bench -r 3 --threads 2; llama.cpp {d['llama_cpp']} (its Q4_0 GGUF keeps "
                  f"the LM head at Q6_K); {each}alternating rounds, medians, ratios within a round [min–max]. "
                  f"Machine: {machine(d)}{machine_note} ({source(*names.values())}).")


def cpu_layout_zen5() -> str:
    """The 8-layer slice at 2 threads beside llama.cpp on the AVX-512 EPYC, as each part of the
    weights came into the CPU layout (bench.thread_scaling --layers 8 --head-tier int4 --cpu-layout)."""
    return thread_scaling_table(ZEN5_LAYOUTS, "jmoe int4 + dense int4, int4 LM head, int8 dot",
                                machine_note=", AVX-512 with VNNI (Zen 5)", rounds_column=True)


def decode_ab_zen5(name: str, first_header: str) -> str:
    """A bench.decode_ab run on the AVX-512 EPYC: each case's decode rate and its ratio to the first."""
    d = load(name)
    first = next(iter(d["cases"]))
    rows = [[case, f(s["decode_tok_s"]), med(s[f"over {first}"], 2)] for case, s in d["summary"].items()]
    out = table([first_header, "decode tok/s", f"over {first}, within a round"], rows)
    return out + (f"\n\njmoe bench {d['jmoe_bench']}; {d['rounds']} alternating rounds, medians [min–max]. "
                  f"Machine: {machine(d)}, AVX-512 with VNNI (Zen 5) ({source(name)}).")


def cpu_layout_ab_zen5() -> str:
    """The three conversions of ZEN5_LAYOUTS timed against each other (python -m bench.decode_ab)."""
    return decode_ab_zen5("kernels/decode_ab_qwen3_8L_cpu_layout_zen5_cpu.json",
                          "Qwen3-30B-A3B slice (8 layers), int4 + dense int4, int4 LM head")


def head_tiers_ab_zen5() -> str:
    """The slice's LM head at int8, int6 and int4 timed against each other (python -m bench.decode_ab)."""
    return decode_ab_zen5("kernels/decode_ab_qwen3_8L_head_tiers_zen5_cpu.json",
                          "Qwen3-30B-A3B slice (8 layers), int4 experts + dense int4, `--cpu-layout`")


def head_tiers_avx2() -> str:
    """The 8-layer slice at 2 threads with each LM head and expert layout (bench.thread_scaling --layers 8
    [--head-tier int4] [--cpu-layout])."""
    names = {"int8 LM head (the converter's default)": "kernels/thread_scaling_qwen3-30b-a3b_8L_cpu.json",
             "int4 LM head (`--head-tier int4`)": "kernels/thread_scaling_qwen3-30b-a3b_8L_head_int4_cpu.json",
             "int4 LM head, experts `--cpu-layout`":
                 "kernels/thread_scaling_qwen3-30b-a3b_8L_head_int4_cpu_layout_cpu.json"}
    return thread_scaling_table(names, "jmoe int4 + dense int4, int8 dot")


def startup() -> str:
    """A warm `jmoe generate` of the bundled model with the step cache on and off (python -m bench.startup)."""
    name = "startup/startup_cpu.json"
    d = load(name)
    rows = [[case, mode, med(r["command_wall_s"], 2), med(r["import_s"], 2), med(r["load_s"], 2),
             med(r["first_generate_s"], 2)] for case, modes in d["cases"].items() for mode, r in modes.items()]
    out = table(["run", "step cache", "command (s)", "import (s)", "load (s)", "first generate (s)"], rows)
    return out + (f"\n\n`{d['command']}`; {d['note']}; {d['rounds']} rounds. Machine: {machine(d)} "
                  f"({source(name)}).")


def perplexity() -> str:
    d = load("perplexity/perplexity_tiny_cpu.json")
    rows = [[dom, f(r["tokens_scored"], 0), f"{r['jmoe_ppl']:.4f}", f"{r['transformers_ppl']:.4f}"]
            for dom, r in d["domains"].items()]
    out = table(["domain", "tokens", "jmoe perplexity", "transformers perplexity"], rows)
    return out + f"\n\nMachine: {machine(d)} ({source('perplexity/perplexity_tiny_cpu.json')})."


def quality() -> str:
    names = {"-": "—", "rtn": "RTN", "gptq": "GPTQ", "haq": "HAQ"}
    rows = []
    plain = load("quality/quality_tiny_cpu.json")
    dot = load("quality/quality_tiny_int8_dot_cpu.json")
    for data, file in [(plain, "quality/quality_tiny_cpu.json"), (dot, "quality/quality_tiny_int8_dot_cpu.json")]:
        for r in data["rows"]:
            if data is dot and r["method"] == "-":
                continue
            acts = {"bf16/f32": "float", "int8 per group (cpu_dot)": "int8 per group (`cpu_dot=\"int8\"`)"}.get(
                r["activations"], r["activations"])
            tier = r["tier"] + (" W8A8" if r["activations"] == "int8 per token" else "")
            rows.append([names[r["method"]], tier, acts, f"{r['prose']:.3f}", f"{r['code']:.3f}", f"{r['math']:.3f}"])
    return table(["method", "tier", "activations", "prose", "code", "math"], rows) + (
        f"\n\nMachines: the float and W8A8 rows, {machine(plain)} ({source('quality/quality_tiny_cpu.json')}); "
        f"the `cpu_dot=\"int8\"` rows, {machine(dot)} ({source('quality/quality_tiny_int8_dot_cpu.json')}).")


INT2_FORMATS = {  # label -> results file: the int2 tier before and after its 8-bit scales
    "groups of 64, float16 scales and offsets (before)": "quality/quality_tiny_cpu.json",
    "groups of 32, 8-bit scales and offsets on per-column bases (now)": "quality/quality_tiny_int2_cpu.json",
}


METHOD_NAMES = {"rtn": "RTN", "gptq": "GPTQ", "haq": "HAQ"}


def over_own_bf16(data: dict, tier: str) -> dict[str, dict[str, float]]:
    """A bench.quality run's float-activation rows at `tier`: {method: {domain: perplexity / the run's bf16 - 1}}."""
    base = next(r for r in data["rows"] if r["tier"] == "bf16")
    return {r["method"]: {d: r[d] / base[d] - 1 for d in ("prose", "code", "math")}
            for r in data["rows"] if r["tier"] == tier and r["activations"] == "float"}


def quality_int2() -> str:
    """The int2 tier's perplexity over bf16 in its two formats (python -m bench.quality [--tiers int2 --no-w8a8])."""
    rows, machines = [], []
    for label, name in INT2_FORMATS.items():
        data = load(name)
        for method, over in over_own_bf16(data, "int2").items():
            rows.append([label, METHOD_NAMES[method]] + [f"+{100 * v:.2f}%" for v in over.values()])
        machines.append(f"{label.split(',')[0]}: {machine(data)} ({source(name)})")
    return table(["int2 format", "method", "prose", "code", "math"], rows) + (
        "\n\nPerplexity over each run's own bf16 on the whole dev splits. Machines: " + "; ".join(machines) + ".")


# tier -> the results file holding it in its default format (python -m bench.quality [--tiers T --no-w8a8])
TIER_QUALITY = {
    "int4": "quality/quality_tiny_cpu.json",
    "int3": "quality/quality_tiny_int3_cpu.json",
    "int2": "quality/quality_tiny_int2_cpu.json",
}


def quality_tiers() -> str:
    """Every quantized expert tier below int8 by every method, each over its own run's bf16."""
    cells, machines = {}, []
    for tier, name in TIER_QUALITY.items():
        data = load(name)
        for method, over in over_own_bf16(data, tier).items():
            cells[(method, tier)] = " / ".join(f"{100 * v:+.2f}%" for v in over.values())
        machines.append(f"{tier}: {machine(data)} ({source(name)})")
    rows = [[METHOD_NAMES[m]] + [cells.get((m, tier), "") for tier in TIER_QUALITY] for m in METHOD_NAMES]
    header = ["method"] + [f"{tier} (prose / code / math)" for tier in TIER_QUALITY]
    return table(header, rows) + (
        "\n\nPerplexity of the tiny model over its bf16 on the whole dev splits, experts at each tier's default "
        "format (int4: groups of 64, float16 scales, 4.50 bits per weight; int3: groups of 32, 8-bit scales, 3.55; "
        "int2: groups of 32, 8-bit scales, 2.55; at Qwen3-30B-A3B's widths, scales and bases included), "
        "dense weights and LM head bf16. "
        "Machines: " + "; ".join(machines) + ".")


def quality_vs_llama(name: str = "quality/quality_vs_llama_cpp_cpu.json") -> str:
    d = load(name)
    domains = ("prose", "code", "math")
    rows = []
    for r in d["rows"]:
        base = r["label"] in ("bf16", "BF16")
        dense = r["dense"] if r["runtime"] == "jmoe" else f"{r['dense_bits']:.2f} bit"
        cells = [f"{r[dom]:.3f}" if base else f"{100 * r['over_bf16'][dom]:+.2f}%" for dom in domains]
        rows.append([r["runtime"], r["label"], f"{r['expert_bits']:.2f}", dense, *cells])
    scored = ", ".join(f"{d['scored_tokens'][dom]:,} {dom}" for dom in domains)
    return table(["runtime", "weights", "bits per expert weight", "dense part", *domains], rows) + (
        f"\n\nPerplexity of the bf16 rows, the others relative to their own runtime's bf16. Windows of "
        f"{d['ctx']} tokens, each scoring its second half ({scored} tokens scored, the same token ids on both "
        f"sides); llama.cpp {d['llama_cpp'].removeprefix('version: ')}. Machine: {machine(d)} ({source(name)}).")


def quality_policies(name: str = "quality/quality_policies_vs_llama_cpp_emr_cpu.json") -> str:
    """Every expert tier and precision policy of one GPTQ conversion beside llama.cpp's types, on the
    three dev domains and the shifting stream (python -m bench.quality --llama-cpp --rows "GPTQ experts
    with dense bf16"), and the share of the int2 -> int4 gap each jmoe row closes on the stream."""
    d = load(name)
    columns = ("prose", "code", "math", "stream")
    prefix = "GPTQ experts with dense bf16: "
    jmoe = {r["label"].removeprefix(prefix): r for r in d["rows"] if r["runtime"] == "jmoe"}
    p4, p2 = jmoe["int4"]["stream"], jmoe["int2"]["stream"]
    rows = []
    for r in d["rows"]:
        base = r["label"] in ("bf16", "BF16")
        cells = [f"{r[c]:.3f}" if base else f"{100 * r['over_bf16'][c]:+.2f}%" for c in columns]
        closed = "" if base or r["runtime"] != "jmoe" else f"{100 * (p2 - r['stream']) / (p2 - p4):.0f}%"
        bits = "moves with the routing" if r.get("expert_bits") is None else f"{r['expert_bits']:.2f}"
        rows.append([r["runtime"], r["label"].removeprefix(prefix), bits, *cells, closed])
    scored = ", ".join(f"{d['scored_tokens'][c]:,} {c}" for c in columns[:3])
    stream = d["stream"]
    return table(["runtime", "experts", "bits per expert weight", *columns[:3],
                  f"stream ({' -> '.join(stream['order'])})", "int2 -> int4 gap closed on the stream"], rows) + (
        f"\n\nPerplexity of the bf16 rows, the others relative to their own runtime's bf16 (jmoe: GPTQ experts, "
        f"dense weights and LM head bf16; the policies scored token by token, DynaExq in the budget of every expert at "
        f"int2 and 8 int4 copies a layer). Windows of {d['ctx']} tokens, each scoring its second half ({scored} "
        f"tokens scored; the stream: the start of each dev text in turn, about {stream['tokens_per_domain']:,} tokens "
        f"of each, {stream['scored_tokens']:,} scored), the same token ids on both sides; llama.cpp "
        f"{d['llama_cpp'].removeprefix('version: ')}. Machine: {machine(d)} ({source(name)}).")


def offload_h200() -> str:
    """Exact offloaded decode on a lent H200: fixed miss slots (before) against chained fetches (after)."""
    name = "offload_decode/offload_decode_qwen3_2L_h200.json"
    d = load(name)
    rows = []
    for case in ("lru@25%", "lru@50%", "lru+prefetch@25%", "dymoe-int4/int2@25%"):
        cells = [case]
        for run in ("before", "after"):
            for temperature in ("temperature_0", "temperature_1"):
                r = d[run]["runs"].get(temperature, {}).get(case)
                cells.append("–" if r is None else
                             f"{r['decode_ms']['median']:.2f} ms, {r['speed_vs_resident']['median']:.2f}x, "
                             f"{r['reads_per_token']:.2f} reads, {r['replays']} replays")
        rows.append(cells)
    return (table(["case", "before, greedy", "before, sampled", "after, greedy", "after, sampled"], rows)
            + f"\n\nMachine: {machine(d)}, one lease ({source(name)}). DyMoE's 'after' is its chained run, which"
              " the code does not keep (degrade mode stays on fixed slots).")


def host_work() -> str:
    """The host thread's own work per decode token, before and after (python -m bench.host_work)."""
    names = ("host_work/host_work_before_cpu.json", "host_work/host_work_after_cpu.json")
    before, after = (load(n) for n in names)
    rows = [[case, med(before["cases"][case]["host_ms_per_token"], 2), med(after["cases"][case]["host_ms_per_token"], 2)]
            for case in after["cases"]]
    return (table(["case", "host ms per decode token, before", "after"], rows)
            + f"\n\nMachine: {machine(after)}; {after['rounds']} rounds each, median [min–max] ({source(*names)}).")


def gpu_suite_offload_h200() -> str:
    """`make gpu`'s offloaded decode on a lent H200: each budget and policy against the resident int4 model."""
    name = "gpu_suite/gpu_suite_h200.json"
    d = load(name)
    resident = d["resident_decode"]["int4"]

    def cell(r: dict, base: dict) -> str:
        return f"{r['tpot_s'] * 1e3:.2f} ms, {base['tpot_s'] / r['tpot_s']:.2f}x"

    rows = [["resident int4", cell(resident, resident), cell(resident["sampled"], resident["sampled"]), "1.00 / 1.00",
             "–", "–"]]
    for r in d["offloaded_decode"]:
        host = r["host_per_decode_token"]
        rows.append([f"{r['policy']}@{r['budget_fraction']:.0%}", cell(r, resident),
                     cell(r["sampled"], resident["sampled"]), f"{host['reads']:.2f} / {host['executions']:.2f}",
                     f"{r['in_step_misses'] / r['tokens']:.2f} / {r['in_step_fetches'] / r['tokens']:.2f}",
                     f"{r['hit_rate']:.2f}"])
    return (table(["case", "greedy: median ms/token, x resident", "sampled", "reads / executions per token",
                   "in-step misses / fetches per token", "hit rate"], rows)
            + f"\n\nMachine: {machine(d)}, one lease ({source(name)}): 4 of 48 layers of Qwen3-30B-A3B shapes,"
              " random weights, int4 experts, bf16 compute, 2 prompts x 32 new tokens, medians of the gaps between"
              " streamed tokens after a warm-up of the same workload, nothing compiled while timed.")


def decode_io() -> str:
    before, after = load("decode_io/decode_io_before_cpu.json"), load("decode_io/decode_io_after_cpu.json")
    rows = []
    for key, case in after["cases"].items():
        b = before["cases"][key]["counts"]["decode"]
        a = case["counts"]["decode"]
        def times(timing):
            r = timing["ratio"] if timing else None
            return "1.0x" if key == "resident" or r is None else f"{r['median']:.1f}x [{r['min']:.1f}–{r['max']:.1f}]"
        ratio = f"{times(before['cases'][key].get('timing'))} → {times(case['timing'])}"
        rows.append([case["counts"]["label"].replace(" (auto)", ""),
                     f"{b['blocking_reads']:.1f} → {a['blocking_reads']:.1f}",
                     f"{b['executions']:.1f} → {a['executions']:.1f}",
                     f"{b['transfers']:.1f} → {a['transfers']:.1f}",
                     ratio])
    out = table(["policy", "blocking reads / token", "executions / token", "host-to-device transfers / token",
                 "ms/token, x resident (same rounds)"], rows)
    return out + (f"\n\nMachine: {machine(after)} (after; before: {machine(before)}); "
                  f"{source('decode_io/decode_io_before_cpu.json', 'decode_io/decode_io_after_cpu.json')}.")


def offload_quality(name: str = "offload_quality/offload_quality_tiny_4096_cpu.json") -> str:
    d = load(name)
    rows = []
    for mode, r in d["modes"].items():
        cells = []
        for dom in ("prose", "code", "math"):
            pct = r["over_bf16_pct"][dom]
            digits = 3 if dom == "math" else 2
            cells.append(f"{r[dom]:.{digits}f}" if mode == "resident bf16" else f"{r[dom]:.{digits}f} ({pct:+.2f}%)")
        rows.append([mode, *cells, f"{100 * r['degraded_share']:.1f}%"])
    out = table(["mode", "prose", "code", "math", "expert uses degraded"], rows)
    return out + f"\n\nMachine: {machine(d)} ({source(name)})."


def offload_decode() -> str:
    d = load("offload_decode/offload_decode_qwen3_cpu.json")
    greedy, sampled = d["runs"]["temperature_0"], d["runs"]["temperature_1"]
    rows = []
    resident = [(min(r[k]["resident_decode_ms"]["median"] for k in r), max(r[k]["resident_decode_ms"]["median"] for k in r))
                for r in (greedy, sampled)]
    rows.append(["resident", f"{resident[0][0]:.1f}–{resident[0][1]:.1f}", f"{resident[1][0]:.1f}–{resident[1][1]:.1f}",
                 "1 / 1", "", ""])
    for key, g in greedy.items():
        s = sampled[key]
        rows.append([key,
                     f"{g['decode_ms']['median']:.1f}, {ratio(g['speed_vs_resident'])}",
                     f"{s['decode_ms']['median']:.1f}, {ratio(s['speed_vs_resident'])}",
                     f"{g['reads_per_token']:.2f} / {g['executions_per_token']:.2f}",
                     f"{g['in_step_fetches_per_token']:.1f}, {s['in_step_fetches_per_token']:.1f}",
                     f"{g['hit_rate']:.2f}"])
    out = table(["case", "greedy: ms/token, x resident", "sampled (T = 1): ms/token, x resident",
                 "blocking reads / executions per token", "in-step fetches / token (greedy, sampled)", "hit rate"], rows)
    mg = d["modelled_gpu"]
    chained_name = "offload_decode/offload_decode_qwen3_modelled_cpu.json"
    chained = load(chained_name)["modelled_gpu"]["cases"]

    def cells(c):
        return [f"{c['modelled_tpot_ms']:.2f}", f"{c['vs_max_of_resident_and_pcie']:.2f}"] if c else ["–", "–"]

    modelled = table(["case", "H100 TPOT, ms: fixed slots", "x max(resident, PCIe floor)", "H100 TPOT, ms: chains (now)",
                      "x max(resident, PCIe floor)"],
                     [[k, *cells(c), *cells(chained.get(k))] for k, c in mg["cases"].items()])
    return (out + f"\n\nMachine: {machine(d)} ({source('offload_decode/offload_decode_qwen3_cpu.json')}).\n\n"
            + modelled + f"\n\nModelled, not measured: {mg['params']['name']}. Fixed slots: from the traces of the CPU"
            " run above, every fetch slot moving a record each step (the model then ignored the steps an accelerator runs"
            " again, which the CPU never does). Chains: the misses and look-ahead that steps fetched, and a predicate read"
            f" (25 µs) per chain and per fetch, from traces of the same cases on the Xeon ({source(chained_name)}; the"
            " slice converted with dense int4 and an int8 head, so its resident step and bytes differ).")


def serve() -> str:
    labels = ("tiny", "qwen3-30b-a3b-2L-int4", "qwen3-30b-a3b-2L-int4-int8dot")
    tiny, q, q8 = (load(f"serve/serve_{label}_cpu.json") for label in labels)

    def cell(r):
        return (f"{f(r['batched']['aggregate_tokens_per_s'], 1)} / {f(r['threaded']['aggregate_tokens_per_s'], 1)}"
                f" ({r['aggregate_speedup']:.2f}×)")

    cols = [tiny["runs"]["resident"], tiny["runs"]["offloaded"], q["runs"]["resident"], q8["runs"]["resident"]]
    rows = [[str(cols[0][i]["streams"]), *[cell(c[i]) for c in cols]] for i in range(len(cols[0]))]
    out = table(["streams", "tiny, resident: engine / threads tok/s", "tiny, a third of the experts' bytes",
                 "Qwen3 2-layer slice", "the slice, `--cpu-dot int8`"], rows)
    return out + (f"\n\nMachine: {machine(tiny)} "
                  f"({source(*(f'serve/serve_{label}_cpu.json' for label in labels))}).")


def convert_memory() -> str:
    d = load("convert_memory/convert_memory_cpu.json")
    gb = 1e9
    rows = []
    for c in d["cases"]:
        size = f"{c['checkpoint_bytes'] / gb:.2f} GB" if c["checkpoint_bytes"] > gb else f"{c['checkpoint_bytes'] / 1e6:.1f} MB"
        tiers = c["tiers"].replace(",", ", ") + (f" ({c['written_bytes'] / gb:.1f} GB)" if c["written_bytes"] > gb else "")
        rows.append([c["model"], size, c["method"].upper(), tiers, f(c["seconds"], 1 if c["seconds"] < 100 else 0),
                     f"{c['peak_rss_bytes'] / gb:.2f} GB", f"{c['peak_anon_bytes'] / gb:.2f} GB"])
    out = table(["checkpoint", "size", "method", "tiers written", "seconds", "peak RSS", "peak anonymous"], rows)
    return out + f"\n\nMachine: {machine(d)} ({source('convert_memory/convert_memory_cpu.json')})."


def overhead() -> str:
    d = load("overhead/overhead_tiny_cpu.json")
    names = {"resident": "all resident", "lru+prefetch/auto": "`auto` (default)",
             "lru+prefetch/resident": "`resident`", "lru+prefetch/layerwise": "`layerwise`"}
    rows = [[names.get(k, k), f"{v['tpot_ms']:.2f}", f"{v['ratio_to_resident']:.2f}", f"{v['host_syncs_per_token']:.0f}"]
            for k, v in sorted(d["variants"].items(), key=lambda kv: kv[1]["ratio_to_resident"] if kv[0] != "resident" else 0)]
    out = table(["path", "TPOT, ms (CPU)", "× all-resident", "host syncs per token"], rows)
    return out + (f"\n\nMachine: {machine(d)}; median of {d['repeats']} rounds "
                  f"({source('overhead/overhead_tiny_cpu.json')}).")


def gpu_decode_ab() -> str:
    d = load("gpu_decode_ab/gpu_decode_ab_gpu.json")
    names = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B", "gpt-oss-20b": "GPT-OSS-20B",
             "deepseek-v2-lite": "DeepSeek-V2-Lite"}
    rows = []
    for c in d["cases"]:
        mb = c["unique_weight_bytes"] / 1e6
        rows.append([f"{names.get(c['model'], c['model'])} {c['tier']} ({mb:,.1f} MB)" if mb < 100 else
                     f"{names.get(c['model'], c['model'])} {c['tier']} ({mb:,.0f} MB)",
                     f"{c['reference_us']:.1f} µs", f"{c['before_us']:.1f} µs", f"{c['after_us']:.1f} µs",
                     f"{f(c['after_unique_GBps'], 0)} GB/s"])
    out = table(["decode, one token", "XLA reference", "kernels before", "kernels now", "now: weight bytes / time"], rows)
    return out + (f"\n\nMeasured on an {machine(d)}, {d['timing']}; before = commit {d['before']} "
                  f"({source('gpu_decode_ab/gpu_decode_ab_gpu.json')}).")


def scale_out() -> str:
    d = load("scale_out/scale_out_qwen3-30b-a3b-8L_cpu.json")
    rows = []
    for r in d["rows"]:
        dec, pre = r["decode_collectives"], r["prefill_collectives"]
        coll = f"{dec['all_reduces']}, {pre['all_reduces']}"
        if dec["all_reduces"] and r["ep"] == 2:
            coll += f" ({dec['bytes_each'] // 1024} KiB, {pre['bytes_each'] // 1024} KiB each)"
        rows.append([str(r["ep"]), f"{f(r['expert_bytes_per_device'] / 2**20, 0)} MiB", f(r["pool_slots_per_device"], 0), coll,
                     f"{r['cpu_pp_tokens_per_s']:.1f} / {r['cpu_tg_tokens_per_s']:.1f}",
                     f"{r['busiest_shard_experts_per_decode_step']:.1f}",
                     f"{r['h100']['modelled_tpot_s'] * 1e3:.3f} ms/token (modelled)"])
    out = table(["ep", "expert bytes / device", "slots / device", "all-reduces per step (decode, prefill)",
                 "CPU pp64 / tg8 tok/s", "busiest shard's experts per decode step", "8 L, H100 × ep, modelled"], rows)
    h = d["rows"][0]["h100"]
    return out + (f"\n\nMachine: {machine(d)}, split into XLA:CPU devices "
                  f"({source('scale_out/scale_out_qwen3-30b-a3b-8L_cpu.json')}); "
                  f"the last column is modelled, not measured ({h['gpu']['name']}, {h['link']['name']}).")


MODEL_NAMES = {"tiny-qwen3-moe": "tiny-qwen3-moe", "qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B",
               "deepseek-v2-lite": "DeepSeek-V2-Lite", "gpt-oss-20b": "GPT-OSS-20B"}
TIERS = ("bf16", "int8", "int4", "int2")


# The newest equal-bits run of each family on each machine (bench.real_shapes, int6 head against Q4_0).
EQUAL_BITS_RUNS = [
    ("AMD EPYC (Zen 4)", "real_shapes/real_shapes_mixed_r_zen4_cpu.json"),
    ("AMD EPYC (Zen 4)", "real_shapes/real_shapes_gpt_oss_head_int6_zen4_cpu.json"),
    ("AMD EPYC (Zen 4)", "real_shapes/real_shapes_mixtral_head_int6_zen4_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_mixed_qwen3_8L_head_int6_s8_zen5_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_gpt_oss_6L_zen5_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_mixtral_4L_six_bit_pass_zen5_cpu.json"),
    ("Intel Xeon (Emerald Rapids)", "real_shapes/real_shapes_after_load_trim_emr_cpu.json"),
    ("Intel Xeon (Emerald Rapids)", "real_shapes/real_shapes_gpt_oss_after_load_trim_emr_cpu.json"),
    ("Intel Xeon (Emerald Rapids)", "real_shapes/real_shapes_mixtral_after_load_trim_emr_cpu.json"),
    ("Intel Xeon (Emerald Rapids)", "real_shapes/real_shapes_deepseek_v2_lite_emr_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_deepseek_v2_lite_16L_six_bit_pass_zen5_cpu.json"),
    ("Intel Xeon with AMX (Granite Rapids class)", "real_shapes/real_shapes_mixed_qwen3_8L_head_int6_gnr_cpu.json"),
]


def ratio_summary(runs: list[tuple[str, str]], comparison, note: str) -> str:
    """One row per run (CPU, results file) of jmoe against llama.cpp within each round: `comparison(run)`
    names the ratio ("ours / theirs") it reads."""
    rows = []
    for cpu, name in runs:
        d = load(name)
        key = comparison(d)
        r = d["ratios"][key]
        rss = " vs ".join(f"{d['summary'][k]['rss_over_loaded']['median']:.2f}x" for k in key.split(" / "))
        rows.append([f"{d['model']['name']}, {d['model']['layers']} layers", cpu,
                     ratio(r["prefill_tok_s"]), ratio(r["decode_tok_s@0"]), ratio(r["decode_tok_s@512"]), rss,
                     f"{d['settings']['rounds']} ({source(name)})"])
    return table(["slice (random weights)", "CPU, 2 cores", "prefill (512)", "decode (depth 0)", "decode (depth 512)",
                  "peak RSS / loaded, jmoe vs llama.cpp", "rounds"], rows) + "\n\n" + note


def equal_bits_summary() -> str:
    return ratio_summary(
        EQUAL_BITS_RUNS, lambda d: "jmoe int4 + dense int4 resident, int8 dot / llama.cpp Q4_0",
        "jmoe: int4 experts, dense int4, int6 LM head, all in the CPU layout, `cpu_dot=\"int8\"`; llama.cpp: "
        "Q4_0 (Q6_K output matrix), `llama-bench -t 2`. Ratios taken within each alternating round, "
        "median [min–max].")


BF16_RUNS = [
    ("Intel Xeon (model not recorded)", "real_shapes/real_shapes_bf16_xeon_cpu.json"),
    ("Intel Xeon (Emerald Rapids)", "real_shapes/real_shapes_deepseek_v2_lite_emr_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_bf16_zen5_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_gpt_oss_bf16_zen5_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_mixtral_bf16_9_rounds_second_zen5_cpu.json"),
    ("AMD EPYC (Zen 5)", "real_shapes/real_shapes_deepseek_v2_lite_bf16_9_rounds_second_zen5_cpu.json"),
]


def bf16_summary() -> str:
    """equal_bits_summary's table for bf16 against llama.cpp's BF16: every family's newest run."""
    return ratio_summary(
        BF16_RUNS,
        lambda d: next((k for k in d["ratios"] if k == "jmoe bf16 resident, bf16 dot / llama.cpp BF16"),
                       next(k for k in d["ratios"] if k.startswith("jmoe bf16 resident")
                            and k.endswith("/ llama.cpp BF16"))),
        "jmoe: bf16 experts and dense weights (the Zen 5 runs with `--cpu-layout`: plain projections and LM head in "
        "column tiles; in the GPT-OSS-20B, Mixtral-8x7B and DeepSeek-V2-Lite runs the bf16 experts too, and "
        "`cpu_dot=\"int8\"`: the experts' inputs rounded to bf16 as llama.cpp's BF16 dot rounds them, in the "
        "Mixtral-8x7B and DeepSeek-V2-Lite runs the dense projections' too); llama.cpp: "
        "its BF16 GGUF, `llama-bench -t 2`. Ratios taken within each alternating round, median [min–max].")


def grid_bits() -> str:
    name = "quality/grid_bits_cpu.json"
    d = load(name)
    rows = [[r["grid"], f"{r['bits_per_weight']:.2f}",
             " / ".join(f"{100 * r['over_bf16'][dom]:+.2f}%" for dom in ("prose", "code", "math"))]
            for r in sorted(d["rows"], key=lambda r: -r["bits_per_weight"])]
    return table(["expert grid (GPTQ)", "bits per weight", "perplexity over bf16 (prose / code / math)"], rows) + (
        f"\n\nThe tiny model, experts only (dense weights and LM head bf16), {d['ctx']}-token windows each scoring "
        f"its second half. Machine: {machine(d)} ({source(name)}).")


def size(nbytes: int) -> str:
    """Bytes under 1 MiB in full, else MiB or GiB to three significant figures."""
    if nbytes < 1 << 20:
        return f"{nbytes:,} B"
    value, unit = (nbytes / (1 << 30), "GiB") if nbytes >= 1 << 30 else (nbytes / (1 << 20), "MiB")
    return f"{sig3(value)} {unit}"


def sig3(value: float) -> str:
    """Three significant figures, trailing zeros kept (18.0, 9.00, 336, 1,234)."""
    decimals = max(0, 2 - math.floor(math.log10(abs(value)))) if value else 2
    return f"{value:,.{decimals}f}"


def tier_bytes() -> str:
    d = load("tier_bytes/tier_bytes_cpu.json")
    rows, totals = [], []
    for key, m in d["models"].items():
        name, tiers = MODEL_NAMES.get(key, key), m["tiers"]
        rows.append([name, *[size(tiers[t]["bytes_per_expert"]) + ("" if t == "bf16" else
                                                                  f" ({tiers[t]['bits_per_weight']:.2f} bit)")
                             for t in TIERS]])
        totals.append([f"all experts: {name} ({m['experts']:,})",
                       *[size(tiers[t]["total_expert_bytes"]) for t in TIERS]])
    out = table(["model", *TIERS], rows + totals)
    return out + f"\n\nFrom the record layout, no machine involved ({source('tier_bytes/tier_bytes_cpu.json')})."


def policies() -> str:
    d = load("policies/policies_cpu.json")
    rows = []
    for label, r in d["quality"]["rows"].items():
        if "both tiers resident" in label:
            continue
        ppl = r["perplexity"]
        rows.append([label, f"{ppl['prose']:.2f}", f"{ppl['code']:.2f}", f"{ppl['math']:.3f}",
                     f"{r['geo_mean_perplexity']:.3f}", f"{r['int2_share_of_uses']:.3f}", f"{r['skipped_uses']:,}",
                     f"{r['bytes_h2d_per_token'] / 1024:.1f}", f"{r['peak_resident_expert_bytes'] / (1 << 20):.2f}",
                     f"{1e3 * r['cpu_s_per_token_measured']:.1f}", f"{1e6 * r['gpu_s_per_token_modelled']:.0f}"])
    out = table(["policy", "prose", "code", "math", "geo-mean", "int2 share of uses", "skipped uses",
                 "KiB moved per token", "peak resident expert MiB", "CPU ms/token (measured)",
                 "GPU µs/token (modelled)"], rows)
    return out + (f"\n\nMachine: {machine(d)}; GPU times modelled ({d['gpu_params_modelled']['name']}) from the "
                  f"run's trace ({source('policies/policies_cpu.json')}).")


def policies_both_resident() -> str:
    d = load("policies/policies_cpu.json")
    rows = d["quality"]["rows"]
    chosen = [("uniform int4", "uniform int4"), ("DyMoE 4/2, r = 0.75", "DyMoE 4/2 r=0.75, both tiers resident"),
              ("random int2, same share", "random 4/2, same int2 share, both tiers resident"),
              ("uniform int2", "uniform int2")]
    out = table(["policy (both tiers resident)", "int2 share of uses", "prose", "code", "math", "geo-mean"],
                [[name, f"{rows[key]['int2_share_of_uses']:.3f}", f"{rows[key]['perplexity']['prose']:.2f}",
                  f"{rows[key]['perplexity']['code']:.2f}", f"{rows[key]['perplexity']['math']:.3f}",
                  f"{rows[key]['geo_mean_perplexity']:.3f}"] for name, key in chosen])
    return out + f"\n\nMachine: {machine(d)} ({source('policies/policies_cpu.json')})."


def placement_hit_rates() -> str:
    d = load("policies/policies_cpu.json")
    names = {"frequency": "global frequency", "paths": "activation paths", "two-stage": "two-stage"}
    out = table(["strategy", "mean", "std", "max − min"],
                [[names.get(k, k), f"{r['mean']:.3f}", f"{r['std']:.3f}", f"{r['max_min_gap']:.3f}"]
                 for k, r in d["quality"]["placement_hit_rates_on_dev"].items()])
    return out + f"\n\nFrom the routing of the dev splits ({source('policies/policies_cpu.json')})."


def speculative_acceptance() -> str:
    d = load("speculative/speculative_cpu.json")
    runs = d["acceptance_by_domain"]
    order = sorted(runs, key=lambda k: (k.split()[1] != "int4", ("prose", "code", "math").index(k.split()[0])))
    # routing fidelity is counted where a look-ahead buffer exists (offloaded runs): these are resident
    fidelity = all(r.get("draft_routing_fidelity") is not None for r in runs.values())
    rows = []
    for key in order:
        split, draft = key.split()
        r = runs[key]
        rows.append([split, draft, f"{r['acceptance_rate']:.3f}",
                     " / ".join(f"{a:.2f}" for a in r["acceptance_by_position"]),
                     f"{r['tokens_per_cycle']:.2f}"] + ([f"{r['draft_routing_fidelity']:.3f}"] if fidelity else []))
    k = len(next(iter(runs.values()))["acceptance_by_position"])
    out = table(["dev split", "draft", "acceptance", f"per drafted position (k = {k})", "tokens per cycle"]
                + (["draft routing fidelity"] if fidelity else []), rows)
    return out + f"\n\nMachine: {machine(d)} ({source('speculative/speculative_cpu.json')})."


def workload_shift() -> str:
    d = load("policies/policies_cpu.json")
    names = {"uniform int4": "uniform int4 (unbudgeted)", "uniform int2": "uniform int2 (unbudgeted)",
             "DynaExq 8/32": "DynaExq 8/32 (defaults: gate-weighted hotness, `alpha=0.9`)",
             "DynaExq 8/32, alpha 0.7": "DynaExq 8/32, `alpha=0.7` (the previous default)",
             "DynaExq 8/32, the previous defaults": "DynaExq 8/32, counts, `alpha=0.5`, `margin=0.01` (the defaults before)",
             "LRU int4 (same budget)": "LRU int4, same budget",
             "placement two-stage int4 (same budget)": "static placement (two-stage) int4 + CPU, same budget"}
    rows = []
    for label, r in d["workload_shift"]["runs"].items():
        st = r["stats"]
        moves = f"{st['promotions']:,} / {st['demotions']:,}" if st["promotions"] or st["demotions"] else "—"
        rows.append([names.get(label, label), f"{r['perplexity']:.3f}", f"{st['bytes_h2d'] / st['steps'] / 1024:.2f}",
                     moves, f"{1e3 * r['cpu_s_per_token_measured']:.1f}", f"{1e6 * r['gpu_s_per_token_modelled']:.0f}"])
    out = table(["run", "perplexity", "KiB moved per token (loading included)", "promotions / demotions",
                 "CPU ms/token (measured)", "GPU µs/token (modelled)"], rows)
    return out + f"\n\nMachine: {machine(d)}; GPU times modelled ({source('policies/policies_cpu.json')})."


def dynaexq_streams(name: str = "policies/dynaexq_streams_cpu.json", labels: dict[str, str] | None = None) -> str:
    """Each stream's share of the gap closed per policy, and all streams' together; `labels` names
    some policies' columns (else the run's names, shortened)."""
    d = load(name)
    policies = list(d["runs"][0]["gap_closed_all_streams"])
    rows = []
    for run in d["runs"]:
        for label, stream in run["streams"].items():
            rows.append([label, f"{run['tokens_per_domain']:,}", f"{stream['offset_tokens']:,}",
                         f"{stream['perplexity']['uniform int4']:.3f} / {stream['perplexity']['uniform int2']:.3f}",
                         *(f"{100 * stream['int2_to_int4_gap_closed'][k]:.0f}%" for k in policies)])
        rows.append(["all three together", f"{run['tokens_per_domain']:,}", "", "",
                     *(f"{100 * run['gap_closed_all_streams'][k]:.0f}%" for k in policies)])
    header = ["stream", "tokens per domain", "from dev token", "perplexity, uniform int4 / int2",
              *((labels or {}).get(k) or k.replace("DynaExq 8/32", "DynaExq").replace("DynaExq, ", "")
                for k in policies)]
    header = [h.replace("hindsight: the next", "foresight of").replace(" tokens", "") for h in header]
    return table(header, rows) + f"\n\nShare of the int2 -> int4 gap closed. Machine: {machine(d)} ({source(name)})."


def dynaexq_stream_offsets(name: str = "policies/dynaexq_stream_offsets_zen1_cpu.json") -> str:
    """The prose -> code -> math stream from several places in the dev texts: each place's share of
    the gap closed, then the median [range] and the pooled share per policy."""
    run = load(name)["runs"][0]
    policies = list(run["gap_closed_all_streams"])
    rows = [[f"{stream['offset_tokens']:,}",
             f"{stream['perplexity']['uniform int4']:.3f} / {stream['perplexity']['uniform int2']:.3f}",
             *(f"{100 * stream['int2_to_int4_gap_closed'][k]:.0f}%" for k in policies)]
            for stream in run["streams"].values()]
    spread = run["gap_closed_per_stream"]
    rows.append(["median [min–max]", "", *(f"{100 * spread[k]['median']:.0f}% [{100 * spread[k]['min']:.0f}–"
                                           f"{100 * spread[k]['max']:.0f}%]" for k in policies)])
    rows.append(["all together", "", *(f"{100 * run['gap_closed_all_streams'][k]:.0f}%" for k in policies)])
    header = ["from dev token", "perplexity, uniform int4 / int2",
              *(k.replace("DynaExq 8/32", "DynaExq").replace("DynaExq, ", "") for k in policies)]
    return table(header, rows) + (f"\n\nShare of the int2 -> int4 gap closed, prose -> code -> math, "
                                  f"{run['tokens_per_domain']} tokens a domain. Machine: {machine(load(name))} "
                                  f"({source(name)}).")


def dymoe_ablation() -> str:
    d = load("policies/policies_cpu.json")
    runs = d["dymoe_ablation_synthetic_qwen3_30b_a3b_4L"]
    configs = list(dict.fromkeys(k.rsplit(" @ ", 1)[0] for k in runs))
    names = {"cache": "cache (LRU)", "+prefetch": "+ prefetch", "+4/2": "+ 4/2", "+4/2+prefetch": "+ 4/2 + prefetch",
             "+4/0+prefetch": "+ 4/0 + prefetch"}

    def cells(r):
        return [sig3(r["bytes_h2d_per_token"] / (1 << 20)), f"{1e3 * r['cpu_tpot_s_measured']:.0f}",
                f"{1e3 * r['gpu_tpot_s_modelled']:.3f}"]

    rows = [[names.get(c, c), *cells(runs[f"{c} @ 25%"]), *cells(runs[f"{c} @ 50%"])] for c in configs]
    out = table(["configuration", "25%: MiB/token", "CPU ms", "GPU ms (modelled)", "50%: MiB/token", "CPU ms",
                 "GPU ms (modelled)"], rows)
    return out + f"\n\nMachine: {machine(d)}; GPU times modelled ({source('policies/policies_cpu.json')})."


def paper_headlines(model: str) -> str:
    # by its path: mkdocs runs this with its own import path
    spec = importlib.util.spec_from_file_location("paper_claims", ROOT / "bench" / "lib" / "paper_claims.py")
    claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(claims)
    name = f"paper_headlines/paper_headlines_{model}_cpu.json"
    d = load(name)
    return claims.markdown(d) + f"\n\nMachine: {machine(d)}; H100 figures modelled ({source(name)})."


def gpt_oss_shapes() -> str:
    name = "real_shapes/real_shapes_gpt_oss_cpu.json"
    d = load(name)
    gib = 1 << 30
    rows = []
    for key, label in [("jmoe bf16 resident", "jmoe bf16 experts, bf16 dense"), ("llama.cpp BF16", "llama.cpp BF16"),
                       ("jmoe int4 resident", "jmoe int4 experts, bf16 dense"),
                       ("jmoe int4 + dense int4 resident", "jmoe int4 experts, `--dense-tier int4`"),
                       ("jmoe int4 + dense int4 resident, int8 dot",
                        "jmoe int4 experts, `--dense-tier int4`, `cpu_dot=\"int8\"`"),
                       ("llama.cpp Q4_0", "llama.cpp Q4_0")]:
        r = d["summary"][key]
        rows.append([label, f"{r['prefill_tok_s']['median']:.1f}",
                     f"{r['decode_tok_s@0']['median']:.1f} / {r['decode_tok_s@512']['median']:.1f}",
                     f"{r['peak_rss_bytes']['median'] / gib:.2f} / {r['loaded_bytes']['median'] / gib:.2f}"])
    out = table(["", "prefill tok/s (512)", "decode tok/s (depth 0 / 512)", "peak RSS / loaded GiB"], rows)
    return out + (f"\n\nMachine: {machine(d)}; {d['settings']['rounds']} rounds, medians ({source(name)}).")


def load_memory() -> str:
    names = ("load_memory/load_memory_before_warm_cpu.json", "load_memory/load_memory_after_cpu.json")
    first, last = (load(n) for n in names)
    rows = []
    for case, a in last["cases"].items():
        b = first["cases"][case]
        rows.append([case, f"{a['reserved_bytes'] / (1 << 20):.0f}", f"{b['load_s']:.1f} → {a['load_s']:.1f}",
                     f"{b['peak_rss_load_ratio']:.2f}× → {a['peak_rss_load_ratio']:.2f}×",
                     f"{b['peak_rss_generate_ratio']:.2f}× → {a['peak_rss_generate_ratio']:.2f}×"])
    out = table(["case", "reserved MiB", "load s", "peak RSS of load", "peak RSS, load + 64 tokens"], rows)
    return out + f"\n\nMachine: {machine(last)} ({source(*names)})."


LONG_CONTEXT_ROUNDS = 2  # before and after each ran in turn, in separate processes, this many times


def long_context_files() -> list[tuple[str, str]]:
    return [(f"long_context/long_context_before_r{r}_cpu.json", f"long_context/long_context_after_r{r}_cpu.json")
            for r in range(1, LONG_CONTEXT_ROUNDS + 1)]


# the workspace as compiled steps hold it, none for the scores of chunks the native CPU attention runs
LONG_CONTEXT_PLAN_NOW = "long_context/long_context_plan_native_chunks_cpu.json"


def long_context_plan() -> str:
    before_name, after_name = long_context_files()[0]
    before, after, now = load(before_name), load(after_name), load(LONG_CONTEXT_PLAN_NOW)
    rows = []
    for b, a, n in zip(before["plan"], after["plan"], now["plan"], strict=True):
        rows.append([a["model"], a["dtype"], f"{a['max_seq_len']:,}", a["max_batch"], size(a["kv_cache_bytes"]),
                     f"{size(b['workspace_bytes'])} → {size(a['workspace_bytes'])}", size(n["workspace_bytes"])])
    out = table(["model", "compute dtype", "max_seq_len", "max_batch", "KV cache", "workspace, before → after",
                 "workspace now"], rows)
    return out + (f"\n\nComputed by `jmoe/runtime/loader.py` ({source(before_name, after_name)}); "
                  f"now: with every query head's width and the cache block read, below, and no block of scores "
                  f"for the prompt chunks the native CPU attention runs (the tiny model's batch chunks of 32 "
                  f"tokens a row) ({source(LONG_CONTEXT_PLAN_NOW)}).")


def long_context_workspace() -> str:
    """The compiled steps' temporaries beside the workspace the plan reserves, before and after."""
    names = ("long_context/workspace_before_cpu.json", "long_context/workspace_after_cpu.json")
    before, after = (load(n)["compiled"] for n in names)
    rows = []
    for b, a in zip(before, after, strict=True):
        rows.append([a["model"], f"{a['max_seq_len']:,}", a["max_batch"],
                     f"{size(max(b['temp_bytes'].values()))} → {size(max(a['temp_bytes'].values()))}",
                     f"{size(b['workspace_bytes'])} → {size(a['workspace_bytes'])}"])
    out = table(["model", "max_seq_len", "max_batch", "largest step's temporaries", "planned workspace"], rows)
    return out + f"\n\nBefore → after. Machine: {machine(load(names[1]))} ({source(*names)})."


def long_context_depth() -> str:
    files = long_context_files()
    runs = [(load(b), load(a)) for b, a in files]
    rows = []
    for depth in runs[0][1]["depth"]["decode"]:
        cells = {k: [(b["depth"]["decode"][depth][k]["median"], a["depth"]["decode"][depth][k]["median"])
                     for b, a in runs] for k in ("ttft_s", "decode_ms_per_token")}
        rows.append([f"{int(depth):,}"] + [" ; ".join(f"{f(b, 2)} → {f(a, 2)}" for b, a in cells[k])
                                           for k in ("ttft_s", "decode_ms_per_token")])
    first = runs[0][1]["depth"]
    out = table(["prompt tokens", "time to first token, s (round 1 ; round 2)", "decode ms/token (round 1 ; round 2)"],
                rows)
    return out + (f"\n\nBefore → after, medians of {first['rounds']} runs each, {first['new_tokens']} new tokens, "
                  f"max_seq_len {first['max_seq_len']:,}. Machine: {machine(runs[0][1])} "
                  f"({source(*(n for pair in files for n in pair))}).")


def kv_int8() -> str:
    """The int8 KV cache: its reservation beside the compute dtype's, the tiny model's perplexity and
    greedy agreement, and decode at depth."""
    quality_name, depth_name = "long_context/kv_int8_quality_cpu.json", "long_context/kv_int8_depth_cpu.json"
    quality, depth = load(quality_name), load(depth_name)
    plan = table(["model", "compute dtype", "max_seq_len", "max_batch", "KV cache", "int8 KV cache"],
                 [[r["model"], r["dtype"], f"{r['max_seq_len']:,}", r["max_batch"], size(r["kv_cache_bytes"]),
                   size(r["int8_kv_cache_bytes"])] for r in quality["plan"]])
    q = quality["quality"]
    rows = []
    for domain in ("prose", "code", "math"):
        ppl = q[domain]["perplexity"]
        rows.append([domain, f(ppl["compute"], 3), f"{f(ppl['int8'], 3)} ({100 * (ppl['int8'] / ppl['compute'] - 1):+.3f}%)",
                     f"{q[domain]['greedy_tokens_equal_before_first_difference']['int8']} of {q['new_tokens']}"])
    scores = table(["dev text", "perplexity, float32 KV", "perplexity, int8 KV", "greedy tokens equal before the first "
                    "difference"], rows)
    d = depth["depth"]
    int8 = d["decode"]["int8_kv"]  # the compute-dtype rows by depth, the int8 ones beside them
    timing = table(["prompt tokens", "decode ms/token, float32 KV", "decode ms/token, int8 KV",
                    "time to first token s, float32 KV", "time to first token s, int8 KV"],
                   [[f"{int(k):,}", med(v["decode_ms_per_token"], 2), med(int8[k]["decode_ms_per_token"], 2),
                     med(v["ttft_s"], 2), med(int8[k]["ttft_s"], 2)] for k, v in d["decode"].items() if k.isdigit()])
    return (plan + "\n\n" + scores + f"\n\nThe tiny model, float32 compute: perplexity over {q['tokens_per_domain']:,} "
            f"tokens of each dev text in windows of {q['window']:,}; greedy continuation of a {q['prompt_tokens']:,}-token "
            "prompt.\n\n" + timing + f"\n\nMedians [min–max] of {d['rounds']} alternating rounds, {d['new_tokens']} new "
            f"tokens, max_seq_len {d['max_seq_len']:,}. Machine: {machine(depth)} ({source(quality_name, depth_name)}).")


def kv_dtypes() -> str:
    """Every KV cache dtype's perplexity and greedy agreement on the tiny model, beside its compute dtype's."""
    name = "long_context/kv_fp8_quality_cpu.json"
    q = load(name)["quality"]
    kinds = [k for k in q["prose"]["perplexity"] if k != "compute"]
    rows = []
    for domain in ("prose", "code", "math"):
        ppl, same = q[domain]["perplexity"], q[domain]["greedy_tokens_equal_before_first_difference"]
        rows.append([domain, f(ppl["compute"], 3)] + [f"{f(ppl[k], 3)} ({100 * (ppl[k] / ppl['compute'] - 1):+.2f}%), "
                                                      f"{same[k]} of {q['new_tokens']}" for k in kinds])
    out = table(["dev text", "float32 KV"] + [f"{k} KV: perplexity, greedy tokens equal" for k in kinds], rows)
    return out + (f"\n\nThe tiny model, float32 compute: perplexity over {q['tokens_per_domain']:,} tokens of each dev "
                  f"text in windows of {q['window']:,}; greedy continuation of a {q['prompt_tokens']:,}-token prompt, "
                  f"tokens equal to the float32 cache's before the first difference. Machine: {machine(load(name))} "
                  f"({source(name)}).")


DEPTH_HEADER = ["KV cache, jmoe / llama.cpp", "depth (tokens)", "jmoe decode tok/s", "llama.cpp decode tok/s",
                "jmoe / llama.cpp"]


def depth_rows(data: dict) -> list[list[str]]:
    """A bench.depth_vs_llama result's summary as rows under DEPTH_HEADER, one per KV pair and depth."""
    rows = []
    for key, v in data["summary"].items():
        pair, depth = key.rsplit(" @", 1)
        rows.append([pair, f"{int(depth):,}", f(v["jmoe_tok_s"]), f(v["llama_cpp_tok_s"]), med(v["ratio"], 2)])
    return rows


def depth_vs_llama(name: str = "long_context/depth_vs_llama_qwen3-30b-a3b_2L_cpu.json") -> str:
    data = load(name)
    out = table(DEPTH_HEADER, depth_rows(data))
    return out + (f"\n\n{data['model']}; jmoe {data['jmoe']}; llama.cpp {data['llama_cpp']}; {data['new_tokens']} new "
                  f"tokens; medians of {data['rounds']} alternating rounds, ratios within a round [min–max]. "
                  f"Machine: {machine(data)} ({source(name)}).")


def expert_mixed_tiers(name: str = "kernels/expert_mixed_tiers_cpu.json") -> str:
    """The mixed mode's routed call alone: int4 and int2 pools in one call, a token's experts split."""
    d = load(name)
    rows = [[case, f"{r['ms']:.3f} [{r['min_ms']:.3f}–{r['max_ms']:.3f}]", f"{r['weight_bytes'] / 1e6:.2f}",
             f"{r['weight_gb_per_s']:.1f}"] for case, r in d["results"].items()]
    return table(["a token's 8 experts", "ms per call", "weight MB read", "GB/s of weights"], rows) + (
        f"\n\n{d['case']}; medians [min–max] of {d['rounds']} alternating rounds of {d['calls_per_round']} calls. "
        f"Machine: {machine(d)} ({source(name)}).")


def cpu_attention(name: str) -> str:
    data = load(name)
    rows = [[f"{r['depth']:,}", r["cache"], r["tokens"], med(r["xla_ms"], 3), med(r["native_ms"], 3),
             f(r["native_gb_s"], 1), med(r["speedup"], 2)] for r in data["rows"]]
    out = table(["depth", "cache", "tokens", "XLA ms / layer", "native ms / layer", "native GB/s", "speed-up"], rows)
    return out + (f"\n\n{data['shapes']}; chains of {data['calls']} calls over {data['layers']} layers' caches; "
                  f"medians [min–max] of {data['rounds']} alternating rounds. Machine: {machine(data)} "
                  f"({source(name)}).")


def depth_vs_llama_native() -> str:
    """The 2-layer slice at depth beside llama.cpp with the native decode attention (4K and 16K runs),
    after the run before it on the same machine."""
    names = ["long_context/depth_vs_llama_qwen3-30b-a3b_2L_zen5_cpu.json",
             "long_context/depth_vs_llama_qwen3-30b-a3b_2L_native_attention_zen5_cpu.json",
             "long_context/depth16k_vs_llama_qwen3-30b-a3b_2L_native_attention_zen5_cpu.json"]
    rows = []
    for label, name in zip(["XLA attention", "native attention", "native attention"], names):
        data = load(name)
        rows += [[label, *row, data["rounds"]] for row in depth_rows(data)]
    out = table(["jmoe", *DEPTH_HEADER, "rounds"], rows)
    data = load(names[-1])
    return out + (f"\n\n{data['model']}; jmoe {data['jmoe']}; llama.cpp {data['llama_cpp']}; {data['new_tokens']} new "
                  f"tokens; ratios within a round [min–max]. Machine: {machine(data)} ({source(*names)}).")


def prefix_sharing() -> str:
    name = "prefix_sharing/prefix_sharing_cpu.json"
    data = load(name)
    rows = []
    for i, (alone, shared) in enumerate(zip(data["rounds"]["alone"], data["rounds"]["shared"]), 1):
        rows.append([i, f"{f(alone['ttft_median_s'], 2)} / {f(alone['ttft_p90_s'], 2)}",
                     f"{f(shared['ttft_median_s'], 2)} / {f(shared['ttft_p90_s'], 2)}",
                     f"{alone['ttft_median_s'] / shared['ttft_median_s']:.1f}x",
                     f"{f(alone['wall_s'], 1)} → {f(shared['wall_s'], 1)}", f"{shared['reused_prompt_tokens']:,}",
                     f"{alone['peak_kv_pages_held']} → {shared['peak_kv_pages_held']}"])
    out = table(["round", "TTFT median / p90 s, no sharing", "TTFT median / p90 s, shared prefix",
                 "median TTFT ratio", "all 16 answered, s", "prompt tokens reused",
                 "most KV pages held at a step"], rows)
    return out + (f"\n\n{data['requests']} concurrent requests, a {data['system_tokens']:,}-token system prompt and a "
                  f"question each, {data['new_tokens']} greedy tokens, the tiny model; same tokens with and without "
                  f"sharing: {'yes' if data['same_tokens'] else 'no'}. Machine: {machine(data)} ({source(name)}).")


def kv_pages() -> str:
    name = "kv_pages/kv_pages_cpu.json"
    data = load(name)
    rows = [[label, f"{run['kv_pages']:,} ({size(run['kv_bytes'])})", size(run["budget_before_experts"]),
             med(run["tokens_per_s"], 0), med(run["ttft_s"], 2), ", ".join(map(str, run["set_aside_per_round"])),
             "yes" if run["answers_are_generates"] else "no"]
            for label, run in data["pools"].items()]
    out = table(["KV pool", "pages (bytes)", "reserved before experts", "tokens/s, median [min–max]",
                 "mean TTFT s", "set aside per round", "answers = generate's"], rows)
    return out + (f"\n\n{data['rows']} rows of a {data['context']:,}-token context, {data['rows']} greedy requests at once "
                  f"({data['prompt_tokens']} prompt tokens, {data['new_tokens']} new), pages of {data['page_tokens']} "
                  f"tokens, {data['rounds']} alternating rounds, the tiny model; a context is "
                  f"{-(-data['context'] // data['page_tokens'])} pages. Machine: {machine(data)} ({source(name)}).")


TABLES = {
    "headline": headline,
    "real-shapes": real_shapes,
    "real-shapes-avx2": real_shapes_avx2,
    "real-shapes-xeon": lambda: shapes_on_avx512("real_shapes/real_shapes_xeon_cpu.json"),
    "real-shapes-bf16-xeon": lambda: shapes_on_avx512("real_shapes/real_shapes_bf16_xeon_cpu.json"),
    "real-shapes-bf16-zen5-before": lambda: shapes_on_avx512("real_shapes/real_shapes_bf16_zen5_before_cpu.json"),
    "real-shapes-bf16-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_bf16_zen5_cpu.json"),
    "gpt-oss-shapes-xeon": lambda: shapes_on_avx512("real_shapes/real_shapes_gpt_oss_xeon_cpu.json"),
    "mixtral-shapes-xeon": lambda: shapes_on_avx512("real_shapes/real_shapes_mixtral_xeon_cpu.json"),
    "gpt-oss-shapes-head-int6-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_gpt_oss_head_int6_zen5_cpu.json"),
    "mixtral-shapes-head-int6-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_head_int6_zen5_cpu.json"),
    "gpt-oss-shapes-head-int6-zen4": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_gpt_oss_head_int6_zen4_cpu.json"),
    "mixtral-shapes-head-int6-zen4": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_head_int6_zen4_cpu.json"),
    "real-shapes-int3-zen4": lambda: shapes_on_avx512("real_shapes/real_shapes_int3_zen4_cpu.json"),
    "gpt-oss-shapes-many-rows-zen4": lambda: shapes_on_avx512("real_shapes/real_shapes_gpt_oss_many_rows_zen4_cpu.json"),
    "mixtral-shapes-many-rows-zen4": lambda: shapes_on_avx512("real_shapes/real_shapes_mixtral_many_rows_zen4_cpu.json"),
    "real-shapes-mixed-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_mixed_zen5_cpu.json"),
    "real-shapes-mixed-head-int4-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_mixed_head_int4_zen5_cpu.json"),
    "real-shapes-mixed-head-int6-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_head_int6_zen5_cpu.json"),
    "head-tiers-ab-zen5": lambda: head_tiers_ab_zen5(),
    "thread-scaling": thread_scaling,
    "head-tiers-avx2": head_tiers_avx2,
    "cpu-layout-zen5": cpu_layout_zen5,
    "cpu-layout-ab-zen5": cpu_layout_ab_zen5,
    "startup": startup,
    "gpt-oss-shapes": gpt_oss_shapes,
    "load-memory": load_memory,
    "long-context-plan": long_context_plan,
    "long-context-workspace": long_context_workspace,
    "long-context-depth": long_context_depth,
    "kv-int8": kv_int8,
    "kv-dtypes": kv_dtypes,
    "prefix-sharing": prefix_sharing,
    "kv-pages": kv_pages,
    "depth-vs-llama": depth_vs_llama,
    "depth-vs-llama-native-zen5": depth_vs_llama_native,
    "depth-vs-llama-emr": lambda: depth_vs_llama("long_context/depth_vs_llama_qwen3-30b-a3b_2L_emr_cpu.json"),
    "cpu-attention-zen5": lambda: cpu_attention("kernels/cpu_attention_zen5_cpu.json"),
    "perplexity": perplexity,
    "quality": quality,
    "quality-vs-llama": quality_vs_llama,
    "quality-policies-emr": quality_policies,
    "quality-int2": quality_int2,
    "quality-tiers": quality_tiers,
    "decode-io": decode_io,
    "offload-h200": offload_h200,
    "gpu-suite-offload-h200": gpu_suite_offload_h200,
    "host-work": host_work,
    "offload-quality": offload_quality,
    "offload-decode": offload_decode,
    "serve": serve,
    "convert-memory": convert_memory,
    "overhead": overhead,
    "gpu-decode-ab": gpu_decode_ab,
    "scale-out": scale_out,
    "tier-bytes": tier_bytes,
    "policies": policies,
    "policies-both-resident": policies_both_resident,
    "placement-hit-rates": placement_hit_rates,
    "speculative-acceptance": speculative_acceptance,
    "workload-shift": workload_shift,
    "dynaexq-streams": dynaexq_streams,
    "dynaexq-stream-offsets": dynaexq_stream_offsets,
    "real-shapes-mixed-r-zen4": lambda: shapes_on_avx512("real_shapes/real_shapes_mixed_r_zen4_cpu.json"),
    "real-shapes-mixed-r-emr": lambda: shapes_on_avx512("real_shapes/real_shapes_mixed_r_emr_cpu.json"),
    "real-shapes-mixed-head-int6-g32-emr": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_head_int6_g32_emr_cpu.json"),
    "quality-vs-llama-head-int6-g32-emr": lambda: quality_vs_llama(
        "quality/quality_vs_llama_cpp_head_int6_g32_emr_cpu.json"),
    "quality-vs-llama-head-int6-s8-zen5": lambda: quality_vs_llama(
        "quality/quality_vs_llama_cpp_head_int6_s8_zen5_cpu.json"),
    "mixed-qwen3-8L-head-int6-s8-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_head_int6_s8_zen5_cpu.json"),
    "head-formats-zen5": head_formats,
    "quality-vs-llama-refined-head-gnr": lambda: quality_vs_llama(
        "quality/quality_vs_llama_cpp_refined_head_gnr_cpu.json"),
    "mixed-qwen3-8L-refined-head-gnr": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_refined_head_gnr_cpu.json"),
    "mixed-qwen3-8L-head-int6-gnr": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_head_int6_gnr_cpu.json"),
    "deepseek-bf16-9-rounds-second-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_deepseek_v2_lite_bf16_9_rounds_second_zen5_cpu.json"),
    "mixtral-bf16-9-rounds-second-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_bf16_9_rounds_second_zen5_cpu.json"),
    "head-scales-ab-zen5": lambda: decode_ab_zen5(
        "kernels/decode_ab_qwen3_8L_int6_head_scales_zen5_cpu.json",
        "Qwen3-30B-A3B slice (8 layers), int4 experts + dense int4, `--cpu-layout`"),
    "gpt-oss-shapes-head-int6-emr": lambda: shapes_on_avx512("real_shapes/real_shapes_gpt_oss_head_int6_emr_cpu.json"),
    "mixtral-shapes-head-int6-emr": lambda: shapes_on_avx512("real_shapes/real_shapes_mixtral_head_int6_emr_cpu.json"),
    "qwen3-shapes-after-load-trim-emr": lambda: shapes_on_avx512("real_shapes/real_shapes_after_load_trim_emr_cpu.json"),
    "gpt-oss-shapes-after-load-trim-emr": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_gpt_oss_after_load_trim_emr_cpu.json"),
    "mixtral-shapes-after-load-trim-emr": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_after_load_trim_emr_cpu.json"),
    "gpt-oss-6L-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_gpt_oss_6L_zen5_cpu.json"),
    "mixtral-4L-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_mixtral_4L_zen5_cpu.json"),
    "router-matmul-zen5": router_matmul,
    "qwen3-8L-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_qwen3_8L_routers_zen5_cpu.json"),
    "deepseek-16L-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_deepseek_v2_lite_16L_zen5_cpu.json"),
    "qwen3-8L-combine-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_qwen3_8L_combine_zen5_cpu.json"),
    "qwen3-8L-combine-7-rounds-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_qwen3_8L_combine_7_rounds_zen5_cpu.json"),
    "qwen3-8L-combine-7-rounds-second-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_qwen3_8L_combine_7_rounds_second_zen5_cpu.json"),
    "mixtral-4L-7-rounds-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_mixtral_4L_7_rounds_zen5_cpu.json"),
    "deepseek-16L-7-rounds-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_deepseek_v2_lite_16L_7_rounds_zen5_cpu.json"),
    "mixed-qwen3-8L-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_mixed_qwen3_8L_zen5_cpu.json"),
    "mixed-qwen3-8L-combine-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_combine_zen5_cpu.json"),
    "qwen3-8L-six-bit-pass-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_qwen3_8L_six_bit_pass_zen5_cpu.json"),
    "deepseek-16L-six-bit-pass-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_deepseek_v2_lite_16L_six_bit_pass_zen5_cpu.json"),
    "mixtral-4L-six-bit-pass-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_4L_six_bit_pass_zen5_cpu.json"),
    "mixed-qwen3-8L-six-bit-pass-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_six_bit_pass_zen5_cpu.json"),
    "mixed-qwen3-8L-one-pass-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_one_pass_zen5_cpu.json"),
    "mixed-qwen3-8L-shared-input-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixed_qwen3_8L_shared_input_zen5_cpu.json"),
    "deepseek-bf16-9-rounds-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_deepseek_v2_lite_bf16_9_rounds_zen5_cpu.json"),
    "mixtral-bf16-9-rounds-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_bf16_9_rounds_zen5_cpu.json"),
    "deepseek-shapes-emr": lambda: shapes_on_avx512("real_shapes/real_shapes_deepseek_v2_lite_emr_cpu.json"),
    "expert-mixed-tiers-zen4": expert_mixed_tiers,
    "expert-tiers": lambda: expert_mixed_tiers("kernels/expert_tiers_cpu.json"),
    "expert-tiers-gfni-all-widths": lambda: expert_mixed_tiers("kernels/expert_tiers_gfni_all_widths_zen4_cpu.json"),
    "grid-bits": grid_bits,
    "equal-bits-summary": equal_bits_summary,
    "bf16-summary": bf16_summary,
    "gpt-oss-bf16-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_gpt_oss_bf16_zen5_cpu.json"),
    "gpt-oss-bf16-untiled-experts-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_gpt_oss_bf16_untiled_experts_zen5_cpu.json",
        "`--cpu-layout` before it tiled the bf16 experts"),
    "mixtral-bf16-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_mixtral_bf16_zen5_cpu.json"),
    "mixtral-bf16-tiled-float-inputs-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_bf16_tiled_float_inputs_zen5_cpu.json"),
    "mixtral-bf16-untiled-experts-zen5": lambda: shapes_on_avx512(
        "real_shapes/real_shapes_mixtral_bf16_untiled_experts_zen5_cpu.json",
        "`--cpu-layout` before it tiled the bf16 experts"),
    "deepseek-bf16-zen5": lambda: shapes_on_avx512("real_shapes/real_shapes_deepseek_v2_lite_bf16_zen5_cpu.json"),
    "quality-vs-llama-mixed-r-zen4": lambda: quality_vs_llama("quality/quality_vs_llama_cpp_mixed_r_zen4_cpu.json"),
    "quality-vs-llama-dense-s8-zen4": lambda: quality_vs_llama("quality/quality_vs_llama_cpp_dense_s8_zen4_cpu.json"),
    "dynaexq-hindsight-zen4": lambda: dynaexq_streams("policies/dynaexq_hindsight_zen4_cpu.json"),
    "dynaexq-allocation-zen4": lambda: dynaexq_streams("policies/dynaexq_allocation_zen4_cpu.json"),
    "dynaexq-hindsight-allocation-zen4": lambda: dynaexq_streams("policies/dynaexq_hindsight_allocation_zen4_cpu.json"),
    "dynaexq-int3-lo-emr": lambda: dynaexq_streams("policies/dynaexq_int3_lo_emr_cpu.json"),
    "dynaexq-one-version-emr": lambda: dynaexq_streams("policies/dynaexq_one_version_emr_cpu.json", {
        "DynaExq 8/32 (defaults)": "int2 + 8 int4 copies a layer (keep_lo)",
        "DynaExq 8/32's budget, int3 lo": "int3 + int4 copies (keep_lo)",
        "DynaExq 8/32's budget, one version an expert": "one version an expert, int2 lo (the default)",
        "DynaExq 8/32's budget, int3 lo, one version an expert": "one version an expert, int3 lo"}),
    "dynaexq-stream-offsets-allocation-zen4": lambda: dynaexq_stream_offsets(
        "policies/dynaexq_stream_offsets_allocation_zen4_cpu.json"),
    "dymoe-ablation": dymoe_ablation,
    "paper-headlines-tiny": lambda: paper_headlines("tiny"),
    "paper-headlines-qwen3": lambda: paper_headlines("qwen3"),
}


def files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(text: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise SystemExit(f"gen_tables: unknown table {name!r}")
        return m.group(1) + TABLES[name]() + "\n" + m.group(4)
    return MARKER.sub(sub, text)


def stale() -> list[Path]:
    """The markdown files whose generated tables differ from what the JSON gives."""
    return [p for p in files() if render(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a table is out of date; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"gen_tables: {p.relative_to(ROOT)} is out of date; run python docs/gen_tables.py", file=sys.stderr)
        return 1 if bad else 0
    for p in files():
        text = p.read_text()
        new = render(text)
        if new != text:
            p.write_text(new)
            print(f"gen_tables: wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
