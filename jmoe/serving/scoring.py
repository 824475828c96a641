"""Log-probabilities of a prompt's own tokens, for completions' `echo` with `logprobs` (what
lm-evaluation-harness's loglikelihood reads): jmoe.forward over the prompt, on a thread of its own.

forward is one step over the whole prompt, taken under the model's lock as the engine's steps are:
the engine's steps interleave with it, and wait for it at most as long as that prompt's prefill
takes in one step. The scorer has one thread, so echo requests queue among themselves rather than
stacking steps ahead of the engine's.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from jmoe.decoding.engine import MIN_PROMPT_BUCKET
from jmoe.decoding.evaluate import forward
from jmoe.serving.logits import token_logprobs
from jmoe.serving.requests import TokenLogprob


class PromptScorer:
    def __init__(self, model):
        self.model = model
        self._thread: ThreadPoolExecutor | None = None  # started by the first request that needs it

    async def score(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """score_now() on the scorer's thread, awaited on the event loop."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="jmoe-scorer")
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.score_now, prompt, top)

    def score_now(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """Each prompt token's log-probability given the tokens before it, with the `top` likeliest
        tokens there; the first token's logprob and alternatives are None (nothing predicts it)."""
        logits = forward(self.model, prompt)  # [T, vocab]: position t predicts token t + 1
        following = dict(enumerate(prompt[1:]))
        scored = token_logprobs(logits[:-1], following, dict.fromkeys(following, top))
        return [TokenLogprob(prompt[0], None, None)] + [scored[t] for t in following]

    def warm_up(self, context: int) -> None:
        """Compile forward at every prompt-length bucket below `context`, so that no echo request
        compiles a step (holding the model) on the request path."""
        length = MIN_PROMPT_BUCKET
        while True:
            self.score_now([0] * min(length, context - 1), 0)
            if length >= context - 1:
                return
            length *= 2
