"""Look-ahead expert prediction (DyMoE): layer l+1's router applied to layer l's hidden state.

While layer l computes, the prediction names the experts layer l+1 will probably want, so their
transfers can start early, ranked by predicted gate in decode and by predicted token count in
prefill (DyMoE's phase-adaptive prefetch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def predict_next(layer, x, valid):
    """x [..., D] residual stream after layer l's attention (N tokens), `layer` the next MoE decoder
    layer -> per-expert predicted token counts [E] and predicted gate scores [E] (the next router's
    combine weights, summed over real tokens).

    The next layer's own post-attention norm and router are applied to x, whatever their kinds
    (RMSNorm or LayerNorm; softmax, sigmoid or sparsemixer routing). Traced inside the caller's jit.
    """
    router = layer.mlp.router
    routing = router(layer.post_attention_layernorm(x.reshape(-1, x.shape[-1])))  # [N, k]
    one_hot = jax.nn.one_hot(routing.ids, router.num_experts, dtype=jnp.float32) * valid[:, None, None]
    return one_hot.sum(axis=(0, 1)).astype(jnp.int32), (one_hot * routing.weights[..., None]).sum(axis=(0, 1))


def rank_predictions(score: np.ndarray, limit: int) -> list[int]:
    """Experts with a positive predicted score (token count or gate), highest first, at most `limit`."""
    order = np.argsort(-score, kind="stable")
    return [int(e) for e in order[:limit] if score[e] > 0]


def recall(predicted: set[int], actual: set[int]) -> tuple[int, int]:
    """(|predicted ∩ actual|, |actual|)."""
    return len(predicted & actual), len(actual)
