"""The host's side of steps that fetch their own experts (jmoe/layers/fetch.py).

Before a step: the policy's plan, the requests it implies (its prefetches and promotions and, in
degrade mode, the versions earlier steps ran without), each given a slot and published at once,
and the landing candidates for what the step chooses to fetch itself (free slots, then what the
policy would evict first, locked until the step is read); all of it, with the handle tables,
packed into one array (one transfer). The step's summary starts its copy to the host at dispatch;
the host reads it once, a step later, to evict and publish what landed, unlock the candidates and
keep every book (hits, misses, LRU order, the policy's counters).

A miss served in the step costs no host round trip; a step that lacked more experts than its miss
slots hold (exact mode) is reported as inexact and the caller runs it again. On an accelerator the
misses and look-ahead of a (layer, tier) are fetched by a chain of conditionals (jmoe/layers/fetch.py):
a layer that lacks nothing costs one predicate read there, not a record per slot, so exact-mode
steps get as many slots as the CPU's (up to twice top_k); degrade mode keeps a few fixed slots.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import jax
import numpy as np

import cpu_kernels
from jmoe.config import ModelConfig
from jmoe.decoding.summary import Summary
from jmoe.layers.experts import ExpertState, NO_SLOT
from jmoe.layers.fetch import SERVED_FETCHED, SERVED_PREFETCHED, FetchInputs, FetchSpec
from jmoe.policies.base import Key, Policy
from jmoe.runtime.host_memory import device_is_host
from jmoe.tiers import SKIP, tier_name

FETCH_PHASES = ("decode", "verify")  # prefill routes too many experts per layer for fixed slots: layer-wise
LANDING_SHARE = 4  # at most a quarter of a pool's cache are a step's landing candidates


@dataclass(frozen=True)
class FetchSlots:
    """Fetch slots per (MoE layer, tier) of a step (FetchSpec's sizes before the pools exist)."""

    misses: int
    lookahead: int
    requests: int
    guarded: bool
    degrade: bool = False
    chained: bool = False  # an accelerator's misses and look-ahead: each fetch in a chain of conditionals
    predict: bool = False  # look ahead from the previous layer (the policy prefetches)
    # a plain decode step's misses and look-ahead where a speculative draft sized these for its
    # verification (None: the same): a decode step routes one token per row, whatever the draft
    decode: tuple[int, int] | None = None

    @property
    def extra(self) -> int:
        """Pool slots per tier beyond the cache: a scratch slot per miss fetch, and the sink."""
        return self.misses + 1


def fetch_slots(cfg: ModelConfig, policy: Policy, device, rows: int, degrade: bool,
                miss_slots: int | None = None, draft_tokens: int = 0, guarded: bool | None = None) -> FetchSlots | None:
    """How many experts a step may fetch per (layer, tier), or None where steps do not fetch (CPU
    execution of cold experts runs layer-wise, a resident policy never fetches).

    On the CPU an unused fetch costs nothing, so a step may fetch every expert `rows` tokens can
    route to. On an accelerator, in exact mode, a (layer, tier)'s misses and look-ahead are fetched
    by a chain of conditionals (an unused chain costs one predicate read, each fetch one more), up
    to twice top_k each; requests (host-chosen, every layer's written as the step starts), and
    every fetch in degrade mode, by fixed slots that move a record every step, so there are few.
    `miss_slots` sets the misses a step fetches per (layer, tier) instead (exact mode). With a
    speculative draft of up to `draft_tokens` tokens, verification looks ahead at what it routed.
    `guarded`: the slots as for the CPU (True) or an accelerator (False) whatever `device` is."""
    if policy.cpu_execution or policy.everything_resident:
        return None
    k, E = cfg.top_k, cfg.num_experts
    guarded = device_is_host(device) if guarded is None else guarded
    # exact mode on an accelerator: chains, so that a layer lacking more than a few experts need not
    # run again. Degrade mode never runs a step again and keeps fixed slots: on a lent H200 its
    # chains' predicate reads (each a wait for the device inside the dispatch) cost more than the
    # records that fixed slots move (bench/results/offload_decode/offload_decode_qwen3_2L_h200.json)
    chained = not guarded and not degrade
    per_token = k if guarded or chained else max(1, k // 4)
    chain = E if guarded else min(E, 2 * k)  # a chain's length: its code, and the zeros an unused one writes
    # a verification routes (draft tokens + 1) tokens per row: on the CPU its misses get slots too
    tokens = max(1, rows) * (draft_tokens + 1 if guarded and draft_tokens else 1)
    misses = min(chain, per_token * tokens) if miss_slots is None else min(E, miss_slots)
    if degrade and policy.never_missing:
        misses = 0
    lookahead = min(chain, per_token * max(int(policy.prefetch), draft_tokens + 1 if draft_tokens else 0))
    # requests carry what a policy asks for beyond the routing: its own plan's, degrade mode's
    own_plan = type(policy).plan is not Policy.plan
    requests = min(E, k if guarded else max(1, k // 4)) if (degrade or own_plan) else 0
    decode = None
    if draft_tokens:
        plain = fetch_slots(cfg, policy, device, rows, degrade, miss_slots, 0, guarded)
        decode = (plain.misses, plain.lookahead)
    return FetchSlots(misses, lookahead, requests, guarded, degrade, chained, policy.prefetch, decode)


def step_fetches(moe_layers: int, requests: int, misses: int, lookahead: int, lookahead_layers: int,
                 chained: bool) -> tuple[int, int, int]:
    """Per tier, an accelerator step's fetches: (records its fixed slots move, used or not; chains
    of conditional fetches; fetches those chains hold). Requests are fixed slots in every layer;
    misses in every layer and look-ahead in `lookahead_layers` of them are chains when `chained`,
    else fixed slots too."""
    chains = moe_layers * (misses > 0) + lookahead_layers * (lookahead > 0)
    links = moe_layers * misses + lookahead_layers * lookahead
    fixed = moe_layers * requests
    return (fixed, chains, links) if chained else (fixed + links, 0, 0)


@dataclass
class Flight:
    """A dispatched fetching step whose summary the host has not read."""

    index: int
    phase: str
    rows: int  # tokens the summary carries first (sampled ones), 0 when the step did not sample
    landing: np.ndarray  # [tiers, landing] candidate slots the step may have landed experts in (-1: none)
    taken: list  # per tier, per candidate: the key whose version was in it (None: free)
    summary: jax.Array | None = None
    signals: object = None
    read: Summary | None = None  # the summary once read (its landings published)
    fixed_slots: dict | None = None  # tier -> records its fixed slots move on an accelerator, used or not


class InStepFetch:
    """Prepares and settles the steps of an Offloaded residency that fetch their own experts."""

    def __init__(self, res, slots: FetchSlots, accelerator: FetchSlots | None = None):
        """accelerator: the slots the same load would give steps on an accelerator (what a trace
        records their fetches would move there; default `slots`)."""
        self.res = res
        pools = res.pools
        cache_slots = tuple(p.slots for p in pools.values())
        landing = max(1, min(res.cfg.num_moe_layers * (slots.lookahead + slots.misses),
                             min(cache_slots) // LANDING_SHARE))
        self.spec = FetchSpec(tuple(pools), tuple(p.layout for p in pools.values()), cache_slots, res.cfg.num_experts,
                              slots.misses, slots.lookahead, slots.requests, landing, slots.guarded,
                              land=res.policy.cache, degrade=slots.degrade, chained=slots.chained,
                              predict=slots.predict,
                              native=slots.guarded and cpu_kernels.available())
        # decode steps of a model with a speculative draft: their own (fewer) misses and look-ahead;
        # scratch and sink stay within the verification's extra slots
        self.specs = {"verify": self.spec, "decode": self.spec if slots.decode is None else
                      dataclasses.replace(self.spec, misses=slots.decode[0], lookahead=slots.decode[1])}
        self.stores = {tier: res.host.stacks(tier) for tier in pools}
        self.accelerator = accelerator or slots
        self.wanted: OrderedDict[tuple[Key, str], str] = OrderedDict()  # (key, tier) -> kind: requests to come
        # dispatched steps not settled yet, oldest first; the next step's tables overlay the newest
        # one's landings, and every older one's are read and published before it is prepared
        self.unsettled: list[Flight] = []
        self._no_landing = None
        # experts steps chose to fetch, per step (EMA): a step gets landing slots for about twice that
        self.chosen_per_step = float(res.cfg.top_k)

    def covers(self, phase: str) -> bool:
        return phase in FETCH_PHASES

    # -- before a step

    def prepare(self, phase: str, rows: int = 0, hint=None) -> tuple[ExpertState, dict, Flight]:
        """The step's expert state (its fetch arrays in one transfer), the pools to donate, and its
        flight. rows: tokens the step's summary carries first; hint: a speculative draft's routing
        [L, E] on the device (the step's look-ahead)."""
        res, spec = self.res, self.specs.get(phase, self.spec)
        self.publish_landings(keep_newest=True)
        self._queue_plan()
        request_ids, request_slots = self._requests()
        E = spec.num_experts
        landing = np.full((len(spec.tiers), spec.landing), NO_SLOT, np.int32)
        keys = np.full_like(landing, -1)
        taken = []
        # a step that can fetch nothing itself locks no slot (the policy's requests may need them all)
        wanted = min(spec.landing, int(np.ceil(2 * self.chosen_per_step)) + res.cfg.top_k) \
            if spec.misses or spec.lookahead else 0
        for i, tier in enumerate(spec.tiers):
            candidates = res.cache.landing_candidates(tier, wanted, keep_unlocked=min(res.cfg.top_k, E))
            for j, (slot, key) in enumerate(candidates):
                landing[i, j], keys[i, j] = slot, -1 if key is None else key[0] * E + key[1]
            taken.append([key for _, key in candidates])
        tables = [res.handles.slot[t] for t in spec.tiers]  # packed as they are (no stacked copy)
        newest = self.unsettled[-1] if self.unsettled and self.unsettled[-1].read is None else None
        if newest is not None:
            previous_slots, previous_keys = newest.landing, newest.signals.landed
        else:
            previous_slots, previous_keys = np.full_like(landing, NO_SLOT), self._empty_landing()
        if res.trace is not None:  # what an accelerator's fixed slots move every step, and its chains
            gpu, L = self.accelerator, res.cfg.num_moe_layers
            record = L * sum(res.host.nbytes(t) for t in spec.tiers)
            misses, lookahead = gpu.decode if phase == "decode" and gpu.decode else (gpu.misses, gpu.lookahead)
            if gpu.chained:  # the fetches themselves are the step's "step-*" transfers
                _, chains, _ = step_fetches(L, gpu.requests, misses, lookahead, L - 1, True)
                res.trace.fetch_slots(gpu.requests * record, 0, len(spec.tiers) * chains)
            else:
                res.trace.fetch_slots((gpu.requests + lookahead) * record, misses * record)
        packed = spec.pack(tables, request_ids, request_slots, landing, keys, previous_slots)
        # numpy: the step's own dispatch moves it (jax.device_put costs more host time than the copy)
        inputs = FetchInputs(self.stores, packed, previous_keys, hint)
        res.stats.count_io(transfers=1, nbytes=packed.nbytes)
        state = ExpertState({}, None, res.selection(), res.backend, int8_dot=res.int8_dot, fetch=inputs,
                            fetch_spec=spec).for_phase(phase)
        flight = Flight(res.step_index, phase, rows, landing, taken)
        flight.fixed_slots = self._fixed_slots(spec, hint is not None)
        return state, res.pool_arrays(), flight

    def _fixed_slots(self, spec: FetchSpec, hinted: bool) -> dict:
        """tier -> records a step's fixed fetch slots move (an accelerator's: each moves its record
        whether used or not): its requests, and in degrade mode its misses and look-ahead too."""
        if spec.guarded:
            return {}
        L = self.res.cfg.num_moe_layers
        lookahead_layers = L if hinted else (L - 1 if spec.predict else 0)  # a draft's hint: at every layer
        per_tier, _, _ = step_fetches(L, spec.requests, spec.misses, spec.lookahead, lookahead_layers, spec.chained)
        return {tier: per_tier for tier in spec.tiers} if per_tier else {}

    def _empty_landing(self) -> jax.Array:
        if self._no_landing is None:
            self._no_landing = jax.device_put(np.full((len(self.spec.tiers), self.spec.landing), -1, np.int32),
                                              self.res.device)
        return self._no_landing

    def _queue_plan(self) -> None:
        """The plan's prefetches and transitions, as requests for this and later steps (a demotion
        to a version already resident is only a change of books)."""
        res = self.res
        plan = res.plan
        for key, tier in plan.prefetch:
            self.wanted.setdefault((key, tier), "prefetch")
        for key, tier in plan.transitions:
            if tier in res.cache.resident.get(key, {}):
                res.cache.request(key, tier, "transition", exact=True)  # drops the higher versions now
            else:
                self.wanted.setdefault((key, tier), "transition")

    def _requests(self) -> tuple[np.ndarray, np.ndarray]:
        """[tiers, L, requests] expert ids and slots of what the step fetches for the host."""
        spec, res = self.spec, self.res
        shape = (len(spec.tiers), res.cfg.num_moe_layers, spec.requests)
        ids, slots = np.full(shape, -1, np.int32), np.full(shape, NO_SLOT, np.int32)
        if not spec.requests:
            self.wanted.clear()
            return ids, slots
        filled = np.zeros(shape[:2], np.int64)
        for (key, tier), kind in list(self.wanted.items()):
            t, layer = spec.tiers.index(tier), key[0]
            if filled[t, layer] == spec.requests:
                continue
            del self.wanted[(key, tier)]
            slot = res.cache.assign(key, tier, kind, exact=kind == "transition")
            if slot is None:
                continue
            ids[t, layer, filled[t, layer]], slots[t, layer, filled[t, layer]] = key[1], slot
            filled[t, layer] += 1
            res.count_fetch(tier, kind, moved=spec.guarded)  # an accelerator's request slots count as they move
        return ids, slots

    def dispatched(self, flight: Flight, pools: dict, signals, summary) -> None:
        """A step was dispatched: take the pools it returns, start its summary's copy to the host."""
        for tier, arrays in pools.items():
            self.res.pools[tier].replace(arrays)
        for tier, records in (flight.fixed_slots or {}).items():
            self.res.count_moved(tier, records)
        summary.copy_to_host_async()
        flight.summary, flight.signals = summary, signals
        self.unsettled.append(flight)

    def failed(self, flight: Flight) -> None:
        """A step that could not be dispatched: its candidates are unlocked (its requests stay
        published: nothing read them, and the next step that runs writes them again)."""
        self.unlock(flight)

    # -- after a step

    def settle(self, flight: Flight) -> tuple[Summary, bool]:
        """Read a step's summary (one blocking read, unless it was read already): publish what
        landed, keep the books when the step is kept. Returns (summary, exact): False when it
        lacked more experts than its miss slots held and its phase may not run degraded (the
        caller runs it again)."""
        res = self.res
        s = self.read(flight)
        self.unsettled.remove(flight)
        res.last_routed = s.routed
        exact = flight.phase in res.policy.degrade_phases or int(s.fetch_counts[:, 0].sum()) == 0
        if exact:
            self._keep_books(flight, s)
        return s, exact

    def discard(self, flight: Flight) -> None:
        """A dispatched step taken back (its successor in a replay): what it landed is published
        all the same (its fetches are as good as any), the rest of it is not kept."""
        if flight in self.unsettled:
            self.read(flight)
            self.unsettled.remove(flight)

    def publish_landings(self, keep_newest: bool = False) -> None:
        """Read the unsettled steps' summaries and publish what they landed, so the host's tables
        are what the device holds (`keep_newest`: but the newest step's, which the next step overlays)."""
        for flight in self.unsettled[: -1 if keep_newest else None]:
            self.read(flight)

    def read(self, flight: Flight) -> Summary:
        """A step's summary, read once: its landings published, its candidates unlocked."""
        if flight.read is None:
            res, spec = self.res, self.spec
            res.synced()
            flight.read = Summary.unpack(res.stats.read_back(flight.summary), tokens=flight.rows,
                                         layers=res.cfg.num_moe_layers, experts=spec.num_experts,
                                         tiers=len(spec.tiers), landing=spec.landing)
            self._adopt(flight, flight.read)
        return flight.read

    def _adopt(self, flight: Flight, s: Summary) -> None:
        res, spec = self.res, self.spec
        E = spec.num_experts
        kinds = {SERVED_FETCHED: "demand", SERVED_PREFETCHED: "prefetch"}
        fetched = s.fetched.sum(axis=0).tolist()  # [tiers][look-ahead, missed]: one reduction, not one per count
        for t, tier in enumerate(spec.tiers):
            slots = flight.landing[t].tolist()
            for position, key in enumerate(s.landed[t].tolist()):
                if key >= 0:
                    layer, expert = divmod(key, E)
                    res.cache.land((layer, expert), tier, slots[position], flight.taken[t][position],
                                   kinds.get(int(s.served[layer, expert]), "demand"))
            for kind, count in zip(("prefetch", "demand"), fetched[t]):
                res.count_fetch(tier, kind, count, moved=spec.guarded or spec.chained)
        self.chosen_per_step = 0.8 * self.chosen_per_step + 0.2 * sum(map(sum, fetched))
        self.unlock(flight)

    def unlock(self, flight: Flight) -> None:
        for t, tier in enumerate(self.spec.tiers):
            self.res.cache.unlock(tier, [s for s in flight.landing[t].tolist() if s != NO_SLOT])

    def _keep_books(self, flight: Flight, s: Summary) -> None:
        """Uses, hits, misses served in the step, degraded and skipped uses, LRU order, counters,
        the policy's observations and, in degrade mode, requests for what ran short."""
        res = self.res
        stats = res.stats
        count = lambda mask: int(np.count_nonzero(mask))  # noqa: E731 - a fraction of ndarray.sum's time
        routed = s.routed
        by_policy = routed & (s.wanted == SKIP)
        short = routed & ~by_policy & (s.chosen < s.wanted)
        fetched = routed & ~short & (s.served == SERVED_FETCHED)
        n_routed, n_short, n_fetched = count(routed), count(short), count(fetched)
        skipped_short = count(short & (s.chosen == SKIP))
        stats.uses += n_routed
        stats.skipped += count(by_policy) + skipped_short
        stats.degraded += n_short - skipped_short
        stats.misses += n_fetched
        stats.hits += count(routed & ~by_policy & ~short & ~fetched)
        stats.count_uses_of(s.chosen[routed])
        if flight.phase == "verify":  # look-ahead from the draft's routing, at every layer
            stats.spec.fidelity_hits += int(s.fetch_counts[:, 2].sum())
            stats.spec.fidelity_total += n_routed
            stats.spec.lookahead_fetched += int(s.fetched[:, :, 0].sum())
        elif self.specs.get(flight.phase, self.spec).lookahead:  # look-ahead from the previous layer
            stats.predicted += int(s.fetch_counts[1:, 2].sum())
            stats.actual += count(routed[1:])
        res.trace_reads(flight.index, routed, s.chosen)
        res.counters.add(s.counts)
        res.policy.observe_experts(s.counts, s.gate, int(s.counts[0].sum()) // max(1, res.cfg.top_k))
        if res.observes_tokens:  # a policy that wants every token's routing: one more read
            res.policy.observe(res.token_routing(flight), res.counters)
        res.cache.touch_all(routed)
        if flight.phase in res.policy.degrade_phases:
            for layer, expert in np.argwhere(short & (s.wanted != SKIP)).tolist():
                self.wanted.setdefault(((layer, expert), tier_name(int(s.wanted[layer, expert]))), "demand")


__all__ = ["FETCH_PHASES", "FetchSlots", "Flight", "InStepFetch", "fetch_slots"]
