"""Expert parallelism at ep = 1, 2, 4, 8: what each device holds, the collectives a step adds, the
speed on this machine's CPU devices, and a modelled time on 8 H100s.

The mesh's devices here are XLA:CPU devices carved out of one machine (8 of them sharing its
cores): every device repeats the dense part of the step, so their tokens/s are a ratio of work,
not a speed-up. The per-device figures (expert bytes, pool slots, collectives) are what a real
mesh would hold and do. The H100 figures replay each decode step's routing (which experts each
shard ran, read back per step) with bench/lib/gpu_model.py's H100 parameters and an assumed NVLink
all-reduce cost: modelled, not measured.

    python -m bench.scale_out                                   # the bundled tiny model
    python -m bench.scale_out --model DIR --tier int4 --label qwen3-30b-a3b-2L   # a bench/real_shapes slice
    python -m bench.scale_out --budget-share 0.5                # offloaded: half of each device's experts

Writes bench/results/scale_out/scale_out_<label>_cpu.json.
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts

import argparse  # noqa: E402
import re  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import numpy as np  # noqa: E402

import jmoe  # noqa: E402
from bench.lib.common import ROOT, write_result  # noqa: E402
from bench.lib.gpu_model import GpuParams, dense_bytes_of  # noqa: E402
from jmoe import bench as llama_bench  # noqa: E402
from jmoe.decoding.engine import new_cache  # noqa: E402
from jmoe.runtime.loader import memory_plan  # noqa: E402


@dataclass(frozen=True)
class LinkParams:
    """An all-reduce over NVLink among 8 H100s (assumed): a fixed latency plus a ring's bytes."""

    name: str = "NVLink 4 all-reduce, 8 GPUs (assumed)"
    latency_us: float = 15.0
    bus_gb_per_s: float = 450.0


def tiny_model() -> str:
    from convert import convert_checkpoint

    out = ROOT / "out" / "bench-scale-out-tiny"
    if not (out / "manifest.json").exists():
        convert_checkpoint(ROOT / "examples" / "tiny-qwen3-moe", out, tiers="bf16,int4", progress=False, overwrite=True)
    return str(out)


def collectives_per_step(model, tokens: int) -> dict:
    """All-reduces in the compiled one-jit step over `tokens` tokens of one row, and their payload."""
    cfg = model.config
    cache = new_cache(cfg, 1, 256, model.kv_dtype)
    ids = np.zeros((1, tokens), np.int32)
    compiled = model.engine.forward.lower(
        model.executor.dense, model.residency.expert_state(), ids, cache, np.zeros(1, np.int32),
        np.zeros(1, np.int32), last_only=True, want_importance=False).compile().as_text()
    count = len(re.findall(r"= [^=]*all-reduce(?:-start)?\(", compiled))
    return {"all_reduces": count, "bytes_each": tokens * cfg.hidden_size * 4}


def routed_per_shard(model, prompt: list[int], tokens: int, shards: int) -> np.ndarray:
    """[decode steps, L, shards] experts each shard ran in each decode step (read back per step)."""
    E = model.config.num_experts
    steps = []
    for i, _ in enumerate(jmoe.generate(model, [prompt], max_new_tokens=tokens, stream=True)):
        if i > 0:  # the first token comes from the prefill step
            steps.append(model.residency.last_routed.reshape(model.config.num_moe_layers, shards, E // shards).sum(2))
    return np.asarray(steps)


def modelled_h100(model, routed: np.ndarray, slot_bytes: int, ep: int, gpu=GpuParams(), link=LinkParams()) -> dict:
    """Seconds per decode token on ep H100s: every device reads the dense weights and its own
    shard's experts; each MoE layer waits for its busiest shard and one all-reduce."""
    hbm = gpu.hbm_gb_per_s * 1e9 * gpu.efficiency
    cfg = model.config
    dense = dense_bytes_of(model)
    payload = cfg.hidden_size * 4
    psum = link.latency_us * 1e-6 + 2 * (ep - 1) / ep * payload / (link.bus_gb_per_s * 1e9) if ep > 1 else 0.0
    per_step = []
    for step in routed:
        busiest = step.max(axis=1).sum() * slot_bytes  # bytes of the slowest shard, layer by layer
        per_step.append((dense + busiest) / hbm + cfg.num_layers * gpu.kernels_per_layer * gpu.launch_us * 1e-6
                        + cfg.num_moe_layers * psum)
    return {"modelled_tpot_s": float(np.mean(per_step)), "gpu": asdict(gpu), "link": asdict(link),
            "label": "modelled, not measured: compute and all-reduces; transfers not modelled"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="converted model (default: the bundled tiny model)")
    parser.add_argument("--tier", default=None)
    parser.add_argument("--label", default="tiny")
    parser.add_argument("--eps", default="1,2,4,8")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (pp)")
    parser.add_argument("--tokens", type=int, default=16, help="generated tokens (tg)")
    parser.add_argument("--budget-share", type=float, default=None,
                        help="offload: a per-device budget holding this share of the device's experts")
    parser.add_argument("--max-seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    path = args.model or tiny_model()
    rows = []
    for ep in [int(e) for e in args.eps.split(",")]:
        budget = None
        if args.budget_share is not None:
            plan = memory_plan(path, tier=args.tier, max_seq_len=args.max_seq_len, policy="lru")
            fixed = sum(v for k, v in plan.items() if k != "all_experts")
            budget = fixed + int(plan["all_experts"] / ep * args.budget_share)
        model = jmoe.load(path, tier=args.tier, mesh=f"ep={ep}", max_seq_len=args.max_seq_len, device_budget=budget,
                          policy=None if budget is None else "lru")
        res = model.residency
        tier = res.tier
        slot_bytes = model.store.record_nbytes(tier)
        slots = res.pools[tier].shard_slots if res.offloading else model.config.num_moe_layers * \
            model.config.num_experts // ep
        perf = llama_bench.run(model, prompt_lengths=[args.prompt], gen_lengths=[args.tokens], repetitions=1)
        prompt = list(range(10, 10 + args.prompt))
        routed = routed_per_shard(model, prompt, args.tokens, ep)
        row = dict(ep=ep, tier=tier, device_budget=budget, expert_bytes_per_device=slots * slot_bytes,
                   pool_slots_per_device=slots, decode_collectives=collectives_per_step(model, 1),
                   prefill_collectives=collectives_per_step(model, args.prompt),
                   cpu_pp_tokens_per_s=perf[0].tokens_per_s, cpu_tg_tokens_per_s=perf[1].tokens_per_s,
                   busiest_shard_experts_per_decode_step=float(routed.max(axis=2).sum(axis=1).mean()),
                   h100=modelled_h100(model, routed, slot_bytes, ep))
        if res.offloading:
            row["bytes_h2d_per_token"] = perf[1].bytes_h2d_per_token
        rows.append(row)
        print(f"ep={ep}: {slots} slots/device ({row['expert_bytes_per_device'] / 2**20:.1f} MiB), "
              f"{row['decode_collectives']['all_reduces']} all-reduces/decode step, "
              f"CPU pp{args.prompt} {row['cpu_pp_tokens_per_s']:.1f} tg{args.tokens} {row['cpu_tg_tokens_per_s']:.1f} "
              f"tok/s; H100 x{ep} modelled {row['h100']['modelled_tpot_s'] * 1e3:.3f} ms/token")
    write_result("scale_out", f"scale_out_{args.label}", dict(
        model=str(args.model or "bundled tiny model"), devices="XLA:CPU devices sharing this machine's cores: CPU "
        "tokens/s are a ratio of work, not of speed", rows=rows))


if __name__ == "__main__":
    main()
