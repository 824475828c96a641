"""Start a jmoe command as N local processes of one jax.distributed job, for testing on one machine.

    python -m jmoe.launch -n 2 [--devices-per-process 2] [--port P] -- jmoe generate MODEL --mesh ep=4 ...

Each process gets JMOE_COORDINATOR (127.0.0.1:P), JMOE_NUM_PROCESSES, JMOE_PROCESS_ID and
JMOE_LOCAL_DEVICES; `jmoe ...` runs as this Python's `-m jmoe.cli`, anything else as given. The
launcher waits for all of them; when one fails it stops the rest and exits with the failure's
status (the first to fail), else 0. SIGINT (Ctrl-C) or SIGTERM is forwarded to every process once
(they run in their own process group, so a terminal's Ctrl-C reaches them only through the
launcher); those still running STOP_GRACE_SECONDS later are killed, and the launcher exits with
128 + the signal, or with the status of a process that ended otherwise (137: it had to be killed).
The processes never outlive the launcher: on Linux each dies with it (PR_SET_PDEATHSIG), even when
the launcher is killed. On several hosts, start the processes yourself with
--coordinator/--num-processes/--process-id (see the README).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jmoe.job_env import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

GRACE_SECONDS = 10.0  # how long the others get to stop by themselves after one failed
STOP_GRACE_SECONDS = 30.0  # how long the processes get to stop after a forwarded signal (past serve's drain)
KILLED_REPORT_SECONDS = 5.0  # a killed process still there this long after: reported (the kernel holds it)
# `python -c DIE_WITH_PARENT PID CMD...` runs CMD, killed when process PID (the launcher) dies, however
# it dies: prctl(PR_SET_PDEATHSIG = 1) survives exec. A wrapper rather than a preexec_fn, since
# Python code between fork and exec is unsafe in a process with threads (jax's, when launch() is
# called in one).
DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                   "os.getppid() == int(sys.argv[1]) or os._exit(1); "  # the launcher died before prctl
                   "os.execvp(sys.argv[2], sys.argv[2:])")


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, parent pid, ...); None where
    there is none (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str:
    """What the kernel says process `pid` is doing ("S (sleeping) in do_epoll_wait"): where a hung
    stop is stuck. "" where /proc cannot tell (not Linux, or the process is gone)."""
    fields = proc_stat(pid)
    try:
        with open(f"/proc/{pid}/wchan") as wchan:
            waiting = wchan.read().strip()
    except OSError:
        fields = None
    if not fields:
        return ""
    state = fields[0]
    names = {"R": "running", "S": "sleeping", "D": "uninterruptible", "Z": "ended, not yet reaped", "T": "stopped"}
    return f"{state} ({names.get(state, '?')})" + (f" in {waiting}" if waiting not in ("", "0") else "")


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to stderr: where a process that does not
    stop is waiting (the launcher, and each jmoe command, register it)."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # stderr is no file (captured, as in a test): nowhere to print
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(cmd: list[str]) -> list[str]:
    return [sys.executable, "-m", "jmoe.cli", *cmd[1:]] if cmd[0] == "jmoe" else cmd


def dying_with_this_process(cmd: list[str]) -> list[str]:
    """`cmd`, killed when this process dies (on Linux; elsewhere `cmd` as it is)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *cmd]


class _Forwarder:
    """Passes each SIGINT and SIGTERM the launcher gets on to the processes, noting the first and when."""

    def __init__(self, children: list):
        self.children = children
        self.signal: int | None = None
        self.at: float | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
            self._previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _forward(self, sig, frame) -> None:
        if self.signal is None:
            self.signal, self.at = sig, time.monotonic()
        for c in self.children:
            if c.poll() is None:
                c.send_signal(sig)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def launch(cmd: list[str], processes: int, devices_per_process: int | None = None, port: int | None = None,
           poll_seconds: float = 0.1) -> int:
    """Run `cmd` as `processes` processes; the exit status of the job (see the module docstring)."""
    port = port or free_port()
    children: list[subprocess.Popen] = []
    forwarder = _Forwarder(children)
    try:
        for i in range(processes):
            if forwarder.signal is not None:  # stopped while starting: start no more
                break
            env = dict(os.environ, **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                                      ENV_PROCESS_ID: str(i)})
            if devices_per_process:
                env[ENV_LOCAL_DEVICES] = str(devices_per_process)
            children.append(subprocess.Popen(dying_with_this_process(command_line(cmd)), env=env, process_group=0))
        status = _wait(children, forwarder, poll_seconds)
    finally:
        forwarder.restore()
        for c in children:  # none outlives the launcher
            if c.poll() is None:
                c.kill()
                c.wait()
    return status if status >= 0 else 128 - status  # killed by a signal: 128 + its number


def _wait(children: list, forwarder: _Forwarder, poll_seconds: float) -> int:
    """Wait for every process, killing them all GRACE_SECONDS after one failed or STOP_GRACE_SECONDS
    after a forwarded signal; the job's status (negative: killed by that signal)."""
    failed_at, status, killed_at = None, 0, None
    while any(c.poll() is None for c in children):
        for c in children:
            code = c.poll()
            if code not in (None, 0) and failed_at is None:
                failed_at, status = time.monotonic(), code
        now = time.monotonic()
        if ((failed_at is not None and forwarder.signal is None and now - failed_at > GRACE_SECONDS)
                or (forwarder.signal is not None and now - forwarder.at > STOP_GRACE_SECONDS)):
            if killed_at is None:  # say which did not stop, and what each was doing
                killed_at = now
                _report_running(children, lambda state: "did not stop in time; killing it "
                                                        f"(it was {state or 'running'})")
            elif now - killed_at > KILLED_REPORT_SECONDS:  # the kernel has not ended it yet: say why, once
                killed_at = float("inf")
                _report_running(children, lambda state: f"has not ended {KILLED_REPORT_SECONDS:g} s after SIGKILL: "
                                                        f"{state or 'unknown state'}")
            for c in children:
                if c.poll() is None:
                    c.kill()
        time.sleep(poll_seconds)
    if forwarder.signal is not None:  # each process should have stopped with the signal's status
        expected = 128 + forwarder.signal
        return next((c.returncode for c in children if c.returncode not in (0, expected, -forwarder.signal)),
                    expected)
    if status == 0:
        status = next((c.returncode for c in children if c.returncode != 0), 0)
    return status


def _report_running(children: list, says) -> None:
    """One stderr line per process still running: `says(its process_state)`."""
    for i, c in enumerate(children):
        if c.poll() is None:
            print(f"jmoe.launch: process {i} (pid {c.pid}) {says(process_state(c.pid))}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jmoe.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--processes", type=int, required=True, help="how many processes")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="CPU devices each process gets (XLA:CPU gives one otherwise)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. jmoe generate ...")
    args = parser.parse_args(argv)
    dump_stacks_on_sigusr1()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("give the command to run after --")
    if args.processes < 1:
        parser.error("-n must be at least 1")
    return launch(cmd, args.processes, args.devices_per_process, args.port)


if __name__ == "__main__":
    sys.exit(main())
