"""The OpenAI-compatible server (jmoe/serving/openai_api.py) on 127.0.0.1, called with the official
`openai` client and with raw HTTP: answers equal `jmoe.generate`'s, concurrent streams, cancels,
and a table of bad requests that each get a 4xx naming the culprit."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

import jmoe
from jmoe.serving import BatchEngine
from jmoe.serving.batcher import CompileCounter
from jmoe.serving.openai_api import MAX_BODY_BYTES, create_app

PROMPTS = ["The quick brown fox", "def main():\n    ", "12 + 35 =", "Python is", "import os\nimport",
           "Beware of", "class Stack:", "7 * 8 ="]
NAME = "tiny"


@pytest.fixture(scope="module")
def served(tiny_converted):
    """(base URL, engine, model): a server on an ephemeral port, stopped after the module."""
    model = jmoe.load(tiny_converted, compute_dtype="float32", max_seq_len=256, max_batch=4)
    engine = BatchEngine(model, max_batch=4, max_waiting=64, context=256, warm_up=True)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", engine, model
    server.should_exit = True
    thread.join(timeout=30)
    engine.close()


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
    ({"prompt": 42}, "prompt"), ({"prompt": [1, -5]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x" * 3000}, "prompt"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    (b"{not json", "JSON"), (b"[1, 2]", "object"), (b"x" * (MAX_BODY_BYTES + 1), "body"),
]


@pytest.mark.parametrize("change, culprit", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_a_4xx_naming_the_culprit(served, change, culprit):
    base = served[0]
    response = post(base, change, raw=True) if isinstance(change, bytes) else post(base, {**OK, **change})
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert culprit in error["message"] or error["param"] == culprit
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"  # still serving


def test_bad_chat_messages_are_refused(served):
    base = served[0]
    for messages, culprit in (([], "messages"), ("hi", "messages"), ([{"role": "robot", "content": "x"}], "role"),
                              ([{"role": "user", "content": 5}], "content"), ([3], "messages[0]")):
        response = httpx.post(f"{base}/v1/chat/completions", json=dict(model=NAME, messages=messages), timeout=30)
        assert response.status_code == 400 and culprit in response.json()["error"]["message"]
    hello = [{"role": "user", "content": "Hi"}]
    for extra, culprit in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 3}, "logprobs"),
                           ({"logprobs": True, "top_logprobs": 50}, "top_logprobs")):
        response = httpx.post(f"{base}/v1/chat/completions", json=dict(model=NAME, messages=hello, **extra), timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == culprit


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
