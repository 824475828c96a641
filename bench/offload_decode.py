"""Offloaded decode at a real model's shapes: every mode against the resident model, in one run.

Model: Qwen3-30B-A3B's exact shapes cut to --layers layers (random weights, bench/lib/random_checkpoint.py),
converted with `--tiers int4,int2 --dense-tier int4 --method rtn`, computed in float32 on the CPU and bfloat16 on a GPU.
Pass --model to use a converted directory instead (it must hold the int4 and int2 tiers).

Cases (--cases): the resident model (every int4 expert on the device); exact offloading (misses
fetched inside the step, the same tokens as resident) with lru and lru+prefetch, pools holding 50%
and 25% of the int4 expert bytes; DyMoE int4/int2 in its default degrade mode (a miss runs at a
resident lower tier) at 25%; speculative decoding with the int2 draft on lru+prefetch at 25%. Each
budget = every fixed term of jmoe.memory_plan for that policy (dense, KV cache, workspace, staging,
fetch slots, draft) + the share of the int4 expert bytes.

Workload: three prompts of --prompt-tokens random ids, --new-tokens new tokens each, greedy and
sampled (temperature 1, --seed): a random-weight router sends greedy tokens almost all alike, so
sampled tokens are the realistic miss pattern.

Protocol: the resident model stays loaded; each case is loaded in turn (so two models are in memory
at a time), warmed up on the whole workload twice (every shape it meets compiled), then timed in
--rounds rounds alternating with the resident model (the order flips every round). Decode ms/token = from each prompt's first streamed token to its last, over the
tokens after the first. Reported: median and [min-max] over rounds, and the ratio resident /
case (speed relative to resident) taken within each round. A case that fails (an error, a compile
in a timed window) is recorded under "failed", the other cases still run, and the run exits non-zero.
Each case's greedy tokens are compared with the resident model's (greedy_tokens_as_resident: the share
equal up to each prompt's first difference; exact modes give 1.0 unless a near tie flips a token). Counters (jmoe.stats()["host"], per decode token: blocking reads, executions,
transfers, bytes; in-step fetches, replays, degraded uses) are differenced over the timed rounds.

Modelled GPU (--no-model to skip): each case once more with trace=True, replayed by bench/lib/gpu_model.py
(an H100 on PCIe Gen5; labelled modelled, nothing ran on a GPU), beside the PCIe floor: the expert
bytes the CPU run really moved per decode token at 46 GB/s, and the modelled resident step.

    python -m bench.offload_decode [--layers 8] [--rounds 3] [--data DIR] [--model DIR] [--model-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jmoe
from bench.lib.common import machine, planned_budget, spread, write_result
from bench.decode_io import busy_seconds, other_cores, wait_for_quiet
from bench.lib.gpu_model import GpuParams, dense_bytes_of, modelled_tpot, replay
from jmoe.policies import DyMoE
from jmoe.serving.compiles import no_compiles

MAX_SEQ_LEN = 512
PCIE_GB_PER_S = 46.0  # the host-to-device rate measured on the one H100 lent so far
CASES = {
    # name: (policy factory, share of the int4 expert bytes in pools or None, speculative draft)
    "resident": (lambda: "resident", None, None),
    "lru@50%": (lambda: "lru", 0.5, None),
    "lru@25%": (lambda: "lru", 0.25, None),
    "lru+prefetch@50%": (lambda: "lru+prefetch", 0.5, None),
    "lru+prefetch@25%": (lambda: "lru+prefetch", 0.25, None),
    "dymoe-int4/int2@25%": (lambda: DyMoE(hi="int4", lo="int2"), 0.25, None),
    "spec-int2+lru+prefetch@25%": (lambda: "lru+prefetch", 0.25, "int2"),
}


def converted(args) -> Path:
    if args.model:
        return Path(args.model)
    from bench.lib.random_checkpoint import write_checkpoint
    from convert import convert_checkpoint

    data = Path(args.data or os.environ.get("JMOE_BENCH_DATA", Path.home() / ".cache" / "jmoe-bench"))
    out = data / f"jmoe-qwen3-30b-a3b-{args.layers}L-int4-int2"
    if not (out / "manifest.json").exists():
        hf = data / f"hf-qwen3-30b-a3b-{args.layers}L"
        if not (hf / "config.json").exists():
            write_checkpoint("qwen3-30b-a3b", hf, layers=args.layers)
        convert_checkpoint(hf, out, tiers="int4,int2", dense_tier="int4", method="rtn")
    return out


def compute_dtype() -> str:
    """bfloat16 on an accelerator (what a user runs there), float32 on the CPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def budget(path: Path, policy, share: float, draft: str | None) -> int:
    return planned_budget(path, share, tier="int4", compute_dtype=compute_dtype(), policy=policy,
                          max_seq_len=MAX_SEQ_LEN, draft=draft)


def load(path: Path, name: str, **extra):
    make_policy, share, draft = CASES[name]
    kw = {"tier": "int4", "compute_dtype": compute_dtype(), "max_seq_len": MAX_SEQ_LEN, **extra}
    if share is not None:
        kw.update(policy=make_policy(), device_budget=budget(path, make_policy(), share, draft))
        if draft:
            kw["draft"] = draft
    return jmoe.load(path, **kw)


def gen_kw(name: str, temperature: float, seed: int, new_tokens: int) -> dict:
    draft = CASES[name][2]
    return {"max_new_tokens": new_tokens, "temperature": temperature, "seed": seed,
            **({"speculative": draft} if draft else {})}


def streamed(model, ids, kw) -> tuple[float, float, int]:
    """One streamed generate: (seconds to its first token, seconds from the first to the last, the
    tokens after the first)."""
    start = time.perf_counter()
    first = last = None
    n = 0
    for _ in jmoe.generate(model, ids, stream=True, **kw):
        last = time.perf_counter()
        first = first or last
        n += 1
    return first - start, last - first, n - 1


def decode_ms(model, prompts, kw) -> float:
    runs = [streamed(model, ids, kw) for ids in prompts]
    return 1e3 * sum(r[1] for r in runs) / max(sum(r[2] for r in runs), 1)


def greedy_tokens(model, prompts, name: str, new_tokens: int) -> list[list[int]]:
    return [list(jmoe.generate(model, ids, **gen_kw(name, 0.0, 0, new_tokens))) for ids in prompts]


def agreement(case: list[list[int]], resident: list[list[int]]) -> float:
    """Share of greedy tokens equal to the resident model's, each prompt up to its first difference
    (after one, the two continue from different text)."""
    same = total = 0
    for a, b in zip(case, resident):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same, total = same + n, total + max(len(a), len(b))
    return same / max(total, 1)


def host_counts(model) -> dict:
    """Counters to difference over a window: host work of every phase but prefill (plain decode, or a
    speculative run's draft and verify), per decode token."""
    s = jmoe.stats(model)
    phases = [io for phase, io in s["host"].items() if phase != "prefill"]
    return {"decode_tokens": s["decode_tokens"], **{k: sum(io.get(k, 0) for io in phases)
                                                    for k in ("reads", "executions", "transfers", "transfer_bytes")},
            "in_step_fetches": s["in_step_fetches"], "in_step_misses": s["in_step_misses"], "replays": s["replays"],
            "degraded": s["degraded"], "expert_uses": s["expert_uses"], "hits": (s["hit_rate"] or 0.0) * s["expert_uses"]}  # None: no expert use yet


def per_token(before: dict, after: dict) -> dict:
    delta = {k: after[k] - before[k] for k in before}
    tokens = max(delta.pop("decode_tokens"), 1)
    uses = max(delta.pop("expert_uses"), 1)
    out = {f"{k}_per_token": v / tokens for k, v in delta.items() if k not in ("hits", "degraded", "replays")}
    out.update(replays=delta["replays"], degraded_share=delta["degraded"] / uses, hit_rate=delta["hits"] / uses,
               decode_tokens=tokens)
    return out


def warm_up_draft_lengths(model, prompts, kw) -> None:
    """Every draft length the governor may choose (each a draft executable of its own; verification
    widths are padded to powers of two): the governor chooses by measured time, so the timed window
    can meet a length that the workload's warm-up did not."""
    from jmoe.decoding.speculative import DEFAULT_K_MAX, auto_k_max

    for k in range(1, auto_k_max(model, DEFAULT_K_MAX) + 1):
        decode_ms(model, prompts, {**kw, "speculative": {"draft": kw["speculative"], "k": k}})


def time_case(name: str, model, resident, prompts, args, temperature: float) -> dict:
    """Warm the case up, then time it in alternating rounds with the resident model."""
    kw, base_kw = gen_kw(name, temperature, args.seed, args.new_tokens), gen_kw("resident", temperature, args.seed,
                                                                                args.new_tokens)
    for _ in range(2):  # warm-up: the whole workload, every shape it meets compiled
        decode_ms(model, prompts, kw)
    if "speculative" in kw:
        warm_up_draft_lengths(model, prompts, kw)
    before = host_counts(model)
    case_ms, resident_ms, rounds = [], [], []
    for r in range(args.rounds):
        waited = wait_for_quiet(args.max_wait)
        busy, start = busy_seconds(), time.perf_counter()
        with no_compiles(name):
            for which in (("resident", "case") if r % 2 == 0 else ("case", "resident")):
                if which == "case":
                    case_ms.append(decode_ms(model, prompts, kw))
                else:
                    resident_ms.append(decode_ms(resident, prompts, base_kw))
        rounds.append({"resident_ms": resident_ms[-1], "case_ms": case_ms[-1], "waited_for_quiet_s": waited,
                       "other_processes_cores": other_cores(busy, busy_seconds(), time.perf_counter() - start)})
    entry = {"decode_ms": spread(case_ms), "resident_decode_ms": spread(resident_ms),
             "speed_vs_resident": spread([b / c for b, c in zip(resident_ms, case_ms)]),
             **per_token(before, host_counts(model)), "rounds": rounds}
    s = entry["speed_vs_resident"]
    print(f"  T={temperature:g} {name:28s} {entry['decode_ms']['median']:7.2f} ms/token (resident "
          f"{entry['resident_decode_ms']['median']:.2f})  x{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"
          f"  reads {entry['reads_per_token']:.2f} exec {entry['executions_per_token']:.2f}"
          f" in-step {entry['in_step_fetches_per_token']:.2f} (misses {entry['in_step_misses_per_token']:.2f})"
          f" replays {entry['replays']}"
          f" hit {entry['hit_rate']:.3f} degraded {entry['degraded_share']:.3f}", flush=True)
    return entry


def timed_run(path: Path, names: list[str], prompts, args, save) -> dict:
    """Each case loaded in turn (one case and the resident model in memory at a time), timed at
    every temperature; `save` is called after each case (a run cut short keeps what it measured)."""
    temperatures = [float(v) for v in args.temperatures.split(",")]
    resident = load(path, "resident")
    for t in temperatures:
        for _ in range(2):
            decode_ms(resident, prompts, gen_kw("resident", t, args.seed, args.new_tokens))
    resident_tokens = greedy_tokens(resident, prompts, "resident", args.new_tokens)
    out = {f"temperature_{t:g}": {} for t in temperatures}
    failed = {}
    for name in names:
        if name == "resident":
            continue
        model = None
        try:  # a case that fails is recorded and the others still run; the run fails at its end
            model = load(path, name)
            for t in temperatures:
                out[f"temperature_{t:g}"][name] = time_case(name, model, resident, prompts, args, t)
            share = agreement(greedy_tokens(model, prompts, name, args.new_tokens), resident_tokens)
            out.setdefault("greedy_tokens_as_resident", {})[name] = share
            print(f"  {name}: {share:.3f} of greedy tokens as the resident model's", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded with its type, the run exits non-zero
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"  {name} FAILED: {failed[name]}", flush=True)
        out["failed"] = failed
        save(out)
        del model
        gc.collect()
    return out


def modelled(path: Path, names: list[str], prompts, args) -> dict:
    """Each case traced on the sampled workload, replayed as an H100 on PCIe (modelled)."""
    out = {}
    params = GpuParams()
    for name in names:
        model = load(path, name, trace=True)
        kw = gen_kw(name, 1.0, args.seed, args.new_tokens)
        decode_ms(model, prompts[:1], kw)
        model.trace.steps.clear()
        before = host_counts(model)
        bytes_before = jmoe.stats(model)["bytes_h2d"]
        decode_ms(model, prompts, kw)
        tokens = max(host_counts(model)["decode_tokens"] - before["decode_tokens"], 1)
        replayed = replay(model.trace.records(), dense_bytes=dense_bytes_of(model), num_layers=model.config.num_layers,
                          params=params)
        moved = (jmoe.stats(model)["bytes_h2d"] - bytes_before) / tokens
        out[name] = {"modelled_tpot_ms": 1e3 * modelled_tpot(replayed, tokens),
                     "bytes_h2d_per_decode_token": moved, "pcie_floor_ms": 1e3 * moved / (PCIE_GB_PER_S * 1e9)}
        del model
        gc.collect()
    resident = out.get("resident", {}).get("modelled_tpot_ms")
    for entry in out.values():
        if resident:
            entry["vs_max_of_resident_and_pcie"] = entry["modelled_tpot_ms"] / max(resident, entry["pcie_floor_ms"])
    return {"params": params.__dict__, "label": "modelled, not measured", "cases": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a converted directory with the int4 and int2 tiers")
    parser.add_argument("--data", help="where the random checkpoint and its conversion go")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-wait", type=float, default=30.0)
    parser.add_argument("--no-model", action="store_true", help="skip the modelled GPU replay")
    parser.add_argument("--model-only", action="store_true",
                        help="only the modelled GPU replay (the traces need no timing), to <out>_modelled_<backend>.json")
    parser.add_argument("--out", default="offload_decode_qwen3")
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    path = converted(args)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, 4000, args.prompt_tokens).tolist() for _ in range(3)]
    result = {"model": path.name, "layers": args.layers, "max_seq_len": MAX_SEQ_LEN, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "rounds": args.rounds, "compute_dtype": compute_dtype(),
              "device": str(jax.devices()[0].device_kind)}

    def save(runs: dict) -> None:
        result["runs"] = runs
        if args.out.endswith(".json"):  # a path of its own (a check of the bench, say)
            Path(args.out).write_text(json.dumps({"machine": machine(), **result}, indent=2) + "\n")
        else:
            write_result("offload_decode", args.out, result)

    if args.model_only:
        result["modelled_gpu"] = modelled(path, names, prompts, args)
        write_result("offload_decode", f"{args.out}_modelled", result)
        return
    save(timed_run(path, names, prompts, args, save))
    if result["runs"]["failed"]:
        sys.exit(f"failed cases: {result['runs']['failed']}")
    if not args.no_model:
        result["modelled_gpu"] = modelled(path, names, prompts, args)
        for name, entry in result["modelled_gpu"]["cases"].items():
            print(f"  modelled H100 {name:28s} {entry['modelled_tpot_ms']:.3f} ms/token, PCIe floor "
                  f"{entry['pcie_floor_ms']:.3f} ms" + (f", x{entry['vs_max_of_resident_and_pcie']:.2f} of max(resident, PCIe)"
                                                       if "vs_max_of_resident_and_pcie" in entry else ""))
        save(result["runs"])


if __name__ == "__main__":
    main()
