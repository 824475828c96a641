"""Counters of the offload runtime, and the summary jmoe.stats() returns."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


class RequestClock:
    """Time to first token and time per output token of one request. Requests on one model may
    interleave step by step, so each keeps its own clock; tick() runs under the model's lock."""

    def __init__(self):
        self.start = time.perf_counter()
        self.last: float | None = None

    def tick(self, stats: "Stats", tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            stats.ttft_seconds.append(now - self.start)
        else:
            stats.tpot_seconds.append(now - self.last)
            stats.decode_tokens += tokens
        self.last = now
        stats.tokens += tokens


@dataclass
class Stats:
    # expert uses: one per (step, MoE layer, expert routed to by a real token)
    uses: int = 0
    hits: int = 0  # resident at (or above) the wanted tier when needed
    late: int = 0  # in flight when needed (the step waited for it)
    misses: int = 0  # fetched on demand
    degraded: int = 0  # ran at a lower resident tier than wanted
    skipped: int = 0  # wanted tier 0 or nothing resident, and the policy allowed skipping
    cpu_runs: int = 0  # ran on the host CPU instead of being fetched
    uses_by_tier: dict[str, int] = field(default_factory=dict)  # uses that ran, by the tier that ran
    cpu_tokens: int = 0
    # transfers
    transfers: int = 0
    bytes_h2d: int = 0
    bytes_h2d_by_tier: dict[str, int] = field(default_factory=dict)
    waited_bytes: int = 0  # bytes of the transfers a step waited for
    transfer_seconds: float = 0.0  # their time from device_put to ready
    stalls: int = 0  # times a step waited for a transfer
    stall_seconds: float = 0.0
    replays: int = 0  # one-jit steps run again because they lacked an expert
    in_step_fetches: int = 0  # expert versions steps fetched themselves (misses, look-ahead, requests)
    in_step_misses: int = 0  # of those, the routed experts a step lacked (fetched on its critical path)
    host_syncs: int = 0  # times the host waited to read routing back from the device
    evictions: int = 0
    resident_bytes: int = 0  # expert bytes published in the pools now
    peak_resident_bytes: int = 0
    promotions: int = 0  # background transitions to a higher version, completed
    demotions: int = 0  # background transitions to a lower version, completed
    # prefetch and prediction
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_evicted_unused: int = 0
    predicted: int = 0  # |predicted set ∩ actual set| summed over (step, layer)
    actual: int = 0  # |actual set| summed over (step, layer)
    # speculative decoding (jmoe/decoding/speculative.py); draft steps are not counted above
    spec: "SpeculationStats" = field(default_factory=lambda: SpeculationStats())
    # what the host waited for and dispatched, by phase ("prefill", "decode", "verify", "draft")
    phase: str = "decode"  # the current step's
    io: dict[str, dict[str, int]] = field(default_factory=dict)
    # timing of generation
    steps: int = 0
    tokens: int = 0
    decode_tokens: int = 0  # tokens after each request's first (what decode steps produced)
    prefill_tokens: int = 0  # prompt positions prefill steps ran (padding included)
    ttft_seconds: list[float] = field(default_factory=list)
    tpot_seconds: list[float] = field(default_factory=list)

    def _io(self, phase: str | None) -> dict:
        key = phase or self.phase
        io = self.io.get(key)
        if io is None:  # not setdefault: that builds a dict on every call, twice a token
            io = self.io[key] = dict(reads=0, executions=0, transfers=0, transfer_bytes=0, dispatch_s=0.0,
                                     read_wait_s=0.0)
        return io

    def count_io(self, *, reads: int = 0, executions: int = 0, transfers: int = 0, nbytes: int = 0,
                 phase: str | None = None) -> None:
        """Host interaction of `phase` (default: the current step's): blocking reads (and waits),
        executables dispatched, host-to-device transfers and their bytes."""
        io = self._io(phase)
        io["reads"] += reads
        io["executions"] += executions
        io["transfers"] += transfers
        io["transfer_bytes"] += nbytes

    def count_dispatch(self, seconds: float) -> None:
        """Wall time the host spent in a step's dispatch (on an accelerator, a conditional inside
        the step makes the dispatch wait for the device)."""
        self._io(None)["dispatch_s"] += seconds

    def read_back(self, array) -> np.ndarray:
        """A step's output as numpy, the time the host was blocked for it counted (read_wait_s);
        with the dispatches', the rest of a token's time is the host's own work."""
        started = time.perf_counter()
        out = np.asarray(array)
        self._io(None)["read_wait_s"] += time.perf_counter() - started
        return out

    def count_uses(self, tier: str, n: int = 1) -> None:
        self.uses_by_tier[tier] = self.uses_by_tier.get(tier, 0) + n

    def count_uses_of(self, chosen: np.ndarray) -> None:
        """Uses by the tier code that ran (an array of codes; 0 = none ran)."""
        from jmoe.tiers import TIER_NAMES

        for code, n in enumerate(np.bincount(np.asarray(chosen).ravel(), minlength=len(TIER_NAMES) + 1)[1:].tolist(), 1):
            if n:
                self.count_uses(TIER_NAMES[code - 1], n)

    def host_summary(self) -> dict:
        """Per phase: blocking reads, executables dispatched, host-to-device transfers and bytes, the
        wall seconds of dispatches and blocked reads (steps that fetch their own experts, and
        sampling decode steps), in all and per token (decode: per token after each request's
        first; prefill: per prompt position)."""
        per = {"decode": self.decode_tokens, "prefill": self.prefill_tokens}
        out = {}
        for phase, io in self.io.items():
            out[phase] = dict(io)
            if per.get(phase):
                out[phase].update({f"{k}_per_token": v / per[phase] for k, v in io.items()})
        return out

    @property
    def waited_bytes_per_s(self) -> float | None:
        """Host-to-device bandwidth the waited transfers achieved (None before any)."""
        return self.waited_bytes / self.transfer_seconds if self.transfer_seconds else None

    def summary(self) -> dict:
        # rates of counted expert uses; None where none were counted (a resident model's steps are
        # not read back for routing, so its uses are not counted: 0.0 would read as all misses)
        rate = (lambda n: n / self.uses) if self.uses else (lambda n: None)
        return {
            "expert_uses": self.uses,
            "hit_rate": rate(self.hits),
            "late_rate": rate(self.late),
            "miss_rate": rate(self.misses),
            "degraded": self.degraded,
            "skipped": self.skipped,
            "uses_by_tier": dict(self.uses_by_tier),
            "cpu_expert_runs": self.cpu_runs,
            "cpu_tokens": self.cpu_tokens,
            "transfers": self.transfers,
            "bytes_h2d": self.bytes_h2d,
            "bytes_h2d_by_tier": dict(self.bytes_h2d_by_tier),
            "bytes_h2d_per_token": self.bytes_h2d / max(self.tokens, 1),
            "waited_transfer_gb_per_s": None if self.waited_bytes_per_s is None else self.waited_bytes_per_s / 1e9,
            "evictions": self.evictions,
            "peak_resident_expert_bytes": self.peak_resident_bytes,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "stalls": self.stalls,
            "stall_seconds": self.stall_seconds,
            "replays": self.replays,
            "in_step_fetches": self.in_step_fetches,
            "in_step_misses": self.in_step_misses,
            "host_syncs": self.host_syncs,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_accuracy": self.prefetch_used / self.prefetch_issued if self.prefetch_issued else None,
            "predictor_recall": self.predicted / self.actual if self.actual else None,
            "steps": self.steps,
            "tokens": self.tokens,
            "decode_tokens": self.decode_tokens,
            "prefill_tokens": self.prefill_tokens,
            "ttft_s": float(np.mean(self.ttft_seconds)) if self.ttft_seconds else None,
            "tpot_s": float(np.mean(self.tpot_seconds)) if self.tpot_seconds else None,
            "host": self.host_summary(),
            **({"speculative": self.spec.summary(self.bytes_h2d)} if self.spec.cycles else {}),
        }


@dataclass
class SpeculationStats:
    cycles: int = 0
    drafted: int = 0  # drafted tokens, summed over rows
    accepted: int = 0  # of them, kept
    emitted: int = 0  # tokens the cycles produced (accepted + one of the target's per row)
    tried_by_position: list[int] = field(default_factory=list)  # drafted position j reached (earlier ones kept)
    accepted_by_position: list[int] = field(default_factory=list)
    lookahead_fetched: int = 0  # experts the draft routed to that verification fetched ahead of its routing
    verify_uses: int = 0  # expert uses of verification steps
    verify_hits: int = 0  # of them, resident when verification needed them
    fidelity_hits: int = 0  # experts verification routed to that the lookahead buffer held
    fidelity_total: int = 0  # experts verification routed to

    def count(self, k: int, accepted: np.ndarray) -> None:
        """One cycle: k drafted tokens per row, accepted[b] of them kept by row b."""
        self.cycles += 1
        self.drafted += k * len(accepted)
        self.accepted += int(accepted.sum())
        self.emitted += int(accepted.sum()) + len(accepted)
        grow = k - len(self.tried_by_position)
        if grow > 0:
            self.tried_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(k):
            self.tried_by_position[j] += int((accepted >= j).sum())
            self.accepted_by_position[j] += int((accepted > j).sum())

    def summary(self, bytes_h2d: int) -> dict:
        return {
            "cycles": self.cycles,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "acceptance_by_position": [a / t if t else None for a, t in
                                       zip(self.accepted_by_position, self.tried_by_position)],
            "tokens_per_cycle": self.emitted / self.cycles,
            "lookahead_fetched": self.lookahead_fetched,
            "verify_hit_rate": self.verify_hits / self.verify_uses if self.verify_uses else None,
            "draft_routing_fidelity": self.fidelity_hits / self.fidelity_total if self.fidelity_total else None,
            "bytes_h2d_per_accepted_token": bytes_h2d / self.emitted if self.emitted else None,
        }
