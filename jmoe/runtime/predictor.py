"""Look-ahead expert prediction (DyMoE): layer l+1's router applied to layer l's hidden state.

While layer l computes, the prediction names the experts layer l+1 will probably want, so their
transfers can start early, ranked by predicted gate in decode and by predicted token count in
prefill (DyMoE's phase-adaptive prefetch).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@partial(jax.jit, static_argnames=("top_k", "eps"))
def predict_next(norm_weight, router_kernel, x, valid, *, top_k: int, eps: float):
    """x [..., D] residual stream after layer l's attention (N tokens) -> per-expert predicted token
    counts [E] and predicted gate scores [E] (softmax of the next router, summed over real tokens).

    The next layer's post-attention RMSNorm and router are applied to x.
    """
    x32 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * norm_weight.astype(jnp.float32)
    logits = normed @ router_kernel.astype(jnp.float32)  # [N, E]
    probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    one_hot = jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32) * valid[:, None, None]
    return one_hot.sum(axis=(0, 1)).astype(jnp.int32), (one_hot * probs[..., None]).sum(axis=(0, 1))


def rank_predictions(score: np.ndarray, limit: int) -> list[int]:
    """Experts with a positive predicted score (token count or gate), highest first, at most `limit`."""
    order = np.argsort(-score, kind="stable")
    return [int(e) for e in order[:limit] if score[e] > 0]


def recall(predicted: set[int], actual: set[int]) -> tuple[int, int]:
    """(|predicted ∩ actual|, |actual|)."""
    return len(predicted & actual), len(actual)
