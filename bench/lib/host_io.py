"""Count what the host waits for and dispatches, independently of jmoe's own counters.

`install()` routes every jitted call through JAX's Python dispatch path (the C++ fast path would
execute without passing through Python) and counts, until `uninstall()`:

- reads: device-to-host reads the host blocks on (`np.asarray`, `np.array`, `jax.device_get`,
  `int()`, `.tolist()` ... on a jax array whose value is not cached on the host yet; numpy reads a
  CPU array through the buffer protocol, so `np.asarray` / `np.array` are counted where called);
- waits: `block_until_ready` on arrays (a blocking wait without a transfer);
- executions: compiled executables run (every jitted call, every eager op);
- transfers / transfer_bytes: host-to-device transfers of host values (numpy arrays and Python
  scalars passed to `jax.device_put`, `jnp.asarray` or a jitted function).

It patches JAX internals (jax 0.10 and 0.11), so it is for benchmarks and tests only, never for
the library. Dispatch through Python is slower: time in a clean process, count in this one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

import jax
import numpy as np
from jax._src import array as jax_array
from jax._src import pjit
from jax._src.interpreters import pxla


@dataclass
class Counts:
    reads: int = 0
    waits: int = 0
    executions: int = 0
    transfers: int = 0
    transfer_bytes: int = 0

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def per(self, n: int) -> dict:
        return {f.name: getattr(self, f.name) / max(n, 1) for f in fields(self)}


_counts = Counts()
_lock = threading.Lock()
_saved: dict | None = None
_inside = threading.local()


def counts() -> Counts:
    """A snapshot of the counts since install()."""
    with _lock:
        return Counts(**{f.name: getattr(_counts, f.name) for f in fields(_counts)})


def _bump(name: str, n: int = 1) -> None:
    with _lock:
        setattr(_counts, name, getattr(_counts, name) + n)


def install() -> None:
    """Start counting (idempotent). Clears JAX's dispatch caches so calls compiled earlier go
    through the counted path too (they recompile once)."""
    global _saved
    if _saved is not None:
        return
    value_prop = jax_array.ArrayImpl._value
    block = jax_array.ArrayImpl.block_until_ready
    execute = pxla.ExecuteReplicated.__call__
    shard_args = pxla.shard_args
    batched_block = jax_array.xc.batched_block_until_ready
    _saved = dict(asarray=np.asarray, array=np.array, value=value_prop, block=block, execute=execute, shard_args=shard_args,
                  fastpath=pjit._get_fastpath_data, batched_block=batched_block)

    def value(self):
        if self._npy_value is None and not getattr(_inside, "asarray", False):
            _bump("reads")
        return value_prop.fget(self)

    def reading(convert):
        # numpy reads a CPU array through the buffer protocol, without _value: count it here
        def converted(obj, *args, **kw):
            if not isinstance(obj, jax_array.ArrayImpl):
                return convert(obj, *args, **kw)
            if obj._npy_value is None:
                _bump("reads")
            _inside.asarray = True
            try:
                return convert(obj, *args, **kw)
            finally:
                _inside.asarray = False
        return converted

    def block_until_ready(self):
        _bump("waits")
        return block(self)

    def batched_block_until_ready(arrays):
        _bump("waits", len(arrays))
        return batched_block(arrays)

    def call(self, *args):
        _bump("executions")
        return execute(self, *args)

    def counted_shard_args(shardings, layouts, copy_semantics, args, *rest, **kw):
        for arg in args:
            if isinstance(arg, (np.ndarray, np.generic, int, float, bool, complex)):
                _bump("transfers")
                _bump("transfer_bytes", int(np.asarray(arg).nbytes))
        return shard_args(shardings, layouts, copy_semantics, args, *rest, **kw)

    np.asarray, np.array = reading(np.asarray), reading(np.array)
    jax_array.ArrayImpl._value = property(value)
    jax_array.ArrayImpl.block_until_ready = block_until_ready
    jax_array.xc.batched_block_until_ready = batched_block_until_ready
    pxla.ExecuteReplicated.__call__ = call
    pxla.shard_args = counted_shard_args
    pjit._get_fastpath_data = lambda *a, **k: None
    jax.clear_caches()


def uninstall() -> None:
    """Stop counting and restore JAX's fast dispatch."""
    global _saved
    if _saved is None:
        return
    np.asarray, np.array = _saved["asarray"], _saved["array"]
    jax_array.ArrayImpl._value = _saved["value"]
    jax_array.ArrayImpl.block_until_ready = _saved["block"]
    jax_array.xc.batched_block_until_ready = _saved["batched_block"]
    pxla.ExecuteReplicated.__call__ = _saved["execute"]
    pxla.shard_args = _saved["shard_args"]
    pjit._get_fastpath_data = _saved["fastpath"]
    _saved = None
    jax.clear_caches()


__all__ = ["Counts", "counts", "install", "uninstall"]
