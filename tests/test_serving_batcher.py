"""Continuous batching (jmoe/serving/batcher.py): requests join and leave one running batch, and
each gets what `jmoe.generate` of its prompt alone gives."""

from __future__ import annotations

import numpy as np
import pytest

import jmoe
from jmoe.decoding.sampling import SamplingOptions
from jmoe.errors import InputError
from jmoe.serving import BatchEngine, QueueFull, Request
from jmoe.serving.compiles import CompileCounter
from jmoe.serving.requests import EngineClosed

PROMPTS = ["The quick brown fox", "def main():\n    ", "12 + 35 =", "Python is", "import os\nimport",
           "Beware of", "class Stack:", "7 * 8 ="]


def encode(model, text: str) -> list[int]:
    return model.tokenizer.encode(text)


def test_each_request_gets_what_it_gets_alone(short_converted):
    """(Offloaded models: test_offloaded_policies_and_execution_paths_serve_what_generate_gives.)"""
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=3)
    alone = [jmoe.generate(model, p, max_new_tokens=20) for p in PROMPTS]
    sampled = jmoe.generate(model, PROMPTS[0], max_new_tokens=20, temperature=0.9, top_k=40, seed=7)
    ids = jmoe.generate(model, encode(model, PROMPTS[2]), max_new_tokens=12)
    with BatchEngine(model, max_batch=3, context=256) as engine:  # 8 requests through 3 slots
        streams = [engine.submit(Request(encode(model, p), max_tokens=20)) for p in PROMPTS]
        streams.append(engine.submit(Request(encode(model, PROMPTS[0]), max_tokens=20,
                                             sampling=SamplingOptions(temperature=0.9, top_k=40, seed=7))))
        streams.append(engine.submit(Request(encode(model, PROMPTS[2]), max_tokens=12, as_text=False)))
        texts = [s.text() for s in streams[:-1]]
        token_ids = list(streams[-1])
        assert engine.running == 0
    assert texts == alone + [sampled]
    assert token_ids == ids
    assert all(s.finish_reason == "length" and s.usage["completion_tokens"] == 20 for s in streams[:8])


def test_rows_leaving_out_of_order_are_compacted_without_changing_anyones_text(short_model):
    limits = [5, 20, 9, 14, 3, 20, 11, 7]  # rows leave mid-batch; the live ones move to the front slots
    alone = [jmoe.generate(short_model, p, max_new_tokens=n) for p, n in zip(PROMPTS, limits)]
    with BatchEngine(short_model, max_batch=4, context=128) as engine:
        streams = [engine.submit(Request(encode(short_model, p), max_tokens=n)) for p, n in zip(PROMPTS, limits)]
        assert [s.text() for s in streams] == alone
        assert engine.bucket(1) == 1 and engine.bucket(3) == 4 and engine.bucket(4) == 4


def test_stop_strings_and_eos_end_a_row(short_model):
    with BatchEngine(short_model, max_batch=2, context=128) as engine:
        full = engine.submit(Request(encode(short_model, "12 + 35 ="), max_tokens=30)).text()
        stop = full[5:8]
        cut = engine.submit(Request(encode(short_model, "12 + 35 ="), max_tokens=30, stop=[stop]))
        assert cut.text() == full[:full.index(stop)] and cut.finish_reason == "stop"
        assert cut.text() == ""  # a finished stream yields nothing more


def test_cancelled_requests_free_their_slots_for_waiting_ones(short_model):
    with BatchEngine(short_model, max_batch=2, context=256) as engine:
        long_ones = [engine.submit(Request(encode(short_model, p), max_tokens=200)) for p in PROMPTS[:2]]
        waiting = engine.submit(Request(encode(short_model, PROMPTS[2]), max_tokens=5))
        for s in long_ones:
            next(iter(s))  # running: a first piece arrived
            s.cancel()
        assert waiting.text() != "" and waiting.finish_reason == "length"
        for s in long_ones:
            list(s)
            assert s.finish_reason == "cancelled" and s.usage["completion_tokens"] < 200
        assert engine.running == 0


def test_no_compile_after_warm_up(short_model):
    with BatchEngine(short_model, max_batch=4, context=128) as engine:
        # warm up: prefill of a 16-token prompt bucket, the batched step, sampling
        first = [engine.submit(Request(encode(short_model, p), max_tokens=6)) for p in PROMPTS[:4]]
        assert all(s.text() for s in first)
        compiled = CompileCounter.count()
        later = [engine.submit(Request(encode(short_model, p), max_tokens=9)) for p in PROMPTS[4:]]
        assert all(s.text() for s in later)
        assert CompileCounter.count() == compiled


def test_a_warmed_up_engine_samples_with_any_warpers_without_compiling(short_model):
    """Each combination of top-k, top-p and min-p is its own sampling executable: warm-up makes them all."""
    with BatchEngine(short_model, max_batch=2, context=128, warm_up=True) as engine:
        compiled = CompileCounter.count()
        samplings = [SamplingOptions(temperature=0.8, seed=1), SamplingOptions(temperature=0.8, top_k=5, seed=2),
                     SamplingOptions(temperature=0.8, top_p=0.9, min_p=0.05, seed=3),
                     SamplingOptions(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=4),
                     SamplingOptions(repetition_penalty=1.2),
                     SamplingOptions(presence_penalty=1.0, frequency_penalty=-0.5),  # traced: no step of their own
                     SamplingOptions(temperature=0.8, top_k=5, presence_penalty=-1.0, frequency_penalty=2.0, seed=5)]
        streams = [engine.submit(Request(encode(short_model, PROMPTS[i % len(PROMPTS)]), max_tokens=5, sampling=s))
                   for i, s in enumerate(samplings)]
        assert all(s.text() for s in streams)
        assert CompileCounter.count() == compiled


def test_rows_with_presence_and_frequency_penalties_beside_plain_rows_get_what_they_get_alone(short_model):
    """Each row counts its own generated tokens: a penalised greedy row, a penalised sampled row and
    plain greedy rows in one batch each give jmoe.generate's text for their options alone."""
    options = [dict(), dict(presence_penalty=0.5, frequency_penalty=1.5),
               dict(temperature=0.9, top_k=40, seed=7, presence_penalty=-0.5, frequency_penalty=1.0), dict()]
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[0], PROMPTS[4]]
    alone = [jmoe.generate(short_model, p, max_new_tokens=20, **kw) for p, kw in zip(prompts, options)]
    assert alone[1] != alone[0]  # the penalties change the text
    with BatchEngine(short_model, max_batch=4, context=128) as engine:
        streams = [engine.submit(Request(encode(short_model, p), max_tokens=20, sampling=SamplingOptions(**kw)))
                   for p, kw in zip(prompts, options)]
        assert [s.text() for s in streams] == alone


def test_bad_requests_and_a_full_queue_are_refused(short_model):
    with BatchEngine(short_model, max_batch=1, max_waiting=0, context=64) as engine:
        with pytest.raises(InputError, match="empty"):
            engine.submit(Request([], max_tokens=4))
        with pytest.raises(InputError, match="leave room"):
            engine.submit(Request(list(range(64)), max_tokens=4))
        with pytest.raises(InputError, match="max_tokens"):
            engine.submit(Request([5, 6], max_tokens=0))
        with pytest.raises(InputError, match="stop"):
            engine.submit(Request([5, 6], max_tokens=4, stop=[3]))
        with pytest.raises(InputError, match="top_k"):  # beyond the vocabulary
            engine.submit(Request([5, 6], max_tokens=4, sampling=SamplingOptions(top_k=10**6)))
        with pytest.raises(InputError, match="vocabulary"):  # refused here, not in the engine's thread
            engine.submit(Request([5, 6], max_tokens=4, sampling=SamplingOptions(logit_bias={10**6: 1.0})))
        with pytest.raises(QueueFull):
            engine.submit(Request([5, 6], max_tokens=4))
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(Request([5, 6], max_tokens=4))


class StepLog:
    """An engine observer noting the decode steps each stream's first token came after."""

    def __init__(self, engine):
        self.engine, self.first_token_step = engine, {}

    def step(self, seconds, rows):
        pass

    def token(self, stream, seconds):
        self.first_token_step.setdefault(id(stream), self.engine.steps)

    def finished(self, stream):
        pass


def test_a_long_prompt_is_prefilled_between_the_running_rows_steps(short_model):
    text = (PROMPTS[0] + " jumps over the lazy dog. ") * 120
    long_prompt = encode(short_model, text)[:1500]  # a 2048-token bucket: four 512-token prefill chunks
    alone = jmoe.generate(short_model, long_prompt, max_new_tokens=6)
    with BatchEngine(short_model, max_batch=2, context=2560, prefill_per_step=512) as engine:
        log = engine.observer = StepLog(engine)
        running = engine.submit(Request(encode(short_model, PROMPTS[1]), max_tokens=60))
        next(iter(running))
        submitted_at_step = engine.steps
        long = engine.submit(Request(long_prompt, max_tokens=6, as_text=False))
        assert list(long) == alone
        # the running row kept decoding while the long prompt went in, a chunk per step
        assert log.first_token_step[id(long)] - submitted_at_step >= 3
        assert running.text() != ""


def test_a_stalled_reader_is_cut_off_and_a_timeout_ends_a_request(short_model):
    import concurrent.futures
    import time

    with BatchEngine(short_model, max_batch=2, context=1024, reader_timeout=0.5) as engine:
        stalled = engine.submit(Request(encode(short_model, PROMPTS[0]), max_tokens=1000))
        next(iter(stalled))  # one piece read, then no more
        read = engine.submit(Request(encode(short_model, PROMPTS[1]), max_tokens=30, as_text=False, logprobs=2))
        short = engine.submit(Request(encode(short_model, PROMPTS[3]), max_tokens=3, logprobs=0))
        # readers that keep reading are not cut; `short` waits for a row, which the stalled request
        # gives up or `read` leaves, whichever comes first, so it is read on a thread of its own
        with concurrent.futures.ThreadPoolExecutor(1) as reader:
            short_read = reader.submit(lambda: list(short.with_logprobs()))
            pairs = list(read.with_logprobs())
            short_read.result(timeout=60)
        assert read.finish_reason == "length" and len(pairs) == 30
        assert short.finish_reason == "length" and short.usage["completion_tokens"] == 3
        assert all(len(lp) == 1 and lp[0].token == piece and len(lp[0].top) == 2 for piece, lp in pairs)
        deadline = time.monotonic() + 60
        while stalled.finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stalled.finish_reason == "reader_timeout" and stalled.usage["completion_tokens"] < 1000
        late = engine.submit(Request(encode(short_model, PROMPTS[2]), max_tokens=30, timeout=0.0))
        assert late.text() == "" and late.finish_reason == "timeout"
        with pytest.raises(InputError, match="logprobs"):
            engine.submit(Request([5, 6], max_tokens=4, logprobs=21))
        assert engine.running == 0



@pytest.mark.parametrize("policy, execution", [("lru+cpu", "auto"), ("lru", "layerwise"), ("lru+prefetch", "resident")])
def test_offloaded_policies_and_execution_paths_serve_what_generate_gives(short_converted, policy, execution):
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=128, max_batch=2)
    budget = plan["dense"] + plan["kv_cache"] + plan["workspace"] + plan["all_experts"] // 3
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget, policy=policy,
                      execution=execution, max_seq_len=128, max_batch=2)
    alone = [jmoe.generate(model, p, max_new_tokens=12) for p in PROMPTS[:3]]
    scored_alone = np.asarray(jmoe.forward(model, encode(model, PROMPTS[3])))
    with BatchEngine(model, max_batch=2, context=128) as engine:  # three requests through two rows
        streams = [engine.submit(Request(encode(model, p), max_tokens=12)) for p in PROMPTS[:3]]
        # what the server's echo scoring runs (jmoe/serving/scoring.py), from another thread, between the engine's steps
        scored = [np.asarray(jmoe.forward(model, encode(model, PROMPTS[3]))) for _ in range(3)]
        texts = [s.text() for s in streams]
    assert texts == alone
    for logits in scored:
        np.testing.assert_allclose(logits, scored_alone, atol=1e-4)
    model.residency.cache.check()
    assert jmoe.stats(model)["peak_resident_expert_bytes"] <= model.memory["experts"]


def failing_step(model, phase: str, *, token: int | None = None, times: int | None = None):
    """The model's step, raising for `phase` steps (only those holding `token`, when given) the first
    `times` times (None: always)."""
    real_step = model.step
    failed = []

    def step(tokens, *args, **kwargs):
        hit = kwargs["phase"] == phase and (token is None or token in np.asarray(tokens))
        if hit and (times is None or len(failed) < times):
            failed.append(phase)
            raise RuntimeError(f"injected {phase} failure")
        return real_step(tokens, *args, **kwargs)

    return step


def test_a_failing_step_ends_its_requests_and_the_engine_goes_on(short_model, monkeypatch):
    alone = jmoe.generate(short_model, PROMPTS[2], max_new_tokens=8)
    with BatchEngine(short_model, max_batch=2, context=128) as engine:
        monkeypatch.setattr(short_model, "step", failing_step(short_model, "decode", times=1))
        failed = engine.submit(Request(encode(short_model, PROMPTS[0]), max_tokens=8))
        failed.text()
        assert failed.finish_reason == "error" and "injected decode failure" in failed.error
        after = engine.submit(Request(encode(short_model, PROMPTS[2]), max_tokens=8))
        assert after.text() == alone and after.finish_reason == "length"
        assert not engine.closed and engine.failure is None


def test_a_request_whose_prefill_fails_fails_alone(short_model, monkeypatch):
    prompt, other = encode(short_model, PROMPTS[1]), encode(short_model, PROMPTS[3])
    marker = next(t for t in prompt if t not in other)  # in the failing request's prefill only
    alone = jmoe.generate(short_model, PROMPTS[3], max_new_tokens=30)
    with BatchEngine(short_model, max_batch=2, context=128) as engine:
        running = engine.submit(Request(other, max_tokens=30))
        pieces = iter(running)
        first = next(pieces)  # running when the other request arrives
        monkeypatch.setattr(short_model, "step", failing_step(short_model, "prefill", token=marker))
        failed = engine.submit(Request(prompt, max_tokens=8))
        assert failed.text() == "" and failed.finish_reason == "error" and "injected prefill" in failed.error
        assert first + "".join(pieces) == alone and running.finish_reason == "length"
        assert engine.running == 0 and not engine.prefilling and not engine.closed


def test_an_engine_whose_steps_keep_failing_stops_and_says_why(short_model, monkeypatch):
    engine = BatchEngine(short_model, max_batch=1, context=64)
    told = []
    engine.on_failure = told.append
    monkeypatch.setattr(short_model, "step", failing_step(short_model, "decode"))
    running = engine.submit(Request(encode(short_model, PROMPTS[0]), max_tokens=8))
    waiting = engine.submit(Request(encode(short_model, PROMPTS[1]), max_tokens=8))
    for s in (running, waiting):
        s.text()
        assert s.finish_reason == "error" and "injected decode failure" in s.error
    engine.close()
    assert engine.closed and "injected decode failure" in engine.failure and told == [engine.failure]
    with pytest.raises(EngineClosed, match="injected decode failure"):
        engine.submit(Request([5, 6], max_tokens=4))


def test_a_row_that_ends_on_eos_reports_the_eos_tokens_logprob(short_model):
    """One logprob per generated token, EOS included (lm-evaluation-harness reads the last one as
    the generated token's): the EOS has no text, but its logprob goes out."""
    eos = short_model.eos_token_ids[0]
    with BatchEngine(short_model, max_batch=2, context=128) as engine:
        stream = engine.submit(Request(encode(short_model, PROMPTS[0]), max_tokens=8, logprobs=2,
                                       sampling=SamplingOptions(logit_bias={eos: 100.0})))
        pieces = list(stream.with_logprobs())
    entries = [entry for _, logprobs in pieces for entry in logprobs]
    assert stream.finish_reason == "stop" and "".join(piece for piece, _ in pieces) == ""
    last = np.asarray(jmoe.forward(short_model, encode(short_model, PROMPTS[0]))[-1], np.float64)
    expected = last[eos] - last.max() - np.log(np.exp(last - last.max()).sum())  # the unbiased model's, as documented
    assert [e.token for e in entries] == [eos] and entries[0].logprob == pytest.approx(expected, abs=1e-4)


def test_a_warmed_up_offloaded_engine_compiles_nothing_on_the_request_path(short_converted):
    """Under a budget (prefill layer-wise, in passes where a layer wants more experts than its pools
    hold; decode fetching in the step): prompts of every length bucket, greedy and sampled, after
    warm-up, compile nothing."""
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=128, max_batch=2,
                            policy="lru+prefetch")
    budget = sum(v for k, v in plan.items() if k != "all_experts") + plan["all_experts"] // 4
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget, policy="lru+prefetch",
                      max_seq_len=128, max_batch=2)
    words = " ".join(PROMPTS).split()
    with BatchEngine(model, max_batch=2, context=128, warm_up=True) as engine:
        compiled = CompileCounter.count()
        streams = [engine.submit(Request(encode(model, " ".join(words[:n])), max_tokens=12,
                                         sampling=SamplingOptions(temperature=0.9 * (n % 2), seed=n)))
                   for n in (2, 9, 17, 30, 41)]
        assert all(s.text() for s in streams)
        assert CompileCounter.count() == compiled
