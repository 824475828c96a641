"""Continuous batching: one engine thread runs every request's decode steps together.

The engine runs up to `max_batch` rows ("slots") of one context length over one pool of KV pages
(jmoe/serving/kv_pages.py): a row holds only the pages its tokens reach. Requests wait in a bounded
queue; between steps, while a slot is free and the pool has pages for its prompt, the oldest
waiting request is admitted: its prompt is prefilled alone (in chunks, its length bucketed) into
pages that its row then keeps. Every step then decodes one token for every slot at once, each row
at its own cache position (the Decoder's per-row positions): a batched step reads each expert once
for all the rows routed to it. A free slot's row is marked as padding (its key start past its
position, no pages), so it attends to nothing and routes to no expert.

A row takes its next page as it reaches it. When the pool has none free, the newest request
gives its pages back: a prompt still being prefilled returns to the front of the queue, a running
row is set aside with its sampler, text and grammar state and later prefilled again from its
prompt and the tokens it generated (recomputed, so a sampled row's draws continue from its own
key; a greedy row's tokens can differ from an undisturbed run only where float rounding does). A
row that could not grow even with the pool to itself ends as "length". No running request fails
for want of pages.

Each request samples with its own key and history, as `jmoe.generate` of that prompt alone would:
greedy output is the same whatever else is in the batch, sampled output the same for a seed. A
row leaves on EOS, a stop string, its token limit, the context's end, its timeout, a cancel (a
client that went away) or a reader that left its output untaken too long, and its slot is free for
the next step. Log-probabilities, when asked for, come from the same step's logits in one device
call for all rows. With a speculative draft each step is a cycle: k drafted tokens per row, one
verification pass, and each greedy row keeps what the target agrees with.

A request can fail, never the engine: an error while a request is prefilled or takes its row ends
that request ("error"), an error in a step ends the rows of that step, and the engine goes on. Only
when a step of padding rows then fails too (or, across processes, on any error) does the engine
stop, ending every request with the error and setting `failure`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import validate
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, PREFILL_CHUNK
from jmoe.decoding.prefixes import PREFIX_BLOCK, put_block, take_block
from jmoe.decoding.generation import RowText, stop_strings
from jmoe.decoding.sampling import ALL_FILTERS, HISTORY_DTYPE, Sampler, SamplingOptions, prompt_history
from jmoe.decoding.speculative import SpeculativeOptions
from jmoe.errors import InputError
from jmoe.runtime.stats import RequestClock
from jmoe.serving.compiles import CompileCounter
from jmoe.serving.kv_pages import NO_PAGE, PagePool
from jmoe.serving.kv_rows import Prefill, prompt_geometry
from jmoe.serving.logits import MAX_TOP_LOGPROBS, greedy_jit, logprobs_jit, row_jit, token_logprobs
from jmoe.serving.requests import EngineClosed, QueueFull, Request, Stream, TokenLogprob, _Replayed
from jmoe.serving.scoring import score_prompt, warm_up_scoring
from jmoe.serving.speculation import Speculation
from jmoe.serving.structured import Constraint, masked_row

log = logging.getLogger("jmoe.serving")


@dataclass
class _Row:
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
class _Dispatched:
    """A decode step on its way: its logits (not yet read back), the rows by slot it ran for, their
    positions, and when it started."""

    logits: jax.Array
    rows: list
    pos: np.ndarray
    started: float


class BatchEngine:
    """Runs submitted requests in one continuously batched decode loop on its own thread.

    model: what jmoe.load returned. max_batch: slots (rows of the KV cache). max_waiting: the
    waiting queue's bound (submit raises QueueFull past it). context: tokens per slot (prompt and
    output; default the model's max_seq_len). reader_timeout: seconds a running request's output
    may wait unread before the request is cut off (default: no bound). A request's own `timeout`
    ends it that long after submit, wherever it is. kv_pages: pages of the KV pool (default: what
    load() reserved for the KV cache, jmoe.JmoeModel.kv_pages). speculative: as jmoe.generate's (a draft tier or
    dict(draft=..., k=...)); the engine drafts a fixed k per cycle (default 3 for "auto").

    If the engine cannot go on (see the module docstring), `failure` says why and `on_failure`, when
    set, is called with it on the engine thread.
    """

    def __init__(self, model, *, max_batch: int = 8, max_waiting: int = 64, context: int | None = None,
                 prefill_per_step: int = PREFILL_CHUNK, reader_timeout: float | None = None, speculative=None,
                 warm_up: bool = False, warm_up_echo: bool = False, observer=None, mirror=None,
                 follower: bool = False, kv_pages: int | None = None):
        """warm_up_echo: with warm_up, compile echo's prompt scoring (score()) too (else its first
        use at each prompt-length bucket compiles it, holding the engine meanwhile). mirror (jmoe/serving/mirror.py): under jax.distributed, process 0's engine publishes each
        iteration's decisions through it and the other processes' engines (follower=True: no loop
        thread; call follow()) replay them."""
        self.model = model
        self.mirror = mirror
        self.max_batch = validate.integer("max_batch", max_batch, minimum=1)
        self.max_waiting = validate.integer("max_waiting", max_waiting, minimum=0)
        context = model.max_seq_len if context is None else validate.integer("context", context, minimum=2)
        self.context = min(context, model.max_seq_len)
        cfg = model.config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos = set(model.eos_token_ids)
        self.kv_pages = model.kv_pages(self.max_batch, self.context) if kv_pages is None else validate.integer(
            "kv_pages", kv_pages, minimum=1)
        self.pool = self._new_pool()
        self.table = self.pool.new_table(self.max_batch)  # each slot's pages (host; the device's copies in _tables)
        self._tables: dict[int, jax.Array] = {}
        self._admissions = itertools.count()
        # requests set aside for want of pages, first to return first: (stream, the prompt to prefill
        # again, the row to resume or None); admitted before the waiting ones, never published again
        self.set_aside: deque[tuple[Stream, list[int], _Row | None]] = deque()
        self.preemptions = 0
        self.pos = np.zeros(self.max_batch, np.int32)
        self.key_start = np.full(self.max_batch, self.context, np.int32)  # free: padding throughout
        self.rows: list[_Row | None] = [None] * self.max_batch
        self.waiting: deque[Stream] = deque()
        self.scoring: deque[tuple[list[int], int, Future]] = deque()  # score()'s jobs, oldest first
        self.prefilling: deque[Prefill] = deque()  # admitted, prompt not all in yet (oldest first)
        # prompt tokens prefilled between two decode steps, at most (at least one chunk): a long
        # prompt arriving does not stall the running streams for its whole prefill
        self.prefill_per_step = validate.integer("prefill_per_step", prefill_per_step, minimum=1)
        # a running request whose reader has left output untaken this long is cut off ("reader_timeout"):
        # a client that stops reading does not hold its slot until max_tokens
        self.reader_timeout = None if reader_timeout is None else validate.real(
            "reader_timeout", reader_timeout, minimum=0.0)
        # speculative decoding (jmoe/serving/speculation.py): a cycle drafts k tokens per row with
        # the model's low-precision copy and verifies them in one pass; greedy rows keep the prefix
        # the target agrees with, other rows draw one token from the verification's first position
        options = SpeculativeOptions.parse(speculative)
        self.speculation = Speculation(model, options) if options else None
        self.steps = 0
        self._inflight: _Dispatched | None = None  # a step dispatched ahead of reading the last one back
        # told of every step (seconds, live rows), token (stream, seconds since its previous one or
        # since submit) and finished stream: how /metrics counts (jmoe/serving/metrics.py)
        self.observer = observer
        self._wake = threading.Condition()
        self._closed = False
        self.failure: str | None = None
        self.on_failure = None
        CompileCounter.start()
        if warm_up:
            self.warm_up()
            if warm_up_echo:
                warm_up_scoring(model, self.context)
        self._thread = threading.Thread(target=self._loop, name="jmoe-batch-engine", daemon=True)
        if not follower:
            self._thread.start()

    def _new_pool(self) -> PagePool:
        pool = PagePool(self.model, self.kv_pages, self.context)
        if pool.row_pages > pool.pages:
            raise InputError(f"the KV pool's {pool.pages} pages of {pool.page} slots do not hold one "
                             f"{self.context}-token context; give the KV cache more bytes or lower the context")
        return pool

    @property
    def cache(self):
        """The pool seen through every slot's pages (what a step over all slots runs on)."""
        return self.pool.view(self._table(self.max_batch))

    def _table(self, n: int) -> jax.Array:
        """The first n slots' pages on the device (sent again only after they change)."""
        if n not in self._tables:
            self._tables[n] = self.pool.put_table(self.table[:n])
        return self._tables[n]

    def warm_up(self) -> None:
        """Compile, before any request, what requests will run: a step at every batch bucket (all
        rows padding), a prefill at every prompt-length bucket, and a kept prompt block's copies out
        of and into a row."""
        prompt_len = MIN_PROMPT_BUCKET
        while prompt_len < self.context:
            table = self.pool.new_table(1)
            self.pool.take(table[0], 0, max(prompt_len, PREFIX_BLOCK))
            decoder = Decoder(self.model, [[self.pad] * prompt_len], prompt_len, self.context, self.pool, table)
            greedy_jit(decoder.prefill())
            if prompt_len == MIN_PROMPT_BUCKET and self.model.prefixes is not None and self.context > PREFIX_BLOCK:
                zero = np.int32(0)
                decoder.cache = put_block(decoder.cache, take_block(decoder.cache, zero, PREFIX_BLOCK, zero), zero, zero)
            self.pool.release(table[0])
            prompt_len *= 2
        n = 1
        while True:
            logits = self._run_step(np.full(n, self.pad, np.int32), np.zeros(n, np.int32),
                                    np.full(n, self.context, np.int32))
            # the next step dispatched from this one's tokens still on the device (_step's overlap)
            self._run_step(greedy_jit(logits), np.zeros(n, np.int32), np.full(n, self.context, np.int32))
            row_jit(logits, np.int32(0))
            masked_row(logits, np.int32(0), np.zeros((1, -(-logits.shape[-1] // 32)), np.int32))  # a constrained row's
            logprobs_jit(logits, np.zeros(n, np.int32))
            if self.speculation is not None:
                self.speculation.warm_up(self, n)
            if n == self.max_batch:
                break
            n = self.bucket(n + 1)
        vocab = self.model.config.vocab_size
        # a penalised greedy draw, and a sampled one with each combination of warpers (each its own executable)
        switched_on = dict(top_k=2, top_p=0.5, min_p=0.1)  # each warper's field, at a value that turns it on
        samplings = [SamplingOptions()] + [
            SamplingOptions(temperature=1.0, **{name: switched_on[name] for name in names})
            for n in range(len(ALL_FILTERS) + 1) for names in itertools.combinations(ALL_FILTERS, n)]
        for sampling in samplings:
            sampler = Sampler(self.model.engine, sampling, np.zeros((1, vocab), HISTORY_DTYPE))
            for _ in range(2):  # the first draw takes host arrays, later ones the device's it returned
                sampler(row_jit(logits, np.int32(0)))

    # ------------------------------------------------------------------ public

    def submit(self, request: Request) -> Stream:
        """Queue a request (checked first: its prompt must leave room for output in the context)."""
        if not request.prompt:
            raise InputError("the prompt is empty")
        if len(request.prompt) >= self.context:
            raise InputError(f"the prompt has {len(request.prompt)} tokens; a slot holds {self.context} "
                             "(leave room for output)")
        validate.integer("max_tokens", request.max_tokens, minimum=1)
        if request.logprobs is not None:
            validate.integer("logprobs", request.logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
        if request.timeout is not None:
            validate.real("timeout", request.timeout, minimum=0.0)
        vocab = self.model.config.vocab_size
        if request.sampling.top_k > vocab:
            raise InputError(f"top_k must be <= {vocab} (the vocabulary), got {request.sampling.top_k}")
        request.sampling.check_vocabulary(vocab)  # here, not in the engine's thread, where it would fail a step
        request = dataclasses.replace(request, stop=stop_strings(request.stop))
        stream = Stream(request)
        with self._wake:
            if self._closed:
                raise self._closed_error()
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already")
            self.waiting.append(stream)
            self._wake.notify()
        return stream

    def score(self, prompt: list[int], top: int) -> Future:
        """A Future of `prompt`'s own tokens' logprobs with `top` alternatives each (echo's; see
        scoring.py), worked out on the engine's thread between two steps."""
        if not prompt or len(prompt) > self.model.max_seq_len:
            raise InputError(f"a prompt to score has 1 to {self.model.max_seq_len} tokens, not {len(prompt)}")
        validate.integer("logprobs", top, minimum=0, maximum=MAX_TOP_LOGPROBS)
        future = Future()
        with self._wake:
            if self._closed:
                raise self._closed_error()
            self.scoring.append((list(prompt), top, future))
            self._wake.notify()
        return future

    def _closed_error(self) -> EngineClosed:
        return EngineClosed(f"the engine failed: {self.failure}" if self.failure else "the engine is closed")

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, or for pages to go on (set aside)."""
        return len(self.waiting) + len(self.set_aside)

    @property
    def closed(self) -> bool:
        """Whether the engine has stopped taking requests (closed, or failed)."""
        return self._closed

    def close(self) -> None:
        """Stop the loop; running and waiting requests end as cancelled."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    def follow(self, give_up=None) -> None:
        """A follower's loop: replay process 0's iterations until it closes (see mirror.py), or
        until give_up(), asked before each iteration and while process 0 is idle, says to stop."""
        while give_up is None or not give_up():
            d = self.mirror.receive(give_up)
            if d is None or d["close"]:
                break
            ended = dict(d["end"])
            self._end_started(lambda stream, running: ended.get(stream.id))
            self.waiting.extend(_Replayed(request, i) for i, request in d["admit"])
            self._admit()
            for prompt, top in d["score"]:  # process 0's scoring, run alike (its result read there)
                score_prompt(self.model, prompt, top)
            if self.running:
                self.speculation.step(self) if self.speculation is not None else self._step()
        self._fail_all(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while self._has_work():
                self._iterate()
        except Exception as error:  # noqa: BLE001 - the engine cannot go on: every request learns why, none hangs
            self._stop_failed(error)
        finally:
            if self.mirror is not None:
                self.mirror.publish([], [], close=True)
        self._fail_all(None)

    def _has_work(self) -> bool:
        """Wait until there is something to do: False once the engine is closed."""
        with self._wake:
            while (not self._closed and not self.waiting and not self.prefilling and self.running == 0
                   and not self.scoring and not self.set_aside):
                self._wake.wait()
            return not self._closed

    def _iterate(self) -> None:
        """End what should end, admit waiting requests, score a prompt, run a step."""
        ended = self._drop_cancelled()
        scoring = self._next_scoring()
        admitting = None
        if self.mirror is not None:  # the followers learn what happens before it does
            self._compact()
            with self._wake:
                admitting = list(self.waiting)[:self._admissible()]
            self.mirror.publish(ended, [(s.id, s.request) for s in admitting], [job[:2] for job in scoring])
        self._admit(None if admitting is None else len(admitting))
        self._score(scoring)
        if self.running:
            try:
                self.speculation.step(self) if self.speculation is not None else self._step()
            except Exception as error:  # noqa: BLE001 - the step's requests fail, the engine goes on
                if self.mirror is not None:  # the other processes ran this step too: no one-sided recovery
                    raise
                self._step_failed(error)

    def _next_scoring(self) -> list[tuple[list[int], int, Future]]:
        """The oldest scoring whose asker still waits (one per iteration: a queue of them holds the
        running rows back by one prompt's forward per token at most)."""
        with self._wake:
            while self.scoring:
                job = self.scoring.popleft()
                if job[2].set_running_or_notify_cancel():
                    return [job]
        return []

    def _score(self, jobs) -> None:
        for prompt, top, future in jobs:
            try:
                future.set_result(score_prompt(self.model, prompt, top))
            except Exception as error:  # noqa: BLE001 - that request fails (its own cache: nothing else lost)
                if self.mirror is not None:  # the other processes ran it too: no one-sided recovery
                    raise
                future.set_exception(error)

    def _step_failed(self, error: Exception) -> None:
        """A step raised: its rows (every running one) end with the error. A step of padding rows then
        checks that the engine can go on; if that raises too, the engine stops."""
        message = _describe(error)
        log.warning("a step failed; its %d requests end with the error: %s", self.running, message,
                    exc_info=error)
        self._inflight = None
        for b, row in enumerate(self.rows):
            if row is not None:
                self._free(b, "error", message)
        self._restore_cache()
        n = self.bucket(1)
        self._run_step(np.full(n, self.pad, np.int32), np.zeros(n, np.int32), np.full(n, self.context, np.int32))

    def _request_failed(self, stream: Stream, error: Exception) -> None:
        """Prefilling `stream` or giving it its row raised: that request ends with the error."""
        if self.mirror is not None:  # the other processes must fail it alike: stop instead
            raise error
        message = _describe(error)
        log.warning("request %d failed: %s", stream.id, message, exc_info=error)
        for p in [p for p in self.prefilling if p.stream is stream]:
            self._drop_prefill(p)
        slot = next((b for b, row in enumerate(self.rows) if row is not None and row.stream is stream), None)
        if slot is not None:
            self._free(slot, "error", message)
        elif stream.finish_reason is None:
            self._end(stream, "error", message)
        self._restore_cache()

    def _restore_cache(self) -> None:
        """After a failed call: if it took the pool with it (a donated buffer), the running rows and
        prompts have lost their keys and values, so they end too, and the engine starts a new pool."""
        if not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.pool.layers)):
            return
        lost = "the KV cache was lost with a failed request"
        for b, row in enumerate(self.rows):
            if row is not None:
                self._free(b, "error", lost)
        while self.prefilling:
            p = self.prefilling.popleft()
            self._end(p.stream, "error", lost)
        while self.set_aside:
            self._end(self.set_aside.popleft()[0], "error", lost)
        self._inflight = None
        self.pool = self._new_pool()
        self.table = self.pool.new_table(self.max_batch)
        self._tables.clear()

    def _stop_failed(self, error: Exception) -> None:
        """The engine cannot go on: every request ends with the error, and `on_failure` is told."""
        self.failure = _describe(error)
        log.error("the serving engine stopped: %s", self.failure, exc_info=error)
        self._fail_all(self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def _fail_all(self, error: str | None) -> None:
        reason = "cancelled" if error is None else "error"
        for b, row in enumerate(self.rows):
            if row is not None:
                self._free(b, reason, error)
        while self.prefilling:
            p = self.prefilling.popleft()
            self.pool.release(p.table[0])
            self._end(p.stream, reason, error)
        while self.set_aside:
            self._end(self.set_aside.popleft()[0], reason, error)
        with self._wake:
            self._closed = True
            while self.waiting:
                self._end(self.waiting.popleft(), reason, error)
            while self.scoring:
                future = self.scoring.popleft()[2]
                if future.set_running_or_notify_cancel():
                    future.set_exception(self._closed_error())

    def _drop_cancelled(self) -> list[tuple[int, str]]:
        """End the requests that were cancelled, ran past their timeout, or whose reader stalled;
        (stream id, reason) of those that held a row or were prefilling."""
        now = time.perf_counter()
        ended = self._end_started(lambda stream, running: self._ending(stream, now, running))
        with self._wake:
            kept = deque()
            for s in self.waiting:
                if reason := self._ending(s, now):
                    self._end(s, reason)
                else:
                    kept.append(s)
            self.waiting = kept
        return ended

    def _end_started(self, reason_of) -> list[tuple[int, str]]:
        """End each running or prefilling request for which reason_of(stream, running) gives a
        reason; (stream id, reason) of each."""
        ended = []
        for b, row in enumerate(self.rows):
            if row is not None and (reason := reason_of(row.stream, True)):
                ended.append((row.stream.id, reason))
                self._free(b, reason)
        for p in list(self.prefilling):
            if reason := reason_of(p.stream, False):
                ended.append((p.stream.id, reason))
                self._drop_prefill(p)
                self._end(p.stream, reason)
        for entry in list(self.set_aside):
            if reason := reason_of(entry[0], entry[2] is not None):
                ended.append((entry[0].id, reason))
                self.set_aside.remove(entry)
                self._end(entry[0], reason)
        return ended

    def _drop_prefill(self, p: Prefill) -> None:
        """A prompt leaves the prefill queue unfinished: its pages go back."""
        self.prefilling.remove(p)
        self.pool.release(p.table[0])

    def _ending(self, stream: Stream, now: float, running: bool = False) -> str | None:
        """Why `stream` should end now, if it should."""
        if stream.cancelled:
            return "cancelled"
        timeout = stream.request.timeout
        if timeout is not None and now - stream.submitted > timeout:
            return "timeout"
        if (running and self.reader_timeout is not None and stream.unread_since is not None
                and now - stream.unread_since > self.reader_timeout):
            return "reader_timeout"
        return None

    def _compact(self) -> None:
        """Move the live rows to the front slots (in order), so a step runs only the first ones (their
        pages move with them in the table; no slot moves)."""
        live = [b for b, row in enumerate(self.rows) if row is not None]
        for dst, src in enumerate(live):
            if src != dst:
                self.table[[dst, src]] = self.table[[src, dst]]
                self._tables.clear()
                self.rows[dst], self.rows[src] = self.rows[src], None
                self.pos[dst], self.key_start[dst] = self.pos[src], self.key_start[src]
                self.pos[src], self.key_start[src] = 0, self.context

    def _prompt_pages(self, prompt_tokens: int) -> int:
        """Pages a prompt of this many tokens takes when admitted (its real tokens' slots)."""
        prompt_len, key_start = prompt_geometry(prompt_tokens, self.context)
        return len(self.pool.pages_for(key_start, prompt_len))

    def _admissible(self) -> int:
        """How many waiting requests (after the rows set aside) the next admission starts: oldest
        first, while a slot is free and the pool has pages for the prompt."""
        free_rows = self.max_batch - self.running - len(self.prefilling)
        free_pages = self.pool.free
        for _, prompt, _ in self.set_aside:
            free_rows -= 1
            free_pages -= self._prompt_pages(len(prompt))
        count = 0
        for stream in self.waiting:
            free_pages -= self._prompt_pages(len(stream.request.prompt))
            if free_rows <= count or free_pages < 0:
                break
            count += 1
        return count

    def _admit(self, limit: int | None = None) -> None:
        """Oldest first, while rows are free and the pool has their prompts' pages: rows set aside
        and then waiting requests (at most `limit` of these) start prefilling; then up to
        prefill_per_step prompt tokens are prefilled, and each prompt that is all in takes a row."""
        self._compact()
        while self.set_aside and self.running + len(self.prefilling) < self.max_batch:
            if not self._start_prefill(*self.set_aside[0]):
                break
            self.set_aside.popleft()
        count = self._admissible() if limit is None else min(limit, self._admissible())
        for _ in range(count):
            with self._wake:
                if not self.waiting:
                    break
                stream = self.waiting.popleft()
            try:
                if not self._start_prefill(stream, stream.request.prompt):  # (_admissible counted its pages)
                    with self._wake:
                        self.waiting.appendleft(stream)
                    break
            except Exception as error:  # noqa: BLE001 - this request fails, not the engine
                self._request_failed(stream, error)
        budget = self.prefill_per_step
        while self.prefilling and budget > 0:
            p = self.prefilling[0]
            try:
                budget -= p.advance()
                if p.done:
                    self.prefilling.popleft()
                    self._start(self.running, p)
            except Exception as error:  # noqa: BLE001 - this request fails, not the engine
                self.pool.release(p.table[0])  # none left once its row holds them
                self._request_failed(p.stream, error)

    def _start_prefill(self, stream: Stream, prompt: list[int], resumed: "_Row | None" = None) -> bool:
        """Take the pages of `prompt`'s real tokens and queue its prefill: False (nothing done) if
        the pool has too few free."""
        prompt_len, key_start = prompt_geometry(len(prompt), self.context)
        table = self.pool.new_table(1)
        if not self.pool.take(table[0], key_start, prompt_len):
            return False
        try:
            self.prefilling.append(Prefill(self.model, stream, self.context, self.pool, table, prompt, resumed))
        except BaseException:
            self.pool.release(table[0])
            raise
        return True

    def _start(self, b: int, prefill: Prefill) -> None:
        """A prefilled request takes row b (the first free one) with its pages, and draws its first
        token (a resumed row goes on from the token it had drawn)."""
        stream, decoder, model = prefill.stream, prefill.decoder, self.model
        request = stream.request
        if prefill.resumed is None:
            sampler = Sampler(model.engine, request.sampling,
                              prompt_history([request.prompt], model.config.vocab_size, request.sampling))
            text = RowText(model.tokenizer, request.stop, request.special_tokens) if request.as_text else None
            constraint = None if request.grammar is None else Constraint(
                request.grammar, model.tokenizer, model.config.vocab_size, self.eos)
            row = _Row(stream, sampler, text, prefill.clock, constraint=constraint, order=next(self._admissions))
        else:
            row = prefill.resumed
        self.table[b], prefill.table[0] = prefill.table[0], NO_PAGE  # the row's pages now
        self._tables.clear()
        self.rows[b] = row
        self.pos[b], self.key_start[b] = decoder.pos[0], decoder.key_start[0]
        if prefill.resumed is not None:
            return
        token = self._draw(row, prefill.logits, 0)
        logprob = token_logprobs(prefill.logits, {0: token}, self._wanted([self.rows[b]]))
        self._emit(b, token, logprob.get(0))

    def bucket(self, live: int) -> int:
        """Rows a step runs for `live` live rows (compacted to the front): the smallest power of two
        that holds them, at most max_batch. Each bucket compiles once."""
        return min(self.max_batch, 1 << max(0, live - 1).bit_length())

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

    def _dispatch(self, tokens, rows: list, pos) -> "_Dispatched":
        """Start a decode step of slots [0, len(rows)) (rows: who is in each, None for padding)."""
        started = time.perf_counter()
        n = len(rows)
        logits = self._run_step(tokens, np.asarray(pos, np.int32), self.key_start[:n].copy())
        return _Dispatched(logits, list(rows), np.asarray(pos, np.int32), started)

    def _can_overlap(self, step: "_Dispatched") -> bool:
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
        logits, cache, pending = self.model.step(jnp.asarray(tokens), cache, pos, key_start, last_only=last_only,
                                                 phase=phase, residency=residency, defer=True)
        if pending is not None:
            corrected, cache = self.model.settle(pending, cache)
            logits = logits if corrected is None else corrected
        self.pool.layers, self._tables[n] = cache.layers, cache.table  # (the step took the cache, table and all)
        return logits

    def _grow(self, tokens: int) -> None:
        """Give every running row the pages for its next `tokens` slots (to the context's end),
        setting the newest requests aside while the pool is short (see the module docstring)."""
        while True:
            short = [b for b, row in enumerate(self.rows) if row is not None
                     and not self._take(b, int(self.pos[b]), min(int(self.pos[b]) + tokens, self.context))]
            if not short:
                return
            if not self._set_aside_newest(keep=short[0]):  # none left to set aside: it has the pool to itself
                self._flush(self.rows[short[0]])
                self._free(short[0], "length")

    def _take(self, b: int, first: int, end: int) -> bool:
        """Slot b's pages for slots [first, end), as PagePool.take (the device's tables sent again if
        it took any)."""
        free = self.pool.free
        taken = self.pool.take(self.table[b], first, end)
        if self.pool.free != free:
            self._tables.clear()
        return taken

    def _set_aside_newest(self, keep: int) -> bool:
        """Free the pages of the newest request other than row `keep`'s: a prompt being prefilled
        back to the front of the queue, else a running row set aside to be resumed. False if there is
        none."""
        if self.prefilling:
            p = self.prefilling[-1]
            self._drop_prefill(p)
            self.set_aside.appendleft((p.stream, p.prompt, p.resumed))
        else:
            others = [b for b, row in enumerate(self.rows) if row is not None and b != keep]
            if not others:
                return False
            b = max(others, key=lambda b: self.rows[b].order)
            row, self.rows[b] = self.rows[b], None
            self.pool.release(self.table[b])
            self._tables.clear()
            self.pos[b], self.key_start[b] = 0, self.context
            # the cache held its prompt and every token it drew but the last, which its next step takes
            self.set_aside.appendleft((row.stream, row.stream.request.prompt + row.history[:-1], row))
        self.preemptions += 1
        return True

    @staticmethod
    def _draw(row: _Row, logits, i: int) -> int:
        """Row `row`'s next token by its sampler, from row i of logits [n, V]; a constrained row's
        from the tokens its grammar allows (its matcher then advanced past the one drawn)."""
        if row.constraint is None:
            return int(np.asarray(row.sampler(row_jit(logits, np.int32(i))))[0])
        token = int(np.asarray(row.sampler(masked_row(logits, np.int32(i), row.constraint.allowed())))[0])
        row.constraint.advance(token)
        return token

    def _draw_or_end(self, row: _Row, logits, i: int) -> int | None:
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
    def _flush(row: _Row) -> None:
        """What a finishing row still holds back: text, and logprobs of tokens whose text is out."""
        tail = row.text.flush() if row.text is not None else ""
        if tail or row.logprobs:
            row.put(tail)

    def _free(self, b: int, reason: str, error: str | None = None) -> None:
        row, self.rows[b] = self.rows[b], None
        self.pos[b], self.key_start[b] = 0, self.context
        self.pool.release(self.table[b])
        self._tables.clear()
        self._end(row.stream, reason, error)

    def _end(self, stream: Stream, reason: str, error: str | None = None) -> None:
        stream._finish(reason, error)
        if self.observer is not None:
            self.observer.finished(stream)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
