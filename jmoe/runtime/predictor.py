"""Look-ahead expert prediction (DyMoE): layer l+1's router applied to layer l's hidden state.

While layer l computes, the prediction names the experts layer l+1 will probably want, so their
transfers can start early. Decode prefetches the predicted top-k; prefill ranks experts by how
many tokens are predicted to pick them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@partial(jax.jit, static_argnames=("top_k", "eps"))
def predict_next(norm_weight, router_kernel, x, valid, *, top_k: int, eps: float):
    """x [..., D] residual stream after layer l's attention (N tokens) -> per-expert predicted token counts [E].

    The next layer's post-attention RMSNorm and router are applied to x (no renormalisation is
    needed: top-k of the softmax equals top-k of the logits).
    """
    x32 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * norm_weight.astype(jnp.float32)
    logits = normed @ router_kernel.astype(jnp.float32)  # [N, E]
    _, ids = jax.lax.top_k(logits, top_k)
    one_hot = jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.int32) * valid[:, None, None]
    return one_hot.sum(axis=(0, 1))


def rank_predictions(counts: np.ndarray, limit: int) -> list[int]:
    """Experts with a predicted token, most predicted first, at most `limit`."""
    order = np.argsort(-counts, kind="stable")
    return [int(e) for e in order[:limit] if counts[e] > 0]


def recall(predicted: set[int], actual: set[int]) -> tuple[int, int]:
    """(|predicted ∩ actual|, |actual|)."""
    return len(predicted & actual), len(actual)
