"""Generation engine: buckets, batching, streaming, stop conditions, sampling, bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

import jmoe
from jmoe.errors import InputError


def test_prompt_lengths_in_one_bucket_compile_once(tiny_model, tiny_tokenizer):
    jmoe.generate(tiny_model, "x = 1", max_new_tokens=4)
    forward, sample = tiny_model.engine.forward, tiny_model.engine.sample
    compiled = (forward._cache_size(), sample._cache_size())
    for prompt in ["def f(x):", "The quick brown fox", "import os\nimport sys\nimport re\n"]:
        assert len(tiny_tokenizer.encode(prompt)) <= 16  # all in the first prompt bucket
        jmoe.generate(tiny_model, prompt, max_new_tokens=4)
    assert (forward._cache_size(), sample._cache_size()) == compiled


def test_a_shorter_request_reuses_a_larger_compiled_cache():
    from jmoe.decoding.generation import CACHE_REUSE_FACTOR, plan_lengths

    prompt = [[1] * 10]  # prompt bucket 16
    assert plan_lengths(prompt, 20, 4096).cache == 64
    assert plan_lengths(prompt, 20, 4096, used_caches=(512, 256, 32)).cache == 256  # the smallest larger one
    assert plan_lengths(prompt, 20, 4096, used_caches=(CACHE_REUSE_FACTOR * 64 * 2,)).cache == 64  # too large
    assert plan_lengths(prompt, 200, 4096, used_caches=(64, 128)).cache == 256  # never a smaller one
    assert plan_lengths(prompt, 20, 100, used_caches=(128,)).cache == 64  # never past the context


def test_shorter_requests_run_on_compiled_steps(tiny_converted):
    """After a long request, a shorter one of as many rows takes its cache: nothing compiles, and
    greedy decoding gives the long request's first tokens (its cache's extra slots are never read)."""
    from jmoe.serving.compiles import no_compiles

    model = jmoe.load(tiny_converted, compute_dtype="float32", max_seq_len=1024)
    prompt = list(range(5, 15))
    long = jmoe.generate(model, prompt, max_new_tokens=150)  # cache 256
    assert model.cache_lengths == {1: {256}}
    with no_compiles("a shorter request"):
        short = jmoe.generate(model, prompt, max_new_tokens=20)  # cache 64 on its own
    assert short == long[:20]
    assert model.cache_lengths == {1: {256}}
    jmoe.generate(model, [prompt, prompt], max_new_tokens=20)  # another batch size: its own bucket
    assert model.cache_lengths == {1: {256}, 2: {64}}


def test_batch_is_left_padded_correctly(tiny_model):
    prompts = ["def add(a, b):", "The tutorial", "12 + 30 = 42\n7 * 8 ="]
    batched = jmoe.generate(tiny_model, prompts, max_new_tokens=24)
    assert batched == [jmoe.generate(tiny_model, p, max_new_tokens=24) for p in prompts]


def test_streaming_yields_the_same_text(tiny_model):
    prompt = "class Parser:\n"
    whole = jmoe.generate(tiny_model, prompt, max_new_tokens=40)
    pieces = list(jmoe.generate(tiny_model, prompt, max_new_tokens=40, stream=True))
    assert len(pieces) > 5 and "".join(pieces) == whole


def test_stop_string_ends_generation(tiny_model):
    prompt = "def fibonacci(n):"
    whole = jmoe.generate(tiny_model, prompt, max_new_tokens=48)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    cut = whole[: whole.index(stop)]
    assert jmoe.generate(tiny_model, prompt, max_new_tokens=48, stop=[stop]) == cut
    assert "".join(jmoe.generate(tiny_model, prompt, max_new_tokens=48, stop=stop, stream=True)) == cut


def test_token_ids_in_token_ids_out(tiny_model, tiny_tokenizer):
    prompt = "for i in range(10):"
    ids = jmoe.generate(tiny_model, tiny_tokenizer.encode(prompt), max_new_tokens=16)
    assert all(isinstance(t, int) for t in ids) and len(ids) == 16
    assert tiny_tokenizer.decode(ids) == jmoe.generate(tiny_model, prompt, max_new_tokens=16)


def test_eos_stops_generation(tiny_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("print(")
    first = jmoe.generate(tiny_model, ids, max_new_tokens=4)
    eos_at_second = dataclasses.replace(tiny_model, config=dataclasses.replace(tiny_model.config, eos_token_ids=(first[1],)))
    assert jmoe.generate(eos_at_second, ids, max_new_tokens=4) == first[:1]


def test_sampling_is_seeded(tiny_model):
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95)
    a = jmoe.generate(tiny_model, "The", seed=1, **kw)
    assert a == jmoe.generate(tiny_model, "The", seed=1, **kw)
    others = {jmoe.generate(tiny_model, "The", seed=s, **kw) for s in (2, 3, 4)}
    assert others - {a}, "different seeds should give different samples"


def test_top_k_1_is_greedy(tiny_model):
    greedy = jmoe.generate(tiny_model, "import", max_new_tokens=20)
    assert jmoe.generate(tiny_model, "import", max_new_tokens=20, temperature=0.7, top_k=1, seed=5) == greedy


def test_repetition_penalty_matches_transformers(tiny_model, tiny_hf_model, tiny_tokenizer):
    prompt = "import os\n"
    ours = jmoe.generate(tiny_model, prompt, max_new_tokens=32, repetition_penalty=1.3)
    ids = tiny_tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = tiny_hf_model.generate(ids, max_new_tokens=32, do_sample=False, repetition_penalty=1.3)
    assert ours == tiny_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert ours != jmoe.generate(tiny_model, prompt, max_new_tokens=32)


def test_chat_messages_use_the_chat_template(tiny_converted, tmp_path):
    # without one (the bundled model), a `role: content` transcript, as `jmoe chat` and the server prompt it
    base = jmoe.load(tiny_converted, compute_dtype="float32")
    assert jmoe.generate(base, [{"role": "user", "content": "def add(a, b):"}], max_new_tokens=12) == jmoe.generate(
        base, "user: def add(a, b):\nassistant:", max_new_tokens=12)
    copy = tmp_path / "chat"
    shutil.copytree(tiny_converted, copy)
    cfg_path = copy / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    cfg_path.write_text(json.dumps(cfg))
    model = jmoe.load(copy, compute_dtype="float32")
    messages = [{"role": "user", "content": "def add(a, b):"}]
    assert jmoe.generate(model, messages, max_new_tokens=12) == jmoe.generate(
        model, "user: def add(a, b):\nassistant:", max_new_tokens=12
    )


def test_bad_prompts_are_refused(tiny_model):
    with pytest.raises(InputError, match="empty"):
        jmoe.generate(tiny_model, "")
    with pytest.raises(InputError, match="empty"):
        jmoe.generate(tiny_model, [])
    with pytest.raises(InputError, match="context"):
        jmoe.generate(tiny_model, [1] * 5000)
    with pytest.raises(InputError, match="max_new_tokens"):
        jmoe.generate(tiny_model, "x", max_new_tokens=0)
    with pytest.raises(InputError, match="top_p"):
        jmoe.generate(tiny_model, "x", temperature=1.0, top_p=0.0)
    with pytest.raises(InputError, match="mix"):
        jmoe.generate(tiny_model, ["text", [1, 2, 3]])
    with pytest.raises(InputError, match="stop strings need text"):
        jmoe.generate(tiny_model, [1, 2, 3], stop="x")


def test_output_is_clamped_to_the_context(tiny_converted):
    model = jmoe.load(tiny_converted, compute_dtype="float32", max_seq_len=64)
    ids = jmoe.generate(model, list(range(1, 40)), max_new_tokens=100)
    assert len(ids) == 64 - 39  # every slot of the context used, none beyond


PENALTY_PROMPT = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12]  # the short model's greedy output repeats a token


def test_presence_and_frequency_penalties_in_greedy_generation(short_model):
    """At 0 they are plain greedy; large, no generated token comes twice; and each token is the
    argmax of the model's logits (jmoe.forward over the whole output, independent of the decode
    loop) after the definition's penalties over the tokens generated before it, not the prompt's."""
    import numpy as np

    plain = jmoe.generate(short_model, PENALTY_PROMPT, max_new_tokens=24)
    assert len(set(plain)) < len(plain)  # it repeats itself: the penalties have something to change
    assert jmoe.generate(short_model, PENALTY_PROMPT, max_new_tokens=24, presence_penalty=0.0,
                         frequency_penalty=0.0) == plain
    distinct = jmoe.generate(short_model, PENALTY_PROMPT, max_new_tokens=24, presence_penalty=2.0,
                             frequency_penalty=2.0)
    assert len(distinct) == 24 and len(set(distinct)) == 24
    presence, frequency = 0.5, 1.5
    out = jmoe.generate(short_model, PENALTY_PROMPT, max_new_tokens=24, presence_penalty=presence,
                        frequency_penalty=frequency)
    assert out != plain and len(out) == 24
    logits = np.asarray(jmoe.forward(short_model, PENALTY_PROMPT + out), np.float64)
    V = logits.shape[-1]
    for i, token in enumerate(out):
        count = np.bincount(np.asarray(out[:i], int), minlength=V)
        row = logits[len(PENALTY_PROMPT) - 1 + i] - frequency * count - presence * (count > 0)
        assert row[token] >= row.max() - 1e-4, (i, token, int(row.argmax()))
