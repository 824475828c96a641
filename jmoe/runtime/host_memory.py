"""Host-memory primitives: aligned buffers, reads from the page cache into them, and the process's RSS.

XLA:CPU takes a numpy array without copying it when its data is 64-byte aligned (jax.device_put;
jnp.asarray copies), so buffers made here can be filled in place and handed to jax as they are.
Reading a file with preadv copies from the page cache straight into such a buffer and, unlike
touching a memory map, adds nothing to the process's resident set but the buffer itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from pathlib import Path

import jax
import numpy as np

ALIGN = 64  # XLA:CPU's minimum alignment for taking a host buffer without a copy


def aligned_empty(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def is_aligned(array: np.ndarray, align: int = ALIGN) -> bool:
    return array.ctypes.data % align == 0


def read_into(fd: int, offset: int, buffers: list[np.ndarray]) -> None:
    """Fill `buffers` (C-contiguous, writable) from consecutive bytes of `fd` starting at `offset`."""
    views = [memoryview(b.reshape(-1).view(np.uint8)) for b in buffers]
    want = sum(v.nbytes for v in views)
    got = os.preadv(fd, views, offset)
    while got < want:  # a short read (signals, huge requests): go on where it stopped
        done, rest = got, []
        for v in views:
            if done >= v.nbytes:
                done -= v.nbytes
                continue
            rest.append(v[done:])
            done = 0
        views = rest
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            raise EOFError(f"file ended {want - got} bytes early")
        got += n


def release_pages(region: np.memmap, start: int, nbytes: int) -> None:
    """Drop this process's mapping of a read-only file range (the page cache keeps the data, so
    the next read maps it again); the range is widened to whole pages."""
    base = getattr(region, "_mmap", None)
    if base is None or not hasattr(base, "madvise") or nbytes <= 0:
        return
    page = mmap.PAGESIZE
    lo = start // page * page
    hi = min(len(base), -(-(start + nbytes) // page) * page)
    base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).
    Compiling a step leaves tens of megabytes freed but held by the allocator, which otherwise
    stay in the process's resident set for as long as it runs."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


# glibc's mallopt parameters, and where its dynamic thresholds settle on a 64-bit machine (the mmap
# threshold grows to DEFAULT_MMAP_THRESHOLD_MAX as large blocks are freed, the trim threshold to twice it)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_SETTLED_MMAP_THRESHOLD = 32 << 20
_SETTLED_TRIM_THRESHOLD = 2 * _SETTLED_MMAP_THRESHOLD
_LOADING_TRIM_THRESHOLD = 4 << 20
_USER_TUNABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


@contextlib.contextmanager
def heap_trimmed_while_loading():
    """Inside (a load), each thread's heap gives its free top back as it frees (also a decorator).

    A load's reader threads (the dense restore's, the expert store's) each leave the top of their
    malloc arena free but resident, tens of MiB each: glibc trims a thread arena's top only on a
    free in it once the top passes the trim threshold, which its dynamic mmap threshold raises to
    64 MiB, and malloc_trim never trims those tops. So inside the trim threshold is 4 MiB; after, the
    thresholds stay where glibc's dynamic ones settle (mmap 32 MiB, trim 64 MiB), so prefill and
    decode allocate as they did once warm. Nothing where malloc is not glibc's, or where the user
    set glibc's own tunables."""
    mallopt = _mallopt()
    if mallopt is None or any(name in os.environ for name in _USER_TUNABLES):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _SETTLED_MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _LOADING_TRIM_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_TRIM_THRESHOLD, _SETTLED_TRIM_THRESHOLD)


@functools.cache
def _mallopt():
    try:
        f = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    f.argtypes, f.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return f


def device_is_host(device) -> bool:
    """Whether `device`'s memory is the host's own (XLA:CPU): a "transfer" is then a memcpy."""
    return device.platform == "cpu"


def to_device_uncopied(array: np.ndarray, device) -> jax.Array:
    """A jax array of `array` on `device`; on the CPU it aliases `array` (64-byte aligned) instead of copying."""
    return jax.device_put(array, device)


def process_memory() -> dict[str, int]:
    """This process's resident memory in bytes from /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile);
    empty where there is no /proc."""
    out = {}
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def available_memory() -> int | None:
    """Bytes the kernel says new allocations can get without swapping (MemAvailable), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
