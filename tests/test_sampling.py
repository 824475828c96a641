"""Sampling filters agree with Hugging Face's logits processors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jmoe.sampling import apply_repetition_penalty, filter_top_k_top_p

NEG = np.finfo(np.float32).min


def kept(logits) -> np.ndarray:
    return np.asarray(logits) > NEG / 2


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (10, 0.5), (0, 0.05), (50, 0.99)])
def test_top_k_top_p_keep_the_same_tokens_as_transformers(top_k, top_p):
    rng = np.random.default_rng(top_k * 100 + int(top_p * 100))
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    ours = filter_top_k_top_p(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p))
    ref = torch.tensor(logits)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    np.testing.assert_array_equal(kept(ours), np.isfinite(ref.numpy()))
    assert kept(ours).sum(-1).min() >= 1


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 50)).astype(np.float32)
    history = torch.tensor([[1, 5, 7, 5], [0, 49, 3, 3]])
    seen = np.zeros((2, 50), bool)
    for b, row in enumerate(history.tolist()):
        seen[b, row] = True
    ours = apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), 1.7)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(history, torch.tensor(logits))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)
