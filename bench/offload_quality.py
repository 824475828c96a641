"""What each offloading mode costs in quality: perplexity of the trained tiny model, token by token.

The bundled tiny Qwen3-MoE is converted with bf16, int4 and int2 experts. Each mode decodes the
first --tokens tokens of each domain's dev text teacher-forced, one decode step per token
(jmoe.perplexity(..., mode="decode")), so a policy that decides per decode step decides for every
token, under a budget of every fixed reservation plus --share of the bf16 expert bytes:

- resident bf16 / int4 / int2: every expert on the device (the references);
- exact lru at int4 (misses fetched inside the step): must equal resident int4;
- DyMoE bf16/int4 and int4/int2, DynaExq bf16/int4 (its budget also holds every expert at int4,
  which it keeps resident), in their default degrade mode (a miss runs at
  the best resident lower tier, or is skipped): the share of expert uses that ran degraded and
  the perplexity beside the exact references.
- DyMoE int4/int2 without a budget: both tiers whole, each token's least important experts at
  int2 (the CPU's per-token mixed precision: bench/real_shapes.py times it).

    python -m bench.offload_quality [--tokens 512] [--window 512] [--share 0.25]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import jmoe
from bench.lib.common import DOMAINS, TINY_HF, dev_tokens, planned_budget, write_result
from convert import convert_checkpoint
from jmoe.policies import DyMoE, DynaExq
from jmoe.runtime.loader import memory_plan

MAX_SEQ_LEN = 1024
MODES = {
    # name: (tier, policy factory or None for resident)
    "resident bf16": ("bf16", None),
    "resident int4": ("int4", None),
    "resident int2": ("int2", None),
    "exact lru int4": ("int4", lambda: "lru"),
    "degrade DyMoE bf16/int4": ("bf16", lambda: DyMoE(hi="bf16", lo="int4")),
    "degrade DyMoE int4/int2": ("int4", lambda: DyMoE(hi="int4", lo="int2")),
    "degrade DynaExq bf16/int4": ("bf16", lambda: DynaExq(hi="bf16", lo="int4")),
    "whole DyMoE int4/int2": ("int4", lambda: DyMoE(hi="int4", lo="int2")),
}
WHOLE = ("whole DyMoE int4/int2",)  # loaded without a budget: both tiers resident, nothing offloaded


def load(path: Path, name: str, share: float):
    tier, make_policy = MODES[name]
    kw = {"tier": tier, "compute_dtype": "float32", "max_seq_len": MAX_SEQ_LEN}
    if make_policy is None:
        return jmoe.load(path, **kw)
    if name in WHOLE:
        return jmoe.load(path, policy=make_policy(), **kw)
    budget = planned_budget(path, share, tier="bf16", compute_dtype="float32", max_seq_len=MAX_SEQ_LEN,
                            policy=make_policy())
    if isinstance(make_policy(), DynaExq):  # every expert stays resident at lo: the share is on top of them
        budget += memory_plan(path, tier="int4", compute_dtype="float32", max_seq_len=MAX_SEQ_LEN)["all_experts"]
    return jmoe.load(path, policy=make_policy(), device_budget=budget, **kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="dev tokens per domain")
    parser.add_argument("--window", type=int, default=512,
                        help="tokens per window (the context each scored token sees at most; default 512)")
    parser.add_argument("--share", type=float, default=0.25, help="share of the bf16 expert bytes in the budget")
    parser.add_argument("--out", default="offload_quality_tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(convert_checkpoint(TINY_HF, Path(tmp) / "tiny", tiers="bf16,int4,int2", progress=False))
        result = {"tokens_per_domain": args.tokens, "window": min(args.window, args.tokens),
                  "share_of_bf16_experts": args.share, "modes": {}}
        for name in MODES:
            model = load(path, name, args.share)
            entry = {}
            for domain in DOMAINS:
                ids = dev_tokens(model.tokenizer, domain, args.tokens)
                entry[domain] = jmoe.perplexity(model, ids, window=min(args.window, args.tokens), mode="decode")
            stats = jmoe.stats(model)
            uses = max(stats["expert_uses"], 1)
            entry.update(degraded_share=stats["degraded"] / uses, skipped_share=stats["skipped"] / uses,
                         replays=stats["replays"], in_step_fetches=stats["in_step_fetches"])
            result["modes"][name] = entry
            del model
        base = result["modes"]["resident bf16"]
        for name, entry in result["modes"].items():
            entry["over_bf16_pct"] = {d: 100 * (entry[d] / base[d] - 1) for d in DOMAINS}
            print(f"{name:28s} " + "  ".join(f"{d} {entry[d]:.3f} ({entry['over_bf16_pct'][d]:+.2f}%)" for d in DOMAINS)
                  + f"  degraded {entry['degraded_share']:.3f} skipped {entry['skipped_share']:.3f}", flush=True)
        exact, resident = result["modes"]["exact lru int4"], result["modes"]["resident int4"]
        result["exact_equals_resident"] = all(math.isclose(exact[d], resident[d], rel_tol=1e-5) for d in DOMAINS)
    write_result("offload_quality", args.out, result)
    if not result["exact_equals_resident"]:
        raise SystemExit("exact offloading's perplexity differs from the resident model's at its tier")


if __name__ == "__main__":
    main()
