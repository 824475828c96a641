"""Evaluation helpers: full-sequence logits and perplexity over long token streams."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import validate
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, bucket, new_cache
from jmoe.errors import InputError


def check_model(model) -> None:
    from jmoe.runtime.loader import JmoeModel

    if not isinstance(model, JmoeModel):
        raise InputError(f"model must be what jmoe.load returned, got {type(model).__name__}")


def token_array(model, token_ids, minimum: int) -> np.ndarray:
    """Validated token ids [T] int32: integers in the vocabulary, at least `minimum` of them."""
    ids = np.asarray(validate.token_ids("token_ids", token_ids, model.config.vocab_size), np.int32)
    if ids.shape[0] < minimum:
        raise InputError(f"token_ids must hold at least {minimum} token(s), got {ids.shape[0]}")
    return ids


def forward(model, token_ids) -> jnp.ndarray:
    """Logits [T, vocab] float32 for one sequence of token ids (no sampling, no cache reuse)."""
    check_model(model)
    ids = token_array(model, token_ids, 1)
    T = ids.shape[0]
    if T > model.max_seq_len:
        raise InputError(f"{T} tokens exceed the context of {model.max_seq_len}")
    P = bucket(T, MIN_PROMPT_BUCKET, model.max_seq_len)
    tokens = np.zeros((1, P), np.int32)
    tokens[0, P - T :] = ids
    cache = new_cache(model.config, 1, P, model.compute_dtype)
    logits, _ = model.step(jnp.asarray(tokens), cache, np.zeros(1, np.int32), np.asarray([P - T], np.int32),
                           last_only=False, phase="prefill")
    return logits[0, P - T :]


@jax.jit
def _token_nll(logits, tokens):
    """logits [1, T, V], tokens [1, T] -> NLL of tokens[:, 1:] given the prefix, [T - 1]."""
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]


def window_nll(model, token_ids, window: int) -> tuple[float, int]:
    """Sum of NLL (nats) and number of predicted tokens over non-overlapping windows of `window` tokens."""
    check_model(model)
    window = validate.integer("window", window, minimum=2, maximum=model.max_seq_len)
    ids = token_array(model, token_ids, 2)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        if len(chunk) < window:  # last partial window: pad on the right, count only real tokens
            padded = np.zeros((window,), np.int32)
            padded[: len(chunk)] = chunk
        else:
            padded = chunk
        tokens = jnp.asarray(padded[None])
        cache = new_cache(model.config, 1, window, model.compute_dtype)
        logits, _ = model.step(tokens, cache, np.zeros(1, np.int32), np.zeros(1, np.int32), last_only=False,
                               phase="prefill")
        nll = np.asarray(_token_nll(logits, tokens))[: len(chunk) - 1]
        total += float(nll.sum(dtype=np.float64))
        count += len(chunk) - 1
    return total, count


def perplexity(model, token_ids, window: int = 512) -> float:
    total, count = window_nll(model, token_ids, window)
    return math.exp(total / count)
