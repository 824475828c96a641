"""The CPU threads jmoe computes with: the process's affinity within its cgroup's CPU quota, or
JMOE_THREADS / --threads, applied before the CPU backend sizes its pool (jmoe/runtime/threads.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from jmoe.errors import InputError, JmoeError
from jmoe.runtime import threads
from tests.conftest import ROOT


def _cgroup(tmp_path, files: dict[str, str], membership: str = "0::/\n"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return threads.cgroup_cpu_limit(tmp_path, tmp_path / "self-cgroup")


def test_cgroup_quota_is_read_v2_and_v1(tmp_path):
    # v2: the process's own group first (a container's 2.5 CPUs round up to 3), the root's when it has none
    assert _cgroup(tmp_path / "a", {"jobs/x/cpu.max": "250000 100000\n", "cpu.max": "max 100000\n"},
                   "0::/jobs/x\n") == 3
    assert _cgroup(tmp_path / "b", {"cpu.max": "100000 100000\n"}, "0::/elsewhere\n") == 1
    assert _cgroup(tmp_path / "c", {"cpu.max": "max 100000\n"}) is None
    # v1: cfs quota over period; -1 is no limit
    assert _cgroup(tmp_path / "d", {"cpu,cpuacct/cpu.cfs_quota_us": "400000\n",
                                    "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}) == 4
    assert _cgroup(tmp_path / "e", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}) is None
    assert _cgroup(tmp_path / "f", {}) is None


def test_requested_threads_come_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    assert threads.requested_threads() == threads.usable_cpus() <= len(os.sched_getaffinity(0))
    assert threads.requested_threads(3) == 3
    monkeypatch.setenv(threads.THREADS_ENV, "5")
    assert threads.requested_threads() == 5
    for bad in ("two", "0", "-1", "1.5"):
        monkeypatch.setenv(threads.THREADS_ENV, bad)
        with pytest.raises(InputError, match=threads.THREADS_ENV):
            threads.requested_threads()
    for bad in (0, -2, True, 2.0):
        with pytest.raises(InputError, match="threads"):
            threads.requested_threads(bad)


def test_a_smaller_count_after_the_backend_started_is_refused(monkeypatch, caplog):
    import jax.numpy as jnp

    jnp.ones(2).block_until_ready()  # this process's backend has started
    cpus = len(os.sched_getaffinity(0))
    assert threads.limit_threads(cpus + 4) == cpus  # no more than the process may use, and nothing changes
    if cpus > 1:
        with pytest.raises(JmoeError, match=threads.THREADS_ENV):
            threads.limit_threads(1)
        # load's own call leaves the running pool as it is, and says so when JMOE_THREADS asked for less
        monkeypatch.setenv(threads.THREADS_ENV, "1")
        with caplog.at_level(logging.WARNING, logger="jmoe"):
            threads.limit_threads_if_not_started()
        assert "JMOE_THREADS=1 is not applied" in caplog.text
    assert len(os.sched_getaffinity(0)) == cpus


def test_load_and_the_cli_pin_the_process_before_the_backend_starts(short_converted):
    """JMOE_THREADS (load) and --threads (the CLI) narrow every thread's affinity before the backend
    starts, so XLA's pool (which the native kernels share) is sized to it; the model still generates."""
    code = ("import os, threading, jmoe\n"
            f"m = jmoe.load({str(short_converted)!r})\n"
            "assert len(jmoe.generate(m, [5, 17, 99], max_new_tokens=3)) == 3\n"
            "print(sorted({len(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}))\n")
    env = dict(os.environ, JMOE_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[1]"

    code = ("import os, sys\nfrom jmoe.cli import main\n"
            f"rc = main(['generate', {str(short_converted)!r}, 'hi', '--max-new-tokens', '2', '--threads', '1'])\n"
            "print(rc, len(os.sched_getaffinity(0)))\n")
    env = {k: v for k, v in os.environ.items() if k != threads.THREADS_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0 1"
