"""Evaluation helpers: full-sequence logits and perplexity over long token streams."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import validate
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, bucket, new_cache
from jmoe.decoding.loaded import check_model
from jmoe.errors import InputError


def token_array(model, token_ids, minimum: int) -> np.ndarray:
    """Validated token ids [T] int32: integers in the vocabulary, at least `minimum` of them."""
    ids = np.asarray(validate.token_ids("token_ids", token_ids, model.config.vocab_size), np.int32)
    if ids.shape[0] < minimum:
        raise InputError(f"token_ids must hold at least {minimum} token(s), got {ids.shape[0]}")
    return ids


def forward(model, token_ids) -> jnp.ndarray:
    """Logits [T, vocab] float32 for one sequence of token ids (no sampling, no cache reuse)."""
    logits, start = bucket_logits(model, token_ids)
    return logits[start:]


def bucket_logits(model, token_ids) -> tuple[jnp.ndarray, int]:
    """forward's logits as the step gives them: [P, vocab] for the sequence left-padded to its
    prompt bucket P, and the position of its first token. (A caller that reads them at positions
    rather than slicing compiles nothing per sequence length.)"""
    check_model(model)
    ids = token_array(model, token_ids, 1)
    T = ids.shape[0]
    if T > model.max_seq_len:
        raise InputError(f"{T} tokens exceed the context of {model.max_seq_len}")
    P = bucket(T, MIN_PROMPT_BUCKET, model.max_seq_len)
    tokens = np.zeros((1, P), np.int32)
    tokens[0, P - T :] = ids
    cache = new_cache(model.config, 1, P, model.kv_dtype)
    logits, _ = model.step(jnp.asarray(tokens), cache, np.zeros(1, np.int32), np.asarray([P - T], np.int32),
                           last_only=False, phase="prefill")
    return logits[0], P - T


@jax.jit
def _token_nll(logits, tokens):
    """logits [1, T, V], tokens [1, T] -> NLL of tokens[:, 1:] given the prefix, [T - 1]."""
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]


def window_nll(model, token_ids, window: int, mode: str = "prefill", context: int = 0) -> tuple[float, int]:
    """Sum of NLL (nats) and number of predicted tokens over non-overlapping windows of `window` tokens.

    mode "prefill" scores a window in one step; "decode" feeds it one token at a time (teacher
    forced) through decode steps, so policies that decide per decode step decide for every token.
    context: each window's tokens at positions 1..context are conditioned on but not scored, so every
    scored token sees at least `context` tokens before it (llama.cpp's perplexity tool scores the
    second half of each window: context = window // 2).
    """
    check_model(model)
    window = validate.integer("window", window, minimum=2, maximum=model.max_seq_len)
    validate.choice("mode", mode, ("prefill", "decode"))
    context = validate.integer("context", context, minimum=0, maximum=window - 2)
    ids = token_array(model, token_ids, 2)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < context + 2:
            break
        nll = _decode_nll(model, chunk) if mode == "decode" else _prefill_nll(model, chunk, window)
        total += float(nll[context:].sum(dtype=np.float64))
        count += len(chunk) - 1 - context
    return total, count


def _prefill_nll(model, chunk: np.ndarray, window: int) -> np.ndarray:
    if len(chunk) < window:  # last partial window: pad on the right, count only real tokens
        padded = np.zeros((window,), np.int32)
        padded[: len(chunk)] = chunk
    else:
        padded = chunk
    tokens = jnp.asarray(padded[None])
    cache = new_cache(model.config, 1, window, model.kv_dtype)
    logits, _ = model.step(tokens, cache, np.zeros(1, np.int32), np.zeros(1, np.int32), last_only=False,
                           phase="prefill")
    return np.asarray(_token_nll(logits, tokens))[: len(chunk) - 1]


@jax.jit
def _next_nll(logits, target):
    """logits [1, V], target [1] -> NLL [1]."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), target[:, None], axis=-1)[:, 0]


def _decode_nll(model, chunk: np.ndarray) -> np.ndarray:
    from jmoe.decoding.decoder import Decoder

    decoder = Decoder(model, [chunk[:1].tolist()], 1, bucket(len(chunk), MIN_PROMPT_BUCKET, model.max_seq_len))
    logits = decoder.prefill()
    nll = []
    for i in range(1, len(chunk)):
        nll.append(_next_nll(logits, jnp.asarray(chunk[i : i + 1])))
        if i + 1 < len(chunk):
            logits = decoder.decode(jnp.asarray(chunk[i : i + 1]))
    return np.asarray(jnp.concatenate(nll))


def perplexity(model, token_ids, window: int = 512, mode: str = "prefill", context: int = 0) -> float:
    """exp(mean NLL) of token_ids over non-overlapping windows; mode "decode" scores token by token;
    context: each window's first tokens only conditioned on (see window_nll)."""
    total, count = window_nll(model, token_ids, window, mode, context)
    return math.exp(total / count)


def window_routing(model, token_ids, window: int = 256, with_weights: bool = False):
    """[T, L, k] the experts each token of token_ids was routed to, running prefill windows through a
    model whose experts are all resident (its steps keep their routing on the device); with
    `with_weights`, also [T, L, k] the combine weight of each."""
    check_model(model)
    if model.residency.offloading:
        raise InputError("routing traces need a model with every expert resident (load it without a budget, "
                         "or at a smaller tier)")
    window = validate.integer("window", window, minimum=2, maximum=model.max_seq_len)
    ids = token_array(model, token_ids, 1)
    routed, weights = [], []
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        cache = new_cache(model.config, 1, len(chunk), model.kv_dtype)
        model.step(jnp.asarray(chunk[None]), cache, np.zeros(1, np.int32), np.zeros(1, np.int32), last_only=True,
                   phase="prefill")
        signals = model.residency.signals
        routed.append(np.asarray(signals.ids)[:, 0].transpose(1, 0, 2))  # [T, L, k]
        if with_weights:
            weights.append(np.asarray(signals.weights, np.float32)[:, 0].transpose(1, 0, 2))
    if with_weights:
        return np.concatenate(routed), np.concatenate(weights)
    return np.concatenate(routed)
