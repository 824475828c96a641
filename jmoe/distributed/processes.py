"""Several processes (and hosts) as one jax.distributed job, stopping together when one dies.

Every process runs the same program over a global mesh (SPMD): each loads and offloads only the
experts of its own devices' shards, and the host-side books (cache, policy) are kept identically
on every process, so every process makes the same decisions and issues the same collectives.

A process that dies would leave the others blocked in a collective until JAX's coordination
service aborts them with an internal error. A watchdog thread in each process instead publishes a
heartbeat in the coordinator's key-value store and watches the others': when one stops beating
(or the coordinator is gone), this process prints which one and exits with PEER_LOST.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import jax
import numpy as np

from jmoe import validate
from jmoe.errors import InputError
from jmoe.job_env import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PEER_TIMEOUT, ENV_PROCESS_ID

DEFAULT_PEER_TIMEOUT = 15.0
HEARTBEAT_INTERVAL = 0.5
PEER_LOST = 3  # exit status when another process of the job died
MAX_PROCESSES = 65536
_KEY = "jmoe/heartbeat/"
_DONE = "jmoe/done/"


def _env_int(name: str, value):
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise InputError(f"{name}={raw!r} is not a non-negative integer")
    return int(raw)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_devices: int | None = None, peer_timeout: float | None = None) -> bool:
    """Join a job of `num_processes` processes whose process 0 listens at `coordinator` (HOST:PORT).

    Unset arguments come from JMOE_COORDINATOR, JMOE_NUM_PROCESSES, JMOE_PROCESS_ID and
    JMOE_LOCAL_DEVICES (what `python -m jmoe.launch` sets). Returns False, doing nothing, when no
    coordinator is given (one process). Call it before anything else uses jax.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = _env_int(ENV_NUM_PROCESSES, num_processes)
    process_id = _env_int(ENV_PROCESS_ID, process_id)
    local_devices = _env_int(ENV_LOCAL_DEVICES, local_devices)
    if coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise InputError("--num-processes / --process-id need --coordinator HOST:PORT (process 0's address)")
        if local_devices:
            jax.config.update("jax_num_cpu_devices", local_devices)
        return False
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"coordinator {coordinator!r} is not HOST:PORT")
    if num_processes is None or process_id is None:
        raise InputError("a distributed run needs the number of processes and this process's id "
                         "(--num-processes, --process-id)")
    validate.integer("num_processes", num_processes, minimum=1, maximum=MAX_PROCESSES)
    if not 0 <= process_id < num_processes:
        raise InputError(f"process id {process_id} is not in 0..{num_processes - 1}")
    if local_devices:
        jax.config.update("jax_num_cpu_devices", local_devices)
    timeout = float(os.environ.get(ENV_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT)) if peer_timeout is None else peer_timeout
    # JAX's own heartbeat is the backstop: ours reports a lost peer first, in plain words. At exit
    # every process waits for the others (process 0 holds the key-value store the others read to the
    # end); bounded, so that a process that died first cannot hold the others for minutes.
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=max(30, int(4 * timeout)),
                               shutdown_timeout_seconds=max(10, int(2 * timeout)))
    if num_processes > 1:
        global _watchdog
        _watchdog = Watchdog(process_id, num_processes, timeout)
        _watchdog.start()
    return True


_watchdog: "Watchdog | None" = None


def fail_stop(error: BaseException) -> None:
    """This process of a job failed: exit now, naming the cause. When another process's death
    caused it (a collective broke), the watchdog confirms that within its timeout and reports it;
    otherwise the error is reported. Never returns: JAX's own shutdown would wait for the others."""
    if _watchdog is not None:
        deadline = time.monotonic() + _watchdog.timeout + 4 * HEARTBEAT_INTERVAL
        while time.monotonic() < deadline:  # the watchdog exits the process if a peer is gone
            time.sleep(0.1)
    print(f"jmoe: error: {first(error)}; stopping process {jax.process_index()} of the job", file=sys.stderr,
          flush=True)
    os._exit(1)


def native_stdout_to_stderr() -> None:
    """Send what native code prints on stdout (gloo announces each connection there) to stderr,
    keeping Python's sys.stdout on the real stdout: a job's output stays clean."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def process_id() -> int:
    """This process's id in its job (0 alone), known without starting jax's backend."""
    from jax._src.distributed import global_state

    return global_state.process_id if global_state.client is not None else 0


def is_main_process() -> bool:
    """Process 0 (the one that prints and takes requests); True without jax.distributed."""
    return jax.process_index() == 0


def agree(value: float) -> float:
    """Process 0's `value` on every process (a measured time or rate that steers a decision, so
    that every process decides alike); the value itself in a single process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float64(value)))


class Watchdog(threading.Thread):
    """Heartbeats through the coordinator; stops this process when another one stops (see above)."""

    def __init__(self, process_id: int, num_processes: int, timeout: float):
        super().__init__(name="jmoe-watchdog", daemon=True)
        from jax._src.distributed import global_state  # the job's key-value store client

        self.client = global_state.client
        self.process_id, self.num_processes, self.timeout = process_id, num_processes, timeout
        self.finished = False
        atexit.register(self.finish)

    def finish(self) -> None:
        """This process is done (a clean exit): the others stop expecting its heartbeat."""
        if not self.finished:
            self.finished = True
            try:
                self.client.key_value_set(f"{_DONE}{self.process_id}", "1", allow_overwrite=True)
            except Exception:  # the coordinator may have gone first
                pass

    def run(self) -> None:
        beat, seen, changed = 0, {}, {}
        while not self.finished:
            now = time.monotonic()
            try:
                self.client.key_value_set(f"{_KEY}{self.process_id}", str(beat), allow_overwrite=True)
                beats = dict(self.client.key_value_dir_get(_KEY))
                done = {k.rsplit("/", 1)[-1] for k, _ in self.client.key_value_dir_get(_DONE)}
            except Exception as e:
                if self.finished:
                    return
                self.stop(f"lost the coordinator (process 0) of this {self.num_processes}-process job: {first(e)}")
            beat += 1
            for other in range(self.num_processes):
                if other == self.process_id or str(other) in done:
                    continue
                value = beats.get(f"{_KEY}{other}")
                if value != seen.get(other):
                    seen[other], changed[other] = value, now
                elif now - changed.setdefault(other, now) > self.timeout:
                    self.stop(f"process {other} of this {self.num_processes}-process job stopped answering for "
                              f"{self.timeout:g} s (it died or was killed)")
            time.sleep(HEARTBEAT_INTERVAL)

    def stop(self, why: str) -> None:
        if self.finished:
            return
        print(f"jmoe: error: {why}; stopping process {self.process_id} too", file=sys.stderr, flush=True)
        os._exit(PEER_LOST)


def first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
