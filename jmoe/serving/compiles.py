"""Counting XLA compilations in this process (what /metrics, the no-recompile checks and the
benchmarks' timed windows read)."""

from __future__ import annotations

import contextlib
import threading

import jax

from jmoe.errors import JmoeError


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


class CompiledInTimedWindow(JmoeError):
    """Something compiled while a benchmark timed: its figure would hold the compile."""


@contextlib.contextmanager
def no_compiles(what: str):
    """A benchmark's timed window: raises CompiledInTimedWindow at its end if anything compiled (or
    was read from the persistent cache) inside it, so a shape left unwarmed fails the run instead of
    slowing its figure."""
    before = CompileCounter.count()
    yield
    compiled = CompileCounter.count() - before
    if compiled:
        raise CompiledInTimedWindow(f"{compiled} compilation(s) in the timed window of {what}: warm every shape "
                                    "it times first")


__all__ = ["CompileCounter", "CompiledInTimedWindow", "no_compiles"]
