"""Per-tier handle tables: for every (MoE layer, expert) and tier, the pool slot of that version.

The host owns the tables and changes them only when a copy into a slot has completed (publish)
or a slot is taken away (retract); the device copies are refreshed before the next step reads
them. NO_SLOT (-1) means the tier's version is not resident.
"""

from __future__ import annotations

import jax
import numpy as np

from jmoe.layers.experts import NO_SLOT


class HandleTable:
    def __init__(self, num_layers: int, num_experts: int, tiers, device):
        self.slot = {tier: np.full((num_layers, num_experts), NO_SLOT, np.int32) for tier in tiers}
        self.device = device
        self._on_device = None

    def publish(self, layer: int, expert: int, tier: str, slot: int) -> None:
        self.slot[tier][layer, expert] = slot
        self._on_device = None

    def retract(self, layer: int, expert: int, tier: str) -> None:
        self.slot[tier][layer, expert] = NO_SLOT
        self._on_device = None

    def resident(self, tier: str) -> np.ndarray:
        """[L, E] bool: which experts have a published version of `tier`."""
        return self.slot[tier] != NO_SLOT

    def on_device(self) -> dict[str, jax.Array]:
        """tier -> [L, E] device slot tables matching the host tables."""
        if self._on_device is None:
            # A private copy: on the CPU, device_put may alias an aligned numpy buffer instead of
            # copying it, and the host tables change in place while earlier steps may still run.
            self._on_device = {tier: jax.device_put(s.copy(), self.device) for tier, s in self.slot.items()}
        return self._on_device
