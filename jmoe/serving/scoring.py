"""Log-probabilities of a prompt's own tokens, for completions' `echo` with `logprobs` (what
lm-evaluation-harness's loglikelihood reads): jmoe.forward over the prompt, read at the prompt's
positions of its padded bucket (so prompt lengths within a bucket share every executable).

The serving engine runs them (BatchEngine.score) on its own thread, one between two steps: the
running rows wait for a scoring at most as long as that prompt's prefill takes in one step, and
where several processes serve one model each of them runs the same scorings in the same order
as the steps (jmoe/serving/mirror.py), as the model's collectives need.
"""

from __future__ import annotations

from jmoe.decoding.engine import MIN_PROMPT_BUCKET
from jmoe.decoding.evaluate import bucket_logits
from jmoe.serving.logits import token_logprobs
from jmoe.serving.requests import TokenLogprob


def score_prompt(model, prompt: list[int], top: int) -> list[TokenLogprob]:
    """Each prompt token's log-probability given the tokens before it, with the `top` likeliest
    tokens there; the first token's logprob and alternatives are None (nothing predicts it)."""
    logits, start = bucket_logits(model, prompt)  # [P, vocab]: position start + t predicts token t + 1
    following = {start + t: token for t, token in enumerate(prompt[1:])}
    scored = token_logprobs(logits, following, dict.fromkeys(following, top))
    return [TokenLogprob(prompt[0], None, None)] + [scored[p] for p in following]


def warm_up_scoring(model, context: int) -> None:
    """Compile the scoring at every prompt-length bucket below `context`, so that no echo request
    compiles (holding the engine) on the request path."""
    length = MIN_PROMPT_BUCKET
    while True:
        score_prompt(model, [0] * min(length, context - 1), 0)
        if length >= context - 1:
            return
        length *= 2
