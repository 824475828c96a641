"""Mixed-precision expert cache: which expert versions sit in which pool slots, and the transfers.

Rules (DyMoE's mixed-precision cache, DynaExq's publish-after-copy):
- a request for a higher tier than the resident one is a miss that fetches the higher version;
  when it lands it replaces the lower ones (promotion), unless the policy keeps lower versions
  (keep_lower: an expert may then be resident in several tiers); a request for a lower tier reuses
  a higher resident version, except an exact request (a demotion), which loads that version and,
  once it is published, frees the higher ones, so an expert is never left without a version;
- a fetch is an asynchronous `jax.device_put` of the expert's host record into a staging buffer
  whose bytes are reserved first; only once the copy is complete is it written into its slot and
  the handle published, so the forward pass never reads a partial expert and never waits on a
  transfer it does not need;
- a full pool evicts the version the policy chooses (least recently used by default) among those
  the current step does not need (pinned);
- on a mesh each pool is partitioned by `ep` shard: an expert takes a slot, and evicts, only in
  its own shard's part, so each device's residency covers its own experts under its own budget.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np

from jmoe.layers.experts import NO_SLOT
from jmoe.policies.base import Key
from jmoe.runtime.budget import BudgetTracker
from jmoe.runtime.handles import HandleTable
from jmoe.runtime.host_store import HostStore
from jmoe.runtime.pools import TierPool
from jmoe.runtime.stats import Stats
from jmoe.tiers import SKIP, TIER_CODES


@dataclass
class Transfer:
    key: Key
    tier: str
    slot: int
    staged: jax.Array  # device copy of the record, being written
    nbytes: int
    kind: str  # "demand" | "prefetch" | "transition"
    started: float
    exact: bool = False  # a demotion: once published, the higher versions go


def least_recent(tier: str, candidates: list[Key]) -> Key:
    return candidates[0]


class CacheManager:
    def __init__(self, host: HostStore, pools: dict[str, TierPool], handles: HandleTable, staging: BudgetTracker,
                 stats: Stats, device, *, victim: Callable[[str, list[Key]], Key] = least_recent,
                 evictable: Callable[[str, Key], bool] | None = None,
                 evicts_from: Callable[[str], bool] = lambda tier: True, keep_lower: bool = False):
        self.host = host
        self.pools = pools
        self.handles = handles
        self.staging = staging  # its budget is the staging bytes reserved on the device at load
        self.stats = stats
        self.victim, self.evictable = victim, evictable  # evictable None: every version is
        self.evicts_from = evicts_from  # False: nothing in that tier's pool is evictable
        self.keep_lower = keep_lower
        self.resident: dict[Key, dict[str, int]] = {}  # key -> {tier: slot}
        self.in_tier: dict[str, set[Key]] = {t: set() for t in pools}  # keys with a version in each pool
        # LRU clock: when each (layer, expert) was last used; a landing version counts as a use
        self.clock = 0
        self.last_used = np.zeros(next(iter(handles.slot.values())).shape, np.int64)
        # free slots per tier and shard, lowest first out
        self.free: dict[str, list[list[int]]] = {
            t: [list(range((d + 1) * p.shard_slots - 1, d * p.shard_slots - 1, -1)) for d in range(p.shards)]
            for t, p in pools.items()}
        self.inflight: dict[Key, Transfer] = {}
        # candidate slots of steps not read yet (they may have written them): tier -> slot -> steps
        self.locked: dict[str, dict[int, int]] = {t: {} for t in pools}
        self.retiring: list[tuple[jax.Array, int]] = []  # (write-complete marker, staging bytes)
        self.pinned: set[Key] = set()
        self.prefetched: set[Key] = set()  # landed from a prefetch and not used yet
        self.trace = None  # a jmoe.runtime.trace.Trace when the run is traced
        # Several processes keep the same books and must decide alike: a transfer is then published
        # when the next step begins, whether or not it landed early on this process's devices.
        self.deterministic = jax.process_count() > 1

    # -- queries

    def code_of(self, key: Key) -> int:
        """Tier code of the best published version (0 if none)."""
        versions = self.resident.get(key)
        return max(TIER_CODES[t] for t in versions) if versions else SKIP

    def code_in_flight(self, key: Key) -> int:
        """Tier code of the version being copied in (0 if none)."""
        moving = self.inflight.get(key)
        return TIER_CODES[moving.tier] if moving else SKIP

    def serves(self, key: Key, code: int) -> bool:
        """Whether a published version at `code` or better can run `key` now."""
        return self.code_of(key) >= code

    # -- requests

    def request(self, key: Key, tier: str, kind: str = "demand", *, exact: bool = False,
                block: bool | None = None) -> str:
        """Make sure `key` is (or will be) resident at `tier` or higher (exactly `tier` when `exact`).

        Returns "hit" (already published), "pending" (a transfer is in flight), "started" (a new
        transfer began) or "full" (no slot can be freed now, or no staging room without waiting).
        Only a blocking request (by default: a demand) waits for earlier transfers to make room.
        """
        block = kind == "demand" if block is None else block
        code = TIER_CODES[tier]
        if self._has(key, tier, exact):
            if exact:  # a demotion to a version already resident: the higher ones go now
                self._drop_above(key, code)
            self.touch(key)
            return "hit"
        moving = self.inflight.get(key)
        if moving is not None and (moving.tier == tier or (not exact and TIER_CODES[moving.tier] >= code)):
            if kind == "demand":
                moving.kind = "demand"
            return "pending"
        if moving is not None:
            self.wait([key])  # another version is landing: let it, then load this one
            if self._has(key, tier, exact):
                return "hit"
        slot = self._claim_slot(tier, key)
        if slot is None:
            return "full"
        nbytes = self.host.nbytes(tier)
        reserved = False
        try:
            while not self.staging.try_reserve("transfer", nbytes):
                if not block or not (self.inflight or self.retiring):
                    self._give_back(tier, slot)
                    return "full"
                self._drain_oldest()
            reserved = True
            staged = self.pools[tier].stage_for(slot, self.host.record(tier, *key))
            self._count_staging(tier)
        except BaseException:  # leave no slot or staging bytes behind
            self._give_back(tier, slot)
            if reserved:
                self.staging.release("transfer", nbytes)
            raise
        self.inflight[key] = Transfer(key, tier, slot, staged, nbytes, kind, time.perf_counter(), exact)
        if self.trace is not None:
            self.trace.transfer(nbytes, kind)
        self.stats.transfers += 1
        self.stats.bytes_h2d += nbytes
        self.stats.bytes_h2d_by_tier[tier] = self.stats.bytes_h2d_by_tier.get(tier, 0) + nbytes
        if kind == "prefetch":
            self.stats.prefetch_issued += 1
        return "started"

    def _has(self, key: Key, tier: str, exact: bool) -> bool:
        return tier in self.resident.get(key, {}) if exact else self.serves(key, TIER_CODES[tier])

    def touch(self, key: Key) -> None:
        """Mark a resident expert as just used (LRU order, prefetch accounting)."""
        self.clock += 1
        self.last_used[key] = self.clock
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.stats.prefetch_used += 1

    def touch_all(self, used: np.ndarray) -> None:
        """Mark every expert of the [L, E] mask `used` as just used (one step's worth, at once)."""
        self.clock += 1
        self.last_used[used] = self.clock
        self._prefetch_used(used)

    def touch_steps(self, used: np.ndarray) -> None:
        """Mark the experts of several steps' masks `used` [n, L, E] as used, in step order."""
        n = used.shape[0]
        last = n - 1 - np.argmax(used[::-1], axis=0)  # the last step that used each expert
        any_use = used.any(axis=0)
        self.last_used[any_use] = self.clock + 1 + last[any_use]
        self.clock += n
        self._prefetch_used(any_use)

    def _prefetch_used(self, used: np.ndarray) -> None:
        """Prefetched versions the [L, E] mask `used` ran count as used prefetches."""
        for key in [k for k in self.prefetched if used[k]]:
            self.prefetched.discard(key)
            self.stats.prefetch_used += 1

    def poll(self) -> None:
        """Publish every transfer whose copy has completed; free staging of finished slot writes
        (deterministic: every transfer and write, waiting for them)."""
        if self.deterministic:
            for t in self.inflight.values():
                t.staged.block_until_ready()
            for marker, _ in self.retiring:
                marker.block_until_ready()
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
        self.stats.count_io(reads=len(moving))  # waits
        for t in moving:
            t.staged.block_until_ready()
            self.stats.transfer_seconds += time.perf_counter() - t.started
            self.stats.waited_bytes += t.nbytes
            if self.trace is not None:
                self.trace.wait(t.nbytes)
            self._publish(t)
        waited = time.perf_counter() - start
        self.stats.stalls += 1
        self.stats.stall_seconds += waited
        return waited

    def drop(self, key: Key) -> None:
        """Evict every version of `key` now (on-demand policies keep nothing between uses)."""
        if key not in self.pinned:
            for tier in list(self.resident.get(key, ())):
                self._give_back(tier, self._evict(key, tier))

    def settle(self) -> None:
        """Wait for every transfer and slot write (used between requests and in tests)."""
        self.wait(list(self.inflight))
        for marker, _ in self.retiring:
            marker.block_until_ready()
        self.poll()

    # -- internals

    def _count_staging(self, tier: str) -> None:
        """What staging one record cost the host: on the CPU a copy of the record put on the device;
        on an accelerator a slice of the host store run on it (its index transferred)."""
        pool = self.pools[tier]
        copies = len(pool.devices[0])
        if self.host.copies:
            self.stats.count_io(executions=1, transfers=1 + copies - 1, nbytes=4)
        else:
            self.stats.count_io(transfers=copies, nbytes=copies * self.host.nbytes(tier))

    def _publish(self, t: Transfer) -> None:
        writes = len(t.staged.parts) if hasattr(t.staged, "parts") else 1
        self.stats.count_io(executions=writes, transfers=writes, nbytes=4 * writes)  # write_slot and its slot index
        done = self.pools[t.tier].write(t.slot, t.staged)
        self.retiring.append((done, t.nbytes))
        del self.inflight[t.key]
        self._place(t.key, t.tier, t.slot, t.kind, t.exact)

    def _place(self, key: Key, tier: str, slot: int, kind: str, exact: bool = False) -> None:
        """Publish `key`'s version at `tier` in `slot` (its bytes are there, or will be before any
        step that reads the handle tables from now on), and let the versions it replaces go."""
        versions = self.resident.setdefault(key, {})
        versions[tier] = slot
        self._count_bytes(tier, +1)
        self.in_tier[tier].add(key)
        self.clock += 1
        self.last_used[key] = self.clock
        self.handles.publish(*key, tier, slot)
        code = TIER_CODES[tier]
        if kind == "transition":
            if any(TIER_CODES[o] > code for o in versions):
                self.stats.demotions += 1
            else:
                self.stats.promotions += 1
        for other in [o for o in versions if o != tier]:
            lower = TIER_CODES[other] < code
            if (lower and not self.keep_lower) or (not lower and exact):  # promotion / demotion done
                self._give_back(other, self._remove(key, other))
        if kind == "prefetch":
            self.prefetched.add(key)

    # -- slots a step fills itself (jmoe/layers/fetch.py)

    def assign(self, key: Key, tier: str, kind: str = "prefetch", exact: bool = False) -> int | None:
        """A slot for the next step to fetch `key`'s `tier` version into, published now: every step
        that reads the tables from now on runs after that step wrote it (it takes the pools that step
        returns). None when `key` needs no fetch or no slot can be freed. `exact`: as for request (a
        demotion loads the lower version, and the higher ones go as it is published)."""
        if self._has(key, tier, exact) or key in self.inflight:
            return None
        slot = self._claim_slot(tier, key)
        if slot is not None:
            self._place(key, tier, slot, kind, exact)
            if kind == "prefetch":
                self.stats.prefetch_issued += 1
        return slot

    def landing_candidates(self, tier: str, n: int, keep_unlocked: int = 0) -> list[tuple[int, Key | None]]:
        """Up to n (slot, the key whose `tier` version is in it, or None for a free slot) that a step
        may fetch experts into, in the order it should take them: free slots, then the versions the
        policy would evict first. A resident one keeps serving until the step overwrites it (only a
        step that does not route to it there does); nothing else claims these slots until the step
        is read (unlock), when each one the step took is `land`ed.

        At most as many as leave `keep_unlocked` of the pool's slots unlocked: the steps in flight
        (this thread's next one, other threads' on the same model) never lock the slots a step run
        again layer by layer needs for one token's experts of a layer (else a small pool has none
        left to fetch into, and the step fails)."""
        n = min(n, max(0, self.pools[tier].shard_slots - len(self.locked[tier]) - keep_unlocked))
        out = [(slot, None) for slot in reversed(self.free[tier][0]) if slot not in self.locked[tier]][:n]
        if len(out) < n:
            out += [(self.resident[k][tier], k) for k in self._eviction_order(tier, n - len(out))]
        for slot, _ in out:
            self.locked[tier][slot] = self.locked[tier].get(slot, 0) + 1
        return out

    def _eviction_order(self, tier: str, n: int) -> list[Key]:
        """The first n versions of `tier` the policy would evict, in order (one device)."""
        order_key = lambda k: (self.last_used[k], k)  # noqa: E731
        if self.victim is least_recent and self.evictable is None:
            return self._least_recent(tier, n)
        if self.victim is least_recent:  # every step asks for a few of many: no full sort
            return heapq.nsmallest(n, self.movable(tier, shard=0), key=order_key)
        candidates = sorted(self.movable(tier, shard=0), key=order_key)
        order = []
        while candidates and len(order) < n:
            key = self.victim(tier, candidates)
            if key is None:
                break
            if key not in candidates:
                raise RuntimeError(f"the policy's victim {key} is not one of the {tier} pool's evictable experts")
            order.append(key)
            candidates.remove(key)
        return order

    def _least_recent(self, tier: str, n: int, shard: int = 0) -> list[Key]:
        """The first n versions least_recent would evict with every version evictable, read off the
        handle table: the movable versions in expert shard `shard`'s slots by (last use, layer,
        expert). Every step asks this of every tier (and a host-chosen fetch into a full pool once),
        and a walk over the pool's keys in Python costs about a microsecond a slot (a millisecond and
        more at a real model's pools)."""
        if n <= 0 or not self.evicts_from(tier):
            return []
        table = self.handles.slot[tier].reshape(-1)
        slots = self.pools[tier].shard_slots
        movable = (table >= shard * slots) & (table < (shard + 1) * slots)  # NO_SLOT is negative
        if self.locked[tier]:  # a gather from a mask of the pool's slots (np.isin costs ~100 µs a call)
            locked = np.zeros(self.pools[tier].slots, bool)
            locked[list(self.locked[tier])] = True
            movable[movable] = ~locked[table[movable]]
        E = table.size // self.last_used.shape[0]
        if self.pinned:
            movable[[layer * E + expert for layer, expert in self.pinned]] = False
        keys = np.flatnonzero(movable)
        # by (last use, layer, expert): one int64 key each (a clock below 2**40 leaves room for the index)
        order = self.last_used.reshape(-1)[keys] * table.size + keys
        if n < order.size:
            order = np.partition(order, n - 1)[:n]
        layers, experts = np.divmod(np.sort(order) % table.size, E)
        return list(zip(layers.tolist(), experts.tolist()))

    def land(self, key: Key, tier: str, slot: int, taken: Key | None, kind: str = "demand") -> bool:
        """A step fetched `key` into candidate `slot`, which held `taken`'s version (None: free):
        that version is evicted and `key` published there. False (the slot is free again) when a
        version of `key` that serves as well is resident or landing by other means."""
        if taken is not None and self.resident.get(taken, {}).get(tier) == slot:
            self._evict(taken, tier)
        else:  # a free slot, or one freed since (a version replaced by a higher one gives its slot back)
            self.free[tier][0].remove(slot)
        if self.serves(key, TIER_CODES[tier]) or self.code_in_flight(key) >= TIER_CODES[tier]:
            self._give_back(tier, slot)
            return False
        self._place(key, tier, slot, kind)
        return True

    def unlock(self, tier: str, slots) -> None:
        """A step whose candidate slots these were has been read: others may claim them again."""
        locked = self.locked[tier]
        for slot in slots:
            if locked.get(slot, 0) <= 1:
                locked.pop(slot, None)
            else:
                locked[slot] -= 1

    def room(self, tier: str, keep=(), shard: int = 0) -> int:
        """Slots of `tier` (of expert shard `shard`) a fetch could take now: free ones no step in
        flight may write, and the versions that could be evicted (movable)."""
        locked = self.locked[tier]
        return sum(slot not in locked for slot in self.free[tier][shard]) + len(self.movable(tier, keep, shard))

    def movable(self, tier: str, keep=(), shard: int | None = None) -> list[Key]:
        """Keys whose `tier` version could be evicted now (not pinned, allowed by the policy, not in
        `keep`; only those of expert shard `shard` when given)."""
        if not self.evicts_from(tier):
            return []
        pool, locked, resident, pinned, evictable = self.pools[tier], self.locked[tier], self.resident, self.pinned, \
            self.evictable
        owner = pool.owner if shard is not None and pool.shards > 1 else None  # one shard owns every expert
        # the cheap tests first, the policy's last: every step's landing candidates walk the whole pool
        return [k for k in self.in_tier[tier] if k not in pinned and k not in keep and resident[k][tier] not in locked
                and (owner is None or owner(k[1]) == shard) and (evictable is None or evictable(tier, k))]

    def _drop_above(self, key: Key, code: int) -> None:
        if key in self.pinned:
            return  # the current step may run it; a later plan asks again
        for other in [t for t in self.resident.get(key, ()) if TIER_CODES[t] > code]:
            self._give_back(other, self._remove(key, other))
            self.stats.demotions += 1

    def _give_back(self, tier: str, slot: int) -> None:
        self.free[tier][slot // self.pools[tier].shard_slots].append(slot)

    def _claim_slot(self, tier: str, key: Key) -> int | None:
        """A free slot of `key`'s shard, else one its victim leaves (a version of the same shard)."""
        pool = self.pools[tier]
        shard = pool.owner(key[1])
        free = self.free[tier][shard]
        for i in range(len(free) - 1, -1, -1):  # lowest first out, skipping slots a step may still write
            if free[i] not in self.locked[tier]:
                return free.pop(i)
        if self.victim is least_recent and self.evictable is None:
            candidates = self._least_recent(tier, 1, shard)
        else:  # least recently used first
            candidates = sorted(self.movable(tier, shard=shard), key=lambda k: (self.last_used[k], k))
        if not candidates:
            return None
        key = self.victim(tier, candidates)
        if key is None:  # the policy keeps every one of them
            return None
        if key not in candidates:
            raise RuntimeError(f"the policy's victim {key} is not one of the {tier} pool's evictable experts")
        return self._evict(key, tier)

    def _count_bytes(self, tier: str, sign: int) -> None:
        self.stats.resident_bytes += sign * self.pools[tier].slot_nbytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)

    def _remove(self, key: Key, tier: str) -> int:
        versions = self.resident[key]
        slot = versions.pop(tier)
        self._count_bytes(tier, -1)
        if not versions:
            del self.resident[key]
        self.in_tier[tier].discard(key)
        self.handles.retract(*key, tier)
        return slot

    def _evict(self, key: Key, tier: str) -> int:
        slot = self._remove(key, tier)
        self.stats.evictions += 1
        if key in self.prefetched and key not in self.resident:
            self.prefetched.discard(key)
            self.stats.prefetch_evicted_unused += 1
        return slot

    def _drain_oldest(self) -> None:
        """Make staging room: finish the oldest in-flight transfer, or wait for a pending slot write."""
        if self.inflight:
            self.wait([next(iter(self.inflight))])
        self.stats.count_io(reads=len(self.retiring))  # waits
        for marker, _ in self.retiring:
            marker.block_until_ready()
        self.poll()

    # -- invariants (tests)

    def check(self) -> None:
        """Assert the bookkeeping invariants; raises AssertionError."""
        for tier, pool in self.pools.items():
            used = [v[tier] for v in self.resident.values() if tier in v]
            moving = [t.slot for t in self.inflight.values() if t.tier == tier]
            slots = used + moving + [s for free in self.free[tier] for s in free]
            assert sorted(slots) == list(range(pool.slots)), f"{tier} slots leaked or doubled"
            for shard, free in enumerate(self.free[tier]):
                assert all(s // pool.shard_slots == shard for s in free), f"{tier} free slot in another shard's list"
            for key, versions in self.resident.items():
                if tier in versions:
                    assert versions[tier] // pool.shard_slots == pool.owner(key[1]), f"{key} in another shard's slot"
            assert self.in_tier[tier] == {k for k, v in self.resident.items() if tier in v}, f"{tier} key set is stale"
            table = self.handles.slot[tier]
            assert (table >= 0).sum() == len(used), f"a {tier} handle points at no resident version"
            for key, versions in self.resident.items():
                assert table[key] == versions.get(tier, NO_SLOT), f"{tier} handle of {key} is stale"
        assert all(v for v in self.resident.values()), "an expert is listed with no version"
        for key, t in self.inflight.items():
            assert t.tier not in self.resident.get(key, {}), f"{key} is both resident and in flight at {t.tier}"
            assert t.slot not in self.locked[t.tier], f"{key} is being copied into a slot a step may write"
        assert self.staging.budget is None or self.staging.total <= self.staging.budget
