"""EleutherAI's lm-evaluation-harness against the OpenAI-compatible server on 127.0.0.1, through its
`local-completions` model and Python API, on the two tasks bundled in tests/data/lm_eval:
jmoe_choice (multiple choice: loglikelihood requests, which it sends as completions with echo and
logprobs) and jmoe_complete (generate_until). Each document's log-likelihoods, greedy flags and
generated text are checked against jmoe.forward / jmoe.generate run directly on the model, and the
accuracies lm-eval reports against the ones computed from those. It runs lm-eval as
`python -m bench.quality --server URL` does (bench.quality.evaluate_server)."""

from __future__ import annotations

import time

import huggingface_hub.constants
import jax
import numpy as np
import pytest

import jmoe
from bench.quality import LM_EVAL_TASKS, evaluate_server
from jmoe.serving import BatchEngine
from tests.conftest import DATA
from tests.serving_helpers import serving

NAME = "tiny"
CONTEXT = 256


@pytest.fixture(scope="module")
def model(short_converted):
    return jmoe.load(short_converted, compute_dtype="float32", max_seq_len=CONTEXT, max_batch=4)


@pytest.fixture(scope="module")
def served(model):
    """(base URL, engine, model): a server on an ephemeral port, stopped after the module."""
    engine = BatchEngine(model, max_batch=4, max_waiting=64, context=CONTEXT)  # no warm-up: nothing here is timed
    with serving(engine, NAME) as base:
        yield base, engine, model


@pytest.fixture
def offline(monkeypatch):
    """No network: the tokenizer is read from the converted model's directory, the tasks' documents
    from tests/data (huggingface_hub read HF_HUB_OFFLINE when it was imported, hence its constant)."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def continuation_logprobs(model, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) and whether greedy decoding would produce it, split into tokens
    as lm-eval splits them (the whole text's tokens past those of the context alone)."""
    whole = model.tokenizer.encode(context + continuation, add_special_tokens=False)
    first = len(model.tokenizer.encode(context, add_special_tokens=False))
    logp = np.asarray(jax.nn.log_softmax(jmoe.forward(model, whole), axis=-1))  # row t predicts token t + 1
    rows = logp[first - 1 : len(whole) - 1]
    wanted = np.asarray(whole[first:])
    return float(rows[np.arange(len(wanted)), wanted].sum()), bool((rows.argmax(-1) == wanted).all())


def test_lm_eval_harness_through_the_server_scores_as_the_model_does(served, short_converted, offline):
    base, engine, model = served
    assert LM_EVAL_TASKS == DATA / "lm_eval"
    began = time.monotonic()
    # bench.quality --server's path; batches of 2 prompts per request, 2 requests at once: lists of
    # token-id prompts, and echo scoring beside generation in the engine
    results = evaluate_server(base, short_converted, ["jmoe_choice", "jmoe_complete"], concurrent=2, batch_size=2)
    assert results["config"]["model_args"]["model"] == NAME and results["config"]["model_args"]["max_length"] == CONTEXT
    elapsed = time.monotonic() - began
    samples = {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in results["samples"]}

    choice = samples["jmoe_choice"]
    assert len(choice) == 6
    correct = []
    for sample in choice:
        doc = sample["doc"]
        direct = [continuation_logprobs(model, doc["question"], " " + c) for c in doc["choices"]]
        got = [tuple(r) for r in sample["filtered_resps"]]
        assert [g[0] for g in got] == pytest.approx([d[0] for d in direct], abs=1e-4), doc["question"]
        assert [g[1] for g in got] == [d[1] for d in direct], doc["question"]
        correct.append(int(np.argmax([d[0] for d in direct])) == doc["answer"])
    accuracy = results["results"]["jmoe_choice"]["acc,none"]
    assert accuracy == pytest.approx(np.mean(correct))
    assert 0 < accuracy < 1  # the documents hold both outcomes, so a mix-up of choices would show

    complete = samples["jmoe_complete"]
    assert len(complete) == 6
    matches = []
    for sample in complete:
        doc, (text,) = sample["doc"], sample["resps"][0]
        options = sample["arguments"][0][1]
        # what local-completions asks for: greedy, max_gen_toks tokens, until + the EOS string as stop
        assert options["max_gen_toks"] == 8 and options["until"] == ["\n", ","]
        stop = options["until"] + [model.tokenizer.eos_token]
        assert text == jmoe.generate(model, doc["context"], max_new_tokens=8, stop=stop), doc["context"]
        matches.append(text == doc["target"])
    assert results["results"]["jmoe_complete"]["exact_match,none"] == pytest.approx(np.mean(matches))
    assert 0 < np.mean(matches) < 1
    assert engine.running == 0 and not engine.waiting
    print(f"lm-eval's run: {elapsed:.1f} s")
