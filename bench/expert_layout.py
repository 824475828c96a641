"""The routed experts of one decode step in each stored layout: [K, N] against the CPU layout
(`jmoe convert --cpu-layout`: column tiles of 64, each streamed whole), on the native CPU kernels.

Qwen3-30B-A3B's widths (gate/up 2,048 x 1,536, down 768 x 2,048), int4 in groups of 64: one token's
8 experts drawn at random from a pool of 128 (so their weights come from memory, not the cache),
`cpu_kernels.routed_expert_ffn` with float inputs and under the int8 dot. The layouts alternate
over --rounds, each round a median of --calls calls after a warm-up; the result is the median of
the rounds with [min-max], and the weight bytes read per second. A compilation inside a timed
window fails the run.

    python -m bench.expert_layout [--rounds 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.lib.common import machine, write_result

SLOTS, TOP_K, D, F, GROUP = 128, 8, 2048, 768, 64


def pools():
    """(gate_up, down) int4 pools of SLOTS random experts in [K, N] layout."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.qarray import QArray, QuantFormat

    fmt = QuantFormat(bits=4, group_size=GROUP, symmetric=False)
    rng = np.random.default_rng(0)

    def pool(k, n):
        return QArray(jnp.asarray(rng.integers(0, 256, (SLOTS, k // 2, n), dtype=np.uint8)),
                      jnp.asarray((rng.random((SLOTS, k // GROUP, n)) * 0.01).astype(np.float16)),
                      jnp.asarray((rng.random((SLOTS, k // GROUP, n)) * -0.005).astype(np.float16)), None, fmt, k)

    return pool(D, 2 * F), pool(F, D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpu_kernels import native, ops
    from jmoe.serving.compiles import CompileCounter
    from pallas_kernels.qarray import tile

    if not ops.available():
        sys.exit("the native CPU kernels are not loaded")
    gate_up, down = pools()
    layouts = {"[K, N]": (gate_up, down), "cpu layout": (tile(gate_up), tile(down))}
    weight_bytes = TOP_K * sum(a.nbytes // SLOTS for w in (gate_up, down) for a in (w.values, w.scales, w.offsets))
    rng = np.random.default_rng(1)
    picks = [jnp.asarray(rng.choice(SLOTS, TOP_K, replace=False).astype(np.int32)) for _ in range(64)]
    h = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    token = jnp.zeros(TOP_K, jnp.int32)
    steps = {dot: jax.jit(lambda h, t, s, g, d, dot=dot: ops.routed_expert_ffn(h, t, s, g, d, int8_dot=dot))
             for dot in (False, True)}
    rounds = {(name, dot): [] for name in layouts for dot in steps}
    for r in range(args.rounds):
        order = list(rounds)
        for name, dot in order[r % len(order):] + order[:r % len(order)]:
            g, d = layouts[name]
            steps[dot](h, token, picks[0], g, d).block_until_ready()  # warm
            compiles = CompileCounter.count()
            times = []
            for i in range(args.calls):
                t = time.perf_counter()
                steps[dot](h, token, picks[i % len(picks)], g, d).block_until_ready()
                times.append(time.perf_counter() - t)
            if CompileCounter.count() != compiles:
                sys.exit(f"{name}, int8 dot {dot}: a compilation in a timed window")
            rounds[(name, dot)].append(statistics.median(times))
    results = {}
    for (name, dot), ts in rounds.items():
        key = f"{name}, {'int8 dot' if dot else 'float inputs'}"
        ms = statistics.median(ts) * 1e3
        results[key] = {"ms": round(ms, 3), "min_ms": round(min(ts) * 1e3, 3), "max_ms": round(max(ts) * 1e3, 3),
                        "weight_gb_per_s": round(weight_bytes / (ms / 1e3) / 1e9, 2)}
        print(f"{key}: {ms:.3f} ms [{min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f}], "
              f"{results[key]['weight_gb_per_s']:.1f} GB/s of weights")
    write_result("kernels", "expert_layout", {
        "machine": machine(), "isa": native.isa(),
        "case": f"routed_expert_ffn, {TOP_K} of {SLOTS} int4 experts (groups of {GROUP}), D={D}, F={F}, one token",
        "weight_bytes_per_call": weight_bytes, "rounds": args.rounds, "calls_per_round": args.calls,
        "results": results})


if __name__ == "__main__":
    main()
