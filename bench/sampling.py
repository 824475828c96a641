"""What drawing one token costs at a real vocabulary: the sampler over Qwen3's 151,936 logits.

Each configuration (greedy; temperature alone; top-p; top-k with top-p, as Qwen3's model card
recommends; min-p) is the jitted sampler every decode path runs (jmoe/decoding/engine.py), on one
row of random logits with a history, warmed up first, then timed --repeat times (block until
ready); median and min-max in milliseconds. Exits if anything compiles in the timed window.

    python -m bench.sampling [--repeat 50] [--rows 1] [--out sampling]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from bench.lib.common import write_result
from jmoe.decoding.engine import _sample_jit
from jmoe.decoding.sampling import HISTORY_DTYPE, SamplingOptions
from jmoe.serving.compiles import no_compiles

VOCAB = 151_936  # Qwen3's
CASES = {
    "greedy": SamplingOptions(),
    "temperature 1": SamplingOptions(temperature=1.0),
    "top_p 0.9": SamplingOptions(temperature=1.0, top_p=0.9),
    "top_k 20 + top_p 0.8, temperature 0.7": SamplingOptions(temperature=0.7, top_k=20, top_p=0.8),
    "min_p 0.05": SamplingOptions(temperature=1.0, min_p=0.05),
}


def time_case(options: SamplingOptions, rows: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    logits = jax.device_put((rng.normal(size=(rows, VOCAB)) * 4).astype(np.float32))
    seen = jax.device_put(np.zeros((rows, VOCAB), HISTORY_DTYPE))
    params = options.device_params(VOCAB)
    key = options.rng()

    def draw():
        return jax.block_until_ready(_sample_jit(logits, seen, key, *params, greedy=options.greedy,
                                                 filters=options.filters))

    draw()
    draw()
    times = []
    with no_compiles("the sampling draws"):
        for _ in range(repeat):
            start = time.perf_counter()
            draw()
            times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--out", default="sampling")
    args = parser.parse_args(argv)
    results = {}
    for name, options in CASES.items():
        results[name] = time_case(options, args.rows, args.repeat)
        r = results[name]
        print(f"{name:40s} {r['median_ms']:7.2f} ms [{r['min_ms']:.2f}-{r['max_ms']:.2f}]")
    write_result("sampling", args.out, {"vocab": VOCAB, "rows": args.rows, "repeat": args.repeat, "cases": results})


if __name__ == "__main__":
    main()
