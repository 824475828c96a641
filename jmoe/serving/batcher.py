"""Continuous batching: one engine thread runs every request's decode steps together.

The engine owns a KV cache of `max_batch` rows ("slots") and one context length. Requests wait in
a bounded queue; between steps each free slot takes the oldest waiting request: its prompt is
prefilled alone (a one-row cache of the same length, in chunks, its length bucketed), and that row
is copied into the slot without touching the other rows. Every step then decodes one token for
every slot at once, each row at its own cache position (the Decoder's per-row positions): a
batched step reads each expert once for all the rows routed to it. A free slot's row is marked as
padding (its key start past its position), so it attends to nothing and routes to no expert.

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

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import validate
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.engine import MIN_PROMPT_BUCKET, PREFILL_CHUNK, bucket, new_cache
from jmoe.decoding.generation import RowText, stop_strings
from jmoe.decoding.sampling import ALL_FILTERS, HISTORY_DTYPE, Sampler, SamplingOptions, greedy_tokens, prompt_history
from jmoe.decoding.speculative import SpeculativeOptions, padded
from jmoe.errors import InputError
from jmoe.runtime.stats import RequestClock
from jmoe.serving.structured import Constraint, masked_row

# "reader_timeout": cut off because its reader left its output unread for reader_timeout seconds
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "reader_timeout", "error")
DEFAULT_ENGINE_DRAFT_K = 3  # drafted tokens per cycle when speculative k is "auto" (a fixed k: few shapes)
MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's bound)

log = logging.getLogger("jmoe.serving")


class QueueFull(Exception):
    """The waiting queue is at its bound: the caller should retry later."""


class EngineClosed(RuntimeError):
    """The engine takes no more requests: it was closed, or it failed (see BatchEngine.failure)."""


@dataclass
class Request:
    """What one request asks for; `prompt` is token ids."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop: list[str] = field(default_factory=list)
    as_text: bool = True  # pieces are text deltas (else token ids)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    timeout: float | None = None  # seconds from submit after which the request ends ("timeout")
    grammar: str | None = None  # structured output: what its answer must follow (jmoe/serving/structured.py)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (its logits before temperature and filtering) and
    the `top` most likely tokens with theirs, most likely first. A prompt's first token, which
    nothing predicts, has None for both."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None


class Stream:
    """A submitted request's output: iterate for its pieces (text deltas or token ids); afterwards
    `finish_reason` and `usage` say how it ended. cancel() frees its slot at the next step."""

    _ids = itertools.count()

    def __init__(self, request: Request, id: int | None = None):
        self.request = request
        self.id = next(Stream._ids) if id is None else id  # what process 0 and its followers call it
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.usage = dict(prompt_tokens=len(request.prompt), completion_tokens=0)
        self.submitted = self._last_token_at = time.perf_counter()
        self.unread_since: float | None = None  # when the oldest piece the reader has not taken was put
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._events: queue.Queue = queue.Queue()
        self._drained = False  # the reader has seen the end
        self._cancelled = threading.Event()
        self._wake_reader = None  # called (on the engine thread) after each event: an async reader's wake-up

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator:
        return (piece for piece, _ in self.with_logprobs())

    def with_logprobs(self) -> Iterator[tuple]:
        """The pieces, each with the TokenLogprobs of the tokens it holds (empty unless the request
        asked for logprobs)."""
        while not self._drained:
            kind, value, logprobs = self._events.get()
            if kind == "done":
                self._drained = True
                return
            self._taken()
            yield value, logprobs

    async def with_logprobs_async(self):
        """with_logprobs() for an asyncio reader: waits on the event loop, holding no thread."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass

        self._wake_reader = wake
        try:
            while not self._drained:
                try:
                    kind, value, logprobs = self._events.get_nowait()
                except queue.Empty:
                    ready.clear()
                    if self._events.empty():  # else an event came between the two looks
                        await ready.wait()
                    continue
                if kind == "done":
                    self._drained = True
                    return
                self._taken()
                yield value, logprobs
        finally:
            self._wake_reader = None

    def _taken(self) -> None:
        """The reader took a piece: what is left was put before now, so it has waited unread since
        then at the latest."""
        self.unread_since = time.perf_counter() if self._events.qsize() else None

    def text(self) -> str:
        """Everything (text requests): blocks until the request ends."""
        return "".join(self)

    def _put(self, piece, logprobs: list | None = None) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        if self.unread_since is None:
            self.unread_since = now
        self._events.put(("piece", piece, logprobs or []))
        self._wake()

    def _wake(self) -> None:
        wake = self._wake_reader
        if wake is not None:
            wake()

    def _since_last_token(self) -> float:
        """Seconds since this stream's previous token (or since it was submitted); resets the mark."""
        now = time.perf_counter()
        last, self._last_token_at = self._last_token_at, now
        return now - last

    def _finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error, self.finished_at = reason, error, time.perf_counter()
        self._events.put(("done", reason, []))
        self._wake()


class _Replayed(Stream):
    """A follower's copy of one of process 0's requests: nobody reads it, so it keeps nothing."""

    def _put(self, piece, logprobs: list | None = None) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def _finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error, self.finished_at = reason, error, time.perf_counter()


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


class _Prefill:
    """A waiting request's prompt on its way in: prefilled alone, a chunk per advance() (the chunks
    Decoder.prefill takes), so a long prompt shares the engine's time with the running rows."""

    def __init__(self, model, stream: Stream, context: int):
        prompt = stream.request.prompt
        prompt_len = bucket(len(prompt), MIN_PROMPT_BUCKET, context)
        if prompt_len + 1 > context:  # no room after bucket padding: no padding then
            prompt_len = len(prompt)
        self.stream = stream
        self.clock = RequestClock()  # time to first token counts the prefill
        self.decoder = Decoder(model, [prompt], prompt_len, context)
        self._chunks = self.decoder.prefill_chunks()
        self.logits = None

    @property
    def done(self) -> bool:
        return self.decoder.pos[0] >= self.decoder.prompt_len

    def advance(self) -> int:
        """Prefill the next chunk: its tokens."""
        taken, self.logits = next(self._chunks)
        return taken


def _insert_row(cache, row_cache, slot):
    """The batch cache with row `slot` replaced by a one-row cache's row."""
    return jax.tree.map(lambda big, one: jax.lax.dynamic_update_index_in_dim(big, one[0], slot, 0), cache, row_cache)


_insert_row_jit = jax.jit(_insert_row, donate_argnums=0)


def _move_row(cache, src, dst):
    """The batch cache with row `dst` replaced by row `src` (compacting live rows to the front)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_update_index_in_dim(
        a, jax.lax.dynamic_index_in_dim(a, src, 0, keepdims=False), dst, 0), cache)


_move_row_jit = jax.jit(_move_row, donate_argnums=0)
# the first n rows of the batch cache, and the batch cache with them written back
_take_rows_jit = jax.jit(lambda cache, n: jax.tree.map(lambda a: a[:n], cache), static_argnums=1)
_put_rows_jit = jax.jit(lambda cache, rows: jax.tree.map(
    lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, 0, 0), cache, rows), donate_argnums=0)
# one row of the step's logits [1, V]; the row index traced, so no row compiles a slice of its own
_row_jit = jax.jit(lambda logits, b: jax.lax.dynamic_slice_in_dim(logits, b, 1))
# every row's greedy token in one call: what the sampler draws for a greedy request without a
# repetition, presence or frequency penalty or logit bias (those off leave the logits exactly as they are)
_greedy_jit = jax.jit(greedy_tokens)


@jax.jit
def _logprobs_jit(logits, tokens):
    """Per row: the log-probability of tokens[b] and the MAX_TOP_LOGPROBS most likely tokens with theirs."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    top, ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logprobs.shape[-1]))
    return chosen, top, ids


def token_logprobs(logits, tokens: dict[int, int], wanted: dict[int, int]) -> dict[int, TokenLogprob]:
    """TokenLogprobs of the rows in `wanted` (row -> alternatives) for their drawn `tokens`, from a
    step's logits [n, V]: one device call for every row."""
    if not wanted:
        return {}
    drawn = np.zeros(logits.shape[0], np.int32)
    for b, token in tokens.items():
        drawn[b] = token
    chosen, top, ids = (np.asarray(a) for a in _logprobs_jit(logits, drawn))
    return {b: TokenLogprob(tokens[b], float(chosen[b]), [(int(i), float(v)) for i, v in zip(ids[b, :k], top[b, :k])])
            for b, k in wanted.items()}


class CompileCounter:
    """XLA compilations in this process since it started counting: jax's backend-compile events and
    its persistent cache's hits (an executable read from the cache was traced and lowered all the
    same, on the request's path; without them a warm cache would hide every recompile)."""

    EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")
    _count = 0
    _registered = False
    _lock = threading.Lock()

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event in cls.EVENTS:
            with cls._lock:
                cls._count += 1

    @classmethod
    def start(cls) -> None:
        """Count from now on (an engine starts it before its warm-up, so /metrics counts every
        compile since start-up, scraped or not)."""
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True

    @classmethod
    def count(cls) -> int:
        cls.start()
        with cls._lock:
            return cls._count


class BatchEngine:
    """Runs submitted requests in one continuously batched decode loop on its own thread.

    model: what jmoe.load returned. max_batch: slots (rows of the KV cache). max_waiting: the
    waiting queue's bound (submit raises QueueFull past it). context: tokens per slot (prompt and
    output; default the model's max_seq_len). reader_timeout: seconds a running request's output
    may wait unread before the request is cut off (default: no bound). A request's own `timeout`
    ends it that long after submit, wherever it is. speculative: as jmoe.generate's (a draft tier or
    dict(draft=..., k=...)); the engine drafts a fixed k per cycle (default 3 for "auto").

    If the engine cannot go on (see the module docstring), `failure` says why and `on_failure`, when
    set, is called with it on the engine thread.
    """

    def __init__(self, model, *, max_batch: int = 8, max_waiting: int = 64, context: int | None = None,
                 prefill_per_step: int = PREFILL_CHUNK, reader_timeout: float | None = None, speculative=None,
                 warm_up: bool = False, observer=None, mirror=None, follower: bool = False):
        """mirror (jmoe/serving/mirror.py): under jax.distributed, process 0's engine publishes each
        iteration's decisions through it and the other processes' engines (follower=True: no loop
        thread; call follow()) replay them."""
        self.model = model
        self.mirror = mirror
        self.max_batch = validate.integer("max_batch", max_batch, minimum=1)
        self.max_waiting = validate.integer("max_waiting", max_waiting, minimum=0)
        context = model.max_seq_len if context is None else validate.integer("context", context, minimum=2)
        self.context = min(context, model.max_seq_len)
        model.check_batch_fits(self.max_batch, self.context)
        cfg = model.config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos = set(model.eos_token_ids)
        self.cache = self._new_cache()
        self.pos = np.zeros(self.max_batch, np.int32)
        self.key_start = np.full(self.max_batch, self.context, np.int32)  # free: padding throughout
        self.rows: list[_Row | None] = [None] * self.max_batch
        self.waiting: deque[Stream] = deque()
        self.prefilling: deque[_Prefill] = deque()  # admitted, prompt not all in yet (oldest first)
        # prompt tokens prefilled between two decode steps, at most (at least one chunk): a long
        # prompt arriving does not stall the running streams for its whole prefill
        self.prefill_per_step = validate.integer("prefill_per_step", prefill_per_step, minimum=1)
        # a running request whose reader has left output untaken this long is cut off ("reader_timeout"):
        # a client that stops reading does not hold its slot until max_tokens
        self.reader_timeout = None if reader_timeout is None else validate.real(
            "reader_timeout", reader_timeout, minimum=0.0)
        # speculative decoding (jmoe/decoding/speculative.py): a cycle drafts k tokens per row with
        # the model's low-precision copy and verifies them in one pass; greedy rows keep the prefix
        # the target agrees with, other rows draw one token from the verification's first position
        options = SpeculativeOptions.parse(speculative)
        self.draft = model.draft(options.draft) if options else None
        self.draft_k = (options.k or DEFAULT_ENGINE_DRAFT_K) if options else 0
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
        self._thread = threading.Thread(target=self._loop, name="jmoe-batch-engine", daemon=True)
        if not follower:
            self._thread.start()

    def _new_cache(self):
        """An empty batch cache, committed to the device as every later cache (a jitted step's output)
        is: the first insert then compiles what every later one runs."""
        model = self.model
        return jax.device_put(new_cache(model.config, self.max_batch, self.context, model.compute_dtype),
                              model.placement.replicated)

    def warm_up(self) -> None:
        """Compile, before any request, what requests will run: a step at every batch bucket (all
        rows padding), a prefill at every prompt-length bucket, and the row copies between them."""
        prompt_len = MIN_PROMPT_BUCKET
        while prompt_len < self.context:
            decoder = Decoder(self.model, [[self.pad] * prompt_len], prompt_len, self.context)
            _greedy_jit(decoder.prefill())
            self.cache = _insert_row_jit(self.cache, decoder.cache, np.int32(0))
            prompt_len *= 2
        self.cache = _move_row_jit(self.cache, np.int32(0), np.int32(0))
        n = 1
        while True:
            logits = self._run_step(np.full(n, self.pad, np.int32), np.zeros(n, np.int32),
                                    np.full(n, self.context, np.int32))
            # the next step dispatched from this one's tokens still on the device (_step's overlap)
            self._run_step(_greedy_jit(logits), np.zeros(n, np.int32), np.full(n, self.context, np.int32))
            _row_jit(logits, np.int32(0))
            masked_row(logits, np.int32(0), np.zeros((1, -(-logits.shape[-1] // 32)), np.int32))  # a constrained row's
            _logprobs_jit(logits, np.zeros(n, np.int32))
            if self.draft is not None:
                self._run_step(np.full(n, self.pad, np.int32), np.zeros(n, np.int32),
                               np.full(n, self.context, np.int32), residency=self.draft)
                for width in sorted({2, padded(np.zeros((1, self.draft_k + 1)), self.context).shape[1]}):
                    verify = self._run_step(np.full((n, width), self.pad, np.int32), np.zeros(n, np.int32),
                                            np.full(n, self.context, np.int32), last_only=False, phase="verify")
                    _greedy_jit(verify)
                    _row_jit(verify[:, 0], np.int32(0))
                    _logprobs_jit(verify.reshape(-1, verify.shape[-1]), np.zeros(n * width, np.int32))
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
                sampler(_row_jit(logits, np.int32(0)))

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
                raise EngineClosed(f"the engine failed: {self.failure}" if self.failure else "the engine is closed")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already")
            self.waiting.append(stream)
            self._wake.notify()
        return stream

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

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
            if self.running:
                self._speculative_step() if self.draft is not None else self._step()
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
            while not self._closed and not self.waiting and not self.prefilling and self.running == 0:
                self._wake.wait()
            return not self._closed

    def _iterate(self) -> None:
        """End what should end, admit waiting requests, run a step."""
        ended = self._drop_cancelled()
        admitting = None
        if self.mirror is not None:  # the followers learn what happens before it does
            self._compact()
            with self._wake:
                admitting = list(self.waiting)[:max(0, self.max_batch - self.running - len(self.prefilling))]
            self.mirror.publish(ended, [(s.id, s.request) for s in admitting])
        self._admit(None if admitting is None else len(admitting))
        if self.running:
            try:
                self._speculative_step() if self.draft is not None else self._step()
            except Exception as error:  # noqa: BLE001 - the step's requests fail, the engine goes on
                if self.mirror is not None:  # the other processes ran this step too: no one-sided recovery
                    raise
                self._step_failed(error)

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
        self.prefilling = deque(p for p in self.prefilling if p.stream is not stream)
        slot = next((b for b, row in enumerate(self.rows) if row is not None and row.stream is stream), None)
        if slot is not None:
            self._free(slot, "error", message)
        elif stream.finish_reason is None:
            self._end(stream, "error", message)
        self._restore_cache()

    def _restore_cache(self) -> None:
        """After a failed call: if it took the batch cache with it (a donated buffer), the running rows
        have lost their keys and values, so they end too, and the engine starts a new cache."""
        if not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
            return
        for b, row in enumerate(self.rows):
            if row is not None:
                self._free(b, "error", "the batch cache was lost with a failed request")
        self._inflight = None
        self.cache = self._new_cache()

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
            self._end(self.prefilling.popleft().stream, reason, error)
        with self._wake:
            self._closed = True
            while self.waiting:
                self._end(self.waiting.popleft(), reason, error)

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
                self.prefilling.remove(p)
                self._end(p.stream, reason)
        return ended

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
        """Move the live rows to the front slots (in order), so a step runs only the first ones."""
        live = [b for b, row in enumerate(self.rows) if row is not None]
        for dst, src in enumerate(live):
            if src != dst:
                self.cache = _move_row_jit(self.cache, np.int32(src), np.int32(dst))
                self.rows[dst], self.rows[src] = self.rows[src], None
                self.pos[dst], self.key_start[dst] = self.pos[src], self.key_start[src]
                self.pos[src], self.key_start[src] = 0, self.context

    def _admit(self, limit: int | None = None) -> None:
        """Oldest first, while rows are free: waiting requests (at most `limit`) start prefilling;
        then up to prefill_per_step prompt tokens are prefilled, and each prompt that is all in
        takes a row."""
        self._compact()
        while self.running + len(self.prefilling) < self.max_batch and limit != 0:
            limit = None if limit is None else limit - 1
            with self._wake:
                if not self.waiting:
                    break
                stream = self.waiting.popleft()
            try:
                self.prefilling.append(_Prefill(self.model, stream, self.context))
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
                self._request_failed(p.stream, error)

    def _start(self, b: int, prefill: _Prefill) -> None:
        """A prefilled request takes row b (the first free one): its cache row copied in, its first token."""
        stream, decoder, model = prefill.stream, prefill.decoder, self.model
        request = stream.request
        sampler = Sampler(model.engine, request.sampling,
                          prompt_history([request.prompt], model.config.vocab_size, request.sampling))
        self.cache = _insert_row_jit(self.cache, decoder.cache, np.int32(b))
        self.pos[b], self.key_start[b] = decoder.pos[0], decoder.key_start[0]
        text = RowText(model.tokenizer, request.stop) if request.as_text else None
        constraint = None if request.grammar is None else Constraint(
            request.grammar, model.tokenizer, model.config.vocab_size, self.eos)
        self.rows[b] = _Row(stream, sampler, text, prefill.clock, constraint=constraint)
        token = self._draw(self.rows[b], prefill.logits, 0)
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
            n = self.bucket(self.running)
            rows = self.rows[:n]
            tokens = np.asarray([r.token if r is not None else self.pad for r in rows], np.int32)
            step = self._dispatch(tokens, rows, np.where([r is not None for r in rows], self.pos[:n], 0))
        rows = step.rows
        greedy = _greedy_jit(step.logits) if any(r is not None and r.plain_greedy for r in rows) else None
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
        return (self.draft is None and all(r.plain_greedy for r in live) and len(live) == self.running
                and all(a is b for a, b in zip(self.rows, step.rows))
                and bool((step.pos[[r is not None for r in step.rows]] + 1 < self.context).all()))

    @staticmethod
    def _wanted(rows) -> dict[int, int]:
        """Row -> alternatives, for the rows whose requests ask for logprobs."""
        return {b: row.stream.request.logprobs for b, row in enumerate(rows)
                if row is not None and row.stream.request.logprobs is not None}

    def _speculative_step(self) -> None:
        """One speculative cycle over the first bucket(live) slots: the draft decodes k tokens per
        row, the target verifies them with each row's last token in one pass, and each row emits
        what it keeps (a plain step when no row is plain greedy or there is no room to draft)."""
        self._compact()
        n = self.bucket(self.running)
        rows = self.rows[:n]
        live = np.asarray([r is not None for r in rows])
        greedy = [b for b, r in enumerate(rows) if r is not None and r.plain_greedy]
        pos = np.where(live, self.pos[:n], 0).astype(np.int32)
        need = max(r.stream.request.max_tokens - r.generated for r in rows if r is not None)
        k = min(self.draft_k, self.context - 1 - int(pos[live].max()), need - 1)
        if not greedy or k <= 0:
            return self._step()
        started = time.perf_counter()
        key_start = self.key_start[:n].copy()
        last = np.asarray([r.token if r is not None else self.pad for r in rows], np.int32)
        drafts = [last]
        for j in range(k):
            drafts.append(np.asarray(_greedy_jit(self._run_step(drafts[-1], pos + j, key_start, residency=self.draft)),
                                     np.int32))
        block = np.stack(drafts, axis=1)  # [n, k + 1]: each row's last token, then its drafts
        block = padded(block, self.context - int(pos.max()))
        verify = self._run_step(block, pos, key_start, last_only=False, phase="verify")  # [n, W, V]
        picks = np.asarray(_greedy_jit(verify))  # [n, W]
        self.steps += 1
        if self.observer is not None:
            self.observer.step(time.perf_counter() - started, self.running)
        emitted, accepted = {}, []
        for b, row in enumerate(rows):
            if row is None:
                continue
            if row.plain_greedy:
                kept = 0
                while kept < k and picks[b, kept] == block[b, kept + 1]:
                    kept += 1
                accepted.append(kept)
                emitted[b] = [int(t) for t in block[b, 1:kept + 1]] + [int(picks[b, kept])]
            elif (token := self._draw_or_end(row, verify[:, 0], b)) is not None:
                emitted[b] = [token]
        self.model.stats.spec.count(k, np.asarray(accepted))
        width = verify.shape[1]
        flat = {b * width + j: t for b, tokens in emitted.items() for j, t in enumerate(tokens)}
        wanted = {b * width + j: k_top for b, k_top in self._wanted(rows).items() for j in range(len(emitted[b]))}
        logprobs = token_logprobs(verify.reshape(n * width, -1), flat, wanted)
        for b, tokens in emitted.items():
            for j, t in enumerate(tokens):
                if self.rows[b] is None:  # ended on an earlier token of its block
                    break
                self.pos[b] += 1
                self._emit(b, t, logprobs.get(b * width + j))

    def _run_step(self, tokens, pos, key_start, *, residency=None, last_only: bool = True, phase: str = "decode"):
        """The model's step over the first len(tokens) rows of the batch cache (taken out and written
        back when they are not all of it), settled: logits [n, V] (a decode step: tokens [n]), or
        [n, T, V] with last_only=False (tokens [n, T]). `residency`: the draft's experts."""
        n = len(tokens)
        cache = self.cache if n == self.max_batch else _take_rows_jit(self.cache, n)
        logits, cache, pending = self.model.step(jnp.asarray(tokens), cache, pos, key_start, last_only=last_only,
                                                 phase=phase, residency=residency, defer=True)
        if pending is not None:
            corrected, cache = self.model.settle(pending, cache)
            logits = logits if corrected is None else corrected
        self.cache = cache if n == self.max_batch else _put_rows_jit(self.cache, cache)
        return logits

    @staticmethod
    def _draw(row: _Row, logits, i: int) -> int:
        """Row `row`'s next token by its sampler, from row i of logits [n, V]; a constrained row's
        from the tokens its grammar allows (its matcher then advanced past the one drawn)."""
        if row.constraint is None:
            return int(np.asarray(row.sampler(_row_jit(logits, np.int32(i))))[0])
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
        self._end(row.stream, reason, error)

    def _end(self, stream: Stream, reason: str, error: str | None = None) -> None:
        stream._finish(reason, error)
        if self.observer is not None:
            self.observer.finished(stream)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
