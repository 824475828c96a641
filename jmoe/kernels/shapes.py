"""Real models' expert FFN shapes, by name: what the kernel tests, the kernel benchmarks and the H100
compile check (bench/gpu_compile.py) measure at, from one table so that they measure the same thing."""

from __future__ import annotations

from typing import NamedTuple


class ExpertShape(NamedTuple):
    hidden: int  # D: the rows' width, the down projection's output
    inner: int  # F: each expert's intermediate width (gate/up write 2F)
    experts: int  # routed experts per layer
    top_k: int  # experts each token is routed to
    biased: bool = False  # per-expert biases and the clamped SwiGLU (GPT-OSS)


EXPERT_SHAPES = {
    "qwen3-30b-a3b": ExpertShape(hidden=2048, inner=768, experts=128, top_k=8),
    "mixtral-8x7b": ExpertShape(hidden=4096, inner=14336, experts=8, top_k=2),
    "qwen1.5-moe-a2.7b": ExpertShape(hidden=2048, inner=1408, experts=60, top_k=4),
    "deepseek-v2-lite": ExpertShape(hidden=2048, inner=1408, experts=64, top_k=6),
    "gpt-oss-20b": ExpertShape(hidden=2880, inner=2880, experts=32, top_k=4, biased=True),
}
