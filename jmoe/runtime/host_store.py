"""Expert versions in host memory, as one stacked array per (tier, MoE layer): [E, record bytes].

A step fetches an expert by one dynamic slice of its layer's array (jmoe/layers/fetch.py), and
the host's own transfers take one record the same way. On an accelerator the arrays live in
pinned host memory (each layer's expert file copied once at load), where the platform has it;
otherwise plain host memory.

When the device is the host CPU nothing is copied at load: each array is the memory-mapped
expert file itself (XLA:CPU takes it without a copy), so the page cache serves fetches and the
process never holds an expert twice beyond what its pools hold.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from tqdm.auto import tqdm

from jmoe.runtime.host_memory import device_is_host
from jmoe.runtime.store import ExpertStore


def host_sharding(device):
    kinds = {m.kind for m in device.addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host" if "unpinned_host" in kinds else None
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind), kind


@partial(jax.jit, static_argnames=("device",))
def _take_record(stack, expert, *, device):
    """Record `expert` [R] of a layer's stacked host array, in the memory of `device`."""
    record = jax.lax.dynamic_slice(stack, (expert, 0), (1, stack.shape[1]))[0]
    return jax.device_put(record, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))


class HostStore:
    def __init__(self, store: ExpertStore, tiers: tuple[str, ...], device, progress: bool | None = None):
        self.store = store
        self.tiers = tiers
        self.device = device
        self.sharding, self.memory_kind = host_sharding(device)
        self.copies = not device_is_host(device)  # on the CPU the files serve as they are
        self._stacks: dict[str, tuple[jax.Array, ...]] = {}
        if self.copies:  # the copy at load, with a progress bar; on the CPU the files' views, when first asked for
            disable = None if progress is None else not progress  # None: only on a terminal
            with tqdm(total=store.num_layers * len(tiers), desc="host store", unit="layer", disable=disable) as bar:
                for tier in tiers:
                    self.stacks(tier, bar.update)

    def stacks(self, tier: str, progress=None) -> tuple[jax.Array, ...]:
        """Each MoE layer's [E, record bytes] array of `tier`, in host memory."""
        if tier not in self._stacks:
            layers = []
            for layer in range(self.store.num_layers):
                layers.append(jax.device_put(self.store.layer_bytes(tier, layer), self.sharding))
                if progress is not None:
                    progress(1)
            self._stacks[tier] = tuple(layers)
        return self._stacks[tier]

    def record(self, tier: str, layer: int, expert: int):
        """uint8 [record_nbytes] of one expert version, for a transfer: on an accelerator already
        on its way to the device (a dynamic slice of the host array); on the CPU a fresh aligned copy."""
        if not self.copies:
            return self.store.read_record(tier, layer, expert)
        return _take_record(self.stacks(tier)[layer], np.int32(expert), device=self.device)

    def nbytes(self, tier: str) -> int:
        return self.store.record_nbytes(tier)
