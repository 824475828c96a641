"""Summaries of bench/real_shapes.py rounds: medians with [min-max], jmoe / llama.cpp ratios per
round, a markdown table for the README, and a plot.

    python -m bench.lib.real_shapes_report [bench/results/real_shapes/real_shapes_cpu.json]   # prints the tables
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.lib.common import RESULTS

SPEED_METRICS = ("prefill_tok_s", "decode_tok_s@0", "decode_tok_s@512")
MEMORY_METRICS = ("peak_rss_bytes", "decode_peak_rss_bytes")
STARTUP_METRICS = ("load_s", "first_token_s", "process_to_first_token_s")
GiB = 2**30


def spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per configuration label, each metric's median and range over the rounds it ran in."""
    by_label: dict[str, list[dict]] = {}
    for run in runs:
        by_label.setdefault(run["label"], []).append(run)
    out = {}
    for label, items in by_label.items():
        keys = sorted({k for r in items for k, v in r.items() if isinstance(v, (int, float)) and k != "round"})
        out[label] = {"kind": items[0]["kind"], **{k: spread([r.get(k) for r in items]) for k in keys}}
    return out


def ratios(runs: list[dict], pairs: list[tuple[str, str]], metrics=SPEED_METRICS) -> dict[str, dict]:
    """jmoe / llama.cpp per metric, each ratio taken within a round, then median and range."""
    by_round: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["label"]] = run
    out = {}
    for jmoe_label, llama_label in pairs:
        entry = {}
        for m in metrics:
            values = [r[jmoe_label][m] / r[llama_label][m] for r in by_round.values()
                      if r.get(jmoe_label, {}).get(m) and r.get(llama_label, {}).get(m)]
            entry[m] = spread(values)
        out[f"{jmoe_label} / {llama_label}"] = entry
    return out


def fmt(s: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if not s:
        return "–"
    med, lo, hi = (s[k] / scale for k in ("median", "min", "max"))
    if s["n"] == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def digits_for(s: dict | None) -> int:
    return 2 if s and s["median"] < 10 else 1


def speed_table(result: dict) -> str:
    prompt = result["settings"]["prompt"]
    rows = ["| | prefill tok/s (%d) | decode tok/s (depth 0) | decode tok/s (depth %d) | peak RSS GiB | "
            "while decoding GiB | loaded GiB |" % (prompt, prompt), "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, s in result["summary"].items():
        if s["kind"] not in ("jmoe", "llama.cpp"):
            continue
        cells = [fmt(s.get(m), digits=digits_for(s.get(m)))
                 for m in ("prefill_tok_s", "decode_tok_s@0", f"decode_tok_s@{prompt}")]
        cells += [fmt(s.get("peak_rss_bytes"), GiB, 2), fmt(s.get("decode_peak_rss_bytes"), GiB, 2),
                  fmt(s.get("loaded_bytes"), GiB, 2)]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ratio_table(result: dict) -> str:
    prompt = result["settings"]["prompt"]
    rows = [f"| jmoe / llama.cpp | prefill ({prompt}) | decode (depth 0) | decode (depth {prompt}) |",
            "| --- | --- | --- | --- |"]
    for name, r in result["ratios"].items():
        cells = [fmt(r.get(m), digits=2) for m in ("prefill_tok_s", "decode_tok_s@0", f"decode_tok_s@{prompt}")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def startup_table(result: dict) -> str:
    rows = ["| fresh process | load s | first token s (%d-token prompt) | start to first token s |"
            % result["settings"]["prompt"], "| --- | --- | --- | --- |"]
    for label, s in result["summary"].items():
        if s["kind"] == "startup":
            rows.append(f"| {label} | " + " | ".join(fmt(s.get(m)) for m in STARTUP_METRICS) + " |")
    return "\n".join(rows)


def conversion_table(result: dict) -> str:
    rows = ["| conversion | seconds | peak RSS GiB | output GiB |", "| --- | --- | --- | --- |"]
    for name, c in result.get("conversions", {}).items():
        secs = f"{c['seconds']:.0f}" if c.get("seconds") else "(reused)"
        rss = f"{c['peak_rss_bytes'] / GiB:.2f}" if c.get("peak_rss_bytes") else "–"
        size = f"{c['bytes'] / GiB:.2f}" if c.get("bytes") else "–"
        rows.append(f"| {name} | {secs} | {rss} | {size} |")
    return "\n".join(rows)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# Other work, in CPUs' worth, above which a run's report says the machine was not idle (runs of earlier
# versions recorded a load average instead, and are not flagged).
BUSY_CPUS = 0.25


def markdown(result: dict) -> str:
    s, layers = result["settings"], result["model"]["layers"]
    head = (f"{result['model']['name']} shapes, {plural(layers, 'layer')}, random weights; "
            f"{result['machine']['cpu']} ({result['machine']['cpu_count']} cores), {plural(s['rounds'], 'round')}"
            f"{' alternating jmoe and llama.cpp' if result.get('ratios') else ''}; median [min–max].")
    busy = max((r.get("cpus_busy_before") or 0 for r in result.get("runs", [])), default=0)
    if busy > BUSY_CPUS:
        head += (f" The machine was not idle (up to {busy:.1f} CPUs busy in the second before a run): timings, "
                 "llama.cpp's most of all, are not representative.")
    parts = [head, speed_table(result)]
    if result.get("ratios"):
        parts.append(ratio_table(result))
    if any(v["kind"] == "startup" for v in result["summary"].values()):
        parts.append(startup_table(result))
    if result.get("conversions"):
        parts.append(conversion_table(result))
    return "\n\n".join(parts)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    prompt = result["settings"]["prompt"]
    metrics = [("prefill_tok_s", f"prefill tok/s ({prompt})"), ("decode_tok_s@0", "decode tok/s (depth 0)"),
               (f"decode_tok_s@{prompt}", f"decode tok/s (depth {prompt})"), ("peak_rss_bytes", "peak RSS (GiB)")]
    labels = [k for k, v in result["summary"].items() if v["kind"] in ("jmoe", "llama.cpp")]
    colors = ["tab:blue" if result["summary"][k]["kind"] == "jmoe" else "tab:orange" for k in labels]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 0.45 * len(labels) + 2), squeeze=False)
    for ax, (m, title) in zip(axes[0], metrics):
        scale = GiB if m.endswith("bytes") else 1.0
        med, lo, hi = [], [], []
        for k in labels:
            s = result["summary"][k].get(m)
            med.append(s["median"] / scale if s else 0)
            lo.append((s["median"] - s["min"]) / scale if s else 0)
            hi.append((s["max"] - s["median"]) / scale if s else 0)
        y = range(len(labels))
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_yticks(list(y))
        ax.set_yticklabels(labels if ax is axes[0][0] else [""] * len(labels), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        if m != "peak_rss_bytes":
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only; minor ones overlap
            ax.xaxis.set_major_formatter(ScalarFormatter())
    fig.suptitle(f"{result['model']['name']} shapes, {plural(result['model']['layers'], 'layer')}, CPU "
                 f"({result['machine']['cpu_count']} cores): jmoe (blue) and llama.cpp (orange)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, nargs="?", default=RESULTS / "real_shapes" / "real_shapes_cpu.json")
    args = parser.parse_args()
    print(markdown(json.loads(args.result.read_text())))


if __name__ == "__main__":
    main()
