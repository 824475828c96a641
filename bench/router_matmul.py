"""The routers' matmuls on the CPU: one decode token's hidden state times each family's router
([hidden, experts] in bf16, as `jmoe convert` keeps it), native kernel and XLA's dot, timed inside a
jitted chain of dependent calls (bench.lib.common.in_graph_seconds: no per-call dispatch).

A router narrower than the kernels' 64-column tile (Mixtral's 8 experts, GPT-OSS's 32, PhiMoE's 16)
is all ragged tile, which the native matmul once walked one weight at a time; cpu_kernels.ops now
hands float weights narrower than a tile to XLA's dot (XLA_DOT_COLUMNS), timed here beside it.

    python -m bench.router_matmul [--name NAME] [--calls 50]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from bench.lib.common import in_graph_seconds, result_name, write_result
from bench.lib.random_checkpoint import MODELS
from jmoe.models import config_from_hf


def router_shapes() -> dict[str, tuple[int, int]]:
    """Each real model the benches know: (hidden size, routed experts)."""
    shapes = {}
    for key, real in sorted(MODELS.items()):
        cfg = config_from_hf(real.config)
        shapes[key] = (cfg.hidden_size, cfg.num_experts)
    return shapes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="dependent calls in the timed chain")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--name", type=result_name, default="router_matmul")
    args = parser.parse_args(argv)

    from cpu_kernels import native, ops

    rows = []
    for model, (d, e) in router_shapes().items():
        w = jnp.asarray((np.random.default_rng(d + e).standard_normal((d, e)) * 0.02).astype(jnp.bfloat16))
        x = jnp.ones((1, d), jnp.float32)
        # each call's output feeds the next call's input, so the chain cannot be reordered or merged;
        # the native kernel even where ops.matmul hands a weight this narrow to XLA's dot
        columns, ops.XLA_DOT_COLUMNS = ops.XLA_DOT_COLUMNS, 0
        try:
            native_s = in_graph_seconds(lambda h, w: h + ops.matmul(h, w)[:, :1] * 1e-9, (x, w), calls=args.calls,
                                        repeat=args.repeat)
        finally:
            ops.XLA_DOT_COLUMNS = columns
        xla_s = in_graph_seconds(lambda h, w: h + jnp.dot(h, w.astype(jnp.float32))[:, :1] * 1e-9, (x, w),
                                 calls=args.calls, repeat=args.repeat)
        rows.append({"model": model, "hidden": d, "experts": e, "weight_bytes": d * e * 2,
                     "native_us": native_s * 1e6, "xla_dot_us": xla_s * 1e6})
        print(f"{model:22s} [{d}, {e:3d}]  native {native_s * 1e6:7.1f} us  XLA dot {xla_s * 1e6:7.1f} us", flush=True)
    write_result("router_matmul", args.name, {"command": "python -m bench.router_matmul", "calls": args.calls,
                                              "repeat": args.repeat, "native_isa": native.isa(), "rows": rows})


if __name__ == "__main__":
    main()
