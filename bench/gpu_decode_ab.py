"""Decode expert kernels on a GPU, two versions side by side: this tree's `expert_ffn_pallas` and an
earlier one loaded from a file (e.g. `git show REV:pallas_kernels/expert_ffn_pallas.py > before.py`).

Every real model shape of bench/gpu_compile.py (Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-20B with biases
and the clamped SwiGLU, DeepSeek-V2-Lite) at every tier, one decode token routed to top_k experts of a
full pool: per-call time within a jitted chain of calls (bench.lib.common.in_graph_seconds) for both
versions and the XLA reference, unique weight bytes per second, and each version's error against
the reference. Needs a GPU; writes bench/results/gpu_decode_ab/gpu_decode_ab_gpu.json.

    python -m bench.gpu_decode_ab --before before.py [--before-label e72a9a6]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib.common import RESULTS, in_graph_seconds, machine
from bench.kernels import TIERS, expert_bytes, max_relative_error, random_pool
from bench.lib.random_checkpoint import model_named
from jmoe.kernels.expert_ffn.reference import expert_ffn_reference
from jmoe.layers.experts import expert_activation
from jmoe.models import config_from_hf
from pallas_kernels import expert_ffn_pallas

# the real models' configs (bench/lib/random_checkpoint.py) give every shape, bias and activation
MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v2-lite")


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("kernel_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def decode_case(model: str, tier: str, seed: int = 0):
    cfg = config_from_hf(model_named(model).config_for(2))  # DeepSeek-V2-Lite: layer 1 is the first MoE layer
    D, F, experts, top_k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    fmt = TIERS[tier]
    keys = jax.random.split(jax.random.key(seed), 4)
    gate_up = random_pool(keys[0], experts, D, 2 * F, fmt)
    down = random_pool(keys[1], experts, F, D, None if fmt is None else dataclasses.replace(fmt, smooth=False))
    rng = np.random.default_rng(seed)
    slots = jnp.asarray(rng.choice(experts, size=top_k, replace=False), jnp.int32)
    rows = jnp.asarray(rng.normal(size=(top_k, D)), jnp.bfloat16)
    extra = dict(activation=expert_activation(cfg))
    if cfg.expert_bias:
        extra.update(gate_up_bias=jax.random.normal(keys[2], (experts, 2 * F), jnp.float32) * 0.02,
                     down_bias=jax.random.normal(keys[3], (experts, D), jnp.float32) * 0.02)
    unique = top_k * (expert_bytes(gate_up) + expert_bytes(down))
    return (rows, slots, gate_up, down), extra, unique


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="an earlier pallas_kernels/expert_ffn_pallas.py")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--tiers", default="bf16,int8,int4,int2")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        parser.error("needs a GPU")
    before = load_module(args.before).expert_ffn_pallas
    rows_out = []
    for model in MODELS:
        for tier in args.tiers.split(","):
            operands, extra, unique = decode_case(model, tier)
            act = extra.pop("activation")
            row = dict(model=model, tier=tier, unique_weight_bytes=unique)
            ref = None
            for name, impl in (("reference", expert_ffn_reference), ("before", before), ("after", expert_ffn_pallas)):
                fn = jax.jit(functools.partial(impl, block_rows=1, activation=act, **extra))
                out = jax.block_until_ready(fn(*operands))
                if name == "reference":
                    ref = out
                else:
                    row[f"{name}_max_rel_error"] = max_relative_error(out, ref)
                seconds = in_graph_seconds(fn, operands, repeat=args.repeat)
                row[f"{name}_us"] = seconds * 1e6
                row[f"{name}_unique_GBps"] = unique / seconds / 1e9
            row["before_over_after"] = row["before_us"] / row["after_us"]
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    out = RESULTS / "gpu_decode_ab" / "gpu_decode_ab_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                                   before=args.before_label, timing="per call within a jitted chain of 20 calls",
                                   cases=rows_out), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
