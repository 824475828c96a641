"""`jmoe bench`: prefill and decode speed of a loaded model, in llama-bench's convention.

For each prompt length p a "pp p" row: prompt tokens prefilled per second (one prompt of p
tokens). For each generation length n and batch size b a "tg n" row: new tokens per second over
b prompts decoded together, prefill excluded (the time of n new tokens less that of one). Each
row is the mean and standard deviation of `repetitions` timed runs after one untimed run (it
compiles), with the expert hit rate and the bytes moved host-to-device per token of those runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from jmoe import validate


@dataclass
class Row:
    test: str  # "pp512", "tg128"
    batch: int
    tokens_per_s: float
    std: float
    hit_rate: float | None
    bytes_h2d_per_token: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _prompt(model, length: int, seed: int) -> list[int]:
    """A prompt of `length` random tokens below the vocabulary's special ones."""
    rng = np.random.default_rng(seed)
    return rng.integers(10, min(model.config.vocab_size, 32000), size=length).tolist()


def _timed(fn, repetitions: int) -> list[float]:
    fn()  # compiles
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _offload_figures(model, tokens: int) -> tuple[float | None, float | None]:
    from jmoe.api import stats

    s = stats(model)
    if not s.get("expert_uses"):  # all resident: nothing is fetched or counted
        return None, None
    return s["hit_rate"], s["bytes_h2d"] / max(tokens, 1)


TG_PROMPT = 16  # prompt tokens of every tg row
MAX_REPETITIONS = 1000


def check(model, prompt_lengths, gen_lengths, batches, repetitions: int) -> None:
    """Every length within the model's context, before any row runs."""
    context = model.max_seq_len
    validate.integer("repetitions", repetitions, minimum=1, maximum=MAX_REPETITIONS)
    for p in prompt_lengths:  # and the one token generated after it
        validate.integer("prompt length", p, minimum=1, maximum=context - 1)
    for n in gen_lengths:
        validate.integer("generation length", n, minimum=2, maximum=context - TG_PROMPT)
    for b in batches:
        validate.integer("batch", b, minimum=1)


def run(model, *, prompt_lengths=(512,), gen_lengths=(128,), batches=(1,), repetitions: int = 3) -> list[Row]:
    """Every pp row, then every (tg, batch) row."""
    import jmoe

    check(model, prompt_lengths, gen_lengths, batches, repetitions)
    rows = []
    for p in prompt_lengths:
        ids = _prompt(model, p, p)
        model.residency.reset_stats()
        times = _timed(lambda: jmoe.generate(model, ids, max_new_tokens=1), repetitions)
        rates = [p / t for t in times]
        rows.append(Row(f"pp{p}", 1, statistics.mean(rates), statistics.pstdev(rates),
                        *_offload_figures(model, p * (repetitions + 1))))
    for n in gen_lengths:
        for b in batches:
            prompts = [_prompt(model, TG_PROMPT, 1000 + i) for i in range(b)]
            one = _timed(lambda: jmoe.generate(model, prompts, max_new_tokens=1), 1)[0]
            model.residency.reset_stats()
            times = _timed(lambda: jmoe.generate(model, prompts, max_new_tokens=n), repetitions)
            rates = [b * (n - 1) / max(t - one, 1e-9) for t in times]
            rows.append(Row(f"tg{n}", b, statistics.mean(rates), statistics.pstdev(rates),
                            *_offload_figures(model, b * n * (repetitions + 1))))
    return rows


def table(rows: list[Row]) -> str:
    """A markdown table, as llama-bench prints."""
    lines = ["| test | batch | t/s | hit rate | bytes h2d / token |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
        moved = "-" if r.bytes_h2d_per_token is None else f"{r.bytes_h2d_per_token / 2**20:.2f} MiB"
        lines.append(f"| {r.test} | {r.batch} | {r.tokens_per_s:.2f} ± {r.std:.2f} | {hit} | {moved} |")
    return "\n".join(lines)
