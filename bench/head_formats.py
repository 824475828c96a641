"""The int6 LM head's formats on the CPU: one decode token's hidden state times Qwen3-30B-A3B's
151,936 x 2,048 head in the CPU layout under the int8 dot, the native kernel alone, each format
timed inside a jitted chain of dependent calls (bench.lib.common.in_graph_seconds), the formats in
alternating rounds. What each reads is what the one-pass kernel reads: both planes' codes and the
low plane's scales, offsets and bases (never the high plane's scales).

    python -m bench.head_formats [--rounds 15] [--name NAME]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib.common import in_graph_seconds, result_name, spread, write_result
from kernel_formats.qarray import QuantFormat, template

HIDDEN, VOCAB = 2048, 151936  # Qwen3-30B-A3B's head
FORMATS = {  # label -> the 6-bit grid's format (the CPU layout)
    "groups of 64, float16 scales": QuantFormat(6, 64, False, tiled=True),
    "groups of 32, float16 scales": QuantFormat(6, 32, False, tiled=True),
    "groups of 32, 8-bit scales": QuantFormat(6, 32, False, tiled=True, scale_bits=8),
}
BASELINE = "groups of 64, float16 scales"


def random_weight(fmt: QuantFormat, rng: np.random.Generator):
    """A head in `fmt` with random codes and small positive scales (the kernel's time does not depend
    on the values)."""
    def leaf(s):
        if s.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, s.shape, dtype=np.uint8))
        if s.dtype == jnp.float16:
            return jnp.asarray((rng.standard_normal(s.shape) * 0.01).astype(np.float16))
        return jnp.asarray((np.abs(rng.standard_normal(s.shape)) * 1e-4).astype(np.float32))  # 8-bit scales' bases

    return jax.tree.map(leaf, template(fmt, HIDDEN, VOCAB))


def read_bytes(w) -> int:
    """The bytes the one-pass kernel reads of a six-bit weight."""
    return sum(a.nbytes for a in jax.tree.leaves(w.low)) + w.high.values.nbytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="dependent calls in each timed chain")
    parser.add_argument("--name", type=result_name, default="head_formats")
    args = parser.parse_args(argv)

    import cpu_kernels
    from cpu_kernels import native

    rng = np.random.default_rng(0)
    weights = {label: random_weight(fmt, rng) for label, fmt in FORMATS.items()}
    x = jnp.asarray(rng.standard_normal((1, HIDDEN)).astype(np.float32))

    def product(h, w):  # the head's logits, one of them fed back so that the calls chain
        return h + cpu_kernels.matmul(h, w, int8_dot=True)[:, :1] * 1e-30

    ms = {label: [] for label in FORMATS}  # (in_graph_seconds compiles and warms each chain before it times it)
    for r in range(args.rounds):
        for label in (FORMATS if r % 2 == 0 else reversed(FORMATS)):
            ms[label].append(1e3 * in_graph_seconds(product, (x, weights[label]), calls=args.calls, repeat=3))
    rows = []
    for label, times in ms.items():
        w = weights[label]
        ratio = np.asarray(ms[BASELINE]) / np.asarray(times)
        rows.append({"format": label, "read_mb": read_bytes(w) / 1e6,
                     "stored_mb": sum(a.nbytes for a in jax.tree.leaves(w)) / 1e6,
                     "ms": spread(times), "gb_s": read_bytes(w) / np.median(times) / 1e6,
                     f"{BASELINE} time over this, within a round": spread(ratio)})
        print(f"{label:30s} {np.median(times):6.2f} ms  reads {read_bytes(w) / 1e6:6.1f} MB  "
              f"{BASELINE} time / this {np.median(ratio):.3f} [{ratio.min():.3f}-{ratio.max():.3f}]", flush=True)
    write_result("kernels", args.name, {
        "command": "python -m bench.head_formats", "shape": [HIDDEN, VOCAB], "rows_multiplied": 1,
        "rounds": args.rounds, "calls": args.calls, "native_isa": native.isa(), "formats": rows})


if __name__ == "__main__":
    main()
