"""How a step runs over a residency object; the paths share the engine's layer code.

- all resident: one jitted step (Engine.forward); the signals stay on the device.
- offloaded decode and verification (every path but "layerwise", where the residency fetches in
  steps: jmoe/runtime/fetching.py): one executable per step that fetches what it lacks from the
  host store itself (exact mode) or runs it at a lower resident tier (degrade mode) and packs a
  summary, read once a step later. A step that lacked more experts than its miss slots hold is run
  again (exact, counted as a replay): the host fetches what it lacked and replays it in one jit.
- "resident" (offloaded prefill in one jit): Engine.forward over what is resident, the selection
  choosing each routed expert's tier inside the step. The host reads the step's routing back; if
  an expert ran below its wanted tier it is fetched and the step replayed (exact), or, in the
  phases the policy lists in degrade_phases, the step is kept and the shortfall counted. A step
  whose experts cannot all be resident at once runs layer-wise.
- "layerwise": the host between each layer's routing and its experts (jmoe/runtime/layerwise.py).
- "auto" (the default): offloaded prefill layer-wise (a prompt routes to more experts per layer
  than a step's fetch slots hold), decode and verification in one executable.

A step can be settled later (`defer`): the caller samples from its logits (or the step samples
itself: decode_sampled) and does its own host work while the device computes, then `settle` reads
its summary, keeps the books and, if it was not exact, runs the step again and returns the
corrected logits. Generation settles each decode step after dispatching the next, so the device
never waits for the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.decoding.engine import Engine, attention_meta_jit
from jmoe.layers.transformer import StepSignals
from jmoe.runtime.fetching import Flight
from jmoe.runtime.kernel_fallback import with_kernel_fallback
from jmoe.runtime.layerwise import LayerPieces, run_layerwise
from jmoe.runtime.residency import Offloaded, shortfall_of

PATHS = ("auto", "layerwise", "resident")


def valid_tokens(start: np.ndarray, key_start: np.ndarray, num_tokens: int) -> np.ndarray:
    """[B * T] bool: which current tokens are real (not left padding)."""
    if num_tokens == 1:
        return start >= key_start
    return ((start[:, None] + np.arange(num_tokens)[None, :]) >= key_start[:, None]).reshape(-1)


@dataclass
class Pending:
    """A dispatched one-jit step whose routing has not been read back yet."""

    res: Offloaded
    tokens: object
    start: np.ndarray
    key_start: np.ndarray
    valid: np.ndarray
    last_only: bool
    phase: str
    signals: StepSignals
    flight: Flight | None = None  # a step that fetched its own experts


@dataclass
class Cycle:
    """A dispatched speculative cycle (Executor.speculate)."""

    res: object
    k: int
    next_token: jax.Array
    tokens: jax.Array  # what the host reads: accepted, next tokens and drafts (a fetching step's summary)
    drafts: jax.Array
    q: jax.Array | None
    flight: Flight | None
    start_state: tuple  # the sampler's (rng, seen) before the verification
    last: jax.Array
    start: np.ndarray
    key_start: np.ndarray


@dataclass
class SampledStep:
    """A dispatched decode step that sampled its next tokens (Executor.decode_sampled)."""

    res: object
    next_tokens: jax.Array  # [B] on the device
    pending: Pending | None  # a fetching step's, to settle; None when nothing can be corrected
    draw: tuple  # the sampler's (rng, seen) before the step drew, to draw again from corrected logits


class Executor:
    """Runs steps of one loaded model over its residency object (see the module docstring)."""

    def __init__(self, engine: Engine, graphdef, dense, residency, path: str = "auto"):
        self.engine, self.residency, self.path = engine, residency, path
        self.dense = nnx.to_pure_dict(dense)  # a plain dict: cheaper to pass to the jitted step than nnx's State
        self.pieces = LayerPieces(graphdef, dense) if residency.offloading else None
        self.careful = False  # "auto": run layer-wise until a step finds every expert resident
        self.vocab_size = nnx.merge(graphdef, dense).config.vocab_size

    def step(self, tokens, cache, start, key_start, *, last_only: bool, phase: str, residency=None,
             defer: bool = False):
        """One forward step over tokens [B, T], row b written from cache slot start[b].

        Returns (logits, cache, pending): pending is None once the step is final, else a Pending
        to pass to settle() (only with defer=True). `residency` overrides the model's (a draft
        running on the same dense weights and cache)."""
        res = residency or self.residency
        start, key_start = np.asarray(start, np.int32), np.asarray(key_start, np.int32)
        if self.fetches(res, phase):
            res.plan_step(phase, tokens.size)
            valid = valid_tokens(start, key_start, 1 if tokens.ndim == 1 else tokens.shape[1])
            try:
                logits, cache, pending = self._fetching(res, tokens, cache, start, key_start, valid, last_only, phase)
                if defer:
                    return logits, cache, pending
                corrected, cache = self._settle(pending, cache)
                return (logits if corrected is None else corrected), cache, None
            finally:
                res.end_step()
        if res.offloading and res.in_step is not None:
            res.in_step.publish_landings()  # this step reads the host's tables: they must be the device's
        res.begin_step(phase, tokens.size)
        try:
            if not res.offloading:
                logits, cache, signals = with_kernel_fallback(self.kernel_users(res), lambda: self.engine.forward(
                    self.dense, res.expert_state().for_phase(phase), tokens, cache, start, key_start,
                    last_only=last_only, want_importance=False))
                res.stats.count_io(executions=1)
                res.observe(signals, valid_tokens(start, key_start, 1 if tokens.ndim == 1 else tokens.shape[1]))
                return logits, cache, None
            valid = valid_tokens(start, key_start, 1 if tokens.ndim == 1 else tokens.shape[1])
            if self.path == "layerwise" or (self.path == "auto" and (self.careful or phase == "prefill")):
                res.catch_up()
                return (*self._layerwise(res, tokens, cache, start, key_start, valid, last_only, phase), None)
            logits, cache, signals = self._forward(res, tokens, cache, start, key_start, last_only, phase)
            pending = Pending(res, tokens, start, key_start, valid, last_only, phase, signals)
            if defer:
                return logits, cache, pending
            replayed, cache = self._settle(pending, cache, defer_books=False)
            return (logits if replayed is None else replayed), cache, None
        finally:
            res.end_step()

    def settle(self, pending: Pending, cache):
        """Read a deferred step's routing back: (None, cache) if it stands, else (its logits run
        again with what it lacked, cache)."""
        try:
            return self._settle(pending, cache)
        finally:
            pending.res.end_step()

    def fetches(self, res, phase: str) -> bool:
        """Whether a step of `phase` over `res` fetches its own experts (one executable, summary read later)."""
        return res.offloading and res.in_step is not None and res.in_step.covers(phase) and self.path != "layerwise"

    def _fetching(self, res: Offloaded, tokens, cache, start, key_start, valid, last_only, phase):
        """Dispatch a step that fetches its own experts: (logits, cache, its Pending)."""
        state, pools, flight = res.in_step.prepare(phase)
        logits, cache, signals, pools, summary = self._dispatch(res, flight, lambda: self.engine.fetching(
            self.dense, state, pools, tokens, cache, start, key_start, last_only=last_only, want_importance=False))
        res.in_step.dispatched(flight, pools, signals, summary)
        return logits, cache, Pending(res, tokens, start, key_start, valid, last_only, phase, signals, flight)

    def _dispatch(self, res, flight, run):
        """Dispatch one executable (`run`), counted; should it fail, a fetching step's landing
        candidates are unlocked (nothing will read it)."""
        started = time.perf_counter()
        try:
            out = with_kernel_fallback(self.kernel_users(res), run)
        except BaseException:
            if flight is not None:
                res.in_step.failed(flight)
            raise
        res.stats.count_io(executions=1)
        res.stats.count_dispatch(time.perf_counter() - started)
        return out

    def decode_sampled(self, tokens, cache, start, key_start, sampler, *, residency=None):
        """One decode step of tokens [B] (on the device) that samples its next tokens itself (one
        executable where the residency allows): (next tokens [B] on the device, cache, SampledStep).
        settle_sampled() reads the tokens back, a step later."""
        res = residency or self.residency
        start, key_start = np.asarray(start, np.int32), np.asarray(key_start, np.int32)
        draw = (sampler.rng, sampler.seen)
        if res.offloading and not self.fetches(res, "decode"):  # steps with the host between layers
            logits, cache, pending = self.step(tokens, cache, start, key_start, last_only=True, phase="decode",
                                               residency=res, defer=True)
            nxt = sampler(logits)
            res.stats.count_io(executions=1)
            return nxt, cache, SampledStep(res, nxt, pending, draw)
        if res.offloading:
            res.plan_step("decode", tokens.size)
        else:
            res.begin_step("decode", tokens.size)
        pools, flight = None, None
        try:
            if res.offloading:
                state, pools, flight = res.in_step.prepare("decode", rows=tokens.shape[0])
            else:
                state = res.expert_state()
            positions = np.stack([start, key_start])  # moved by the step's dispatch (no device_put)
            res.stats.count_io(transfers=1, nbytes=positions.nbytes)
            nxt, seen, rng, cache, pools, summary, signals = self._dispatch(res, flight, lambda: self.engine.decode(
                self.dense, state, pools, tokens, cache, positions, sampler.seen, sampler.rng, *sampler.params,
                greedy=sampler.greedy, filters=sampler.filters))
            sampler.advance(rng, seen)
            if flight is None:
                res.observe(signals, valid_tokens(start, key_start, 1))
                return nxt, cache, SampledStep(res, nxt, None, draw)
            res.in_step.dispatched(flight, pools, signals, summary)
            valid = valid_tokens(start, key_start, 1)
            return nxt, cache, SampledStep(res, nxt, Pending(res, tokens, start, key_start, valid, True, "decode",
                                                             signals, flight), draw)
        finally:
            res.end_step()

    def settle_sampled(self, step: SampledStep, cache, sampler):
        """Read a decode_sampled step back: (its next tokens [B] as numpy, whether they were drawn
        again, cache). A step that was not exact runs again (_run_again) and draws again (same key and
        history, so sampling stays exact)."""
        res = step.res
        if step.pending is None:
            res.stats.count_io(reads=1)
            return res.stats.read_back(step.next_tokens), False, cache
        if step.pending.flight is None:  # a step with the host between layers, settled like any other
            corrected, cache = self.settle(step.pending, cache)
        else:
            try:
                summary, exact = res.in_step.settle(step.pending.flight)
                if exact:
                    return summary.tokens, False, cache
                corrected, cache = self._run_again(step.pending, summary, cache)
            finally:
                res.end_step()
        if corrected is None:
            res.stats.count_io(reads=1)
            return np.asarray(step.next_tokens), False, cache
        tokens = sampler.redraw(corrected, step.draw)
        res.stats.count_io(executions=1, reads=1)
        return np.asarray(tokens), True, cache

    # -- speculative decoding: a cycle is a draft and a verification, one executable each

    def speculate(self, last, cache, start, key_start, sampler, k: int, draft) -> tuple:
        """Dispatch a cycle: `draft` (a residency with every expert resident) decodes k tokens per
        row from `last` [B] (on the device) in one executable, then the model verifies them in one
        executable that accepts on the device (k = 0: a plain step). Returns (cache, Cycle);
        settle_cycle() reads it."""
        res = self.residency
        start, key_start = np.asarray(start, np.int32), np.asarray(key_start, np.int32)
        B = last.shape[0]
        positions = np.stack([start, key_start])
        res.stats.count_io(transfers=1, nbytes=positions.nbytes, phase="verify")
        positions = jax.device_put(positions, res.device)
        if k:
            draft.begin_step("draft", B * k)
            draft.stats.steps += k - 1  # a draft step per drafted position
            drafts, q, hint, cache, rng = self.engine.draft(self.dense, draft.expert_state(), last, cache, positions,
                                                            sampler.seen, sampler.rng, *sampler.params, k=k,
                                                            greedy=sampler.greedy, filters=sampler.filters)
            sampler.advance(rng, sampler.seen)  # the drafts' history is the verification's to keep
            res.stats.count_io(executions=1, phase="verify")
        else:  # nothing drafted: empty blocks
            drafts, hint = np.zeros((B, 0), np.int32), None
            q = None if sampler.greedy else np.zeros((B, 0, self.vocab_size), np.float32)
        start_state = (sampler.rng, sampler.seen)
        if res.offloading and not self.fetches(res, "verify"):  # the host between layers: verify, then accept
            block = jnp.concatenate([last[:, None], jnp.asarray(drafts)], axis=1)
            logits, cache, _ = self.step(block, cache, start, key_start, last_only=False, phase="verify")
            accepted, nxt, seen, rng = self.engine.accept_again(logits, drafts, q, sampler.seen, sampler.rng,
                                                                *sampler.params, greedy=sampler.greedy,
                                                                filters=sampler.filters)
            res.stats.count_io(executions=3)
            sampler.advance(rng, seen)
            tokens = jnp.concatenate([accepted, nxt, jnp.asarray(drafts).reshape(-1)])
            return cache, Cycle(res, k, nxt, tokens, drafts, q, None, start_state, last, start, key_start)
        flight = None
        if res.offloading:
            res.plan_step("verify", B * (k + 1))
            state, pools, flight = res.in_step.prepare("verify", rows=B * (k + 2), hint=hint)
        else:
            res.begin_step("verify", B * (k + 1))
            state, pools = res.expert_state().for_phase("verify"), None
        try:
            accepted, nxt, seen, rng, cache, pools, packed, signals = self._dispatch(
                res, flight, lambda: self.engine.verify(self.dense, state, pools, last, drafts, cache, positions,
                                                        sampler.seen, sampler.rng, q, *sampler.params,
                                                        greedy=sampler.greedy, filters=sampler.filters))
            sampler.advance(rng, seen)
            if flight is not None:
                res.in_step.dispatched(flight, pools, signals, packed)
            else:
                res.observe(signals, valid_tokens(start, key_start, k + 1))
            return cache, Cycle(res, k, nxt, packed, drafts, q, flight, start_state, last, start, key_start)
        finally:
            res.end_step()

    def settle_cycle(self, cycle: "Cycle", cache, sampler):
        """Read a cycle back (one blocking read): (accepted drafts per row [B], the target's next
        token per row [B], the drafts [B, k], all numpy; the next token on the device; cache). A
        verification that was not exact runs again (_run_again) and accepts again from the same key
        and history."""
        res, k = cycle.res, cycle.k
        B = cycle.last.shape[0]
        if cycle.flight is None:
            res.stats.count_io(reads=1, phase="verify")
            tokens = np.asarray(cycle.tokens)
        else:
            summary, exact = res.in_step.settle(cycle.flight)
            tokens = summary.tokens
            if not exact:
                block = jnp.concatenate([cycle.last[:, None], jnp.asarray(cycle.drafts)], axis=1)
                again = Pending(res, block, cycle.start, cycle.key_start, valid_tokens(cycle.start, cycle.key_start,
                                                                                      k + 1), False, "verify", None)
                logits, cache = self._run_again(again, summary, cache)
                sampler.advance(*cycle.start_state)
                accepted, nxt, seen, rng = self.engine.accept_again(logits, cycle.drafts, cycle.q, sampler.seen,
                                                                    sampler.rng, *sampler.params, greedy=sampler.greedy,
                                                                    filters=sampler.filters)
                sampler.advance(rng, seen)
                res.stats.count_io(executions=3, reads=1)
                tokens = np.asarray(jnp.concatenate([accepted, nxt, jnp.asarray(cycle.drafts).reshape(-1)]))
                cycle.next_token = nxt
        accepted, nxt, drafts = tokens[:B], tokens[B:2 * B], tokens[2 * B:2 * B + B * k].reshape(B, k)
        return accepted.astype(np.int64), nxt.astype(np.int32), drafts, cycle.next_token, cache

    def discard(self, step: SampledStep) -> None:
        """A decode_sampled step taken back unread (its input token changed)."""
        if step.pending is not None and step.pending.flight is not None:
            step.res.in_step.discard(step.pending.flight)

    def _forward(self, res: Offloaded, tokens, cache, start, key_start, last_only, phase):
        want_importance = phase == "prefill" and res.policy.wants_importance
        out = with_kernel_fallback(self.kernel_users(res), lambda: self.engine.forward(
            self.dense, res.expert_state().for_phase(phase), tokens, cache, start, key_start, last_only=last_only,
            want_importance=want_importance))
        res.stats.count_io(executions=1)
        return out

    def kernel_users(self, res) -> list:
        """The residencies whose kernels a failure to compile switches to the XLA path: the step's and the model's."""
        return [res] if res is self.residency else [res, self.residency]

    def _settle(self, p: Pending, cache, *, defer_books: bool = True):
        res = p.res
        if p.flight is not None:
            summary, exact = res.in_step.settle(p.flight)
            if exact:
                return None, cache
            return self._run_again(p, summary, cache)
        res.synced()
        summary = np.asarray(p.signals.per_expert)  # [3, L, E]: tokens, wanted, chosen per expert; one small read
        res.last_routed = summary[0] > 0
        if not ((summary[0] > 0) & (summary[2] < summary[1])).any():  # the common case: nothing ran short
            if defer_books:
                res.defer_books(p.signals, summary, p.valid, p.phase)
            else:
                res.catch_up()
                res.accept(res.read(p.signals, p.valid, p.phase, sync=False), set())
            return None, cache
        res.catch_up()
        routings = res.read(p.signals, p.valid, p.phase, sync=False)
        wanted, missing = res.shortfall(routings)
        if not missing or (p.phase in res.policy.degrade_phases and res.ran_every(routings)):
            res.accept(routings, set(), missing)
            return None, cache
        if self.path == "auto":
            self.careful = True
            res.stats.replays += 1
            return self._layerwise(res, p.tokens, cache, p.start, p.key_start, p.valid, p.last_only, p.phase)
        return self._replay(p, cache, routings, wanted, missing)

    def _run_again(self, p: Pending, summary, cache):
        """A fetching step that lacked more experts than its miss slots hold, run again exactly: the
        host fetches what its summary says ran short (exact up to the first layer that overflowed,
        the best guess past it) and replays it over resident experts, one executable and one read
        per run; layer-wise only where they cannot all be resident at once. (Layer by layer costs a
        few reads and executions per layer: on a GPU, milliseconds a layer.)"""
        p.res.in_step.publish_landings()  # the host's tables must be the device's before it fetches
        wanted, missing = shortfall_of(summary.routed, summary.wanted, summary.chosen)
        return self._replay(p, cache, None, wanted, missing)

    def _replay(self, p: Pending, cache, routings, wanted, missing):
        """Fetch what the step lacked and run it again until it lacks nothing. Each replay makes at
        least one more layer exact (its experts stay pinned), so L + 1 runs suffice for a policy
        whose wants follow the routing."""
        res, fetched = p.res, set()
        for _ in range(res.cfg.num_moe_layers):
            if not res.fits(wanted):  # this step's experts cannot all be resident together
                break
            res.fetch(wanted, missing)
            fetched.update(missing)
            res.stats.replays += 1
            logits, cache, signals = self._forward(res, p.tokens, cache, p.start, p.key_start, p.last_only, p.phase)
            routings = res.read(signals, p.valid, p.phase)
            wanted, missing = res.shortfall(routings)
            if not missing:
                res.accept(routings, fetched)
                return logits, cache
        # Too many experts for the pools at once, or wants that keep moving (a policy answering
        # differently each time it is asked): run the step layer by layer, which fetches as it goes.
        return self._layerwise(res, p.tokens, cache, p.start, p.key_start, p.valid, p.last_only, p.phase)

    def _layerwise(self, res: Offloaded, tokens, cache, start, key_start, valid, last_only, phase):
        if res.in_step is not None:
            res.in_step.publish_landings()  # the host's tables must be the device's
        before = res.stats.misses + res.stats.late + res.stats.cpu_runs
        one = tokens.ndim == 1  # one token per row: logits come back [B, V] as from the one-jit step
        tokens = tokens[:, None] if one else tokens
        meta = attention_meta_jit(self.pieces.cfg, tokens.shape[1], *jax.device_put((start, key_start)), cache.table)
        res.stats.count_io(executions=1 + 2 * one, transfers=2, nbytes=start.nbytes + key_start.nbytes)
        logits, cache = run_layerwise(self.pieces, res, tokens, cache, meta, valid, last_only=last_only, phase=phase)
        if res.stats.misses + res.stats.late + res.stats.cpu_runs == before:
            self.careful = False  # every expert was resident: the next step may run in one jit
        return (logits[:, 0] if one else logits), cache


__all__ = ["PATHS", "Cycle", "Executor", "Pending", "SampledStep", "valid_tokens"]
