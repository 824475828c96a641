"""Decode attention on the CPU: the native kernel (cpu_kernels.attention) against the blocked XLA
formulation it replaced, at Qwen3-30B-A3B's heads (32 query heads on 4 cache heads of 128) or
another model's (`--heads`). The
native kernel reads a paged cache (pages of 64 slots in shuffled order, as a page table leaves them
after sequences come and go), XLA the same data contiguous.

Each timed call is one layer's attention of a decode token (or a speculative verification of 4)
over a cache at the given depth; a chain of calls cycles through --layers distinct caches, so the
caches are read from memory as in a decode step, not from the last level of cache. Native and XLA
alternate within each round; medians [min-max] over rounds. Fails if anything compiles in a timed
window.

    python -m bench.cpu_attention [--depths 4096,16384] [--tokens 1,4] [--heads 32,4,128]
                                  [--caches float32,bfloat16,int8] [--rounds 3] [--tag zen5]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from bench.lib.common import timed, write_result
from jmoe.layers.attention import AttentionMeta, blocked_attention, quantize_rows

HEADS, CACHE_HEADS, WIDTH = 32, 4, 128
CACHES = ("float32", "bfloat16", "int8")
PAGE = 64


def caches(kind: str, layers: int, depth: int, table: np.ndarray, rng, cache_heads: int = CACHE_HEADS,
           width: int = WIDTH) -> tuple[list, list]:
    """Per layer, (keys, values) contiguous [1, K, depth, w] and the same as pages [n, K, PAGE, w]:
    the row's page p at table[0, p]."""
    def one():
        k, v = (rng.normal(size=(1, cache_heads, depth, width)).astype(np.float32) for _ in range(2))
        if kind == "int8":
            return quantize_rows(jnp.asarray(k)), quantize_rows(jnp.asarray(v))
        return jnp.asarray(k, kind), jnp.asarray(v, kind)

    def paged(x):  # [1, K, depth, w] -> [n, K, PAGE, w]
        pages = x[0].reshape(x.shape[1], -1, PAGE, x.shape[3]).transpose(1, 0, 2, 3)
        return pages[np.argsort(table[0])]

    contiguous = [one() for _ in range(layers)]
    return contiguous, [jax.tree.map(paged, c) for c in contiguous]


def chain(attend, layers: int, calls: int):
    """One executable running `calls` attentions, each on the next layer's cache, each call's query
    depending on the last call's output (nothing hoisted or overlapped)."""
    def run(q, per_layer):
        for i in range(calls):
            k, v = per_layer[i % layers]
            q = q + 1e-3 * attend(q, k, v)
        return q

    return jax.jit(run)


def seconds_per_call(fn, q, per_layer, calls: int, repeat: int) -> float:
    # timed() fails the run if its calls compile
    return timed(lambda: jax.block_until_ready(fn(q, per_layer)), repeat=repeat, warmup=0) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="4096,16384")
    parser.add_argument("--tokens", default="1,4", help="current tokens per call (decode, verification)")
    parser.add_argument("--layers", type=int, default=8, help="distinct caches a chain cycles through")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heads", default=f"{HEADS},{CACHE_HEADS},{WIDTH}",
                        help="query heads, cache heads, width (default Qwen3-30B-A3B's)")
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--tag", default=None, help="the result file's name: cpu_attention_<tag>")
    args = parser.parse_args()
    heads, cache_heads, width = (int(x) for x in args.heads.split(","))
    if not cpu_kernels.available():
        raise SystemExit("the native CPU kernels are not loaded")
    rng = np.random.default_rng(0)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        table = rng.permutation(depth // PAGE).astype(np.int32)[None]
        for kind in args.caches.split(","):
            contiguous, paged = caches(kind, args.layers, depth, table, rng, cache_heads, width)
            cache_bytes = sum(x.nbytes for x in jax.tree.leaves(contiguous[0]))
            for tokens in (int(t) for t in args.tokens.split(",")):
                groups = heads // cache_heads
                q = jnp.asarray(rng.normal(size=(1, cache_heads, groups * tokens, width)).astype(np.float32))
                start = jnp.array([depth - tokens], jnp.int32)
                meta = AttentionMeta(start, jnp.zeros((1,), jnp.int32), jnp.zeros((1, tokens, 2)),
                                     jnp.zeros((1, tokens, 2)), jnp.zeros((1, 1), jnp.int32))  # one page a row
                kw = dict(groups=groups, scale=width**-0.5, window=None, precision=None)
                forms = {
                    "native": lambda q, k, v: cpu_kernels.attention(q, k, v, meta.start, meta.key_start, table,
                                                                    groups=groups, scale=kw["scale"], window=None)[0],
                    "xla": lambda q, k, v: blocked_attention((q,), (k,), v, meta, reachable_only=True, **kw)[0],
                }
                fns = {name: chain(f, args.layers, args.calls) for name, f in forms.items()}
                inputs = {"native": paged, "xla": contiguous}
                for name, fn in fns.items():
                    jax.block_until_ready(fn(q, inputs[name]))  # compiles
                times = {name: [] for name in fns}
                for r in range(args.rounds):
                    for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                        times[name].append(seconds_per_call(fns[name], q, inputs[name], args.calls, repeat=3))
                ratios = [x / n for x, n in zip(times["xla"], times["native"])]
                row = {"depth": depth, "cache": kind, "tokens": tokens, "cache_bytes_per_layer": cache_bytes,
                       **{f"{name}_ms": {"median": statistics.median(t) * 1e3, "min": min(t) * 1e3,
                                         "max": max(t) * 1e3} for name, t in times.items()},
                       "native_gb_s": cache_bytes / statistics.median(times["native"]) / 1e9,
                       "speedup": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
                rows.append(row)
                print(f"depth {depth:6d} {kind:8s} T={tokens}: xla {row['xla_ms']['median']:.3f} ms, native "
                      f"{row['native_ms']['median']:.3f} ms ({row['native_gb_s']:.1f} GB/s), "
                      f"x{row['speedup']['median']:.2f} [{row['speedup']['min']:.2f}-{row['speedup']['max']:.2f}]",
                      flush=True)
    write_result("kernels", f"cpu_attention_{args.tag}" if args.tag else "cpu_attention", {
        "shapes": f"{heads} query heads on {cache_heads} cache heads of {width}",
        "layers": args.layers, "calls": args.calls, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
