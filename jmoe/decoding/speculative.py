"""Speculative decoding with the model's own low-precision copy as the draft (MoE-SpeQ).

The draft is the same converted model at a low tier (int4 or int2) with every one of its experts
resident in its own pool (jmoe.load(..., draft="int4") reserves it within the budget); it shares the
dense weights and the KV cache with the target. A cycle is two executables and at most two
blocking reads:

1. the draft decodes k tokens per row in one jitted scan, sampling them on the device (its steps
   never reach the target policy's counters); its routing (the gate weight each expert received
   over the k tokens) is the Expert Lookahead Buffer;
2. the target verifies each row's last token and its k drafts in one executable (tokens grouped
   by expert, so each expert's weights are read once): offloaded, it fetches what it lacks itself,
   its look-ahead at each layer being the experts the draft routed to there that are not resident
   (fetched before the layer's own routing is known, landing in the pools for later cycles), and
   accepts on the device (jmoe/decoding/acceptance.py);
3. the host waits for the drafts (to time them), then reads the verification's summary (accepted
   counts, the next tokens, the drafts and the routing): each row keeps its accepted prefix plus
   one token of the target's, advancing by its own count (rejected positions are overwritten).

Greedy output is exactly the plain greedy output; sampled output follows the target's
distribution (acceptance.py says how).

The governor picks k each cycle as argmax over k <= k_max of E[tokens(k)] / T_cycle(k):
E[tokens(k)] = 1 + sum_{i<=k} prod_{j<=i} a_j with per-position acceptance rates a_j tracked by
EMA, and T_cycle(k) = k * t_draft + t_verify(k) + bytes still to fetch / host-to-device bandwidth,
t_verify interpolated from the verification times measured so far; k = 0 (a plain step) competes
too, so where drafting cannot pay (a draft step costing as much as a target step) the governor
stops drafting, trying again every EXPLORE cycles. A cycle without drafts is PLAIN_RUN plain decode
steps run as plain decoding runs them, each dispatched before the previous one is read (PlainRun),
and t_verify(0) is their time per token; the plain cycles up to the next look at drafting run as
one such run (Governor.plain_steps). A governor is the model's, per draft, draft length and rows:
the next request starts from what the earlier ones measured. k_max comes from the latency
target `max_cycle_s` when given and, with an offloaded target, from the pools: no more drafted
tokens than the run tier's pool can verify in one pass (auto_k_max).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import validate
from jmoe.decoding import acceptance, prefixes
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.sampling import ALL_FILTERS, Sampler, SamplingOptions, prompt_history
from jmoe.distributed.processes import agree
from jmoe.errors import InputError
from jmoe.runtime.stats import RequestClock
from jmoe.tiers import TIER_NAMES

DEFAULT_K_MAX = 8
EXPLORE = 16  # cycles between looks at speculating again, once plain steps are faster
PLAIN_RUN = 4  # plain steps in one such cycle (overlapped with each other: see PlainRun)


@dataclass(frozen=True)
class SpeculativeOptions:
    draft: str
    k: int | None  # None: the governor chooses
    k_max: int = DEFAULT_K_MAX
    max_cycle_s: float | None = None  # latency target: the governor keeps a cycle under it

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeOptions | None":
        """`speculative=` of generate: None, a draft tier, or dict(draft=..., k=int | "auto", k_max=...,
        max_cycle_s=...)."""
        if value is None or value is False:
            return None
        if isinstance(value, str):
            value = {"draft": value}
        if not isinstance(value, dict):
            raise InputError(f"speculative must be a draft tier such as 'int4' or a dict(draft=..., k=...), got {value!r}")
        unknown = set(value) - {"draft", "k", "k_max", "max_cycle_s"}
        if unknown:
            raise InputError(f"speculative has unknown keys {sorted(unknown)}; it takes draft, k, k_max, max_cycle_s")
        draft = validate.choice("speculative draft", value.get("draft"), TIER_NAMES)
        k_max = validate.integer("speculative k_max", value.get("k_max", DEFAULT_K_MAX), minimum=1, maximum=32)
        k = value.get("k", "auto")
        k = None if k == "auto" else validate.integer("speculative k", k, minimum=1, maximum=32)
        max_cycle_s = value.get("max_cycle_s")
        if max_cycle_s is not None:
            max_cycle_s = validate.real("speculative max_cycle_s", max_cycle_s, above=0.0)
        return cls(draft, k, max(k_max, k or 1), max_cycle_s)


class Governor:
    """Draft length per cycle from an amortisation roofline (see the module docstring)."""

    def __init__(self, k_max: int, fixed: int | None = None, bandwidth: float = 10e9, alpha: float = 0.3,
                 max_cycle_s: float | None = None):
        self.k_max, self.fixed, self.bandwidth, self.alpha = k_max, fixed, bandwidth, alpha  # bandwidth: bytes/s
        self.max_cycle_s = max_cycle_s
        self.accept = np.full(max(k_max, fixed or 0), 0.8)  # per drafted position: P(accepted | earlier ones accepted)
        self.t_draft: float | None = None  # seconds per draft step
        self.t_verify: dict[int, float] = {}  # k -> seconds per verification
        self.missing_bytes = 0.0  # per drafted position, still to fetch before verification
        self.plain_cycles = 0
        self.draft_cycles = 0
        self.plain_ahead = 1  # plain cycles that the last choose() of 0 stands for (see plain_steps)

    def expected_tokens(self, k: int) -> float:
        return 1.0 + float(np.cumprod(self.accept[:k]).sum())

    def cycle_seconds(self, k: int) -> float:
        t_draft = self.t_draft or 0.0
        if self.t_verify:
            known = sorted(self.t_verify)
            t_verify = float(np.interp(k, known, [self.t_verify[x] for x in known]))
        else:
            t_verify = t_draft * 4 or 1.0
        return k * t_draft + t_verify + k * self.missing_bytes / self.bandwidth

    def choose(self) -> int:
        """k for the next cycle; 0 (plain steps) when no draft length pays for itself, with a look
        at the best k >= 1 every EXPLORE cycles to keep its acceptance and timing estimates fresh,
        and at plain steps every EXPLORE cycles of drafting (and as soon as a draft was timed)."""
        self.plain_ahead = 1
        if self.fixed is not None:
            return self.fixed
        if self.t_draft is None:
            return min(4, self.k_max)  # nothing measured yet
        if 0 not in self.t_verify:
            return 0  # plain steps' own time, not an estimate from verifications
        ks = range(1, self.k_max + 1)
        if self.max_cycle_s is not None:  # k_max from the latency target
            ks = [k for k in ks if k == 1 or self.cycle_seconds(k) <= self.max_cycle_s]
        best = max(ks, key=lambda k: self.expected_tokens(k) / self.cycle_seconds(k))
        plain_s = self.cycle_seconds(0)  # measured: plain steps are timed before any comparison
        if self.expected_tokens(best) / self.cycle_seconds(best) < 1 / plain_s:
            self.plain_cycles += 1
            if self.plain_cycles % EXPLORE:
                self.plain_ahead = EXPLORE - self.plain_cycles % EXPLORE  # plain up to the next look
                return 0
        else:
            self.draft_cycles += 1
            if self.draft_cycles % EXPLORE == 0:
                return 0
        return best

    def plain_steps(self) -> int:
        """Plain steps to run after choose() returned 0: every plain cycle up to its next look at
        drafting, in one run (counted as chosen). A run waits for its last step before the next
        cycle is chosen, so runs of PLAIN_RUN steps would each pay a round trip that the overlapped
        steps inside a run hide (a quarter of plain decoding's speed on a small model)."""
        ahead, self.plain_ahead = self.plain_ahead, 1
        self.plain_cycles += ahead - 1
        return ahead * PLAIN_RUN

    def update(self, k: int, accepted: np.ndarray, draft_s: float, verify_s: float, missing_bytes: float) -> None:
        """accepted [B]: how many of the k drafted tokens each row kept."""
        if k == 0:  # a plain step: only its time is news
            self.t_verify[0] = self._ema(self.t_verify.get(0), verify_s)
            return
        for j in range(k):  # position j was tried by the rows that accepted every earlier one
            tried = accepted >= j
            if tried.any():
                rate = float((accepted[tried] > j).mean())
                self.accept[j] = (1 - self.alpha) * self.accept[j] + self.alpha * rate
        self.t_draft = self._ema(self.t_draft, draft_s / k)
        self.t_verify[k] = self._ema(self.t_verify.get(k), verify_s)
        self.missing_bytes = self._ema(self.missing_bytes, missing_bytes / k)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new


_processed = jax.jit(acceptance.processed)


@partial(jax.jit, static_argnames=("greedy", "filters"))
def accept(logits, drafts, q, seen, rng, params, *, greedy: bool, filters=ALL_FILTERS):
    """acceptance.accept as one executable (tests and the serving engine's rows)."""
    return acceptance.accept(logits, drafts, q, seen, rng, params, greedy=greedy, filters=filters)


def auto_k_max(model, k_max: int) -> int:
    """Offloaded, the governor drafts no more tokens than the pools can verify at once: (k + 1)
    tokens route to up to (k + 1) * top_k experts per layer, and the run tier's pool holds
    slots / layers of them per layer (beyond that, verification runs in several passes)."""
    res = model.residency
    if not res.offloading:
        return k_max
    per_layer = res.slots // model.config.num_moe_layers
    return max(1, min(k_max, per_layer // model.config.top_k - 1))


def h2d_bandwidth(stats) -> float:
    """Host-to-device bytes/s measured by the waited transfers so far (10 GB/s before any)."""
    return agree(stats.waited_bytes_per_s or 10e9)


def speculative_steps(model, prompts: list[list[int]], lengths, sampling: SamplingOptions,
                      options: SpeculativeOptions) -> Iterator[np.ndarray]:
    """Like generation.token_steps: yields [B] next tokens per step, -1 for a row with nothing new
    (rows accept different numbers of tokens), produced cycle by cycle (see the module docstring).
    Each cycle holds the model's lock: requests sharing the model interleave cycle by cycle."""
    cfg, B = model.config, len(prompts)
    draft = model.draft(options.draft)
    decoder = Decoder(model, prompts, lengths.prompt, lengths.cache)
    spec = model.stats.spec
    k_max = options.k_max if options.k is not None else auto_k_max(model, options.k_max)
    with model.lock:  # the model's, for these options and rows: earlier requests' measurements carry over
        key = (options.draft, options.k, k_max, options.max_cycle_s, B)
        governor = model.governors.setdefault(key, Governor(k_max, options.k, max_cycle_s=options.max_cycle_s))
    seen = prompt_history(prompts, cfg.vocab_size, sampling)
    sample = Sampler(model.engine, sampling, seen, model.placement.commit_to)
    model.count(**Sampler.cost(sampling, seen), phase="prefill")
    clock = RequestClock()
    last = sample(prefixes.prefill(decoder, model.prefixes, prompts))  # on the device
    model.count(executions=1, phase="prefill")
    produced = np.ones(B, int)
    queue: list[list[int]] = [[int(t)] for t in model.read_tokens(last, phase="prefill")]
    def drain() -> Iterator[np.ndarray]:
        """Yield a token per row while every unfinished row has one queued."""
        finished = produced >= lengths.new_tokens
        while all(q or done for q, done in zip(queue, finished)) and any(queue):
            out = np.array([q.pop(0) if q else -1 for q in queue], np.int32)
            with model.lock:
                clock.tick(model.stats, int((out >= 0).sum()))
            yield out

    while True:
        yield from drain()
        finished = produced >= lengths.new_tokens
        if finished.all():
            return
        active = ~finished
        with model.lock:
            decoder.pos = np.where(active, decoder.pos, decoder.pos[active].min())  # finished rows only idle along
            room = lengths.cache - 1 - int(decoder.pos.max())
            need = int((lengths.new_tokens - produced[active]).max())
            k = max(0, min(governor.choose(), room, need - 1))
            plain = min(governor.plain_steps(), room + 1, need) if k == 0 else 0
        if k == 0:  # drafting does not pay now: plain steps, as plain decoding runs them (overlapped)
            run = PlainRun(decoder, last, sample)
            for out in run.steps(plain):
                wanting = np.flatnonzero(produced < lengths.new_tokens)
                for b in wanting:
                    queue[b].append(int(out[b]))
                produced[wanting] += 1
                with model.lock:
                    spec.count(0, np.zeros(len(wanting), int))
                yield from drain()
            last = run.last
            with model.lock:  # the governor is shared by the model's requests
                governor.update(0, None, 0.0, agree(run.seconds / run.taken), 0.0)
            continue
        with model.lock:
            governor.bandwidth = h2d_bandwidth(model.stats)
            hits, uses, moved = model.stats.hits, model.stats.uses, model.stats.bytes_h2d
            t = time.perf_counter()
            cycle = decoder.speculate(last, sample, k, draft)
            cycle.drafts.block_until_ready()  # times the draft (the second of a cycle's two blocking reads)
            model.stats.count_io(reads=1, phase="verify")
            draft_s = time.perf_counter() - t
            accepted, nxt, drafts, last = decoder.settle_cycle(cycle, sample)
            draft_s, verify_s = agree(draft_s), agree(time.perf_counter() - t - draft_s)
            spec.verify_hits += model.stats.hits - hits
            spec.verify_uses += model.stats.uses - uses
            decoder.advance(accepted + 1)
            governor.update(k, accepted[active], draft_s, verify_s, model.stats.bytes_h2d - moved)
            spec.count(k, accepted[active])
        for b in np.flatnonzero(active):
            new = [*drafts[b, : accepted[b]].tolist(), int(nxt[b])][: lengths.new_tokens - produced[b]]
            queue[b].extend(new)
            produced[b] += len(new)


class PlainRun:
    """Plain decode steps inside speculative decoding, each dispatched before the previous one is
    read, as generation.token_steps runs them (a speculative cycle waits for its own result before
    the next is dispatched, so a plain step in a cycle's place would cost the host's round trip too)."""

    def __init__(self, decoder: Decoder, last, sample: Sampler):
        self.decoder, self.sample = decoder, sample
        self.last = last  # the tokens [B] on the device that the next step takes in
        self.seconds = 0.0  # in the steps (their dispatches and reads), not in the caller's hands
        self.taken = 0

    def steps(self, n: int) -> Iterator[np.ndarray]:
        """Yield each of n steps' tokens [B] (numpy); `last` is then the last of them on the device."""
        decoder, sample = self.decoder, self.sample
        t = time.perf_counter()
        current = decoder.decode_sampled(self.last, sample)
        for i in range(n):
            more = i + 1 < n
            following = decoder.decode_sampled(current, sample) if more else None
            out, redrawn = decoder.settle_sampled(sample)
            if redrawn and more:  # the next step took in the token drawn first: run it again
                decoder.rewind_last()
                following = decoder.decode_sampled(jnp.asarray(out), sample)
            self.last = jnp.asarray(out) if redrawn and not more else current
            current = following
            self.seconds += time.perf_counter() - t
            self.taken += 1
            yield out
            t = time.perf_counter()


def padded(block: np.ndarray, room: int) -> np.ndarray:
    """The verification block padded to a power-of-two length (repeating its last token) when the
    cache has room, so a governor varying k compiles a few verification shapes, not k_max. What the
    padding writes lies beyond every row's accepted tokens and is overwritten later."""
    T = block.shape[1]
    width = 1 << (T - 1).bit_length()
    if width == T or width > room:
        return block
    return np.concatenate([block, np.repeat(block[:, -1:], width - T, axis=1)], axis=1)
