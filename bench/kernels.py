"""Grouped expert FFN: the Pallas kernel vs the jnp reference (dequantize, then matmul), every tier,
decode and prefill shapes of Qwen3-30B-A3B, Mixtral-8x7B and Qwen1.5-MoE-A2.7B.

On a GPU the kernel is compiled (Triton) and both sides are timed per call within a jitted chain of
calls (median after warm-up), and also one call alone with its dispatch; the payload has weight
bytes read, achieved GB/s and kernel / reference, and for int4 decode the Mosaic GPU kernel
(kernel_backend="mosaic") timed the same way. On a CPU the
kernel runs in Pallas interpret mode: a correctness run (max relative error) whose wall times say
nothing about kernel speed; the pool then holds only the slots the routing uses, prefill uses fewer
tokens, and Mixtral prefill runs one tier (the others are listed as skipped in the payload).

    python -m bench.kernels [--prefill-tokens N] [--repeat 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib.common import in_graph_seconds, timed, write_result
from jmoe.kernels.expert_ffn.reference import expert_ffn_reference
from jmoe.kernels.shapes import EXPERT_SHAPES, ExpertShape
from jmoe.layers.experts import GATHER_MAX_ASSIGNMENTS, PREFILL_BLOCK_ROWS, block_layout
from jmoe.tiers import tier_format
from kernel_formats.qarray import QArray, QuantFormat
from pallas_kernels import expert_ffn_pallas, supports
from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic, supports_mosaic

MODELS = {name: EXPERT_SHAPES[name] for name in ("qwen3-30b-a3b", "mixtral-8x7b", "qwen1.5-moe-a2.7b")}
TIERS = {
    "bf16": None,
    "int8": tier_format("int8"),
    "int4": tier_format("int4"),
    "int2": tier_format("int2"),
    "int8-w8a8": tier_format("int8", w8a8=True),
}
GPU_PREFILL_TOKENS = 512
# Interpret mode runs the programs of the grid one after another on the host. Prefill needs more
# than 64 assignments (else the model takes the decode layout): 32 Qwen tokens x 8, 40 Mixtral x 2.
CPU_PREFILL_TOKENS = {"qwen3-30b-a3b": 32, "mixtral-8x7b": 40, "qwen1.5-moe-a2.7b": 20}
# Mixtral prefill takes about a minute per tier in interpret mode: only the default low tier runs.
CPU_PREFILL_TIERS = {"mixtral-8x7b": ("int4",), "qwen1.5-moe-a2.7b": ("int4",)}
DTYPE = jnp.bfloat16


# ----------------------------------------------------------------------------- inputs


def random_pool(key, slots: int, k: int, n: int, fmt: QuantFormat | None):
    """A pool [slots, K, N] at a tier: random bf16 weights, or random packed bytes (every byte is a
    valid packing of random codes) with small random scales and offsets."""
    keys = jax.random.split(key, 4)
    if fmt is None:
        return jax.random.normal(keys[0], (slots, k, n), DTYPE) * jnp.asarray(0.02, DTYPE)
    kp = fmt.padded_k(k)
    groups = kp // fmt.group_size
    values = jax.random.bits(keys[0], (slots, kp // fmt.pack, n), jnp.uint8)
    scales = jax.random.uniform(keys[1], (slots, groups, n), jnp.float32, 0.5, 1.5) * (0.04 / fmt.midpoint)
    offsets = None if fmt.symmetric else jax.random.normal(keys[2], (slots, groups, n), jnp.float32) * 0.02
    act_scale = jax.random.uniform(keys[3], (slots, k), jnp.float32, 0.5, 2.0) if fmt.smooth else None
    f16 = lambda a: None if a is None else a.astype(jnp.float16)  # noqa: E731
    return QArray(values, f16(scales), f16(offsets), f16(act_scale), fmt, k)


def expert_bytes(pool) -> int:
    """Bytes of one expert version in a pool (every leaf has a leading slots dim)."""
    leaves = jax.tree.leaves(pool)
    return int(sum(a.nbytes // a.shape[0] for a in leaves))


class Case(NamedTuple):
    rows: jax.Array  # [R, D]
    block_slot: jax.Array  # [R / block_rows]
    block_rows: int
    used_experts: int
    assignments: int


def routed_case(shape: ExpertShape, tokens: int, compact_pool: bool, seed: int = 0) -> Case:
    """Random top-k routing of `tokens` tokens, laid out as the model lays it out (decode: one row per
    assignment; prefill: slot-sorted blocks). With compact_pool, slots are renumbered 0..used-1."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(shape.experts, size=shape.top_k, replace=False) for _ in range(tokens)])  # [T, k]
    used = np.unique(experts)
    slots = np.searchsorted(used, experts) if compact_pool else experts
    h = jnp.asarray(rng.normal(size=(tokens, shape.hidden)), DTYPE)
    token = np.repeat(np.arange(tokens), shape.top_k)
    flat = jnp.asarray(slots.reshape(-1), jnp.int32)
    if tokens * shape.top_k <= GATHER_MAX_ASSIGNMENTS:  # decode: every assignment reads its own expert
        return Case(h[token], flat, 1, len(used), flat.shape[0])
    layout = block_layout(flat, jnp.ones(flat.shape, bool), PREFILL_BLOCK_ROWS, shape.experts)
    token_of_row = jnp.concatenate([jnp.asarray(token, jnp.int32), jnp.array([tokens], jnp.int32)])[layout.row_source]
    rows = jnp.concatenate([h, jnp.zeros((1, shape.hidden), DTYPE)])[token_of_row]
    return Case(rows, layout.block_slot, PREFILL_BLOCK_ROWS, len(used), flat.shape[0])


# ----------------------------------------------------------------------------- one case


def max_relative_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def run_case(model: str, phase: str, tier: str, tokens: int, on_gpu: bool, repeat: int) -> dict:
    shape, fmt = MODELS[model], TIERS[tier]
    case = routed_case(shape, tokens, compact_pool=not on_gpu)
    slots = shape.experts if on_gpu else case.used_experts
    keys = jax.random.split(jax.random.key(1), 2)
    gate_up = random_pool(keys[0], slots, shape.hidden, 2 * shape.inner, fmt)
    down_fmt = None if fmt is None else dataclasses.replace(fmt, smooth=False)
    down = random_pool(keys[1], slots, shape.inner, shape.hidden, down_fmt)
    args = (case.rows, case.block_slot, gate_up, down)
    result = dict(model=model, phase=phase, tier=tier, tokens=tokens, assignments=case.assignments,
                  block_rows=case.block_rows, blocks=int(case.block_slot.shape[0]), pool_slots=slots,
                  experts_used=case.used_experts)
    if not supports(case.rows, gate_up, down, case.block_rows):
        return {**result, "skipped": "not supported by the kernel (the XLA reference runs instead)"}
    kernel = jax.jit(functools.partial(expert_ffn_pallas, block_rows=case.block_rows, interpret=not on_gpu))
    reference = jax.jit(functools.partial(expert_ffn_reference, block_rows=case.block_rows))
    t = time.perf_counter()
    ours = jax.block_until_ready(kernel(*args))
    first_call = time.perf_counter() - t
    try:
        ref = jax.block_until_ready(reference(*args))
    except jax.errors.JaxRuntimeError as e:  # the reference materializes every block's weights
        return {**result, "skipped": f"reference failed: {str(e).splitlines()[0][:200]}"}
    result["max_rel_error"] = max_relative_error(ours, ref)
    if not on_gpu:
        t = time.perf_counter()
        jax.block_until_ready(kernel(*args))
        return {**result, "interpret_compile_and_run_s": first_call, "interpret_run_s": time.perf_counter() - t}
    result.update(gpu_timings(kernel, reference, args, case, gate_up, down, repeat))
    if supports_mosaic(case.rows, gate_up, down, case.block_rows):  # int4 decode: the Mosaic GPU kernel too
        mosaic = jax.jit(expert_ffn_mosaic)
        result["mosaic_max_rel_error"] = max_relative_error(jax.block_until_ready(mosaic(*args)), ref)
        result["mosaic_ms"] = in_graph_seconds(mosaic, args, repeat=repeat) * 1e3
        result["mosaic_unique_GBps"] = result["unique_weight_bytes"] / result["mosaic_ms"] / 1e6
    return result


def gpu_timings(kernel, reference, args, case: Case, gate_up, down, repeat: int) -> dict:
    """kernel_ms / reference_ms: per call within a jitted chain of calls (bench.lib.common.in_graph_seconds),
    what a model step pays; *_call_ms: one call timed alone, dispatch and host sync included."""
    kernel_s = in_graph_seconds(kernel, args, repeat=repeat)
    reference_s = in_graph_seconds(reference, args, repeat=repeat)
    kernel_call_s = timed(lambda: jax.block_until_ready(kernel(*args)), repeat=repeat, warmup=2)
    reference_call_s = timed(lambda: jax.block_until_ready(reference(*args)), repeat=repeat, warmup=2)
    per_expert = expert_bytes(gate_up) + expert_bytes(down)
    read = int(np.sum(np.asarray(case.block_slot) >= 0)) * per_expert  # every non-empty block reads its expert
    unique = case.used_experts * per_expert  # what HBM must deliver at least (blocks of one slot share it)
    return {
        "kernel_ms": kernel_s * 1e3,
        "reference_ms": reference_s * 1e3,
        "kernel_call_ms": kernel_call_s * 1e3,
        "reference_call_ms": reference_call_s * 1e3,
        "kernel_over_reference": kernel_s / reference_s,
        "weight_bytes_read": read,
        "unique_weight_bytes": unique,
        "kernel_GBps": read / kernel_s / 1e9,
        "kernel_unique_GBps": unique / kernel_s / 1e9,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-tokens", type=int, default=None, help="default: 512 on GPU, 32/40 on CPU")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    cases, skipped = [], []
    for model in MODELS:
        prefill_tokens = args.prefill_tokens or (GPU_PREFILL_TOKENS if on_gpu else CPU_PREFILL_TOKENS[model])
        for phase, tokens in (("decode", 1), ("prefill", prefill_tokens)):
            for tier in TIERS:
                if not on_gpu and phase == "prefill" and tier not in CPU_PREFILL_TIERS.get(model, TIERS):
                    skipped.append(dict(model=model, phase=phase, tier=tier, reason="interpret mode too slow on CPU"))
                    continue
                r = run_case(model, phase, tier, tokens, on_gpu, args.repeat)
                print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                cases.append(r)
    mode = ("compiled Pallas Triton kernel" if on_gpu else
            "Pallas interpret mode on CPU: a correctness run; wall times are not kernel performance")
    write_result("kernels", "kernels", {
        "mode": mode,
        "dtype": jnp.dtype(DTYPE).name,
        "block_rows": {"decode": 1, "prefill": PREFILL_BLOCK_ROWS},
        "tier_formats": {t: None if f is None else f.to_json() for t, f in TIERS.items()},
        "cases": cases,
        "skipped": skipped,
    })


if __name__ == "__main__":
    main()
