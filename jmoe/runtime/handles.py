"""The handle table: for every (MoE layer, expert), the tier code and pool slot the forward reads.

The host owns the table and changes it only when a copy into a slot has completed (publish) or
a slot is taken away (retract); the device copy is refreshed before the next forward reads it.
"""

from __future__ import annotations

import jax
import numpy as np

from jmoe.tiers import SKIP


class HandleTable:
    def __init__(self, num_layers: int, num_experts: int, device):
        self.tier = np.zeros((num_layers, num_experts), np.int32)  # SKIP: no resident version
        self.slot = np.zeros((num_layers, num_experts), np.int32)
        self.device = device
        self._on_device = None

    def publish(self, layer: int, expert: int, code: int, slot: int) -> None:
        self.tier[layer, expert], self.slot[layer, expert] = code, slot
        self._on_device = None

    def retract(self, layer: int, expert: int) -> None:
        self.tier[layer, expert] = SKIP
        self._on_device = None

    def on_device(self) -> tuple[jax.Array, jax.Array]:
        """(tier [L, E], slot [L, E]) device arrays matching the host table."""
        if self._on_device is None:
            self._on_device = (jax.device_put(self.tier, self.device), jax.device_put(self.slot, self.device))
        return self._on_device
