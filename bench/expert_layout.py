"""The routed experts of one decode step in each stored layout: [K, N] against the CPU layout
(`jmoe convert --cpu-layout`: column tiles of 64, each streamed whole), on the native CPU kernels.

Qwen3-30B-A3B's widths (gate/up 2,048 x 1,536, down 768 x 2,048), int4 in groups of 64: one token's
8 experts drawn at random from a pool of 128 (so their weights come from memory, not the cache),
`cpu_kernels.routed_expert_ffn` with float inputs and under the int8 dot. The layouts alternate
over --rounds, each round a median of --calls calls after a warm-up; the result is the median of
the rounds with [min-max], and the weight bytes read per second. A compilation inside a timed
window fails the run.

    python -m bench.expert_layout [--rounds 5] [--calls 200]

With --int2 it compares the int2 tier's two formats instead, both layouts: groups of 64 with
float16 scales and offsets (the earlier default) against groups of 32 with 8-bit scales and offsets
on per-column float32 bases (the default now), bench/results/kernels/expert_layout_int2_cpu.json.

With --mixed it times the per-token mixed mode's routed call instead: the int4 and int2 tiers'
pools (their default formats, CPU layout, int8 dot) in one `routed_expert_ffn_tiers` call, a
token's 8 experts split 8/0, 6/2, 4/4 and 0/8 between them, beside each tier alone in
`routed_expert_ffn`: whether reading some experts at int2 saves what its bytes say inside the
kernel (bench/results/kernels/expert_mixed_tiers_cpu.json).

With --tiers it times each quantized expert tier alone (int4, int3, int2 in their default formats,
CPU layout, int8 dot): the time a token's experts take against the bytes they read; on a CPU with
GFNI int3 also with its codes' bit fields taken out by shifts, as a CPU without GFNI does (the
other widths always take the shifts) (bench/results/kernels/expert_tiers_cpu.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.lib.common import machine, write_result
from jmoe.kernels.shapes import EXPERT_SHAPES

QWEN3 = EXPERT_SHAPES["qwen3-30b-a3b"]
SLOTS, TOP_K, D, F, GROUP = QWEN3.experts, QWEN3.top_k, QWEN3.hidden, QWEN3.inner, 64


def pools(fmt=None):
    """(gate_up, down) pools of SLOTS random experts in [K, N] layout (default: int4 in groups of GROUP)."""
    import jax.numpy as jnp
    import numpy as np

    from kernel_formats.qarray import QArray, QuantFormat

    fmt = fmt or QuantFormat(bits=4, group_size=GROUP, symmetric=False)
    rng = np.random.default_rng(0)

    def pool(k, n):
        values = jnp.asarray(rng.integers(0, 256, (SLOTS, fmt.packed_rows(k), n), dtype=np.uint8))
        groups = k // fmt.group_size
        if fmt.scale_bits == 8:
            codes = lambda: jnp.asarray(rng.integers(1, 256, (SLOTS, groups, n), dtype=np.uint8))  # noqa: E731
            bases = jnp.asarray(np.stack([rng.random((SLOTS, n)) * 4e-5, rng.random((SLOTS, n)) * 4e-5], axis=1),
                                jnp.float32)
            return QArray(values, codes(), codes(), None, fmt, k, bases)
        return QArray(values, jnp.asarray((rng.random((SLOTS, groups, n)) * 0.01).astype(np.float16)),
                      jnp.asarray((rng.random((SLOTS, groups, n)) * -0.005).astype(np.float16)), None, fmt, k)

    return pool(D, 2 * F), pool(F, D)


def expert_bytes(gate_up, down) -> int:
    """The bytes one expert of these pools reads: its codes, scales, offsets and bases."""
    return sum(a.nbytes // SLOTS for w in (gate_up, down) for a in (w.values, w.scales, w.offsets, w.bases)
               if a is not None)


def one_token():
    """A decode token's inputs: 64 draws of its TOP_K experts from the pool (calls cycle through them,
    so the weights come from memory), its hidden state [1, D], and its row of each expert."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    picks = [jnp.asarray(rng.choice(SLOTS, TOP_K, replace=False).astype(np.int32)) for _ in range(64)]
    return picks, jnp.asarray(rng.standard_normal((1, D)).astype(np.float32)), jnp.zeros(TOP_K, jnp.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--int2", action="store_true", help="the int2 tier's two formats, both layouts")
    parser.add_argument("--mixed", action="store_true", help="int4 and int2 pools in one call, experts split between")
    parser.add_argument("--tiers", action="store_true", help="each quantized tier alone, CPU layout, int8 dot")
    args = parser.parse_args()
    if args.mixed:
        return mixed_tiers(args.rounds, args.calls)
    if args.tiers:
        return each_tier(args.rounds, args.calls)

    import jax

    from cpu_kernels import ops
    from jmoe.tiers import tier_format
    from kernel_formats.qarray import QuantFormat, tile

    if not ops.available():
        sys.exit("the native CPU kernels are not loaded")
    formats = {"int4 g64": None}
    if args.int2:
        formats = {"int2 g64 f16 scales": QuantFormat(bits=2, group_size=64, symmetric=False),
                   "int2 g32 8-bit scales": tier_format("int2")}
    layouts, weight_bytes = {}, {}
    for label, fmt in formats.items():
        gate_up, down = pools(fmt)
        prefix = "" if not args.int2 else f"{label}, "
        layouts[prefix + "[K, N]"] = (gate_up, down)
        layouts[prefix + "cpu layout"] = (tile(gate_up), tile(down))
        weight_bytes[prefix + "[K, N]"] = weight_bytes[prefix + "cpu layout"] = TOP_K * expert_bytes(gate_up, down)
    picks, h, token = one_token()
    steps = {dot: jax.jit(lambda h, t, s, g, d, dot=dot: ops.routed_expert_ffn(h, t, s, g, d, int8_dot=dot))
             for dot in (False, True)}
    cases, read = {}, {}
    for name, (g, d) in layouts.items():
        for dot, step in steps.items():
            key = f"{name}, {'int8 dot' if dot else 'float inputs'}"
            cases[key] = (lambda s, step=step, g=g, d=d: step(h, token, s, g, d), picks)
            read[key] = weight_bytes[name]
    tiers = "int2 experts in both formats" if args.int2 else f"int4 experts (groups of {GROUP})"
    time_and_write("expert_layout_int2" if args.int2 else "expert_layout",
                   f"routed_expert_ffn, {TOP_K} of {SLOTS} {tiers}, D={D}, F={F}, one token",
                   cases, read, args.rounds, args.calls)


def time_and_write(name: str, case: str, cases: dict, read: dict, rounds: int, calls: int) -> None:
    """The cases timed in alternating rounds (timed_rounds), printed and written to
    bench/results/kernels/NAME_cpu.json with the machine and `case`, the setup they share."""
    from cpu_kernels import native

    results = summarize_rounds(timed_rounds(cases, rounds, calls), read)
    write_result("kernels", name, {"machine": machine(), "isa": native.isa(), "case": case, "rounds": rounds,
                                   "calls_per_round": calls, "results": results})


def timed_rounds(cases: dict, rounds: int, calls: int) -> dict:
    """{name: [median seconds of each round]}: the cases (name -> (call, picks)) alternating, each
    round a median of `calls` calls after a warm-up; a compilation in a timed window fails the run."""
    from jmoe.serving.compiles import no_compiles

    out = {name: [] for name in cases}
    order = list(cases)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            call, picks = cases[name]
            call(picks[0]).block_until_ready()  # warm
            times = []
            with no_compiles(name):
                for i in range(calls):
                    t = time.perf_counter()
                    call(picks[i % len(picks)]).block_until_ready()
                    times.append(time.perf_counter() - t)
            out[name].append(statistics.median(times))
    return out


def summarize_rounds(rounds: dict, read: dict) -> dict:
    """Each case's median over the rounds with [min-max] and the weight bytes it read per second, printed."""
    results = {}
    for name, ts in rounds.items():
        ms = statistics.median(ts) * 1e3
        results[name] = {"ms": round(ms, 3), "min_ms": round(min(ts) * 1e3, 3), "max_ms": round(max(ts) * 1e3, 3),
                         "weight_bytes": read[name], "weight_gb_per_s": round(read[name] / (ms / 1e3) / 1e9, 2)}
        print(f"{name}: {ms:.3f} ms [{min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f}], {read[name] / 1e6:.2f} MB, "
              f"{results[name]['weight_gb_per_s']:.1f} GB/s of weights")
    return results


def mixed_tiers(rounds: int, calls: int) -> None:
    import jax
    import jax.numpy as jnp

    from cpu_kernels import ops
    from jmoe.tiers import tier_format
    from kernel_formats.qarray import tile

    if not ops.available():
        sys.exit("the native CPU kernels are not loaded")
    tiers = {"int4": [tile(w) for w in pools(tier_format("int4"))],
             "int2": [tile(w) for w in pools(tier_format("int2"))]}
    one_expert = {t: expert_bytes(*weights) for t, weights in tiers.items()}
    picks, h, token = one_token()
    both = [(*tiers["int4"], None, None), (*tiers["int2"], None, None)]
    two_pools = jax.jit(lambda s, t: ops.routed_expert_ffn_tiers(h, token, s, t, both, int8_dot=True))
    one_pool = jax.jit(lambda s, g, d: ops.routed_expert_ffn(h, token, s, g, d, int8_dot=True))
    cases, read = {}, {}
    for tier, weights in tiers.items():
        cases[f"8 at {tier}, one pool"] = (lambda s, weights=weights: one_pool(s, *weights), picks)
        read[f"8 at {tier}, one pool"] = TOP_K * one_expert[tier]
    for low in (0, 2, 4, 8):
        codes = jnp.asarray([0] * (TOP_K - low) + [1] * low, jnp.int32)
        name = f"{TOP_K - low} at int4 + {low} at int2, two pools"
        cases[name] = (lambda s, codes=codes: two_pools(s, codes), picks)
        read[name] = (TOP_K - low) * one_expert["int4"] + low * one_expert["int2"]
    time_and_write("expert_mixed_tiers",
                   f"routed_expert_ffn(_tiers), {TOP_K} of {SLOTS} experts per pool, int4 and int2 in their default "
                   f"formats, CPU layout, int8 dot, D={D}, F={F}, one token", cases, read, rounds, calls)



def by_shifts(call):
    """call() run to completion with the int8 dot unpacking codes by shifts (native.using_gfni(False))."""
    from cpu_kernels import native

    with native.using_gfni(False):
        return call().block_until_ready()


def each_tier(rounds: int, calls: int) -> None:
    """--tiers: one token's routed experts at each quantized tier (default formats, CPU layout, int8 dot)."""
    import jax

    from cpu_kernels import native, ops
    from jmoe.tiers import tier_format
    from kernel_formats.qarray import tile

    if not ops.available():
        sys.exit("the native CPU kernels are not loaded")
    picks, h, token = one_token()
    step = jax.jit(lambda h, t, s, g, d: ops.routed_expert_ffn(h, t, s, g, d, int8_dot=True))
    cases, read = {}, {}
    for tier in ("int4", "int3", "int2"):
        gate_up, down = pools(tier_format(tier))
        g, d = tile(gate_up), tile(down)
        cases[tier] = (lambda s, g=g, d=d: step(h, token, s, g, d), picks)
        read[tier] = TOP_K * expert_bytes(gate_up, down)
        if tier == "int3" and native.gfni():  # its codes' bit fields taken out by shifts, as without GFNI
            cases[f"{tier}, by shifts"] = (lambda s, g=g, d=d: by_shifts(lambda: step(h, token, s, g, d)), picks)
            read[f"{tier}, by shifts"] = read[tier]
    time_and_write("expert_tiers",
                   f"routed_expert_ffn, {TOP_K} of {SLOTS} experts at each tier's default format, CPU layout, "
                   f"int8 dot, D={D}, F={F}, one token", cases, read, rounds, calls)


if __name__ == "__main__":
    main()
