"""The OpenAI-compatible server (jmoe/serving/openai_api.py, run by jmoe/serving/server.py) on
127.0.0.1, called with the official `openai` client and with raw HTTP: answers equal
`jmoe.generate`'s, concurrent streams, cancels, a table of bad requests that each get a 4xx naming
the culprit, failing steps, hung-up clients, connection limits and the access log."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

import jmoe
from jmoe.serving import BatchEngine, requests, scoring
from jmoe.serving.compiles import CompileCounter
from jmoe.serving.openai_api import create_app
from jmoe.serving.responses import FINISH_REASONS
from jmoe.serving.validation import MAX_BODY_BYTES
from jmoe.serving.server import Server
from tests.serving_helpers import serving, start

PROMPTS = ["The quick brown fox", "def main():\n    ", "12 + 35 =", "Python is", "import os\nimport",
           "Beware of", "class Stack:", "7 * 8 ="]
NAME = "tiny"


@pytest.fixture(scope="module")
def model(short_converted):
    return jmoe.load(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=4)


@pytest.fixture(scope="module")
def served(model):
    """(base URL, engine, model): a server on an ephemeral port, stopped after the module."""
    engine = BatchEngine(model, max_batch=4, max_waiting=64, context=256, warm_up=True)
    with serving(engine, NAME) as base:
        yield base, engine, model


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)


def test_completions_and_chat_streamed_and_whole(served):
    base, engine, model = served
    c = client(base)
    alone = jmoe.generate(model, PROMPTS[2], max_new_tokens=16)
    whole = c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0)
    assert whole.choices[0].text == alone and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens == len(model.tokenizer.encode(PROMPTS[2]))
    chunks = list(c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == alone
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    messages = [{"role": "user", "content": "Hello"}]
    answer = c.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=12, temperature=0)
    streamed = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == answer.choices[0].message.content != ""
    assert answer.choices[0].message.role == "assistant"
    stop = alone[3:6]
    cut = c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == alone[:alone.index(stop)] and cut.choices[0].finish_reason == "stop"
    two = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0.9, seed=3, n=2)
    assert len(two.choices) == 2 and two.usage.completion_tokens == 16
    assert [m.id for m in c.models.list().data] == [NAME]
    raw = httpx.post(f"{base}/v1/completions", json=dict(model=NAME, prompt=PROMPTS[2], max_tokens=4, stream=True,
                                                        temperature=0), timeout=60).text
    assert raw.rstrip().endswith("data: [DONE]") and all(line.startswith("data: ") for line in raw.split("\n\n") if line)


def test_sixteen_concurrent_streams_each_get_their_own_text(served):
    base, engine, model = served
    prompts = PROMPTS * 2
    alone = {p: jmoe.generate(model, p, max_new_tokens=24) for p in PROMPTS}
    c = client(base)

    def one(prompt: str) -> str:
        stream = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in stream)

    one(PROMPTS[0])  # warm-up (already done if the tests before ran)
    before = CompileCounter.count()
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, prompts))
    assert texts == [alone[p] for p in prompts]
    assert CompileCounter.count() == before  # warmed up by the test before: nothing compiles on the request path
    assert engine.running == 0 and not engine.waiting


def test_closed_streams_free_their_slots(served):
    base, engine, _ = served
    c = client(base)
    streams = [c.completions.create(model=NAME, prompt=p, max_tokens=200, temperature=0, stream=True)
               for p in PROMPTS[:4]]
    for s in streams:
        next(iter(s))  # running
    for s in streams[:2]:
        s.close()  # the client goes away
    later = [c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0) for p in PROMPTS[4:6]]
    assert all(r.choices[0].text for r in later)
    for s in streams[2:]:
        s.close()
    deadline = time.monotonic() + 60
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.running == 0


def post(base: str, body, raw: bool = False) -> httpx.Response:
    content = body if raw else json.dumps(body)
    return httpx.post(f"{base}/v1/completions", content=content, headers={"content-type": "application/json"},
                      timeout=60)


OK = dict(model=NAME, prompt="Hi", max_tokens=2)
# (body changes or a raw body, the field the answer must name)
BAD = [
    ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 2**70}, "seed"),
    ({"n": 0}, "n"), ({"n": 10**6}, "n"), ({"n": "2"}, "n"), ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"stream_options": 3}, "stream_options"),
    ({"model": "gpt-9"}, "model"), ({"model": 7}, "model"), ({"prompt": ""}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": 42}, "prompt"), ({"prompt": [1, -5]}, "prompt"), ({"prompt": ["a", 5]}, "prompt[1]"),
    ({"prompt": []}, "prompt"), ({"prompt": [[1], []]}, "prompt[1]"), ({"prompt": [[1], [2**31]]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"), ({"prompt": [[1, 2], "x" * 3000]}, "prompt[1]"),
    # at most the engine's rows and queue (4 + 64) completions in all
    ({"prompt": ["a"] * 69}, "prompt"), ({"prompt": ["a"] * 9, "n": 8}, "prompt"),
    ({"prompt": [[1]] * 10**5}, "prompt"),
    ({"prompt": "x" * 3000}, "prompt"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"frequency_penalty": 10**400}, "frequency_penalty"),
    (b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "frequency_penalty": 1e999}', "frequency_penalty"),
    (b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "presence_penalty": -1e999}', "presence_penalty"),
    (b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "presence_penalty": NaN}', "presence_penalty"),
    # fields silently ignored before: unknown ones, and logit_bias / min_p out of range
    ({"temprature": 0.5}, "temprature"), ({"top_a": 0.1}, "top_a"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"), ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (b"{not json", "JSON"), (b"[1, 2]", "object"), (b"x" * (MAX_BODY_BYTES + 1), "body"),
    # past what the step holds, or what the server allows
    ({"top_k": 2**31}, "top_k"), ({"top_k": 10**6}, "top_k"), ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": 257}, "max_tokens"), ({"seed": 2**64}, "seed"), ({"logprobs": 10**9}, "logprobs"),
    ({"n": 10**30}, "n"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    # structured output: a format or schema that is not one
    ({"response_format": "json"}, "response_format"), ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format"),
    # not Unicode, or nested past what any request needs
    (b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "stop[0]"),
    (b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    (b'{"prompt": "x", "user": ' + b"[" * 40 + b"]" * 40 + b"}", "nested"),
]


@pytest.mark.parametrize("change, culprit", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_a_4xx_naming_the_culprit(served, change, culprit):
    base = served[0]
    response = post(base, change, raw=True) if isinstance(change, bytes) else post(base, {**OK, **change})
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert culprit in error["message"] or error["param"] == culprit
    assert error["type"] == "invalid_request_error"
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"  # still serving


def test_the_requests_that_killed_the_engine_leave_it_answering_alike(served):
    """Issue 30's cases (an int32 overflow in the step's top_k, a lone surrogate, deep nesting, an
    unbounded max_tokens): each a JSON 400, and the next greedy answer as before."""
    base, engine, model = served
    alone = jmoe.generate(model, PROMPTS[2], max_new_tokens=12)
    for body in (json.dumps({"prompt": "x", "max_tokens": 2, "top_k": 2147483648}).encode(),
                 b'{"prompt": "a\\ud800b", "max_tokens": 2}', b"[" * 100_000,
                 json.dumps({"prompt": "x", "max_tokens": 10**30}).encode()):
        response = post(base, body, raw=True)
        assert response.status_code == 400 and response.json()["error"]["message"]
        answer = client(base).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0)
        assert answer.choices[0].text == alone
    assert not engine.closed


def test_an_unexpected_error_is_a_json_500_and_one_log_record(served, monkeypatch, caplog):
    from jmoe.serving import validation

    def broken(*args, **kwargs):
        raise TypeError("an unexpected error")

    monkeypatch.setattr(validation, "encode", broken)
    response = post(served[0], OK)
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert "TypeError" in response.json()["error"]["message"]
    assert [r.exc_info[0] for r in caplog.records if r.levelno >= logging.ERROR] == [TypeError]
    monkeypatch.undo()
    assert post(served[0], OK).status_code == 200


def test_unknown_paths_and_methods_get_openai_errors(served):
    base = served[0]
    for response, status in ((httpx.get(f"{base}/v1/nothing", timeout=10), 404),
                             (httpx.get(f"{base}/v1/completions", timeout=10), 405)):
        assert response.status_code == status and response.json()["error"]["message"]


def test_a_failing_step_is_a_json_error_and_the_engine_goes_on(served, monkeypatch):
    """A step that raises (injected) ends the requests in it with an OpenAI-style 500, or an error
    event in a stream; the server keeps serving and the next greedy answer is unchanged."""
    base, engine, model = served
    alone = jmoe.generate(model, PROMPTS[2], max_new_tokens=12)
    real_step = model.step
    failures = []

    def step(tokens, cache, pos, key_start, **kwargs):
        live = (np.asarray(key_start) < engine.context).any()  # (not the engine's check with padding rows)
        if kwargs["phase"] == "decode" and live and len(failures) < 2:  # the next two decode steps fail
            failures.append(1)
            raise RuntimeError("injected step failure")
        return real_step(tokens, cache, pos, key_start, **kwargs)

    monkeypatch.setattr(model, "step", step)
    whole = post(base, dict(model=NAME, prompt=PROMPTS[0], max_tokens=8))
    error = whole.json()["error"]
    assert whole.status_code == 500 and error["type"] == "server_error" and "injected step failure" in error["message"]
    with pytest.raises(openai.APIError, match="injected step failure"):
        for _ in client(base).completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, stream=True):
            pass
    assert len(failures) == 2
    answer = client(base).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert answer.choices[0].text == alone
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok" and not engine.closed


def always_failing_decode(model, monkeypatch) -> None:
    real_step = model.step

    def step(*args, **kwargs):
        if kwargs["phase"] == "decode":
            raise RuntimeError("the device is gone")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(model, "step", step)


def test_an_engine_that_cannot_go_on_stops_the_server_with_status_1(model, monkeypatch):
    """Steps that keep failing (a padding step too): the request gets a JSON 500, /health 503, and
    `jmoe serve`'s server stops by itself with exit status 1, for a supervisor to restart it."""
    from starlette.testclient import TestClient

    from jmoe import cli
    from jmoe.launch import free_port

    always_failing_decode(model, monkeypatch)
    with BatchEngine(model, max_batch=1, context=64) as engine:
        stream = engine.submit(requests.Request([5, 6], max_tokens=4))
        stream.text()
        assert stream.finish_reason == "error"
        wait_for(lambda: engine.closed, what="the engine to stop")
        health = TestClient(create_app(engine, NAME)).get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the device is gone" in health.json()["error"]
    args = cli.build_parser().parse_args(["serve", "tiny", "--port", str(free_port()), "--max-batch", "1"])
    base, answers = f"http://127.0.0.1:{args.port}", []

    def answering() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def ask() -> None:
        wait_for(answering, what="the server")
        answers.append(post(base, dict(model=NAME, prompt="Hi", max_tokens=4)))

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    engine_options = dict(max_batch=1, max_waiting=4, reader_timeout=None, speculative=None, warm_up=False)
    assert cli.serve(args, model, engine_options, cli.serve_options(args)) == cli.ENGINE_FAILED
    asking.join(timeout=30)
    assert answers[0].status_code == 500 and "the device is gone" in answers[0].json()["error"]["message"]


class Gate:
    """Holds the engine's decode steps once `rows` rows are running, until opened (the model's step,
    patched), so that a test can act while requests are known to be running or waiting."""

    def __init__(self, engine, rows: int, monkeypatch):
        self.open = threading.Event()
        real_step = engine.model.step

        def step(*args, **kwargs):
            if kwargs["phase"] == "decode" and engine.running >= rows:
                assert self.open.wait(120), "the gate was never opened"
            return real_step(*args, **kwargs)

        monkeypatch.setattr(engine.model, "step", step)


def raw_request(base: str, body: dict) -> socket.socket:
    """A connection that has sent a completion request (the answer is left unread)."""
    host, port = base.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return conn


def read_json_response(conn: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the HTTP response on `conn` (which it closes)."""
    with conn, conn.makefile("rb") as reply:
        status = int(reply.readline().split()[1])
        headers = dict(line.decode().lower().split(":", 1) for line in iter(reply.readline, b"\r\n"))
        return status, json.loads(reply.read(int(headers["content-length"])))


def wait_for(condition, seconds: float = 60, what: str = "the condition") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_whole_requests_wait_without_threads_and_hung_up_ones_free_their_rows(served, monkeypatch):
    """Fifty whole (non-streamed) requests waiting on a held engine take no thread each; the clients
    of the four running ones hang up and their rows end as cancelled; the waiting ones then finish
    with what generate gives."""
    base, engine, model = served
    alone = jmoe.generate(model, PROMPTS[3], max_new_tokens=4)
    gate = Gate(engine, 4, monkeypatch)
    threads = threading.active_count()
    hung_up = [raw_request(base, dict(model=NAME, prompt=PROMPTS[0], max_tokens=200)) for _ in range(4)]
    wait_for(lambda: engine.running == 4, what="four running requests")
    waiting = [raw_request(base, dict(model=NAME, prompt=PROMPTS[3], max_tokens=4, temperature=0))
               for _ in range(46)]
    wait_for(lambda: len(engine.waiting) == 46, what="46 waiting requests")
    assert threading.active_count() <= threads + 2  # no thread per waiting request
    assert httpx.get(f"{base}/health", timeout=10).json()["waiting"] == 46  # the event loop is free
    running = [row.stream for row in engine.rows if row is not None]
    for conn in hung_up:
        conn.close()
    wait_for(lambda: all(s.cancelled for s in running), what="the hung-up requests' cancels")
    gate.open.set()
    answers = [read_json_response(conn) for conn in waiting]
    assert all(status == 200 and a["choices"][0]["text"] == alone for status, a in answers)
    assert [s.finish_reason for s in running] == ["cancelled"] * 4
    assert all(s.usage["completion_tokens"] < 200 for s in running)
    wait_for(lambda: engine.running == 0, what="every row free")


def test_every_finish_reason_of_the_engine_has_one_for_the_client():
    assert set(FINISH_REASONS) | {"error"} == set(requests.FINISH_REASONS)
    assert FINISH_REASONS["reader_timeout"] == "reader_timeout"  # a cut-off reader is not a natural end


def test_each_request_leaves_one_access_log_line_and_hang_ups_no_traceback(served, caplog):
    base = served[0]
    caplog.set_level(logging.INFO, logger="jmoe.access")
    prompt_tokens = post(base, dict(model=NAME, prompt=PROMPTS[2], max_tokens=5)).json()["usage"]["prompt_tokens"]
    stream = client(base).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()  # the client hangs up mid-stream

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "jmoe.access"]

    wait_for(lambda: len(lines()) >= 2, what="two access-log lines")
    whole, cut = lines()[:2]
    assert '"POST /v1/completions" 200 ' in whole and whole.endswith(f"tokens={prompt_tokens}+5")
    assert '"POST /v1/completions" 499 ' in cut
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an error was logged"


@pytest.fixture
def guarded(model):
    """A second server (its own small engine) with a short idle timeout and room for 4 connections."""
    engine = BatchEngine(model, max_batch=1, context=64)
    server = Server(create_app(engine, NAME), engine, port=0, idle_timeout=3.0, max_connections=4)
    thread = start(server)
    yield f"http://127.0.0.1:{server.port}"
    server.stop()
    thread.join(timeout=30)
    engine.close()


def test_silent_connections_are_closed_and_too_many_refused(guarded):
    silent = [socket.create_connection(("127.0.0.1", int(guarded.rsplit(":", 1)[1])), timeout=30) for _ in range(4)]
    busy = httpx.get(f"{guarded}/health", timeout=10)  # the fifth connection
    assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_error"

    def closed(conn) -> bool:
        return bool(select.select([conn], [], [], 0)[0]) and conn.recv(1) == b""

    wait_for(lambda: all(closed(c) for c in silent), seconds=30, what="the silent connections to be closed")
    for conn in silent:
        conn.close()
    assert httpx.get(f"{guarded}/health", timeout=10).json()["status"] == "ok"


def test_logit_bias_and_min_p_change_the_answer(served):
    """logit_bias bans what greedy decoding would pick (the issue's case: banned newlines still came
    out) and forces a token; min_p narrows sampling; each in a batch beside a plain greedy row."""
    base, engine, model = served
    prompt = "def main():\n    "
    ids = model.tokenizer.encode(prompt)
    greedy_ids = jmoe.generate(model, ids, max_new_tokens=24)
    banned = sorted(set(greedy_ids))[:6]
    bias = {str(t): -100 for t in banned}
    body = {**OK, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        biased = pool.submit(post, base, {**body, "logit_bias": bias})
        plain = pool.submit(post, base, body)
        text = biased.result().json()["choices"][0]["text"]
        assert plain.result().json()["choices"][0]["text"] == model.tokenizer.decode(greedy_ids)
    alone = jmoe.generate(model, ids, max_new_tokens=24, logit_bias={t: -100 for t in banned})
    assert not set(alone) & set(banned) and alone != greedy_ids
    assert text == model.tokenizer.decode(alone)
    forced = post(base, {**OK, "max_tokens": 4, "temperature": 1.0, "seed": 3, "logit_bias": {"7": 100}}).json()
    assert forced["choices"][0]["text"] == model.tokenizer.decode([7] * 4)
    # min_p = 1 keeps only the most likely token: sampling at any seed gives the greedy text
    narrow = [post(base, {**body, "max_tokens": 12, "temperature": 1.0, "seed": s, "min_p": 1.0}).json()
              ["choices"][0]["text"] for s in (1, 2)]
    assert narrow == [model.tokenizer.decode(greedy_ids[:12])] * 2
    ignored = post(base, {**OK, "user": "someone", "metadata": {"k": "v"}, "store": False})
    assert ignored.status_code == 200


THING = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
         "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                        "kind": {"enum": ["prose", "code", "math"]}}}


def check_thing(text: str) -> None:
    """`text` is a JSON object that THING's schema allows (checked field by field)."""
    thing = json.loads(text)
    assert set(thing) == {"name", "count", "kind"}, text
    assert isinstance(thing["name"], str) and len(thing["name"]) <= 12, text
    assert type(thing["count"]) is int and 0 <= thing["count"] <= 99, text
    assert thing["kind"] in ("prose", "code", "math"), text


def test_response_format_holds_answers_to_a_json_schema(served):
    """json_schema answers, greedy and sampled, whole and streamed, completions and chat, are JSON
    the schema allows and end by themselves; a plain greedy request beside them answers as alone;
    json_object answers are JSON objects; seeded constrained answers repeat."""
    base, engine, model = served
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING, "strict": True}}
    alone = jmoe.generate(model, PROMPTS[0], max_new_tokens=16)
    free = post(base, {**OK, "prompt": PROMPTS[1], "max_tokens": 64, "temperature": 0}).json()["choices"][0]["text"]
    with pytest.raises(json.JSONDecodeError):  # the model left to itself writes no JSON
        json.loads(free)
    with ThreadPoolExecutor(4) as pool:
        plain = pool.submit(post, base, {**OK, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
        held = [pool.submit(post, base, {**OK, "prompt": p, "max_tokens": 64, "temperature": t, "seed": 5,
                                         "response_format": fmt}) for p, t in ((PROMPTS[1], 0), (PROMPTS[3], 1.0),
                                                                              (PROMPTS[4], 1.0))]
        assert plain.result().json()["choices"][0]["text"] == alone
        answers = [h.result().json()["choices"][0] for h in held]
    for choice in answers:
        assert choice["finish_reason"] == "stop"
        check_thing(choice["text"])
    again = post(base, {**OK, "prompt": PROMPTS[3], "max_tokens": 64, "temperature": 1.0, "seed": 5,
                        "response_format": fmt}).json()["choices"][0]["text"]
    assert again == answers[1]["text"]
    cats = [{"role": "user", "content": "Count the cats"}]
    chunks = client(base).chat.completions.create(model=NAME, messages=cats, max_tokens=64, temperature=1.0, seed=2,
                                                  response_format=fmt, stream=True)
    check_thing("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    objects = [post(base, {**OK, "prompt": prompt, "max_tokens": 64, "temperature": temperature, "seed": 1,
                           "response_format": {"type": "json_object"}}).json()["choices"][0]
               for prompt in PROMPTS[:3] for temperature in (0, 1.0)]
    for choice in objects:  # each a JSON object, or one cut at max_tokens
        assert choice["text"].startswith("{")
        assert choice["finish_reason"] == "length" or isinstance(json.loads(choice["text"]), dict)
    assert any(choice["finish_reason"] == "stop" for choice in objects)
    text = post(base, {**OK, "prompt": PROMPTS[1], "max_tokens": 64, "temperature": 0,
                       "response_format": {"type": "text"}}).json()["choices"][0]["text"]
    assert text == free


def test_presence_and_frequency_penalties_answer_what_generate_gives(served):
    """Completions (beside a plain greedy row, and streamed) and chat with the penalties give
    jmoe.generate's output with them; a bad value on chat is a 400 naming the field too."""
    base, engine, model = served
    prompt = "def main():\n    "
    ids = model.tokenizer.encode(prompt)
    penalties = dict(presence_penalty=0.5, frequency_penalty=1.5)
    plain_ids = jmoe.generate(model, ids, max_new_tokens=20)
    alone = jmoe.generate(model, ids, max_new_tokens=20, **penalties)
    assert alone != plain_ids
    body = {**OK, "prompt": prompt, "max_tokens": 20, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        penalised = pool.submit(post, base, {**body, **penalties})
        plain = pool.submit(post, base, body)
        assert penalised.result().json()["choices"][0]["text"] == model.tokenizer.decode(alone)
        assert plain.result().json()["choices"][0]["text"] == model.tokenizer.decode(plain_ids)
    streamed = client(base).completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                               **penalties)
    assert "".join(ch.choices[0].text for ch in streamed) == model.tokenizer.decode(alone)
    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    answer = client(base).chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                                  **penalties)
    expected = jmoe.generate(model, chat_ids, max_new_tokens=16, **penalties)
    assert answer.choices[0].message.content == model.tokenizer.decode(expected)
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", "x")):
        refused = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, field: value}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_bad_chat_messages_are_refused(served):
    base = served[0]
    for messages, culprit in (([], "messages"), ("hi", "messages"), ([{"role": "robot", "content": "x"}], "role"),
                              ([{"role": "user", "content": 5}], "content"), ([3], "messages[0]"),
                              ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "image_url", "image_url": {"url": "x"}}]}],
                               "messages[0].content[1].type"),
                              ([{"role": "user", "content": [{"type": "text", "text": 7}]}],
                               "messages[0].content[0].text"),
                              ([{"role": "user", "content": ["text"]}], "messages[0].content[0]")):
        response = httpx.post(f"{base}/v1/chat/completions", json=dict(model=NAME, messages=messages), timeout=30)
        assert response.status_code == 400 and culprit in response.json()["error"]["message"]
    hello = [{"role": "user", "content": "Hi"}]
    for extra, culprit in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 3}, "logprobs"),
                           ({"echo": True}, "echo"),
                           ({"logprobs": True, "top_logprobs": 50}, "top_logprobs")):
        response = httpx.post(f"{base}/v1/chat/completions", json=dict(model=NAME, messages=hello, **extra), timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == culprit


def test_tokenize_and_detokenize_round_trip(served):
    base, engine, model = served
    text = PROMPTS[1]
    ids = model.tokenizer.encode(text)
    answer = httpx.post(f"{base}/tokenize", json={"model": NAME, "prompt": text}, timeout=30).json()
    assert answer == {"tokens": ids, "count": len(ids), "max_model_len": engine.context}
    plain = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    assert plain["tokens"] == model.tokenizer.encode(text, add_special_tokens=False)
    hello = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": hello}, timeout=30).json()
    completion = httpx.post(f"{base}/v1/chat/completions", json={"messages": hello, "max_tokens": 1},
                            timeout=60).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"] > 0
    back = httpx.post(f"{base}/detokenize", json={"model": NAME, "tokens": ids}, timeout=30).json()
    assert back == {"prompt": text}
    assert httpx.post(f"{base}/detokenize", json={"tokens": []}, timeout=30).json() == {"prompt": ""}
    # lm-evaluation-harness's tokenizer_backend=remote: the special tokens from /tokenizer_info, ids from /tokenize
    from lm_eval.utils import RemoteTokenizer

    remote = RemoteTokenizer(f"{base}/v1/completions", timeout=30)
    assert (remote.eos_token, remote.eos_token_id) == (model.tokenizer.eos_token, model.tokenizer.eos_token_id)
    assert remote.encode(text) == model.tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(ids) == text


@pytest.mark.parametrize("path, body, culprit", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"),
    ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 4096]}, "tokens"), ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [2**31]}, "tokens"), ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"), ("/detokenize", {"tokens": [1], "skip": 1}, "skip"),
])
def test_bad_tokenize_requests_get_a_4xx_naming_the_field(served, path, body, culprit):
    response = httpx.post(f"{served[0]}{path}", json=body, timeout=30)
    error = response.json()["error"]
    assert 400 <= response.status_code < 500 and error["param"] == culprit and error["message"]


def test_one_model_by_id_and_a_404_for_others(served):
    base = served[0]
    card = httpx.get(f"{base}/v1/models/{NAME}", timeout=10)
    assert card.status_code == 200 and card.json() == httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
    assert client(base).models.retrieve(NAME).id == NAME
    for other in ("gpt-9", "org/tiny", "tiny%20x"):
        missing = httpx.get(f"{base}/v1/models/{other}", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.fixture
def app_client(served):
    """make(**create_app options): Starlette's test client for another app over the module's engine
    (nothing compiles); the engine's metrics stay the module server's."""
    from starlette.testclient import TestClient

    engine = served[1]
    observer = engine.observer

    def make(**options) -> TestClient:
        app = create_app(engine, NAME, **options)
        engine.observer = observer
        return TestClient(app, raise_server_exceptions=False)

    return make


KEY = "sk-test-0123456789"


def test_an_api_key_guards_the_api_but_not_health_or_metrics(app_client, caplog):
    caplog.set_level(logging.INFO)
    http = app_client(api_key=KEY)
    keyed = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in (("GET", "/v1/models", None), ("GET", f"/v1/models/{NAME}", None),
                               ("POST", "/v1/completions", OK), ("POST", "/tokenize", {"prompt": "a"}),
                               ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/tokenizer_info", None),
                               ("GET", "/v1/nothing", None)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            refused = http.request(method, path, json=body, headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["code"] == "invalid_api_key" and KEY not in refused.text
        assert http.request(method, path, json=body, headers=keyed).status_code == (404 if "nothing" in path else 200)
    assert http.get("/v1/models", headers={"Authorization": f"bearer  {KEY}"}).status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    answer = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
                           ).completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert answer.choices[0].text
    assert not [r for r in caplog.records if KEY in r.getMessage()]


def test_api_options_of_jmoe_serve_are_checked(monkeypatch):
    from jmoe import cli
    from jmoe.errors import InputError

    def options(*extra):
        return cli.app_options(cli.build_parser().parse_args(["serve", "m", *extra]))

    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    assert options()["api_key"] is None and options()["allowed_origins"] is None
    monkeypatch.setenv(cli.API_KEY_ENV, KEY)
    assert options()["api_key"] == KEY and options("--api-key", "other")["api_key"] == "other"
    assert options("--allowed-origins", "https://a.example, http://localhost:3000")["allowed_origins"] == [
        "https://a.example", "http://localhost:3000"]
    assert options("--allowed-origins", "*")["allowed_origins"] == ["*"]
    for bad in (["--api-key", ""], ["--api-key", "two words"], ["--api-key", "k\u00e9y"], ["--allowed-origins", ""],
                ["--allowed-origins", "a.example"], ["--allowed-origins", "https://a.example/"],
                ["--allowed-origins", "*,https://a.example"]):
        with pytest.raises(InputError) as refused:
            options(*bad)
        assert KEY not in str(refused.value) and "two words" not in str(refused.value)


PREFLIGHT = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_only_when_origins_are_allowed(app_client):
    plain = app_client()
    assert plain.options("/v1/completions", headers=PREFLIGHT).status_code == 405  # as before: no CORS
    assert "access-control-allow-origin" not in plain.get("/v1/models", headers={"Origin": "https://a.example"}).headers
    http = app_client(allowed_origins=["https://a.example"], api_key=KEY)
    preflight = http.options("/v1/completions", headers=PREFLIGHT)  # a preflight carries no key
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://a.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
    answer = http.post("/v1/completions", json=OK, headers={"Origin": "https://a.example",
                                                            "Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://a.example"
    refused = http.post("/v1/completions", json=OK, headers={"Origin": "https://a.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://a.example"
    stranger = http.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://b.example"})
    assert stranger.status_code == 400 and "origin" in stranger.json()["error"]["message"]
    anyone = app_client(allowed_origins=["*"]).get("/v1/models", headers={"Origin": "https://b.example"})
    assert anyone.headers["access-control-allow-origin"] == "*"


def test_a_list_of_prompts_gets_n_choices_per_prompt_whole_and_streamed(served):
    base, _, model = served
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[5]]
    alone = [jmoe.generate(model, p, max_new_tokens=6) for p in prompts]
    c = client(base)
    whole = c.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in whole.choices] == list(range(6))
    assert [ch.text for ch in whole.choices] == [a for a in alone for _ in range(2)]  # index = prompt * n + j
    ids = [model.tokenizer.encode(p) for p in prompts]
    assert whole.usage.prompt_tokens == sum(map(len, ids)) and whole.usage.completion_tokens == 36
    as_ids = c.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert [ch.text for ch in as_ids.choices] == alone
    texts = [""] * 6
    for chunk in c.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True,
                                      stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
        usage = chunk.usage
    assert texts == [ch.text for ch in whole.choices] and usage.total_tokens == whole.usage.total_tokens


def log_softmax(logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_echo_logprobs_are_the_prompts_log_softmax(served):
    """echo with logprobs (lm-evaluation-harness's loglikelihood request): the text starts with the
    prompt, and the logprobs cover its tokens (the first null), each the log-softmax of jmoe.forward's
    logits before it; max_tokens 0 gives the prompt alone."""
    base, _, model = served
    prompt = PROMPTS[4]
    ids = model.tokenizer.encode(prompt)
    ref = log_softmax(jmoe.forward(model, ids))
    texts = [model.tokenizer.decode([t]) for t in ids]
    scored = post(base, {**OK, "prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 0}).json()
    choice = scored["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == texts and lp["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(ids))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], expected, atol=1e-4)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        assert len(top) == 3
        assert sorted(top.values(), reverse=True) == pytest.approx(np.sort(ref[i])[::-1][:3], abs=1e-4)
    # lm-evaluation-harness's local-completions: token-id prompts, max_tokens 1, logprobs 1; it sums
    # token_logprobs[ctxlen:-1] (the continuation, not the one generated token)
    context, continuation = ids[:3], ids[3:]
    plain = post(base, {**OK, "prompt": [PROMPTS[1]], "max_tokens": 1, "temperature": 0, "logprobs": 1}).json()
    harness = post(base, {**OK, "prompt": [ids, model.tokenizer.encode(PROMPTS[1])], "max_tokens": 1,
                          "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}).json()
    first, second = sorted(harness["choices"], key=lambda ch: ch["index"])
    assert first["text"].startswith(prompt) and len(first["logprobs"]["token_logprobs"]) == len(ids) + 1
    loglikelihood = sum(first["logprobs"]["token_logprobs"][len(context):-1])
    assert loglikelihood == pytest.approx(sum(ref[i - 1, ids[i]] for i in range(len(context), len(ids))), abs=1e-3)
    assert second["text"] == PROMPTS[1] + plain["choices"][0]["text"]
    generated = {k: second["logprobs"][k][-1:] for k in ("tokens", "token_logprobs", "top_logprobs")}
    assert generated == {k: plain["choices"][0]["logprobs"][k] for k in generated}
    assert second["logprobs"]["text_offset"][-1] == len(PROMPTS[1])
    echoed = post(base, {**OK, "prompt": [continuation], "echo": True, "max_tokens": 2, "temperature": 0}).json()
    assert echoed["choices"][0]["text"].startswith(model.tokenizer.decode(continuation))
    assert echoed["choices"][0]["logprobs"] is None


def test_streamed_echo_sends_what_the_whole_answer_holds(served):
    """echo streamed: each choice's first chunk is its prompt (with its logprobs), then its
    completion's chunks; joined, they are the whole answer's text and logprobs (max_tokens 0: the
    prompt alone, finished "length")."""
    base = served[0]
    for max_tokens in (0, 6):
        body = {**OK, "prompt": [PROMPTS[4], PROMPTS[2]], "echo": True, "logprobs": 2, "max_tokens": max_tokens,
                "temperature": 0}
        whole = sorted(post(base, body).json()["choices"], key=lambda ch: ch["index"])
        chunks = list(client(base).completions.create(**{**body, "stream": True}))
        for choice in whole:
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice["index"]]
            assert "".join(c.text for c in mine) == choice["text"]
            assert mine[0].text == body["prompt"][choice["index"]]
            logprobs = [c.logprobs for c in mine if c.logprobs is not None]
            assert sum((lp.token_logprobs for lp in logprobs), []) == choice["logprobs"]["token_logprobs"]
            assert sum((lp.text_offset for lp in logprobs), []) == choice["logprobs"]["text_offset"]
            assert mine[-1].finish_reason == choice["finish_reason"]


def test_echo_scoring_runs_on_the_engine_thread_and_compiles_once_per_prompt_bucket(served, monkeypatch):
    """Scoring runs where the engine's steps run (so that where several processes serve one model,
    each runs it at the same point); warm-up scores at each bucket; prompts of one bucket share
    every executable."""
    from jmoe.errors import InputError

    base, engine, model = served
    calls = []
    real_logits = scoring.bucket_logits

    def bucket_logits(model, ids):
        calls.append((len(ids), threading.current_thread().name))
        return real_logits(model, ids)

    monkeypatch.setattr(scoring, "bucket_logits", bucket_logits)
    scoring.warm_up_scoring(model, 20)
    assert [n for n, _ in calls] == [16, 19]  # each bucket below the context (19: the longest prompt, bucket 32)
    calls.clear()
    first = engine.score(list(range(1, 18)), 2).result(timeout=120)  # bucket 32 (compiled above, by warm-up)
    before = CompileCounter.count()
    later = [engine.score(list(range(1, n)), 2).result(timeout=120) for n in (21, 31)]
    assert CompileCounter.count() == before
    assert calls == [(17, "jmoe-batch-engine"), (20, "jmoe-batch-engine"), (30, "jmoe-batch-engine")]
    assert first[0].logprob is None and [len(s) for s in [first, *later]] == [17, 20, 30]
    # a prefix's tokens are scored alike whatever follows them (causal attention), whatever the padding
    assert [t.logprob for t in later[0][:17]] == pytest.approx([t.logprob for t in first], abs=1e-5)
    with pytest.raises(InputError):
        engine.score([], 1)


def test_chat_content_parts_read_as_their_joined_text(served):
    base = served[0]
    body = dict(model=NAME, max_tokens=6, temperature=0)
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    answers = [httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={**body, "messages": [{"role": "user", "content": content}]}).json()
               for content in ("Hello", parts)]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"] == answers[1]["usage"]


def test_logprobs_are_the_models_log_softmax(served):
    """Completions' logprobs (whole) and chat's (streamed) against a teacher-forced forward pass of
    the prompt and the answer: each token's logprob and its alternatives are the log-softmax of the
    logits before it; greedy picks the most likely."""
    import numpy as np

    from jmoe.decoding.evaluate import forward

    base, _, model = served
    c = client(base)
    whole = c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=8, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    prompt = model.tokenizer.encode(PROMPTS[4])
    answer = model.tokenizer.encode(PROMPTS[4] + whole.choices[0].text)[len(prompt):]
    logits = np.asarray(forward(model, prompt + answer), np.float64)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    for j, (token, logprob, top) in enumerate(zip(answer, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert abs(logprob - row[token]) < 2e-3
        assert len(top) == 3 and abs(max(top.values()) - logprob) < 1e-6  # greedy: the most likely token
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(row)[::-1][:3], abs=2e-3)
    streamed = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=10,
                                         temperature=0, stream=True, logprobs=True, top_logprobs=2,
                                         stream_options={"include_usage": True})
    content, entries, usage = "", [], None
    for chunk in streamed:
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].logprobs:
            entries += chunk.choices[0].logprobs.content
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
    assert len(entries) == usage.completion_tokens and "".join(e.token for e in entries) == content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries)


def test_metrics_count_requests_tokens_and_latencies(served):
    base, engine, _ = served
    before = httpx.get(f"{base}/metrics", timeout=10).text
    c = client(base)
    c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0)
    text = httpx.get(f"{base}/metrics", timeout=10).text

    def value(exposition: str, name: str) -> float:
        lines = [line for line in exposition.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    assert value(text, 'jmoe_requests_total{finish_reason="length"}') == value(
        before, 'jmoe_requests_total{finish_reason="length"}') + 1
    assert value(text, "jmoe_generated_tokens_total") == value(before, "jmoe_generated_tokens_total") + 5
    assert value(text, "jmoe_time_to_first_token_seconds_count") == value(
        before, "jmoe_time_to_first_token_seconds_count") + 1
    assert value(text, "jmoe_inter_token_latency_seconds_count") >= 4
    assert value(text, "jmoe_step_seconds_count") > 0 and value(text, "jmoe_requests_running") == 0
    assert "jmoe_compiles" in text and "jmoe_expert_hit_rate" in text


def test_an_oversize_body_without_a_length_is_cut_off(served):
    base = served[0]
    chunks = (b"x" * (1 << 16) for _ in range(MAX_BODY_BYTES // (1 << 16) + 2))  # chunked: no Content-Length
    response = httpx.post(f"{base}/v1/completions", content=chunks, timeout=60)
    assert response.status_code == 413 and "bytes" in response.json()["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"


# a chat template that takes tools, in the <tool_call> format Hermes' and Qwen's templates teach
TOOL_TEMPLATE = """{%- if tools %}system: you may call these tools, each in a <tool_call></tool_call> block:
{%- for tool in tools %} {{ tool.function.name }}{% endfor %}
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}assistant:
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}
{% elif m.role == "tool" %}tool: {{ m.content }}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}
{%- endfor %}assistant:"""
# GPT-OSS's harmony, cut down: its markers are plain text to the test model's tokenizer
HARMONY_TEMPLATE = """{%- if tools %}<|start|>developer<|message|>namespace functions {
{%- for tool in tools %} type {{ tool.function.name }} = () => any;{% endfor %} }<|end|>{% endif %}
{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == "assistant" %}<|channel|>final{% endif %}<|message|>
{{- m.content }}<|end|>{% endfor %}<|start|>assistant"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 10}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                   "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}


def check_call(call: dict) -> None:
    """A tool call in OpenAI's shape whose arguments the function's parameters allow (checked by hand)."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 10
    else:
        assert call["function"]["name"] == "add" and set(arguments) == {"a", "b"}
        assert all(type(v) is int and 0 <= v <= 999 for v in arguments.values())


def chat_post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "max_tokens": 96, **body}, timeout=60)


def test_tools_reach_the_template_and_required_calls_come_back_as_tool_calls(served, monkeypatch):
    """With a template that takes tools: "required" and a named tool_choice give calls whose
    arguments fit the schema (whole and streamed, finish reason tool_calls); "auto" renders the
    tools into the prompt; a conversation with a call and its result renders."""
    base, engine, model = served
    ask = [{"role": "user", "content": "What is 12 + 35?"}]
    untooled = chat_post(base, {"messages": ask}).json()["usage"]["prompt_tokens"]
    monkeypatch.setattr(model.tokenizer, "chat_template", TOOL_TEMPLATE)
    auto = chat_post(base, {"messages": ask, "tools": [WEATHER, ADD], "temperature": 0}).json()
    assert auto["usage"]["prompt_tokens"] > untooled + 10  # the tools were described to the model (briefly:
    # the test model's context is 256 tokens)
    assert auto["choices"][0]["message"].get("tool_calls") is None
    assert auto["choices"][0]["finish_reason"] != "tool_calls"
    named = {"type": "function", "function": {"name": "add"}}
    for choice, temperature in (("required", 0), ("required", 1.0), (named, 1.0)):
        answer = chat_post(base, {"messages": ask, "tools": [WEATHER, ADD], "tool_choice": choice,
                                  "temperature": temperature, "seed": 4}).json()["choices"][0]
        assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None, answer
        [call] = answer["message"]["tool_calls"]
        check_call(call)
        if isinstance(choice, dict):
            assert call["function"]["name"] == "add"
    chunks = list(client(base).chat.completions.create(model=NAME, messages=ask, tools=[WEATHER], max_tokens=96,
                                                       tool_choice="required", stream=True))
    [delta] = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    check_call(delta.tool_calls[0].model_dump())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    called = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 12, \"b\": 35}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "47"}]
    follow = chat_post(base, {"messages": called, "tools": [ADD], "max_tokens": 4}).json()
    assert "error" not in follow
    assert follow["usage"]["prompt_tokens"] > auto["usage"]["prompt_tokens"]  # the call and its result rendered


@pytest.mark.parametrize("body, culprit", [
    ({"tools": [WEATHER]}, "tools"),  # the fixture's model has no chat template that takes tools
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "47"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add",
                                                                                      "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(served, body, culprit, monkeypatch):
    base, _, model = served
    if "tool_choice" in body and "tools" in body:  # checked against a template that takes tools
        monkeypatch.setattr(model.tokenizer, "chat_template", TOOL_TEMPLATE)
    response = chat_post(base, {"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == culprit
    completions = post(base, {**OK, "tools": [WEATHER]})  # completions take no tools
    assert completions.status_code == 400 and completions.json()["error"]["param"] == "tools"


def test_tool_calls_are_read_from_hermes_blocks():
    from jmoe.serving.tools import parse_tools, tool_calls

    tools = parse_tools([WEATHER, ADD], None)
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>not json</tool_call>')
    content, calls = tool_calls(text, tools)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert content.startswith("Let me check.") and "unknown" in content and "not json" in content
    assert tool_calls("no calls here", tools) == ("no calls here", [])


# templates that teach the other tool-call formats the server reads (in the words their families' templates use)
MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS]{% for tool in tools %} {{ tool.function.name }}{% endfor %}
[/AVAILABLE_TOOLS] call them as [TOOL_CALLS] followed by a JSON list
{% endif %}{%- for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}assistant:"""
LLAMA3_TEMPLATE = """{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument \
name and its value}. Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}
{% endif %}{%- for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}assistant:"""


DEEPSEEK_V31_TEMPLATE = """{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %} \
<｜tool▁calls▁begin｜>
{% endif %}{%- for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}assistant:"""


@pytest.mark.parametrize("template, opening", [(MISTRAL_TEMPLATE, "[TOOL_CALLS]["), (LLAMA3_TEMPLATE, '{"name":'),
                                               (DEEPSEEK_V31_TEMPLATE, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add")])
def test_required_calls_in_the_mistral_and_llama_formats(served, monkeypatch, template, opening):
    """The template's format is recognised, a required call is written in it (the raw answer, read
    without tools, shows it) and comes back as tool_calls whose arguments fit the schema."""
    base, _, model = served
    from jmoe.serving import responses

    monkeypatch.setattr(model.tokenizer, "chat_template", template)
    answers, read = [], responses.tool_calls
    monkeypatch.setattr(responses, "tool_calls", lambda text, tools: answers.append(text) or read(text, tools))
    ask = [{"role": "user", "content": "What is 12 + 35?"}]
    named = {"type": "function", "function": {"name": "add"}}
    answer = chat_post(base, {"messages": ask, "tools": [WEATHER, ADD], "tool_choice": named, "max_tokens": 160,
                              "temperature": 1.0, "seed": 2}).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None, answer
    [call] = answer["message"]["tool_calls"]
    check_call(call)
    assert call["function"]["name"] == "add"
    [raw] = answers  # the answer as drawn: in the template's format
    assert raw.startswith(opening) and "add" in raw, raw


def test_harmony_answers_split_by_channel_whole_and_streamed():
    """GPT-OSS's channels: analysis is the reasoning, final (or text outside any message) the
    content, a commentary to one of the tools a call (to another, or not JSON: content); streamed
    in pieces cut anywhere, the deltas add up to the whole answer's reasoning and content, a marker
    never leaking."""
    import random

    from jmoe import harmony
    from jmoe.serving.tools import HARMONY

    names = {"get_weather", "add"}
    think = "<|channel|>analysis<|message|>The user wants 2 + 2 < 5.<|end|><|start|>assistant"
    answer = think + "<|channel|>final<|message|>It is 4.<|return|>"
    call = (think + '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 2}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}')
    stranger = '<|channel|>commentary to=functions.delete_all<|message|>{"now": true}<|call|>'
    assert harmony.split(answer, names) == ("The user wants 2 + 2 < 5.", "It is 4.", [])
    assert harmony.split(call, names) == ("The user wants 2 + 2 < 5.", "", [("add", '{"a": 2, "b": 2}'),
                                                                           ("get_weather", '{"city": "Oslo"}')])
    assert harmony.split(stranger, names) == ("", '{"now": true}', [])
    assert harmony.split("Plain words.", names) == ("", "Plain words.", [])
    assert harmony.split("Plain.<|channel|>final<|message|>Then final.", names) == ("", "Plain.Then final.", [])
    content, calls = HARMONY.read(call, names)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 2, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert HARMONY.read(answer, names) == (answer, [])
    # generate on chat messages to such a template answers with the final channel: its rows keep special tokens
    from jmoe.decoding.generation import split_prompts
    from jmoe.tokenizer import load_tokenizer
    from tests.conftest import TINY_HF

    tokenizer = load_tokenizer(TINY_HF)
    ask = [{"role": "user", "content": "hi"}]
    tokenizer.chat_template = HARMONY_TEMPLATE
    assert [split_prompts(tokenizer, p, 4096).harmony for p in (ask, [ask, ask], "hi", ["hi"])] == [
        True, True, False, False]
    tokenizer.chat_template = TOOL_TEMPLATE
    assert not split_prompts(tokenizer, ask, 4096).harmony
    rng = random.Random(0)
    for text in (answer, call, stranger, "Plain.<|channel|>final<|message|>Then final."):
        for longest in [7] * 30 + [60] * 10:  # pieces of a token or two, and pieces holding whole messages
            stream, reasoning, content, i = harmony.HarmonyStream(names), "", "", 0
            while i < len(text):
                j = min(len(text), i + rng.randint(1, longest))
                r, c = stream.feed(text[i:j])
                reasoning, content, i = reasoning + r, content + c, j
                assert "<|" not in r + c
            whole = harmony.split(text, names)
            assert (reasoning, content) == whole[:2]


def test_a_harmony_template_gets_channels_and_tool_calls_back(served, monkeypatch):
    """A model whose template writes harmony (GPT-OSS): a required call comes back as tool_calls
    (whole and streamed), no marker in the content; a free answer without channels is all content."""
    from jmoe.serving.validation import parse_request

    base, engine, model = served
    ask = [{"role": "user", "content": "What is 12 + 35?"}]
    assert not parse_request({"messages": ask}, model, NAME, chat=True).harmony
    monkeypatch.setattr(model.tokenizer, "chat_template", HARMONY_TEMPLATE)
    assert parse_request({"messages": ask}, model, NAME, chat=True).harmony  # its text keeps special tokens
    answer = chat_post(base, {"messages": ask, "tools": [WEATHER, ADD], "tool_choice": "required",
                              "temperature": 0}).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None, answer
    [call] = answer["message"]["tool_calls"]
    check_call(call)
    chunks = list(client(base).chat.completions.create(model=NAME, messages=ask, tools=[ADD], max_tokens=96,
                                                       tool_choice="required", stream=True))
    [delta] = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    check_call(delta.tool_calls[0].model_dump())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    free = chat_post(base, {"messages": ask, "temperature": 0, "max_tokens": 8}).json()["choices"][0]["message"]
    streamed = "".join(c.choices[0].delta.content or "" for c in client(base).chat.completions.create(
        model=NAME, messages=ask, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert free["content"] and "<|" not in free["content"] and streamed == free["content"]


def test_tool_calls_are_read_in_each_format():
    from types import SimpleNamespace

    from jmoe.errors import InputError
    from jmoe.serving.tools import (DEEPSEEK, DEEPSEEK_V31, HARMONY, HERMES, LLAMA3, MISTRAL, parse_tools,
                                    template_format)

    names = parse_tools([WEATHER, ADD], None).names
    args = lambda calls: [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]  # noqa: E731
    # Mistral: a JSON list after [TOOL_CALLS] (text before it is content), or newer templates' name[ARGS]{...}
    content, calls = MISTRAL.read('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                                  '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', names)
    assert content == "Sure." and args(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    content, calls = MISTRAL.read('[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
                                  names)
    assert content is None and args(calls) == [("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Rome"})]
    for text in ('[TOOL_CALLS][{"name": "unknown", "arguments": {}}]', "[TOOL_CALLS] not json", "no calls"):
        assert MISTRAL.read(text, names) == (text, [])
    # Llama 3.1: the whole answer is the call(s), "parameters" holding the arguments
    content, calls = LLAMA3.read('<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Lima"}}', names)
    assert content is None and args(calls) == [("add", {"a": 5, "b": 6}), ("get_weather", {"city": "Lima"})]
    for text in ('The answer is {"name": "add"}', '{"name": "unknown", "parameters": {}}', '{"name": "add"} and more'):
        assert LLAMA3.read(text, names) == (text, [])
    # the format a template teaches; a marker the tokenizer holds as one special token is drawn as that token
    of = lambda template: template_format(SimpleNamespace(chat_template=template))  # noqa: E731
    assert (of(TOOL_TEMPLATE), of(MISTRAL_TEMPLATE), of(LLAMA3_TEMPLATE)) == (HERMES, MISTRAL, LLAMA3)
    assert of(HARMONY_TEMPLATE) is HARMONY  # GPT-OSS
    with pytest.raises(InputError, match="format"):
        of("{% for tool in tools %}{{ tool }}{% endfor %} call them as <<name>>")
    with pytest.raises(InputError, match="no tools"):
        of("{% for m in messages %}{{ m.content }}{% endfor %}")
    # DeepSeek-V3 / R1 (the function's name, then its arguments fenced as JSON) and V3.1 (name, arguments)
    begin, call, sep, end, ends = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                   "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
    text = (f'Checking.{begin}{call}function{sep}get_weather\n```json\n{{"city": "Oslo"}}\n```{end}'
            f'{call}function{sep}add\n```json\n{{"a": 1, "b": 2}}\n```{end}{ends}')
    content, calls = DEEPSEEK.read(text, names)
    assert content == "Checking." and args(calls) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    content, calls = DEEPSEEK_V31.read(f'{begin}{call}add{sep}{{"a": 7, "b": 8}}{end}{ends}', names)
    assert content is None and args(calls) == [("add", {"a": 7, "b": 8})]
    for text in (f"{begin}{call}unknown{sep}{{}}{end}{ends}", f"{begin}{call}add{sep}not json{end}{ends}"):
        assert DEEPSEEK.read(text, names) == (text, [])
    assert of(f"{{% if tools %}}{begin}```json{{% endif %}}") == DEEPSEEK
    assert of(f"{{% if tools %}}{begin}{{% endif %}}") == of(DEEPSEEK_V31_TEMPLATE) == DEEPSEEK_V31
    special = SimpleNamespace(added_tokens_encoder={"[TOOL_CALLS]": 5})
    assert MISTRAL.call_grammar({}, special).startswith("start: <[5]> calls")
    assert MISTRAL.call_grammar({}, None).startswith('start: "[TOOL_CALLS]" calls')
