"""`jmoe bench`: prefill and decode speed of a loaded model, in llama-bench's convention.

For each prompt length p a "pp p" row: prompt tokens prefilled per second (one prompt of p
tokens, generating one). For each generation length n and batch size b a "tg n" row: new tokens
per second of the decode steps alone, b prompts decoded together, timed within each run from the
first streamed step (the prefill's token) to the last, over the b * (n - 1) tokens decoded in
between (EOS is banned, as llama-bench ignores it, so every row decodes all n). Each row is the
mean and standard deviation of `repetitions` timed runs after one untimed run (it compiles; a
compile in the timed runs fails the bench: jmoe.serving.compiles.no_compiles), with the expert
hit rate and the bytes moved host-to-device per token of those runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from jmoe import validate
from jmoe.serving.compiles import no_compiles


@dataclass
class Row:
    model: str
    backend: str
    test: str  # "pp512", "tg128"
    batch: int
    tokens_per_run: int  # tokens each timed run counted
    tokens_per_s: float
    std: float
    hit_rate: float | None
    bytes_h2d_per_token: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def random_prompt(model, length: int, seed: int) -> list[int]:
    """A prompt of `length` random tokens below the vocabulary's special ones."""
    rng = np.random.default_rng(seed)
    return rng.integers(10, min(model.config.vocab_size, 32000), size=length).tolist()


def _timed(fn, repetitions: int, what: str) -> list[float]:
    fn()  # compiles
    times = []
    with no_compiles(what):
        for _ in range(repetitions):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return times


def decode_seconds(model, prompts: list[list[int]], n: int) -> tuple[float, int]:
    """(seconds, tokens) of one run's decode steps: from the first streamed step to the last."""
    import jmoe

    no_eos = {int(t): -100.0 for t in model.eos_token_ids}
    first = last = None
    tokens = 0
    for step in jmoe.generate(model, prompts, max_new_tokens=n, stream=True, logit_bias=no_eos):
        now = time.perf_counter()
        if first is None:
            first = now  # the prefill's token: not a decode step
            continue
        last, tokens = now, tokens + sum(piece is not None for piece in step)
    return last - first, tokens


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
    import jax

    import jmoe

    check(model, prompt_lengths, gen_lengths, batches, repetitions)
    name, backend = model.path.name, jax.default_backend()
    rows = []
    for p in prompt_lengths:
        ids = random_prompt(model, p, p)
        model.residency.reset_stats()
        times = _timed(lambda: jmoe.generate(model, ids, max_new_tokens=1), repetitions, f"pp{p}")
        rates = [p / t for t in times]
        rows.append(Row(name, backend, f"pp{p}", 1, p, statistics.mean(rates), statistics.pstdev(rates),
                        *_offload_figures(model, p * (repetitions + 1))))
    for n in gen_lengths:
        for b in batches:
            prompts = [random_prompt(model, TG_PROMPT, 1000 + i) for i in range(b)]
            decode_seconds(model, prompts, n)  # compiles
            model.residency.reset_stats()
            with no_compiles(f"tg{n}, batch {b}"):
                runs = [decode_seconds(model, prompts, n) for _ in range(repetitions)]
            rates = [tokens / seconds for seconds, tokens in runs]
            rows.append(Row(name, backend, f"tg{n}", b, runs[0][1], statistics.mean(rates), statistics.pstdev(rates),
                            *_offload_figures(model, b * n * repetitions)))
    return rows


def table(rows: list[Row]) -> str:
    """A markdown table, as llama-bench prints."""
    lines = ["| model | backend | test | batch | t/s | hit rate | bytes h2d / token |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
        moved = "-" if r.bytes_h2d_per_token is None else f"{r.bytes_h2d_per_token / 2**20:.2f} MiB"
        lines.append(f"| {r.model} | {r.backend} | {r.test} | {r.batch} | {r.tokens_per_s:.2f} ± {r.std:.2f} | {hit} "
                     f"| {moved} |")
    return "\n".join(lines)
