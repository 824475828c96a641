"""Token sampling: repetition penalty, temperature, top-k, top-p (in Hugging Face's order), greedy."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jmoe.errors import InputError


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits, seen, penalty):
    """HF rule: seen tokens' positive logits are divided by the penalty, negative ones multiplied."""
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalized, logits)


def filter_top_k_top_p(logits, top_k, top_p):
    """Mask logits [B, V] outside the top-k and outside the smallest set with probability >= top_p."""
    neg = jnp.finfo(logits.dtype).min
    V = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = jax.lax.dynamic_slice_in_dim(sorted_desc, jnp.clip(top_k - 1, 0, V - 1), 1, axis=-1)  # [B, 1]
    drop_k = (top_k > 0) & (sorted_desc < kth)
    sorted_desc = jnp.where(drop_k, neg, sorted_desc)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_above < top_p) & ~drop_k
    # The smallest kept logit is the threshold; ties with it are kept too (as in HF).
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, neg, logits)


def sample_tokens(logits, seen, key, temperature, top_k, top_p, penalty, *, greedy: bool):
    """logits [B, V] float32, seen [B, V] bool -> next tokens [B] int32."""
    logits = apply_repetition_penalty(logits, seen, penalty)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_top_k_top_p(logits / temperature, top_k, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
