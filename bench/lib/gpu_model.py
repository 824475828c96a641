"""A trace-driven GPU time model: what a traced run would have taken on a GPU (modelled, not measured).

jmoe.load(..., trace=True) records, per step, the expert bytes each MoE layer read, every transfer
(bytes and kind), the bytes the host waited for, and the host syncs (jmoe/runtime/trace.py).
This replays that record with stated GPU parameters and the overlap the runtime schedules:

- compute of a step reads the dense weights once and every expert version it ran, at a fraction
  `efficiency` of HBM bandwidth, plus a launch latency per kernel;
- transfers go through one copy engine at the host-to-device bandwidth; those the host waited for
  (demand fetches) stall the step, the others (prefetches, background transitions) overlap with
  compute, and copy time beyond the step's compute spills into the next step's queue;
- a step that fetches experts itself (jmoe/layers/fetch.py) moves what its fixed fetch slots move
  on an accelerator, used or not: the slots filled before a layer routes (requests, look-ahead)
  overlap the compute, those of its misses stall it (the layer waits for them); the fetches the
  traced run needed (kinds "step-demand" / "step-prefetch") are inside those slots and not counted
  again; where its misses and look-ahead are chains of conditionals, those fetches are what moves
  (look-ahead overlapping, misses stalling) and every chain and fetch costs a predicate read
  (`predicate_us`: a device-to-host read of the predicate inside the step, with the relaunch after it);
- each host sync costs `sync_us`; expert-tokens run on the host CPU cost `cpu_us_per_token`.

Defaults describe an H100 SXM (HBM3, 3.35 TB/s) on PCIe Gen5 x16 (about 55 GB/s from pinned host
memory); on a lent GPU, measured bandwidths replace them (GpuParams(hbm_gb_per_s=..., ...)).
Every figure that comes from here is labelled "modelled".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GpuParams:
    name: str = "H100 SXM on PCIe Gen5 x16 (assumed)"
    hbm_gb_per_s: float = 3350.0
    h2d_gb_per_s: float = 55.0
    efficiency: float = 0.7  # of HBM bandwidth reached by bandwidth-bound decode kernels
    launch_us: float = 4.0
    kernels_per_layer: int = 8
    sync_us: float = 15.0
    predicate_us: float = 25.0  # per conditional: the H200's `bench/gpu_fetch.py` gave 20-40 us
    cpu_us_per_token: float = 40.0


def replay(records, *, dense_bytes: int, num_layers: int, params: GpuParams = GpuParams()) -> dict:
    """Modelled seconds per step of a trace (Trace.records()), and TTFT / TPOT summaries."""
    hbm = params.hbm_gb_per_s * 1e9 * params.efficiency
    h2d = params.h2d_gb_per_s * 1e9
    backlog = 0.0  # background copy time still queued from earlier steps
    steps = []
    for r in records:
        compute = (dense_bytes + sum(r.expert_bytes.values())) / hbm
        compute += num_layers * params.kernels_per_layer * params.launch_us * 1e-6
        background_kinds = ("prefetch", "transition", "step-prefetch") if r.chains else ("prefetch", "transition")
        background = (sum(b for b, kind in r.transfers if kind in background_kinds) + r.slot_bytes_early) / h2d
        demanded = sum(b for b, kind in r.transfers if kind == "step-demand") if r.chains else 0
        stall = (r.slot_bytes_late + demanded) / h2d
        chained = sum(kind in ("step-prefetch", "step-demand") for _, kind in r.transfers) if r.chains else 0
        predicates = r.chains + chained
        if r.waited_bytes or stall:  # one copy engine: what a step waits for comes after the queue
            stall, backlog = stall + backlog + r.waited_bytes / h2d, 0.0
        backlog = max(0.0, backlog + background - compute)  # background copies overlap the compute
        seconds = (compute + stall + r.syncs * params.sync_us * 1e-6 + predicates * params.predicate_us * 1e-6
                   + r.cpu_tokens * params.cpu_us_per_token * 1e-6)
        steps.append({"phase": r.phase, "tokens": r.tokens, "seconds": seconds})
    decode = [s["seconds"] for s in steps if s["phase"] == "decode"]
    by_phase: dict[str, float] = {}
    for s in steps:
        by_phase[s["phase"]] = by_phase.get(s["phase"], 0.0) + s["seconds"]
    return {"params": asdict(params), "steps": len(steps), "modelled_prefill_s": by_phase.get("prefill", 0.0),
            "modelled_tpot_s": sum(decode) / len(decode) if decode else None,
            "modelled_seconds_by_phase": by_phase}


def modelled_tpot(modelled: dict, decode_tokens: int) -> float:
    """Modelled seconds per token after the first, from every non-prefill step (plain decode steps,
    or a speculative run's draft and verification steps) over the tokens they produced."""
    seconds = sum(v for phase, v in modelled["modelled_seconds_by_phase"].items() if phase != "prefill")
    return seconds / max(decode_tokens, 1)


def dense_bytes_of(model) -> int:
    """Bytes of the dense weights a step reads."""
    from jmoe.runtime.budget import tree_nbytes

    return tree_nbytes(model.dense)
