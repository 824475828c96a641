"""How many CPU threads jmoe computes with: the cores this process may use, or as many as asked.

XLA's CPU client sizes its thread pool, which the native kernels share, from the process's CPU
affinity when the backend starts. It does not read a cgroup's CPU quota, so in a container given
4 CPUs of a 64-core host it would start 64 threads that the quota then throttles (jax#27028).
`limit_threads` narrows the affinity before the backend starts: to `count`, to `JMOE_THREADS`, or
by default to the quota. After the backend has started the pool's size is fixed.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from jmoe import validate
from jmoe.errors import InputError, JmoeError

THREADS_ENV = "JMOE_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """CPUs this process's cgroup quota allows (quota / period, rounded up), or None when unlimited.

    cgroup v2: `cpu.max` ("max 100000" or "<quota> <period>") in this process's group, else the root's;
    cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us (quota -1: unlimited)."""
    candidates = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            hierarchy, _, path = line.split(":", 2)
            if hierarchy == "0":
                candidates.append(root / path.lstrip("/") / "cpu.max")
    except (OSError, ValueError):
        pass
    candidates.append(root / "cpu.max")
    for path in candidates:
        try:
            quota, period = path.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    for group in ("cpu,cpuacct", "cpu"):
        try:
            quota = int((root / group / "cpu.cfs_quota_us").read_text())
            period = int((root / group / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 else max(1, math.ceil(quota / period))
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity), no more than its cgroup quota allows."""
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return cpus if limit is None else min(cpus, limit)


def requested_threads(count: int | None = None) -> int:
    """`count`, else JMOE_THREADS, else usable_cpus(); a clear error for anything but a positive integer."""
    if count is None:
        text = os.environ.get(THREADS_ENV)
        if text is None:
            return usable_cpus()
        try:
            count = int(text)
        except ValueError:
            raise InputError(f"{THREADS_ENV} must be a positive integer, got {text!r}") from None
        return validate.integer(THREADS_ENV, count, minimum=1)
    return validate.integer("threads", count, minimum=1)


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def limit_threads(count: int | None = None) -> int:
    """Compute with `count` threads (None: JMOE_THREADS, else the usable CPUs): every thread of this
    process is pinned to that many of the CPUs it may use now (more than those cannot be had), so the
    CPU backend, when it starts, sizes its pool to match. Returns the thread count in effect.

    Raises InputError for a count that is not a positive integer, and JmoeError where the backend has
    already started with another count (call this, or set JMOE_THREADS, before the first computation)."""
    count = requested_threads(count)
    allowed = sorted(os.sched_getaffinity(0))
    if count >= len(allowed):
        return len(allowed)
    if _backend_started():
        raise JmoeError(f"the CPU backend has started with {len(allowed)} threads; ask for {count} before the "
                        f"first computation ({THREADS_ENV}={count}, or jmoe's --threads)")
    keep = set(allowed[:count])
    for task in os.listdir("/proc/self/task"):  # sched_setaffinity pins one thread: pin them all
        try:
            os.sched_setaffinity(int(task), keep)
        except OSError:  # a thread that ended meanwhile
            pass
    return count


def limit_threads_if_not_started() -> None:
    """load's default: limit_threads() where the backend has not started yet; after that, as it is."""
    if not _backend_started():
        limit_threads()
        return
    count = requested_threads()  # a malformed JMOE_THREADS is still an error
    running = len(os.sched_getaffinity(0))
    if THREADS_ENV in os.environ and count < running:
        logging.getLogger("jmoe").warning("%s=%d is not applied: the CPU backend had started with %d threads before "
                                          "jmoe.load (set it before the first computation)", THREADS_ENV, count,
                                          running)


__all__ = ["THREADS_ENV", "cgroup_cpu_limit", "usable_cpus", "requested_threads", "limit_threads",
           "limit_threads_if_not_started"]
