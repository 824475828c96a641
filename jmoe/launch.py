"""Start a jmoe command as N local processes of one jax.distributed job, for testing on one machine.

    python -m jmoe.launch -n 2 [--devices-per-process 2] [--port P] -- jmoe generate MODEL --mesh ep=4 ...

Each process gets JMOE_COORDINATOR (127.0.0.1:P), JMOE_NUM_PROCESSES, JMOE_PROCESS_ID and
JMOE_LOCAL_DEVICES; `jmoe ...` runs as this Python's `-m jmoe.cli`, anything else as given. The
launcher waits for all of them; when one fails it stops the rest and exits with the failure's
status (the first to fail), else 0. Ctrl-C stops them all. On several hosts, start the processes
yourself with --coordinator/--num-processes/--process-id (see the README).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from jmoe.distributed.processes import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

GRACE_SECONDS = 10.0  # how long the others get to stop by themselves after one failed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(cmd: list[str]) -> list[str]:
    return [sys.executable, "-m", "jmoe.cli", *cmd[1:]] if cmd[0] == "jmoe" else cmd


def launch(cmd: list[str], processes: int, devices_per_process: int | None = None, port: int | None = None,
           poll_seconds: float = 0.1) -> int:
    """Run `cmd` as `processes` processes; the exit status of the job (see the module docstring)."""
    port = port or free_port()
    children = []
    for i in range(processes):
        env = dict(os.environ, **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                                  ENV_PROCESS_ID: str(i)})
        if devices_per_process:
            env[ENV_LOCAL_DEVICES] = str(devices_per_process)
        children.append(subprocess.Popen(command_line(cmd), env=env))
    failed_at, status = None, 0
    try:
        while any(c.poll() is None for c in children):
            for c in children:
                code = c.poll()
                if code not in (None, 0) and failed_at is None:
                    failed_at, status = time.monotonic(), code
            if failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
                for c in children:
                    if c.poll() is None:
                        c.kill()
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGINT)
        for c in children:
            try:
                c.wait(GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                c.kill()
        return 130
    if status == 0:
        status = next((c.returncode for c in children if c.returncode != 0), 0)
    return status if status >= 0 else 128 - status  # killed by a signal: 128 + its number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jmoe.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--processes", type=int, required=True, help="how many processes")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="CPU devices each process gets (XLA:CPU gives one otherwise)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. jmoe generate ...")
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("give the command to run after --")
    if args.processes < 1:
        parser.error("-n must be at least 1")
    return launch(cmd, args.processes, args.devices_per_process, args.port)


if __name__ == "__main__":
    sys.exit(main())
