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

This module holds the engine's loop, its public calls and its warm-up; each of its jobs is a mixin
in a module of its own, reading and writing the engine's state: admission.py (slots, pages,
prefill), stepping.py (decode steps, token output), endings.py (cancels, timeouts, failures), and
speculation.py the speculative cycle.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import deque
from concurrent.futures import Future

import jax
import numpy as np

from jmoe import validate
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, PREFILL_CHUNK
from jmoe.decoding.generation import stop_strings
from jmoe.decoding.prefixes import PREFIX_BLOCK
from jmoe.decoding.sampling import ALL_FILTERS, HISTORY_DTYPE, Sampler, SamplingOptions
from jmoe.decoding.speculative import SpeculativeOptions
from jmoe.errors import InputError
from jmoe.serving.admission import Admission
from jmoe.serving.compiles import CompileCounter
from jmoe.serving.endings import Endings
from jmoe.serving.kv_rows import Prefill
from jmoe.serving.logits import MAX_TOP_LOGPROBS, greedy_jit, logprobs_jit, row_jit
from jmoe.serving.requests import EngineClosed, QueueFull, Request, Stream, _Replayed
from jmoe.serving.scoring import score_prompt, warm_up_scoring
from jmoe.serving.speculation import Speculation
from jmoe.serving.stepping import Dispatched, Row, Stepping
from jmoe.serving.structured import masked_row

log = logging.getLogger("jmoe.serving")


class BatchEngine(Admission, Stepping, Endings):
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
        use at each prompt-length bucket compiles it, holding the engine meanwhile). mirror
        (jmoe/serving/mirror.py): under jax.distributed, process 0's engine publishes each
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
        self.set_aside: deque[tuple[Stream, list[int], Row | None]] = deque()
        self.preemptions = 0
        self.pos = np.zeros(self.max_batch, np.int32)
        self.key_start = np.full(self.max_batch, self.context, np.int32)  # free: padding throughout
        self.rows: list[Row | None] = [None] * self.max_batch
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
        self._inflight: Dispatched | None = None  # a step dispatched ahead of reading the last one back
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

    def warm_up(self) -> None:
        """Compile, before any request, what requests will run: a step at every batch bucket (all
        rows padding), a prefill at every prompt-length bucket, and the page copies of kept prompt
        blocks (jmoe/serving/kv_prefixes.py)."""
        prompt_len = MIN_PROMPT_BUCKET
        while prompt_len < self.context:
            table = self.pool.new_table(1)
            self.pool.take(table[0], 0, max(prompt_len, PREFIX_BLOCK))
            decoder = Decoder(self.model, [[self.pad] * prompt_len], prompt_len, self.context, self.pool, table)
            greedy_jit(decoder.prefill())
            if prompt_len == MIN_PROMPT_BUCKET and self.prefixes is not None:
                self.pool.copy_page(int(table[0, 0]), int(table[0, 0]))
                self.pool.copy_slots(table[0], 1, int(table[0, 0]))
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
            sampler = Sampler(self.model.engine, sampling, np.zeros((1, vocab), HISTORY_DTYPE),
                              self.model.placement.commit_to)
            sampler(row_jit(logits, np.int32(0)))  # later draws take the arrays it returns: the same executable

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
