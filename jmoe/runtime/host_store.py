"""Expert versions in host memory, ready for asynchronous host -> device copies.

On an accelerator, each (tier, MoE layer, expert) record of the converted model becomes one
pinned-host JAX array of bytes (the record as stored: no repacking), so fetching an expert version
is a single `jax.device_put` of one array. Where the platform has no pinned host memory, plain
host arrays.

When the device is the host CPU nothing is copied at load: the converted files are the host store.
A fetch reads the record from the page cache into a fresh aligned buffer that jax takes without a
copy, and the pool slot write is the only other copy, so the process never holds an expert twice
beyond the transfers in flight (which the staging reservation bounds).
"""

from __future__ import annotations

import jax
import numpy as np
from tqdm.auto import tqdm

from jmoe.runtime.host_memory import device_is_host
from jmoe.runtime.store import ExpertStore


def host_sharding(device):
    kinds = {m.kind for m in device.addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host" if "unpinned_host" in kinds else None
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind), kind


class HostStore:
    def __init__(self, store: ExpertStore, tiers: tuple[str, ...], device, progress: bool | None = None):
        self.store = store
        self.tiers = tiers
        self.sharding, self.memory_kind = host_sharding(device)
        self.copies = not device_is_host(device)  # on the CPU the files serve as they are
        L, E = store.num_layers, store.num_experts
        self._records: dict[str, list[list[jax.Array]]] = {}
        if not self.copies:
            return
        disable = None if progress is None else not progress  # None: only on a terminal
        with tqdm(total=L * E * len(tiers), desc="host store", unit="expert", disable=disable) as bar:
            for tier in tiers:
                rows = []
                for layer in range(L):
                    rows.append([jax.device_put(np.asarray(store.record_bytes(tier, layer, e)), self.sharding)
                                 for e in range(E)])
                    bar.update(E)
                self._records[tier] = rows

    def record(self, tier: str, layer: int, expert: int):
        """uint8 [record_nbytes] of one expert version: a host jax array, or (CPU) a fresh aligned copy."""
        if not self.copies:
            return self.store.read_record(tier, layer, expert)
        return self._records[tier][layer][expert]

    def nbytes(self, tier: str) -> int:
        return self.store.record_nbytes(tier)
