"""A step's summary: everything the host learns from a step, as one small int32 array.

An offloaded step packs its sampled tokens and its routing per (MoE layer, expert) into one array
whose copy to the host starts when the step is dispatched; the host reads it once, a step later
(one blocking read per token), and keeps every book (cache, policy, counters) from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.layers.transformer import StepSignals

FETCH_COUNTS = 3  # fetch.LayerReport.counts


def pack(signals: StepSignals, tokens=None) -> jax.Array:
    """The summary of a step (traced): int32 [n]."""
    counts, wanted, chosen = signals.per_expert
    L, E = counts.shape
    served = jnp.zeros((L, E), jnp.int32) if signals.served is None else signals.served
    fetch = jnp.zeros((L, FETCH_COUNTS), jnp.int32) if signals.fetch_counts is None else signals.fetch_counts
    parts = [jnp.zeros((0,), jnp.int32) if tokens is None else tokens.astype(jnp.int32).reshape(-1),
             counts, wanted, chosen, jax.lax.bitcast_convert_type(signals.gate.astype(jnp.float32), jnp.int32), served,
             fetch, signals.missing.astype(jnp.int32)]
    if signals.landed is not None:
        parts += [signals.fetched, signals.landed]
    return jnp.concatenate([p.reshape(-1).astype(jnp.int32) for p in parts])


@dataclass(frozen=True)
class Summary:
    """A step's summary on the host (see the module docstring)."""

    tokens: np.ndarray  # [B] sampled tokens (empty when the step did not sample)
    counts: np.ndarray  # [L, E] tokens routed to each expert
    wanted: np.ndarray  # [L, E] its wanted tier code
    chosen: np.ndarray  # [L, E] the code that ran (0: none)
    gate: np.ndarray  # [L, E] float32 gate weight it received
    served: np.ndarray  # [L, E] how it was fetched in the step (fetch.SERVED_*; 0: it was not)
    fetch_counts: np.ndarray  # [L, 3] fetch.LayerReport.counts
    missing: np.ndarray  # [L] assignments of real tokens that ran below their wanted tier
    fetched: np.ndarray  # [L, tiers, 2] look-ahead and missed experts fetched per tier
    landed: np.ndarray  # [tiers, landing] layer * E + expert that landed in each landing slot (-1: none)

    @classmethod
    def unpack(cls, flat: np.ndarray, *, tokens: int, layers: int, experts: int, tiers: int = 0,
               landing: int = 0) -> "Summary":
        """tiers, landing: the step's FetchSpec's (0: a step that fetched nothing)."""
        flat = np.asarray(flat)
        sizes = [tokens] + [layers * experts] * 5 + [layers * FETCH_COUNTS, layers, layers * tiers * 2, tiers * landing]
        ends = list(itertools.accumulate(sizes))
        parts = [flat[end - size:end] for size, end in zip(sizes, ends)]  # views (np.split costs ~50 µs)
        grid = lambda a: a.reshape(layers, experts)  # noqa: E731
        return cls(parts[0], grid(parts[1]), grid(parts[2]), grid(parts[3]), grid(parts[4]).view(np.float32),
                   grid(parts[5]), parts[6].reshape(layers, FETCH_COUNTS), parts[7],
                   parts[8].reshape(layers, tiers, 2), parts[9].reshape(tiers, landing))

    @property
    def routed(self) -> np.ndarray:
        return self.counts > 0


__all__ = ["pack", "Summary", "FETCH_COUNTS"]
