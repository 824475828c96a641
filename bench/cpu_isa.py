"""The native CPU matmul on each instruction-set path this CPU can run (JMOE_CPU_ISA: the widest,
avx2, portable), at Qwen3-30B-A3B's decode shapes: the LM head (2,048 x 151,936), a dense
projection (2,048 x 4,096) and one expert's gate/up (2,048 x 1,536) and down (768 x 2,048), with
int4 codes (--bits 2 or 8 for the other tiers), at 1, 4, 16 and 64
rows (a decode token, a speculative verification or small batch, the fused path's limit, a prefill
chunk's expert share), with float inputs and, at 1 and 4 rows, under the int8 dot (inputs rounded
to int8 per group: integer products under AVX-512 VNNI, and under AVX2 for codes of up to 4 bits).

Each path runs in its own process (the path is chosen when the kernels load), the paths
alternating over `--rounds`; medians with [min-max] of the per-round medians, and the weight
bytes read per second.

    python -m bench.cpu_isa [--rounds 3] [--bits 4] [--rows 1,4,16,64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.lib.common import ROOT, result_name, write_result

SHAPES = {"lm_head": (2048, 151936), "attention q": (2048, 4096), "expert gate_up": (2048, 1536),
          "expert down": (768, 2048)}


def measure(rows_list=(1, 4, 16, 64), bits: int = 4) -> dict:
    """In this process: median ms, GB/s of weights and GFLOP/s per (shape, rows) on the path JMOE_CPU_ISA chose,
    for weights of `bits`-bit codes."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import cpu_kernels
    from jmoe.quant import QuantFormat
    from kernel_formats.qarray import QArray

    rng = np.random.default_rng(0)
    fmt = QuantFormat(bits=bits, group_size=64, symmetric=False)
    products = {"": jax.jit(lambda x, w: cpu_kernels.matmul(x, w)),
                " int8 dot": jax.jit(lambda x, w: cpu_kernels.matmul(x, w, int8_dot=True))}
    out = {}
    for name, (K, N) in SHAPES.items():
        w = QArray(jnp.asarray(rng.integers(0, 256, size=(K * bits // 8, N), dtype=np.uint8)),
                   jnp.asarray(rng.random((K // 64, N)).astype(np.float16)),
                   jnp.asarray(rng.random((K // 64, N)).astype(np.float16)), None, fmt, K)
        nbytes = sum(a.nbytes for a in jax.tree.leaves(w))
        for inputs, matmul in products.items():
            # the int8 dot (load's cpu_dot="int8": inputs rounded per group) at decode's row counts
            for rows in rows_list if not inputs else [r for r in rows_list if r <= 4]:
                x = jnp.asarray(rng.standard_normal((rows, K)).astype(np.float32))
                matmul(x, w).block_until_ready()
                times = []
                for _ in range(15):
                    start = time.perf_counter()
                    matmul(x, w).block_until_ready()
                    times.append(time.perf_counter() - start)
                ms = 1e3 * statistics.median(times)
                out[f"{name} x{rows}{inputs}"] = {"ms": ms, "GB_per_s": nbytes / ms / 1e6,
                                                  "GFLOP_per_s": 2 * rows * K * N / ms / 1e6}
    return out


def isa_paths() -> list[str]:
    code = "import cpu_kernels.native as n; print(n.isa())"
    widest = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return [p for p in dict.fromkeys([widest or "default", "avx2", "portable"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", type=result_name, default="cpu_isa", help="the result file's name (_cpu.json added)")
    parser.add_argument("--rows", default="1,4,16,64", help="input rows per product, comma-separated")
    parser.add_argument("--bits", type=int, choices=(2, 4, 8), default=4, help="weight code width (default 4)")
    args = parser.parse_args()
    paths = isa_paths()
    runs = {p: [] for p in paths}
    for r in range(args.rounds):
        for path in paths[r % len(paths):] + paths[:r % len(paths)]:
            env = dict(os.environ, PYTHONPATH=str(ROOT), JMOE_CPU_ISA=path)
            code = (f"import json; from bench.cpu_isa import measure; "
                    f"print(json.dumps(measure(({args.rows},), bits={args.bits})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                                  check=True)
            runs[path].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summary = {}
    for path, results in runs.items():
        for case in results[0]:
            ms = [r[case]["ms"] for r in results]
            summary.setdefault(case, {})[path] = {
                "ms": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
                "GB_per_s": statistics.median(r[case]["GB_per_s"] for r in results),
                "GFLOP_per_s": statistics.median(r[case]["GFLOP_per_s"] for r in results)}
    for case, by in summary.items():
        print(f"{case:22s} " + "  ".join(f"{p}: {v['ms']['median']:.2f} ms ({v['GB_per_s']:.1f} GB/s, "
                                          f"{v['GFLOP_per_s']:.0f} GFLOP/s)"
                                          for p, v in by.items()))
    write_result("kernels", args.name, {"shapes": {k: list(v) for k, v in SHAPES.items()},
                                        "format": f"int{args.bits}, group 64, asymmetric", "rows": args.rows,
                                        "rounds": args.rounds, "summary": summary})


if __name__ == "__main__":
    main()
