"""How the serving engine ends requests (a mixin of BatchEngine, jmoe/serving/batcher.py): a
cancel, a timeout or a stalled reader; a request or a step that failed (that request or that
step's rows end, the engine goes on); and the engine stopping, which ends every request."""

from __future__ import annotations

import logging
import time
from collections import deque

import jax
import numpy as np

from jmoe.serving.kv_rows import Prefill
from jmoe.serving.requests import Stream

log = logging.getLogger("jmoe.serving")


class Endings:
    """BatchEngine's ends of requests and recovery from failures. Reads and writes the engine's
    slots, queues and pool; a stream ends only here (_end)."""

    def _step_failed(self, error: Exception) -> None:
        """A step raised: its rows (every running one) end with the error. A step of padding rows then
        checks that the engine can go on; if that raises too, the engine stops."""
        message = describe(error)
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
        message = describe(error)
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
        self.failure = describe(error)
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
            p.release()
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
        p.release()

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


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
