"""`jmoe serve` as a process: SIGTERM and SIGINT each stop it while a request runs (started
with SIGINT ignored, as a shell starts a background job): the request is drained (it ends as it
would have), and the process exits with 128 + the signal well within the drain bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from jmoe.launch import free_port

DRAIN = 10.0  # --drain-timeout: the bound a stop takes at most (plus the process's own exit)
ROUNDS = [signal.SIGTERM, signal.SIGINT]
# `python -c IGNORING_SIGINT ARGS`: jmoe ARGS, started with SIGINT ignored (as a shell starts "cmd &")
IGNORING_SIGINT = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "from jmoe.cli import main; sys.exit(main(sys.argv[1:]))")


def start_server(model, cache, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", IGNORING_SIGINT, "serve", str(model), "--port", str(port), "--max-batch", "1",
         "--max-seq-len", "64", "--dtype", "float32", "--drain-timeout", str(DRAIN)],
        env=dict(os.environ, JMOE_COMPILATION_CACHE=str(cache)), stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert server.poll() is None, "the server exited while starting"
        try:
            httpx.get(f"{base}/health", timeout=2)
            return server, base
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)


def test_sigterm_and_sigint_stop_a_server_with_a_running_request(short_converted, tmp_path):
    compile_cache = tmp_path / "xla"  # shared by the rounds' servers: only the first one compiles its steps
    for i, sig in enumerate(ROUNDS):
        log_path = tmp_path / f"server{i}.log"
        with open(log_path, "w") as log:
            server, base = start_server(short_converted, compile_cache, log)
        try:
            body = dict(prompt="The quick brown fox", max_tokens=40, temperature=0, stream=True)
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                events = response.iter_lines()
                assert next(events).startswith("data: ")  # the request is running
                server.send_signal(sig)
                signalled = time.monotonic()
                rest = [line for line in events if line]
            code = server.wait(timeout=DRAIN + 60)
            took = time.monotonic() - signalled
        finally:
            if server.poll() is None:
                server.kill()
        log = log_path.read_text()
        assert code == 128 + sig, log[-2000:]
        assert took < DRAIN, f"round {i}: {took:.1f} s to stop"
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert "Traceback" not in log and '"POST /v1/completions" 200' in log
