"""A random-weight slice of a real model, as jmoe int4 (experts and dense weights) and as llama.cpp's
Q4_0 GGUF of the same weights: what the benchmarks that compare the two at equal bits start from
(bench/depth_vs_llama.py, bench/thread_scaling.py). Each piece is made once under `data` and reused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.lib import llama_cpp
from bench.lib.common import ROOT
from bench.lib.random_checkpoint import write_checkpoint


def int4_slice_and_q4_0(model: str, layers: int, data: Path, head_tier: str | None = None,
                        cpu_layout: bool = False) -> tuple[Path, Path, Path, llama_cpp.LlamaCpp]:
    """(the Hugging Face checkpoint, the jmoe int4 + dense int4 conversion, the Q4_0 GGUF, llama.cpp).
    head_tier: the conversion's --head-tier (default: the converter's, int8 beside dense int4);
    cpu_layout: convert with --cpu-layout (experts in the CPU kernels' column tiles)."""
    hf = data / f"hf-{model}-{layers}L"
    if not (hf / "random_checkpoint.json").is_file():
        print(f"writing {hf} ...", flush=True)
        write_checkpoint(model, hf, layers=layers)
    converted = data / (f"jmoe-{model}-{layers}L-int4-dense-int4{f'-head-{head_tier}' if head_tier else ''}"
                        f"{'-cpu' if cpu_layout else ''}")
    if not (converted / "manifest.json").is_file():
        print(f"jmoe convert -> {converted} ...", flush=True)
        head = ["--head-tier", head_tier] if head_tier else []
        layout = ["--cpu-layout"] if cpu_layout else []
        subprocess.run([sys.executable, "-m", "jmoe.cli", "convert", str(hf), "-o", str(converted), "--tiers", "int4",
                        "--dense-tier", "int4", *head, *layout, "--method", "rtn", "--force", "--no-progress"],
                       check=True, cwd=ROOT)
    llama = llama_cpp.find_llama_cpp()
    gguf = Path(llama_cpp.convert(llama, hf, data / f"gguf-{model}-{layers}L", types=("Q4_0",))["Q4_0"]["path"])
    return hf, converted, gguf, llama
