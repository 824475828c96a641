"""Mixed-precision expert cache: which expert version sits in which pool slot, and the transfers.

Rules (DyMoE's mixed-precision cache, DynaExq's publish-after-copy):
- an expert is resident in one tier only; a request for a higher tier than the resident one is a
  miss that fetches the higher version and replaces the lower one when it lands (promotion);
  a request for a lower tier reuses the higher resident version;
- a fetch is an asynchronous `jax.device_put` of the expert's host record into a staging buffer
  whose bytes are reserved first; only once the copy is complete is it written into its slot and
  the handle published, so the forward pass never reads a partial expert and never waits on a
  transfer it does not need;
- a full pool evicts its least recently used expert that the current step does not need (pinned).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import jax

from jmoe.runtime.budget import BudgetTracker
from jmoe.runtime.handles import HandleTable
from jmoe.runtime.host_store import HostStore
from jmoe.runtime.pools import TierPool
from jmoe.runtime.stats import Stats
from jmoe.tiers import SKIP, TIER_CODES

Key = tuple[int, int]  # (MoE layer, expert)


@dataclass
class Transfer:
    key: Key
    tier: str
    slot: int
    staged: jax.Array  # device copy of the record, being written
    nbytes: int
    kind: str  # "demand" | "prefetch"
    started: float


class CacheManager:
    def __init__(self, host: HostStore, pools: dict[str, TierPool], handles: HandleTable, staging: BudgetTracker,
                 stats: Stats, device):
        self.host = host
        self.pools = pools
        self.handles = handles
        self.staging = staging  # its budget is the staging bytes reserved on the device at load
        self.stats = stats
        self.target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")  # from pinned host memory
        self.resident: dict[Key, tuple[str, int]] = {}
        self.lru: dict[str, OrderedDict[Key, None]] = {t: OrderedDict() for t in pools}
        self.free: dict[str, list[int]] = {t: list(range(p.slots - 1, -1, -1)) for t, p in pools.items()}
        self.inflight: dict[Key, Transfer] = {}
        self.retiring: list[tuple[jax.Array, int]] = []  # (write-complete marker, staging bytes)
        self.pinned: set[Key] = set()
        self.prefetched: set[Key] = set()  # landed from a prefetch and not used yet

    # -- queries

    def code_of(self, key: Key) -> int:
        """Tier code of the published version (0 if none)."""
        tier = self.resident.get(key)
        return TIER_CODES[tier[0]] if tier else SKIP

    def code_in_flight(self, key: Key) -> int:
        """Tier code of the version being copied in (0 if none)."""
        moving = self.inflight.get(key)
        return TIER_CODES[moving.tier] if moving else SKIP

    # -- requests

    def request(self, key: Key, tier: str, kind: str = "demand") -> str:
        """Make sure `key` is (or will be) resident at `tier` or higher.

        Returns "hit" (already published), "pending" (a transfer is in flight), "started" (a new
        transfer began) or "full" (no slot can be freed now, or a prefetch found no staging room).
        """
        code = TIER_CODES[tier]
        if self.code_of(key) >= code:
            self.touch(key)
            return "hit"
        if self.code_in_flight(key) >= code:
            if kind == "demand":
                self.inflight[key].kind = "demand"
            return "pending"
        if key in self.inflight:
            self.wait([key])  # a lower version is landing: let it, then promote
        slot = self._claim_slot(tier)
        if slot is None:
            return "full"
        nbytes = self.host.nbytes(tier)
        reserved = False
        try:
            while not self.staging.try_reserve("transfer", nbytes):
                if kind == "prefetch" or not (self.inflight or self.retiring):
                    self.free[tier].append(slot)
                    return "full"
                self._drain_oldest()
            reserved = True
            staged = jax.device_put(self.host.record(tier, *key), self.target)
        except BaseException:  # leave no slot or staging bytes behind
            self.free[tier].append(slot)
            if reserved:
                self.staging.release("transfer", nbytes)
            raise
        self.inflight[key] = Transfer(key, tier, slot, staged, nbytes, kind, time.perf_counter())
        self.stats.transfers += 1
        self.stats.bytes_h2d += nbytes
        self.stats.bytes_h2d_by_tier[tier] = self.stats.bytes_h2d_by_tier.get(tier, 0) + nbytes
        if kind == "prefetch":
            self.stats.prefetch_issued += 1
        return "started"

    def touch(self, key: Key) -> None:
        """Mark a resident expert as just used (LRU order, prefetch accounting)."""
        tier = self.resident.get(key)
        if tier is not None:
            self.lru[tier[0]].move_to_end(key)
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.stats.prefetch_used += 1

    def poll(self) -> None:
        """Publish every transfer whose copy has completed; free staging of finished slot writes."""
        for key in [k for k, t in self.inflight.items() if t.staged.is_ready()]:
            self._publish(self.inflight[key])
        still = []
        for marker, nbytes in self.retiring:
            if marker.is_ready():
                self.staging.release("transfer", nbytes)
            else:
                still.append((marker, nbytes))
        self.retiring = still

    def wait(self, keys) -> float:
        """Block until the transfers of `keys` (if any are in flight) are published; seconds waited."""
        moving = [self.inflight[k] for k in keys if k in self.inflight]
        if not moving:
            return 0.0
        start = time.perf_counter()
        for t in moving:
            t.staged.block_until_ready()
            self.stats.transfer_seconds += time.perf_counter() - t.started
            self.stats.waited_bytes += t.nbytes
            self._publish(t)
        waited = time.perf_counter() - start
        self.stats.stalls += 1
        self.stats.stall_seconds += waited
        return waited

    def drop(self, key: Key) -> None:
        """Evict `key` now (on-demand policies keep nothing between uses)."""
        if key in self.resident and key not in self.pinned:
            tier, slot = self._evict(key)
            self.free[tier].append(slot)

    def settle(self) -> None:
        """Wait for every transfer and slot write (used between requests and in tests)."""
        self.wait(list(self.inflight))
        for marker, _ in self.retiring:
            marker.block_until_ready()
        self.poll()

    # -- internals

    def _publish(self, t: Transfer) -> None:
        done = self.pools[t.tier].write(t.slot, t.staged)
        self.retiring.append((done, t.nbytes))
        old = self.resident.get(t.key)
        if old is not None:  # promotion: the lower version gives its slot back
            self.lru[old[0]].pop(t.key)
            self.free[old[0]].append(old[1])
        self.resident[t.key] = (t.tier, t.slot)
        self.lru[t.tier][t.key] = None
        self.handles.publish(*t.key, TIER_CODES[t.tier], t.slot)
        del self.inflight[t.key]
        if t.kind == "prefetch":
            self.prefetched.add(t.key)

    def _claim_slot(self, tier: str) -> int | None:
        if self.free[tier]:
            return self.free[tier].pop()
        for key in self.lru[tier]:  # least recently used first
            if key not in self.pinned:
                return self._evict(key)[1]
        return None

    def _evict(self, key: Key) -> tuple[str, int]:
        tier, slot = self.resident.pop(key)
        self.lru[tier].pop(key)
        self.handles.retract(*key)
        self.stats.evictions += 1
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.stats.prefetch_evicted_unused += 1
        return tier, slot

    def _drain_oldest(self) -> None:
        """Make staging room: finish the oldest in-flight transfer, or wait for a pending slot write."""
        if self.inflight:
            self.wait([next(iter(self.inflight))])
        for marker, _ in self.retiring:
            marker.block_until_ready()
        self.poll()

    # -- invariants (tests)

    def check(self) -> None:
        """Assert the bookkeeping invariants; raises AssertionError."""
        for tier, pool in self.pools.items():
            used = [s for k, (t, s) in self.resident.items() if t == tier]
            moving = [t.slot for t in self.inflight.values() if t.tier == tier]
            slots = used + moving + self.free[tier]
            assert sorted(slots) == list(range(pool.slots)), f"{tier} slots leaked or doubled"
            assert list(self.lru[tier]) == [k for k in self.lru[tier] if self.resident[k][0] == tier]
        for key, (tier, slot) in self.resident.items():
            assert self.handles.tier[key] == TIER_CODES[tier] and self.handles.slot[key] == slot
        assert (self.handles.tier > 0).sum() == len(self.resident), "a handle points at no resident version"
        assert not set(self.resident) & set(self.inflight) or all(
            self.inflight[k].tier != self.resident[k][0] for k in set(self.resident) & set(self.inflight)
        ), "an expert is both resident and in flight at the same tier"
        assert self.staging.budget is None or self.staging.total <= self.staging.budget
