"""The serving engine's decode steps (a mixin of BatchEngine, jmoe/serving/batcher.py): a step over
the live slots, the next one dispatched from its greedy tokens before they are read back where
that is safe, and each row's new token drawn and handed to its stream (or the row ended)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import numpy as np

from jmoe.decoding.generation import RowText
from jmoe.decoding.sampling import Sampler
from jmoe.errors import InputError
from jmoe.runtime.stats import RequestClock
from jmoe.serving.logits import greedy_jit, row_jit, token_logprobs
from jmoe.serving.requests import Stream, TokenLogprob
from jmoe.serving.structured import Constraint, masked_row


@dataclass
class Row:
    """A running request in a slot."""

    stream: Stream
    sampler: Sampler
    text: RowText | None
    clock: RequestClock
    token: int = 0  # the last token drawn, fed to the next step
    generated: int = 0
    logprobs: list = field(default_factory=list)  # of tokens whose text has not gone out yet
    constraint: Constraint | None = None  # the grammar its tokens must follow, if any
    order: int = 0  # when it was admitted (the newest gives its pages back first)
    history: list = field(default_factory=list)  # the tokens it generated (a resumed row prefills them again)

    def put(self, piece) -> None:
        """A piece to the stream, with the logprobs of the tokens behind it."""
        self.stream._put(piece, self.logprobs)
        self.logprobs = []

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a repetition, presence or frequency penalty, a logit bias or a grammar: its
        token comes from the step's one argmax call."""
        return self.constraint is None and self.stream.request.sampling.plain_greedy


@dataclass
class Dispatched:
    """A decode step on its way: its logits (not yet read back), the rows by slot it ran for, their
    positions, and when it started."""

    logits: jax.Array
    rows: list
    pos: np.ndarray
    started: float


class Stepping:
    """BatchEngine's decode steps and token output. Reads and writes the engine's slots (rows, pos,
    key_start, the page table) and pool; ends rows through the engine's Endings."""

    def _step(self) -> None:
        """One decode step of the first bucket(live) slots (free ones as padding), then each live
        row's next token. Where every row of the step is plain greedy, the next step is dispatched
        with the step's argmax tokens while they are still on the device, before this step's tokens
        are read back and handed out: the host's work overlaps the device's."""
        self._compact()
        step, self._inflight = self._inflight, None
        if step is None:
            self._grow(1)
            self._compact()
            if self.running == 0:
                return
            n = self.bucket(self.running)
            rows = self.rows[:n]
            tokens = np.asarray([r.token if r is not None else self.pad for r in rows], np.int32)
            step = self._dispatch(tokens, rows, np.where([r is not None for r in rows], self.pos[:n], 0))
        rows = step.rows
        greedy = greedy_jit(step.logits) if any(r is not None and r.plain_greedy for r in rows) else None
        if greedy is not None and self._can_overlap(step):
            live = np.asarray([r is not None for r in rows])
            self._inflight = self._dispatch(greedy, rows, np.where(live, step.pos + 1, 0))
        self.steps += 1
        if self.observer is not None:
            self.observer.step(time.perf_counter() - step.started, self.running)
        greedy = None if greedy is None else np.asarray(greedy)
        slot = {id(r): b for b, r in enumerate(self.rows) if r is not None}  # rows may have moved since dispatch
        tokens = {}
        for i, row in enumerate(rows):
            if row is None or slot.get(id(row)) is None:  # padding, or a row that ended meanwhile
                continue
            self.pos[slot[id(row)]] += 1
            if row.plain_greedy:
                tokens[i] = int(greedy[i])
            elif (token := self._draw_or_end(row, step.logits, i)) is not None:
                tokens[i] = token
        wanted = {i: k for i, k in self._wanted(rows).items() if i in tokens}  # not rows that ended meanwhile
        logprobs = token_logprobs(step.logits, tokens, wanted)
        for i, token in tokens.items():
            self._emit(slot[id(rows[i])], token, logprobs.get(i))
        if self.running == 0:
            self._inflight = None  # every row it ran for has ended

    def _dispatch(self, tokens, rows: list, pos) -> "Dispatched":
        """Start a decode step of slots [0, len(rows)) (rows: who is in each, None for padding)."""
        started = time.perf_counter()
        n = len(rows)
        logits = self._run_step(tokens, np.asarray(pos, np.int32), self.key_start[:n].copy())
        return Dispatched(logits, list(rows), np.asarray(pos, np.int32), started)

    def _can_overlap(self, step: "Dispatched") -> bool:
        """Whether the step after `step` may start before its tokens are read back: the same rows in
        the same slots, nothing else running, all plain greedy, room for one more token each, and no
        speculative cycles (they draft from host tokens)."""
        live = [r for r in step.rows if r is not None]
        return (self.speculation is None and all(r.plain_greedy for r in live) and len(live) == self.running
                and all(a is b for a, b in zip(self.rows, step.rows))
                and bool((step.pos[[r is not None for r in step.rows]] + 1 < self.context).all())
                and all(self._take(b, int(step.pos[b]) + 1, int(step.pos[b]) + 2)  # its next slot's page
                        for b, r in enumerate(step.rows) if r is not None))

    @staticmethod
    def _wanted(rows) -> dict[int, int]:
        """Row -> alternatives, for the rows whose requests ask for logprobs."""
        return {b: row.stream.request.logprobs for b, row in enumerate(rows)
                if row is not None and row.stream.request.logprobs is not None}

    def _run_step(self, tokens, pos, key_start, *, residency=None, last_only: bool = True, phase: str = "decode"):
        """The model's step over the first len(tokens) rows of the batch cache (taken out and written
        back when they are not all of it), settled: logits [n, V] (a decode step: tokens [n]), or
        [n, T, V] with last_only=False (tokens [n, T]). `residency`: the draft's experts."""
        n = len(tokens)
        cache = self.pool.view(self._table(n))
        if not isinstance(tokens, jax.Array):  # committed, as a step's own tokens are: one executable for both
            tokens = self.model.put(np.asarray(tokens))
        logits, cache, pending = self.model.step(tokens, cache, pos, key_start, last_only=last_only,
                                                 phase=phase, residency=residency, defer=True)
        if pending is not None:
            corrected, cache = self.model.settle(pending, cache)
            logits = logits if corrected is None else corrected
        self.pool.layers, self._tables[n] = cache.layers, cache.table  # (the step took the cache, table and all)
        return logits

    @staticmethod
    def _draw(row: Row, logits, i: int) -> int:
        """Row `row`'s next token by its sampler, from row i of logits [n, V]; a constrained row's
        from the tokens its grammar allows (its matcher then advanced past the one drawn)."""
        if row.constraint is None:
            return int(np.asarray(row.sampler(row_jit(logits, np.int32(i))))[0])
        token = int(np.asarray(row.sampler(masked_row(logits, np.int32(i), row.constraint.allowed())))[0])
        row.constraint.advance(token)
        return token

    def _draw_or_end(self, row: Row, logits, i: int) -> int | None:
        """_draw, or None when the row's grammar fails it (that request ends with the error, not the step)."""
        try:
            return self._draw(row, logits, i)
        except InputError as error:
            self._free(next(b for b, r in enumerate(self.rows) if r is row), "error", str(error))
            return None

    def _emit(self, b: int, token: int, logprob: TokenLogprob | None = None) -> None:
        """Hand a row's new token (and its logprob, when asked for) to its stream, or end the row
        (EOS, stop string, limits)."""
        row = self.rows[b]
        with self.model.lock:
            row.clock.tick(self.model.stats, 1)
        if self.observer is not None:
            self.observer.token(row.stream, row.stream._since_last_token())
        if token in self.eos:
            if logprob is not None:  # no text, but a scorer reads one logprob per generated token
                row.logprobs.append(logprob)
            self._flush(row)
            self._free(b, "stop")
            return
        row.token = token
        row.history.append(token)
        row.generated += 1
        row.stream.usage["completion_tokens"] = row.generated
        if logprob is not None:
            row.logprobs.append(logprob)
        if row.text is None:
            row.put(token)
        else:
            delta = row.text.push(token)
            if delta:
                row.put(delta)
            if row.text.stopped:
                self._flush(row)
                self._free(b, "stop")
                return
        if row.generated >= row.stream.request.max_tokens or self.pos[b] >= self.context:  # no slot to write it
            self._flush(row)
            self._free(b, "length")

    @staticmethod
    def _flush(row: Row) -> None:
        """What a finishing row still holds back: text, and logprobs of tokens whose text is out."""
        tail = row.text.flush() if row.text is not None else ""
        if tail or row.logprobs:
            row.put(tail)
