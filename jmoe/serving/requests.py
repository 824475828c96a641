"""What a client hands the serving engine and gets back: a Request, the Stream of its output (with
each token's TokenLogprob when asked for), and the errors submit raises."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from jmoe.decoding.sampling import SamplingOptions

# "reader_timeout": cut off because its reader left its output unread for reader_timeout seconds
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "reader_timeout", "error")


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
    special_tokens: bool = False  # its text keeps special tokens (a harmony chat answer's markers)


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
