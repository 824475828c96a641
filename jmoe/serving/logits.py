"""What the serving engine reads from a step's logits: one row of them, every row's greedy token, and
the log-probabilities (with the likeliest alternatives) of the tokens drawn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.decoding.sampling import greedy_tokens
from jmoe.serving.requests import TokenLogprob

MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's bound)

# one row of the step's logits [1, V]; the row index traced, so no row compiles a slice of its own
row_jit = jax.jit(lambda logits, b: jax.lax.dynamic_slice_in_dim(logits, b, 1))
# every row's greedy token in one call: what the sampler draws for a greedy request without a
# repetition, presence or frequency penalty or logit bias (those off leave the logits exactly as they are)
greedy_jit = jax.jit(greedy_tokens)


@jax.jit
def logprobs_jit(logits, tokens):
    """Per row: the log-probability of tokens[b] and the MAX_TOP_LOGPROBS most likely tokens with theirs."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    top, ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logprobs.shape[-1]))
    return chosen, top, ids


def token_logprobs(logits, tokens: dict[int, int], wanted: dict[int, int]) -> dict[int, TokenLogprob]:
    """TokenLogprobs of the rows in `wanted` (row -> alternatives) for their drawn `tokens`, from a
    step's logits [n, V]: one device call for every row."""
    if not wanted:
        return {}
    drawn = np.zeros(logits.shape[0], np.int32)
    for b, token in tokens.items():
        drawn[b] = token
    chosen, top, ids = (np.asarray(a) for a in logprobs_jit(logits, drawn))
    return {b: TokenLogprob(tokens[b], float(chosen[b]), [(int(i), float(v)) for i, v in zip(ids[b, :k], top[b, :k])])
            for b, k in wanted.items()}
