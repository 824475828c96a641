"""Speculative decoding with the model's own low-precision copy as the draft (MoE-SpeQ).

The draft is the same converted model at a low tier (int4 or int2) with every one of its experts
resident in its own pool (jmoe.load(..., draft="int4") reserves it within the budget); it shares the
dense weights and the KV cache with the target. A cycle:

1. the draft decodes k tokens per row (its steps never reach the target policy's counters);
2. its routing fills the Expert Lookahead Buffer, (drafted position, layer) -> (expert, gate):
   (I) entries whose target version is resident serve as they are; (II) while the draft still runs,
   the missing ones of each drafted position are prefetched, most confident first, within a
   bandwidth budget (what the copy engine can move during a draft step); (III) whatever is still
   missing is fetched before verification;
3. the target verifies the k drafted tokens and the last committed one in one pass (tokens grouped
   by expert, so each expert's weights are read once) and each row keeps its accepted prefix plus
   one token of the target's, advancing by its own count (rejected positions are overwritten).

Acceptance: greedy keeps the longest prefix the target's argmax agrees with, so the output is
exactly the plain greedy output; sampling accepts a drafted token with probability
min(1, p(x) / q(x)) and on rejection draws from the normalised residual max(0, p - q), so the
output follows the target's distribution. Both distributions go through the same repetition
penalty, temperature, top-k and top-p, with the same history.

The governor picks k each cycle as argmax over k <= k_max of E[tokens(k)] / T_cycle(k):
E[tokens(k)] = 1 + sum_{i<=k} prod_{j<=i} a_j with per-position acceptance rates a_j tracked by
EMA, and T_cycle(k) = k * t_draft + t_verify(k) + bytes still to fetch / host-to-device bandwidth,
t_verify interpolated from the verification times measured so far; k = 0 (a plain step) competes
too, so where drafting cannot pay (a draft step costing as much as a target step) the governor
stops drafting, trying again every EXPLORE cycles. k_max comes from the latency
target `max_cycle_s` when given and, with an offloaded target, from the pools: no more drafted
tokens than the run tier's pool can verify in one pass (auto_k_max).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import validate
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.sampling import SamplingOptions, apply_repetition_penalty, greedy_tokens, prompt_history, warp
from jmoe.distributed.processes import agree
from jmoe.errors import InputError
from jmoe.runtime.stats import RequestClock
from jmoe.tiers import TIER_CODES, TIER_NAMES, tier_name

DEFAULT_K_MAX = 8
EXPLORE = 16  # cycles between looks at speculating again, once plain steps are faster


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
        """k for the next cycle; 0 (verify only the committed token: a plain step) when no draft
        length pays for itself, with a look at the best k >= 1 every EXPLORE cycles to keep its
        acceptance and timing estimates fresh."""
        if self.fixed is not None:
            return self.fixed
        if self.t_draft is None:
            return min(4, self.k_max)  # nothing measured yet
        ks = range(1, self.k_max + 1)
        if self.max_cycle_s is not None:  # k_max from the latency target
            ks = [k for k in ks if k == 1 or self.cycle_seconds(k) <= self.max_cycle_s]
        best = max(ks, key=lambda k: self.expected_tokens(k) / self.cycle_seconds(k))
        plain_s = self.cycle_seconds(0)  # measured, or estimated from the shortest verification seen
        if self.expected_tokens(best) / self.cycle_seconds(best) < 1 / plain_s:
            self.plain_cycles += 1
            if self.plain_cycles % EXPLORE:
                return 0
        return best

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


@jax.jit
def _processed_block(logits, seen, drafted, temperature, top_k, one_minus_top_p, penalty):
    """_processed at every position of a verification block in one call: logits [B, T, V], seen
    [B, V] before the block, drafted [B, T - 1] the tokens after positions 0..T-2 (position j's
    history is seen plus drafted[:, :j])."""
    B, T, V = logits.shape
    later = jnp.cumsum(jax.nn.one_hot(drafted, V, dtype=jnp.int32), axis=1) > 0  # [B, T - 1, V]
    history = seen[:, None, :] | jnp.concatenate([jnp.zeros((B, 1, V), bool), later], axis=1)
    probs, pick = _processed(logits.reshape(B * T, V), history.reshape(B * T, V), temperature, top_k,
                             one_minus_top_p, penalty)
    return probs.reshape(B, T, V), pick.reshape(B, T)


@jax.jit
def _processed(logits, seen, temperature, top_k, one_minus_top_p, penalty):
    """Next-token probabilities [B, V] and greedy choice [B] after the penalty and the warpers."""
    penalized = apply_repetition_penalty(logits, seen, penalty)
    return jax.nn.softmax(warp(penalized, temperature, top_k, one_minus_top_p), axis=-1), greedy_tokens(penalized)


class LookaheadBuffer:
    """The Expert Lookahead Buffer of one cycle: for each drafted position and MoE layer, the experts
    the draft routed to and its confidence (gate weight), and the three fetch phases it drives."""

    def __init__(self, target, spec_stats):
        self.res, self.stats = target, spec_stats
        self.entries: dict[tuple[int, int], float] = {}  # (layer, expert) -> highest gate weight seen

    def add(self, signals) -> list[tuple[int, int]]:
        """Record one draft step's routing; returns the entries it added, most confident first."""
        ids, weights = jax.device_get((signals.ids, signals.weights))  # [L, B, 1, k]
        found: dict[tuple[int, int], float] = {}
        for layer in range(ids.shape[0]):
            for e, w in zip(ids[layer].ravel().tolist(), weights[layer].ravel().tolist()):
                found[(layer, e)] = max(found.get((layer, e), 0.0), w)
        new = sorted((key for key in found if key not in self.entries), key=lambda key: -found[key])
        for key, w in found.items():
            self.entries[key] = max(self.entries.get(key, 0.0), w)
        return new

    def tier(self, key) -> str:
        """The version verification will want: the target's plan for it (its run tier without one)."""
        plan = self.res.plan
        return tier_name(int(plan.hi[key])) if plan is not None else self.res.tier

    def _missing(self, keys):
        cache = self.res.cache
        return [key for key in keys if not cache.serves(key, TIER_CODES[self.tier(key)])]

    def during_draft(self, keys, byte_budget: float) -> None:
        """Phase I (entries already resident serve as they are) and phase II (fetch the missing
        ones, most confident first, while the draft runs, within `byte_budget` bytes)."""
        if not self.res.offloading:
            self.stats.phase1 += len(keys)
            return
        missing = self._missing(keys)
        self.stats.phase1 += len(keys) - len(missing)
        spent = 0
        cache = self.res.cache
        cache.pinned = set(self.entries)  # a fetch for this cycle never evicts another of its entries
        try:
            for key in missing:
                tier = self.tier(key)
                nbytes = self.res.pools[tier].slot_nbytes
                if spent + nbytes > byte_budget:
                    break
                if key in cache.inflight:
                    continue
                if cache.request(key, tier, "prefetch") == "started":
                    self.stats.phase2 += 1
                    spent += nbytes
        finally:
            cache.pinned = set()

    def before_verify(self) -> None:
        """Phase III: fetch every entry still missing, most confident first, and wait for them."""
        if not self.res.offloading:
            return
        cache = self.res.cache
        order = sorted(self.entries, key=lambda key: -self.entries[key])
        missing = self._missing(order)
        cache.pinned = set(self.entries)
        try:
            for key in missing:
                if key in cache.inflight:
                    continue
                state = cache.request(key, self.tier(key), "prefetch", block=True)
                if state == "full":  # the pools cannot hold the whole buffer: verification fetches the rest
                    break
                self.stats.phase3 += state == "started"
            cache.wait([key for key in missing if key in cache.inflight])
        finally:
            cache.pinned = set()


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
    governor = Governor(k_max, options.k, max_cycle_s=options.max_cycle_s)
    params = sampling.device_params()
    rng = np.random.default_rng(sampling.seed)
    seen = prompt_history(prompts, cfg.vocab_size, sampling)

    def draw(probs, pick) -> np.ndarray:
        if sampling.greedy:
            return np.asarray(pick, np.int32)
        return np.array([rng.choice(row.shape[0], p=normalised(row)) for row in np.asarray(probs, np.float64)],
                        np.int32)

    clock = RequestClock()
    with model.lock:
        probs, pick = _processed(decoder.prefill(), jnp.asarray(seen), *params)
        last = draw(probs, pick)
    produced = np.ones(B, int)
    queue: list[list[int]] = [[int(t)] for t in last]
    seen[np.arange(B), last] = True
    while True:
        finished = produced >= lengths.new_tokens
        while all(q or done for q, done in zip(queue, finished)) and any(queue):
            out = np.array([q.pop(0) if q else -1 for q in queue], np.int32)
            with model.lock:
                clock.tick(model.stats, int((out >= 0).sum()))
            yield out
        if finished.all():
            return
        active = ~finished
        with model.lock:
            decoder.pos = np.where(active, decoder.pos, decoder.pos[active].min())  # finished rows only idle along
            room = lengths.cache - 1 - int(decoder.pos.max())
            need = int((lengths.new_tokens - produced[active]).max())
            k = max(0, min(governor.choose(), room, need - 1))
            governor.bandwidth = h2d_bandwidth(model.stats)
            drafts, q_probs, draft_s, missing_bytes, buffer = draft_tokens(decoder, draft, last, seen, k, params,
                                                                           draw, model)
            t = time.perf_counter()
            hits, uses = model.stats.hits, model.stats.uses
            block = np.stack([last, *drafts], axis=1)  # [B, k + 1]
            verify_logits = decoder.verify(jnp.asarray(padded(block, lengths.cache - int(decoder.pos.max()))))
            accepted, nxt = accept(verify_logits, block, q_probs, seen, params, sampling.greedy, rng)
            verify_s = agree(time.perf_counter() - t)
            spec.verify_hits += model.stats.hits - hits
            spec.verify_uses += model.stats.uses - uses
            if k:
                count_fidelity(spec, model.residency.last_routed, buffer)
            decoder.advance(accepted + 1)
            governor.update(k, accepted[active], draft_s, verify_s, missing_bytes)
            spec.count(k, accepted[active])
        for b in np.flatnonzero(active):
            new = [*block[b, 1 : accepted[b] + 1].tolist(), int(nxt[b])][: lengths.new_tokens - produced[b]]
            queue[b].extend(new)
            produced[b] += len(new)
            seen[b, new] = True
        last = nxt.astype(np.int32)


def padded(block: np.ndarray, room: int) -> np.ndarray:
    """The verification block padded to a power-of-two length (repeating its last token) when the
    cache has room, so a governor varying k compiles a few verification shapes, not k_max. What the
    padding writes lies beyond every row's accepted tokens and is overwritten later."""
    T = block.shape[1]
    width = 1 << (T - 1).bit_length()
    if width == T or width > room:
        return block
    return np.concatenate([block, np.repeat(block[:, -1:], width - T, axis=1)], axis=1)


def draft_tokens(decoder, draft, last, seen, k, params, draw, model):
    """Steps 1-2 of a cycle: the draft decodes k tokens per row from `last` into the shared cache
    (then the rows step back), its routing filling the lookahead buffer (phases I and II), and
    phase III fetches what is still missing. Returns (drafts [k x [B]], their probabilities, draft
    seconds, bytes phase III moved, the buffer)."""
    buffer = LookaheadBuffer(model.residency, model.stats.spec)
    drafts, q_probs = [], []
    if not k:
        return drafts, q_probs, 0.0, 0, buffer
    seen_j = seen.copy()
    token = last
    bandwidth = h2d_bandwidth(model.stats)
    t = time.perf_counter()
    for j in range(k):
        logits = decoder.decode(jnp.asarray(token), residency=draft)
        probs, pick = _processed(logits, jnp.asarray(seen_j), *params)
        token = draw(probs, pick)
        drafts.append(token)
        q_probs.append(probs)
        seen_j[np.arange(len(token)), token] = True
        step_s = agree((time.perf_counter() - t) / (j + 1))
        buffer.during_draft(buffer.add(draft.signals), bandwidth * step_s)
    draft_s = agree(time.perf_counter() - t)
    decoder.advance(-k)
    before = model.stats.bytes_h2d
    buffer.before_verify()
    return drafts, q_probs, draft_s, model.stats.bytes_h2d - before, buffer


def count_fidelity(spec, routed, buffer) -> None:
    """Of the experts verification routed to, how many the lookahead buffer held."""
    if routed is None:
        return
    held = np.zeros_like(routed)
    for key in buffer.entries:
        held[key] = True
    spec.fidelity_hits += int((routed & held).sum())
    spec.fidelity_total += int(routed.sum())


def accept(verify_logits, block: np.ndarray, q_probs: list, seen: np.ndarray, params, greedy: bool, rng):
    """Per row: how many drafted tokens stand, and the target's token after them.

    verify_logits [B, T' >= k + 1, V] are the target's after block[:, 0..k] (and any padding);
    q_probs[j] [B, V] the draft's processed distribution for drafted token block[:, j + 1]; seen
    [B, V] the history before the block's first drafted token. The target's distribution at position
    j goes through the same penalty and warpers with the same history (seen plus the drafts before it)."""
    B, T = block.shape
    k = T - 1
    width = verify_logits.shape[1]
    drafted = np.concatenate([block[:, 1:], np.repeat(block[:, -1:], width - k, axis=1)], axis=1)  # [B, T']
    probs, picks = _processed_block(verify_logits, jnp.asarray(seen), jnp.asarray(drafted[:, : width - 1]), *params)
    p_pick = np.asarray(picks).T  # [T', B]
    p_probs = None if greedy else np.asarray(probs, np.float64).transpose(1, 0, 2)  # [T', B, V]
    q = [None if greedy else np.asarray(x, np.float64) for x in q_probs]
    accepted = np.zeros(B, int)
    nxt = np.zeros(B, np.int32)
    for b in range(B):
        n = 0
        while n < k:
            d = block[b, n + 1]
            keep = p_pick[n][b] == d if greedy else rng.random() * q[n][b, d] < p_probs[n][b, d]
            if not keep:
                break
            n += 1
        accepted[b] = n
        if greedy:
            nxt[b] = p_pick[n][b]
        elif n == k:  # every draft kept: one more token from the target's last distribution
            nxt[b] = rng.choice(p_probs[k].shape[1], p=normalised(p_probs[k][b]))
        else:  # rejected: draw from the normalised residual max(0, p - q)
            residual = np.maximum(p_probs[n][b] - q[n][b], 0.0)
            nxt[b] = rng.choice(residual.shape[0], p=normalised(residual if residual.sum() > 0 else p_probs[n][b]))
    return accepted, nxt


def normalised(p: np.ndarray) -> np.ndarray:
    return p / p.sum()
