"""Device pools of expert weights.

Each tier has one preallocated slab [slots, ...] (the tier's ExpertWeights with a leading slots
axis). A slot is filled from one transferred record (the bytes of one expert version) by a jitted,
donated update that reinterprets the record's byte ranges as the slab's arrays, in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.distributed.mesh import Placement
from jmoe.errors import BudgetError
from jmoe.format import RecordLayout
from jmoe.layers.records import write_records
from jmoe.quant import ExpertWeights
from jmoe.runtime.budget import format_size, tree_nbytes
from jmoe.runtime.host_memory import aligned_empty
from jmoe.runtime.store import ExpertStore


def pool_template(store: ExpertStore, tier: str, slots: int) -> ExpertWeights:
    """Shapes of a pool of `slots` expert versions at `tier`."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((slots, *s.shape), s.dtype), store.template(tier))


def slot_nbytes(store: ExpertStore, tier: str) -> int:
    """Device bytes one slot takes (the record minus its alignment padding)."""
    return tree_nbytes(store.template(tier))


@partial(jax.jit, static_argnames=("layout",), donate_argnums=(0,))
def write_slot(pool, slot, record, *, layout: RecordLayout):
    """pool with slot `slot` overwritten by `record` (uint8 [layout.nbytes]); also returns a scalar
    that is ready only once the write has happened."""
    written = jax.tree.leaves(write_records(pool, jnp.reshape(slot, (1,)), record[None], layout))
    treedef = jax.tree.structure(pool)
    done = written[0][slot].reshape(-1)[0].astype(jnp.float32)
    return treedef.unflatten(written), done


class Staged:
    """Copies of one record (or slot-write markers) on several devices: the tp replicas of a shard."""

    def __init__(self, parts: list):
        self.parts = parts

    def is_ready(self) -> bool:
        return all(p.is_ready() for p in self.parts)

    def block_until_ready(self) -> "Staged":
        for p in self.parts:
            p.block_until_ready()
        return self


class TierPool:
    """One tier's device slab and what is needed to fill its slots from records.

    On a mesh the slab is partitioned: `shard_slots` slots per `ep` shard, each shard's part on its
    own devices (one array per device, written there), and slot s belongs to shard s // shard_slots.
    The step reads the parts as one global array sharded over `ep`."""

    def __init__(self, store: ExpertStore, tier: str, shard_slots: int, placement, extra: int = 0):
        """placement: a Placement or one device. extra: slots after the cache's (one device only)
        that steps fetching experts use for what does not stay (jmoe/layers/fetch.py)."""
        self.tier = tier
        self.placement = placement = Placement.of(placement)
        if extra and placement.mesh is not None:
            raise ValueError("a pool on a mesh has no slots beyond its cache")
        self.shards, self.shard_slots = placement.shards, shard_slots
        self.slots = shard_slots * self.shards  # the cache's
        self.extra = extra
        self.experts_per_shard = store.num_experts // self.shards
        self.layout = store.layouts[tier]
        self.slot_nbytes = slot_nbytes(store, tier)
        template = pool_template(store, tier, shard_slots + extra)
        self.devices = [placement.local_devices(d) for d in range(self.shards)]
        # zeros made on the device and committed to it, as every later slot write leaves them: a
        # step compiled before the first write is then reused after it
        zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)  # noqa: E731
        self.parts = {device: jax.jit(zeros, out_shardings=jax.sharding.SingleDeviceSharding(device))()
                      for devices in self.devices for device in devices}
        self._global = None

    @property
    def nbytes(self) -> int:
        """Bytes of one shard's part (what each device holds)."""
        return (self.shard_slots + self.extra) * self.slot_nbytes

    @property
    def arrays(self) -> ExpertWeights:
        """The pool as the step reads it: [slots, ...] (on a mesh, sharded over `ep`)."""
        if self.placement.mesh is None:
            return self.parts[self.placement.device]
        if self._global is None:
            parts = list(self.parts.values())
            leaves = [jax.tree.leaves(p) for p in parts]
            treedef = jax.tree.structure(parts[0])
            self._global = treedef.unflatten([
                self.placement.assemble((self.slots, *leaves[0][i].shape[1:]), [ls[i] for ls in leaves])
                for i in range(len(leaves[0]))])
        return self._global

    def owner(self, expert: int) -> int:
        """The shard whose slots may hold `expert` (of any layer)."""
        return expert // self.experts_per_shard

    def stage_for(self, slot: int, record) -> jax.Array | Staged:
        """Start copying a host record to the devices of `slot`'s shard (asynchronously)."""
        puts = [jax.device_put(record, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))
                for device in self.devices[slot // self.shard_slots]]
        return puts[0] if len(puts) == 1 else Staged(puts)

    def replace(self, arrays) -> None:
        """Take the pool a step returned (it donated these arrays: they wrote fetched experts)."""
        self.parts[self.placement.device] = arrays

    def write(self, slot: int, staged) -> jax.Array | Staged:
        """Copy a staged record into `slot` (asynchronously); returns the write's completion marker."""
        shard, local = divmod(slot, self.shard_slots)
        records = staged.parts if isinstance(staged, Staged) else [staged]
        done = []
        for device, record in zip(self.devices[shard], records, strict=True):
            self.parts[device], marker = write_slot(self.parts[device], np.int32(local), record, layout=self.layout)
            done.append(marker)
        self._global = None
        return done[0] if len(done) == 1 else Staged(done)


def resident_pool(store: ExpertStore, tier: str, placement) -> ExpertWeights:
    """A pool holding every expert at `tier`: expert (layer, e) of shard d = e // (E / shards) in
    slot d * L * E' + layer * E' + e - d * E' (E' = E / shards; one device: layer * E + e).

    Built one array at a time: each shard's rows are read from the files straight into an aligned
    host buffer, which jax takes without a copy on the CPU (so the pool is the only copy of these
    weights) and copies out of on an accelerator (so the host holds at most one of them at a time).
    """
    placement = Placement.of(placement)
    L, E, shards = store.num_layers, store.num_experts, placement.shards
    per = E // shards
    leaves, treedef = jax.tree.flatten(pool_template(store, tier, L * E))

    def rows(index, spec, shard):
        host = aligned_empty((L * per, *spec.shape[1:]), spec.dtype)
        for layer in range(L):
            store.read_leaf(tier, layer, index, host[layer * per : (layer + 1) * per],
                            experts=range(shard * per, (shard + 1) * per))
        return host

    arrays = [placement.put_experts(spec.shape, lambda shard, i=i, spec=spec: rows(i, spec, shard))
              for i, spec in enumerate(leaves)]
    return treedef.unflatten(arrays)


def resident_slots(num_layers: int, num_experts: int, shards: int) -> np.ndarray:
    """[L, E] slot of each expert in resident_pool's layout."""
    per = num_experts // shards
    layer = np.arange(num_layers)[:, None]
    expert = np.arange(num_experts)[None, :]
    shard = expert // per
    return (shard * num_layers * per + layer * per + expert - shard * per).astype(np.int32)


STAGING_TRANSFERS_PER_TOP_K = 2  # transfers in flight at once: two tokens' worth of one layer's experts


def staging_nbytes(store: ExpertStore, tiers) -> int:
    """Device bytes reserved for transfers in flight when offloading with pools at `tiers`."""
    return STAGING_TRANSFERS_PER_TOP_K * store.config.top_k * max(store.record_nbytes(t) for t in tiers)


@dataclass(frozen=True)
class PoolPlan:
    slots: dict[str, int]  # tier -> slots of its pool's cache
    slot_nbytes: dict[str, int]
    staging_nbytes: int
    extra: int = 0  # slots per pool beyond the cache (experts fetched in a step that do not stay)

    @property
    def nbytes(self) -> int:
        """The caches' bytes (what stays resident)."""
        return sum(self.slots[t] * self.slot_nbytes[t] for t in self.slots)

    @property
    def fetch_nbytes(self) -> int:
        """The extra slots' bytes (memory_plan's "fetch")."""
        return self.extra * sum(self.slot_nbytes.values())


def plan_pools(store: ExpertStore, policy, fixed: int, budget: int | None,
               staging_transfers: int | None = None, shards: int = 1, extra: int = 0) -> PoolPlan:
    """Size one pool per tier from what the budget leaves after the fixed reservations.

    On a mesh (`shards` ep shards) the budget and the fixed reservations are per device, and the
    slots are each shard's (of its num_experts / shards experts per layer).

    The policy may size its pools itself (Policy.size_pools); otherwise each tier gets its share of
    that remainder. A pool must hold at least one token's experts of one layer (top_k slots) beside
    its `extra` slots (what steps fetch and do not keep, reserved first); staging is sized for
    `staging_transfers` of the largest record (default: staging_nbytes). With no budget every pool
    can hold every expert unless the policy says otherwise.
    """
    cfg = store.config
    shares = policy.pools()
    per_slot = {t: slot_nbytes(store, t) for t in shares}
    staging = staging_nbytes(store, shares) if staging_transfers is None else \
        staging_transfers * max(store.record_nbytes(t) for t in shares)
    staging += extra * sum(per_slot.values())  # the extra slots, counted with staging in messages
    experts = cfg.num_experts // shards
    total_experts = cfg.num_moe_layers * experts
    left = None if budget is None else max(0, budget - fixed - staging)
    slots = policy.size_pools(left, per_slot, cfg.num_moe_layers, experts)
    if slots is None:
        slots = {t: total_experts if left is None else int(left * share // per_slot[t]) for t, share in shares.items()}
    slots = {t: min(total_experts, n) for t, n in slots.items()}
    if budget is not None and sum(n * per_slot[t] for t, n in slots.items()) > left:
        raise BudgetError(f"policy {policy.name!r} sized its pools beyond the device budget")
    working = min(cfg.top_k, experts)  # one token's experts of one layer may all be one shard's
    if any(n < working for n in slots.values()):
        need = max(-(-working * per_slot[t] // share) for t, share in shares.items())
        pools = ", ".join(f"{working} experts x {format_size(per_slot[t])} at {t}" for t in shares)
        given = "(none)" if budget is None else format_size(budget)
        raise BudgetError(
            f"device budget {given} cannot hold the dense weights, KV cache and one layer's "
            f"working set: needs at least {format_size(fixed + staging + int(need))} ({format_size(fixed)} fixed + "
            f"{format_size(staging)} transfer staging and fetch slots + {pools})"
        )
    return PoolPlan(slots, per_slot, staging - extra * sum(per_slot.values()), extra)
