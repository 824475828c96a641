"""Time of GPTQ, the calibrated quantizer, on one expert at a real model's shapes.

A calibrated conversion quantizes every expert's two matrices (gate_up [D, 2F], down [F, D]) at
every integer tier; at Qwen3-30B-A3B's shapes that is 48 x 128 experts a tier, so the seconds per
expert decide whether such a conversion takes minutes or a day. Per tier and matrix: the whole of
`gptq_quantize` and its parts (the inverse Hessian's Cholesky factor, the rounding passes, the grid
refit), the median of `--repeat` runs after one warm-up (which compiles the rounding loop), with
random weights and a Hessian from random calibration rows. `model_expert_hours` extrapolates the
expert median to the whole model's experts on this machine (a product, not a run).

    python -m bench.convert_speed [--repeat 3] [--name convert_speed]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.lib.common import result_name, write_result
from bench.lib.synthetic import QWEN3_30B_A3B

QWEN3_LAYERS = 48  # Qwen3-30B-A3B's MoE layers
CALIB_ROWS = 512  # calibration rows routed to the expert


def seconds(fn, repeat: int) -> dict:
    fn()  # warm-up: compiles the rounding loop at this shape
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return {"median_s": statistics.median(runs), "min_s": min(runs), "max_s": max(runs), "runs": len(runs)}


def matrix_case(k: int, n: int, tier: str, repeat: int, rng) -> dict:
    import jax

    from convert.quantizers import gptq
    from jmoe.tiers import tier_format

    fmt = tier_format(tier)
    x = rng.standard_normal((CALIB_ROWS, k))
    hessian = x.T @ x
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    u, dead = gptq.inverse_hessian_cholesky(hessian, 0.01)
    w_padded, u_padded, block = gptq.padded_blocks(w, u, fmt, 128)
    codes, scales, offsets = (np.asarray(a) for a in jax.block_until_ready(gptq._gptq_blocks(w_padded, u_padded, fmt,
                                                                                            block)))
    groups = k // fmt.group_size
    return {
        "shape": [k, n], "tier": tier,
        "whole": seconds(lambda: gptq.gptq_quantize(w, hessian, fmt), repeat),
        "cholesky": seconds(lambda: gptq.inverse_hessian_cholesky(hessian, 0.01), repeat),
        "rounding_pass": seconds(lambda: jax.block_until_ready(gptq._gptq_blocks(w_padded, u_padded, fmt, block)),
                                 repeat),
        "refit": seconds(lambda: gptq.refit_groups(w, hessian, codes[:k], scales[:groups], offsets[:groups], fmt,
                                                   dead), repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiers", default="int4,int2")
    parser.add_argument("--name", type=result_name, default="convert_speed")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    d, f = QWEN3_30B_A3B["hidden"], QWEN3_30B_A3B["moe_intermediate"]
    tiers = {}
    for tier in args.tiers.split(","):
        cases = [matrix_case(d, 2 * f, tier, args.repeat, rng), matrix_case(f, d, tier, args.repeat, rng)]
        expert_s = sum(c["whole"]["median_s"] for c in cases)
        experts = QWEN3_LAYERS * QWEN3_30B_A3B["experts"]
        tiers[tier] = {"matrices": cases, "expert_median_s": expert_s,
                       "model_expert_hours": expert_s * experts / 3600}
        print(tier, {c["tier"] + str(c["shape"]): round(c["whole"]["median_s"], 2) for c in cases},
              f"expert {expert_s:.2f} s, {experts} experts: {expert_s * experts / 3600:.1f} h", flush=True)
    write_result("convert_speed", args.name, {
        "model_shapes": "Qwen3-30B-A3B (gate_up [2048, 1536], down [768, 2048])", "calib_rows": CALIB_ROWS,
        "method": "gptq", "tiers": tiers})


if __name__ == "__main__":
    main()
