"""Speculative decoding's device side: the draft's tokens and the target's acceptance, traced into
the steps that draft and verify (jmoe/decoding/engine.py), so a cycle never waits on the host.

Acceptance: greedy keeps the longest prefix of drafts the target's argmax agrees with (the output
is exactly the plain greedy one); sampling keeps drafted token d at position j with probability
min(1, p_j(d) / q_j(d)) and, at the first rejection, draws from the normalised residual
max(0, p_j - q_j) (from p_k when every draft was kept), so the output follows the target's
distribution. p and q both go through the logit bias, the repetition, presence and frequency
penalties, temperature, top-k, top-p and min-p, with the history as it stands at each position (the
prompt's and earlier tokens', and the drafts before: each drafted token counted once more).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.decoding.sampling import ALL_FILTERS, biased, greedy_tokens, record, warp


def processed(logits, seen, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency,
              filters=ALL_FILTERS):
    """Next-token probabilities [B, V] and greedy choice [B] after the bias, the penalties (over the
    history `seen`, jmoe/decoding/sampling.py) and the warpers (those in `filters`)."""
    penalized = biased(logits, seen, penalty, bias, presence, frequency)
    return (jax.nn.softmax(warp(penalized, temperature, top_k, one_minus_top_p, min_p, filters), axis=-1),
            greedy_tokens(penalized))


def processed_block(logits, seen, drafted, temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence,
                    frequency, filters=ALL_FILTERS):
    """`processed` at every position of a verification block: logits [B, T, V], seen [B, V] the
    history before the block, drafted [B, T - 1] the tokens after positions 0..T-2 (position j's
    history is seen with drafted[:, :j] counted in). Returns probabilities [B, T, V] and greedy
    choices [B, T]."""
    B, T, V = logits.shape
    later = jnp.cumsum(jax.nn.one_hot(drafted, V, dtype=jnp.int32), axis=1)  # [B, T - 1, V]: drafted so far
    history = seen[:, None, :] + jnp.concatenate([jnp.zeros((B, 1, V), jnp.int32), later], axis=1)
    probs, pick = processed(logits.reshape(B * T, V), history.reshape(B * T, V), temperature, top_k,
                            one_minus_top_p, penalty, min_p, bias, presence, frequency, filters)
    return probs.reshape(B, T, V), pick.reshape(B, T)


def draft_tokens(step, last, cache, seen, rng, params, *, k: int, greedy: bool, filters=ALL_FILTERS):
    """k tokens per row, in one scan over `step(cache, tokens [B], j) -> (logits [B, V], gate [L, E],
    cache)`, the draft's decode step at drafted position j: (drafts [B, k], their probabilities q
    [B, k, V] (what each was drawn from; unused when greedy), the gate weight the draft routed
    [L, E] summed over its k tokens, cache, rng)."""
    B = last.shape[0]

    def body(carry, j):
        tokens, cache, seen, rng = carry
        logits, gate, cache = step(cache, tokens, j)
        probs, pick = processed(logits, seen, *params, filters)
        if greedy:
            nxt = pick
        else:
            rng, key = jax.random.split(rng)
            nxt = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
        seen = record(seen, jnp.arange(B), nxt)
        return (nxt, cache, seen, rng), (nxt, probs, gate)

    (_, cache, _, rng), (drafts, q, gates) = jax.lax.scan(body, (last.astype(jnp.int32), cache, seen, rng),
                                                          jnp.arange(k))
    return drafts.T, q.transpose(1, 0, 2), gates.sum(0), cache, rng


def accept(logits, drafts, q, seen, rng, params, *, greedy: bool, filters=ALL_FILTERS):
    """The target's verdict on a block: logits [B, k + 1, V] after each row's last token and its k
    drafts [B, k] (q [B, k, V] their draft probabilities; may be None when greedy), seen [B, V] the
    history before the drafts. Returns (accepted drafts per row [B], the target's next token [B],
    the history with the kept drafts and the next token, rng)."""
    B, T, V = logits.shape
    k = T - 1
    probs, picks = processed_block(logits, seen, drafts, *params, filters)
    if greedy:
        keep = picks[:, :k] == drafts
    else:
        rng, key = jax.random.split(rng)
        u = jax.random.uniform(key, (B, k))
        p_d = jnp.take_along_axis(probs[:, :k], drafts[..., None], -1)[..., 0]
        q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
        keep = u * q_d < p_d  # with probability min(1, p / q)
    accepted = jnp.cumprod(keep.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)
    if greedy:
        nxt = jnp.take_along_axis(picks, accepted[:, None], 1)[:, 0]
    else:
        q_all = jnp.zeros((B, T, V), probs.dtype) if q is None else jnp.concatenate(
            [q, jnp.zeros((B, 1, V), probs.dtype)], axis=1)  # past the last draft: the target's own p
        p_n = jnp.take_along_axis(probs, accepted[:, None, None], 1)[:, 0]
        residual = jnp.maximum(p_n - jnp.take_along_axis(q_all, accepted[:, None, None], 1)[:, 0], 0.0)
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_n)
        rng, key = jax.random.split(rng)
        nxt = jax.random.categorical(key, jnp.log(residual), axis=-1)
    nxt = nxt.astype(jnp.int32)
    kept = jnp.arange(k)[None, :] < accepted[:, None]
    rows = jnp.arange(B)[:, None]
    seen = record(seen, rows, jnp.where(kept, drafts, V), mode="drop")
    seen = record(seen, jnp.arange(B), nxt)
    return accepted, nxt, seen, rng


__all__ = ["accept", "draft_tokens", "processed", "processed_block"]
