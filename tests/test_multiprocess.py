"""Several local processes as one jax.distributed job (loopback only): the tokens of one process
from generate and from a served job, fail-stop when a process dies, and the launcher's exit codes,
signal forwarding and its processes dying with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jmoe
from jmoe.decoding.evaluate import forward
from jmoe.distributed.processes import PEER_LOST
from jmoe.launch import STOP_GRACE_SECONDS, command_line, free_port, launch, proc_stat, process_state
from jmoe.runtime.loader import memory_plan

# jobs of CPU processes: on a GPU machine the default devices are the GPU's
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU devices only")

PROMPT = "The Python standard library"
SEQ = 256
SERVE_SEQ = 64  # the served job's context: its warm-up compiles a prefill per power of two below it
JOB_SECONDS = 240  # bound on one whole job (start-up, compile, generation)


def generate_command(model, *extra, tokens=24):
    return ["jmoe", "generate", str(model), PROMPT, "--max-new-tokens", str(tokens), "--max-seq-len", str(SEQ),
            "--dtype", "float32", *extra]


def run_job(cmd, processes=2, devices=2):
    return subprocess.run([sys.executable, "-m", "jmoe.launch", "-n", str(processes), "--devices-per-process",
                           str(devices), "--", *cmd], capture_output=True, text=True, timeout=JOB_SECONDS)


@pytest.fixture(scope="module")
def one_process_text(short_converted):
    return one_process_output(short_converted)


def one_process_output(path) -> str:
    """What `jmoe generate` prints for generate_command's prompt, from one process."""
    model = jmoe.load(path, compute_dtype="float32", max_seq_len=SEQ)
    return PROMPT + jmoe.generate(model, PROMPT, max_new_tokens=24) + "\n"


def test_two_processes_resident_give_one_process_tokens(short_converted, one_process_text):
    job = run_job(generate_command(short_converted, "--mesh", "ep=4"))
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout == one_process_text  # printed once, by process 0; gloo's lines go to stderr


def test_two_processes_offloaded_under_a_per_device_budget(tiny_converted):
    """(The whole tiny model: a third of a device's share of a 2-layer model's experts leaves nothing to evict.)"""
    plan = memory_plan(tiny_converted, compute_dtype="float32", max_seq_len=SEQ, policy="lru")
    budget = sum(v for k, v in plan.items() if k != "all_experts") + plan["all_experts"] // 4 // 3
    job = run_job(generate_command(tiny_converted, "--mesh", "ep=4", "--policy", "lru", "--device-budget",
                                   str(budget), "--stats"))
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout == one_process_output(tiny_converted)
    stats = job.stderr[job.stderr.index("{"):]
    assert '"transfers": 0,' not in stats and '"evictions": 0,' not in stats  # it did offload


def test_killing_a_process_stops_the_other_with_a_clear_message(short_converted):
    port = free_port()
    cmd = command_line(generate_command(short_converted, "--mesh", "ep=4", tokens=2000) + ["--max-seq-len", "4096"])
    procs = []
    for i in range(2):
        env = dict(os.environ, JMOE_COORDINATOR=f"127.0.0.1:{port}", JMOE_NUM_PROCESSES="2", JMOE_PROCESS_ID=str(i),
                   JMOE_LOCAL_DEVICES="2", JMOE_PEER_TIMEOUT="3")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        seen, deadline = "", time.monotonic() + JOB_SECONDS
        while PROMPT not in seen:  # generation has begun: the prompt is printed first
            assert time.monotonic() < deadline and procs[0].poll() is None, "the job did not start"
            seen += procs[0].stdout.read(1)
        procs[1].kill()
        killed = time.monotonic()
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - killed
        err = procs[0].stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert code == PEER_LOST, err[-2000:]
    assert "process 1 of this 2-process job stopped answering" in err
    assert took < 30


def test_launcher_propagates_the_first_failure(capfd):
    fail_one = [sys.executable, "-c", "import os, sys; sys.exit(5 if os.environ['JMOE_PROCESS_ID'] == '1' else 0)"]
    assert launch(fail_one, 2) == 5
    assert launch([sys.executable, "-c", "pass"], 3) == 0
    # a process that hangs after another failed is stopped after the grace period
    hang_one = [sys.executable, "-c",
                "import os, sys, time; sys.exit(7) if os.environ['JMOE_PROCESS_ID'] == '0' else time.sleep(600)"]
    started = time.monotonic()
    assert launch(hang_one, 2) == 7
    assert time.monotonic() - started < 60
    # and the launcher says which one it killed, and what it was doing
    assert re.search(r"process 1 \(pid \d+\) did not stop in time; killing it \(it was S \(sleeping\)",
                     capfd.readouterr().err)


def ignoring_sigint(cmd: list[str]) -> list[str]:
    """`cmd` started with SIGINT ignored, as a shell starts a background job ("cmd &")."""
    return [sys.executable, "-c", ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                                   "os.execvp(sys.argv[1], sys.argv[1:])"), *cmd]


# a job's process: says its pid (in one write: the processes share the pipe), then waits to be stopped
WAITER = [sys.executable, "-c", ("import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                                 "os.write(1, b'%d\\n' % os.getpid()); time.sleep(120)")]

# WAITER as a jmoe command is: SIGUSR1 prints its Python stacks
STACK_WAITER = [sys.executable, "-c", ("import faulthandler, os, signal, time; "
                                       "faulthandler.register(signal.SIGUSR1, all_threads=True); "
                                       "os.write(1, b'%d\\n' % os.getpid()); time.sleep(120)")]


def start_launcher(cmd, processes=2, sigint_ignored=False):
    """The launcher running `cmd`, and the pids its processes printed (they have started)."""
    launcher = [sys.executable, "-m", "jmoe.launch", "-n", str(processes), "--", *cmd]
    job = subprocess.Popen(ignoring_sigint(launcher) if sigint_ignored else launcher, stdout=subprocess.PIPE, text=True)
    return job, [int(job.stdout.readline()) for _ in range(processes)]


def gone(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is None or fields[0] == "Z"  # a zombie has ended


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, the ones they started, and so on (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = proc_stat(int(entry))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def stop_report(pid: int, stderr: Path) -> str:
    """Where a job that does not stop is stuck: each of its processes' state, then their stderr with
    every thread's Python stack (SIGUSR1: the launcher and jmoe commands print them, see jmoe.launch)."""
    pids = [pid, *descendants(pid)]
    states = [f"pid {p}: {process_state(p) or 'gone'}" for p in pids]
    for p in pids:  # one at a time: the processes share the file, and would interleave their lines
        before = stderr.stat().st_size
        try:
            os.kill(p, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        size, deadline = before, time.monotonic() + 5
        while (size == before or stderr.stat().st_size != size) and time.monotonic() < deadline:
            size = stderr.stat().st_size  # until it has written its stacks and stopped writing
            time.sleep(0.25)
    return "\n".join(states) + "\n" + stderr.read_text()[-6000:]


def test_a_stuck_jobs_report_names_its_processes_and_their_stacks(tmp_path):
    """The diagnosis a stop that hangs would get: the launcher's and its processes' states and Python stacks."""
    with open(tmp_path / "stderr.txt", "w") as err:
        job = subprocess.Popen([sys.executable, "-m", "jmoe.launch", "-n", "2", "--", *STACK_WAITER],
                               stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            pids = [int(job.stdout.readline()) for _ in range(2)]
            report = stop_report(job.pid, tmp_path / "stderr.txt")
        finally:
            job.kill()
            job.wait()
    for pid in [job.pid, *pids]:
        assert f"pid {pid}: " in report and f"pid {pid}: gone" not in report, report
    assert report.count("most recent call first") >= 3, report  # faulthandler's stacks, one per process
    assert "in _wait" in report, report  # the launcher's own stack


def test_the_launcher_forwards_sigint_and_sigterm_even_started_with_sigint_ignored():
    for sig in [signal.SIGINT, signal.SIGTERM] * 2:
        job, pids = start_launcher(WAITER, sigint_ignored=True)
        job.send_signal(sig)
        try:
            assert job.wait(timeout=STOP_GRACE_SECONDS - 5) == 128 + sig  # stopped by the signal, not killed late
        finally:
            if job.poll() is None:
                job.kill()
        assert all(gone(pid) for pid in pids)


def test_a_jobs_processes_die_with_their_launcher():
    job, pids = start_launcher(WAITER)
    job.kill()  # no chance to stop them itself
    job.wait()
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a process outlived its launcher"
        time.sleep(0.05)


@pytest.mark.parametrize("env,message", [
    (dict(JMOE_COORDINATOR="127.0.0.1:1", JMOE_NUM_PROCESSES="2", JMOE_PROCESS_ID="5"), "process id 5 is not in 0..1"),
    (dict(JMOE_COORDINATOR="nowhere", JMOE_NUM_PROCESSES="2", JMOE_PROCESS_ID="0"), "not HOST:PORT"),
    (dict(JMOE_COORDINATOR="127.0.0.1:1", JMOE_NUM_PROCESSES="two", JMOE_PROCESS_ID="0"), "JMOE_NUM_PROCESSES"),
    (dict(JMOE_NUM_PROCESSES="2", JMOE_PROCESS_ID="1"), "--coordinator"),
])
def test_bad_process_options_are_refused(short_converted, env, message):
    bad = subprocess.run(command_line(["jmoe", "generate", str(short_converted), "x"]), env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr[-1000:]


def test_serve_as_two_processes_answers_like_generate(short_converted, tmp_path):
    """Process 0 takes the requests; process 1 replays its engine's decisions. Greedy answers equal
    generate's, a stream closed early ends on both, and SIGINT (the job started with SIGINT ignored,
    as in the background) stops both processes by themselves, together (exit 130: none had to be
    killed; neither waits in JAX's shutdown barrier for one that already left)."""
    import concurrent.futures
    import urllib.request

    import openai

    port = free_port()
    with open(tmp_path / "stderr.txt", "w") as err:  # a file: a pipe nobody reads could fill and block the job
        job = subprocess.Popen(ignoring_sigint([
            sys.executable, "-m", "jmoe.launch", "-n", "2", "--devices-per-process", "2", "--",
            *command_line(["jmoe", "serve", str(short_converted), "--mesh", "ep=4", "--port", str(port),
                           "--max-batch", "2", "--max-seq-len", str(SERVE_SEQ), "--dtype", "float32"])]),
            stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while True:
            assert job.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        name = api.models.list().data[0].id
        cut = api.completions.create(model=name, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
        for i, _ in enumerate(cut):
            if i == 2:
                break
        cut.close()  # ends on process 0 and, through the next iteration's decisions, on process 1
        prompts = [PROMPT, "def parse(self, text):", "12 + 35 =", "The Python standard library"]

        def ask(prompt):
            return api.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, prompts))
        echoed = api.completions.create(model=name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2).choices[0]
        job.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        try:
            code = job.wait(timeout=STOP_GRACE_SECONDS + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not stop within {STOP_GRACE_SECONDS + 30:g} s of SIGINT\n"
                        + stop_report(job.pid, tmp_path / "stderr.txt"))
        took = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            job.kill()
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=SERVE_SEQ)
    assert answers == [jmoe.generate(model, p, max_new_tokens=16) for p in prompts]
    # echo's prompt logprobs, scored by both processes at the same point: one process's log-softmax
    ids = model.tokenizer.encode(PROMPT)
    logits = np.asarray(forward(model, ids), np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    assert echoed.text == PROMPT and echoed.logprobs.token_logprobs[0] is None
    assert echoed.logprobs.token_logprobs[1:] == pytest.approx([logp[t, ids[t + 1]] for t in range(len(ids) - 1)],
                                                               abs=1e-4)
    assert code == 130, (tmp_path / "stderr.txt").read_text()[-2000:]
    assert took < 20, f"{took:.1f} s to stop"
