"""Shared prompt prefixes (jmoe/decoding/prefixes.py): a serving engine and batched generate keep
the blocks of each prompt they prefilled and a later prompt starting with the same tokens copies
them in instead of prefilling them; its tokens do not change, the kept bytes stay within the reservation, the least
recently used blocks go first and nothing compiles on the request path."""

from __future__ import annotations

import numpy as np
import pytest

import jmoe
from jmoe.decoding import prefixes
from jmoe.decoding.decoder import Decoder
from jmoe.decoding.prefixes import PREFIX_BLOCK, PrefixCache
from jmoe.errors import InputError
from jmoe.serving import BatchEngine, Request
from jmoe.serving.compiles import CompileCounter
from tests.conftest import dev_text


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 4000, size=n).tolist()


def test_blocks_are_found_by_their_whole_prefix_and_the_last_token_is_left_to_prefill():
    store = PrefixCache(capacity=10 * 8, block_nbytes=8, block=4)
    a = tokens(0, 10)  # two full blocks and two tokens
    store.keep(a, lambda j: f"a{j}")
    assert store.lookup(a) == ["a0", "a1"]
    assert store.lookup(a[:8]) == ["a0"]  # the 8th token's logits are needed: its block is prefilled
    assert store.lookup(a[:9]) == ["a0", "a1"]
    # the same second block behind another first block is another prefix
    b = tokens(1, 4) + a[4:8] + [1]
    assert store.lookup(b) == []
    store.keep(b, lambda j: f"b{j}")
    assert store.lookup(b) == ["b0", "b1"] and store.lookup(a) == ["a0", "a1"]
    assert store.nbytes == 4 * 8


def test_the_least_recently_used_leaf_goes_first_and_the_store_keeps_its_bytes():
    store = PrefixCache(capacity=3 * 8, block_nbytes=8, block=4)
    a, b = tokens(2, 9), tokens(3, 9)
    store.keep(a, lambda j: f"a{j}")  # a0 <- a1
    store.keep(b[:5], lambda j: f"b{j}")  # b0
    store.lookup(a)  # a's blocks used after b0's
    store.keep(b, lambda j: f"b{j}")  # b1 needs room: b0 is the oldest leaf, but b1 extends it
    assert store.nbytes <= store.capacity
    assert store.lookup(a) == ["a0"] and store.lookup(b) == ["b0", "b1"]  # a1 (a leaf) went, never a0 before it
    assert store.stats.evicted_blocks == 1
    tiny = PrefixCache(capacity=8, block_nbytes=8, block=4)
    tiny.keep(a, lambda j: f"a{j}")  # room for one block: the first, never a block without its parent
    assert tiny.lookup(a) == ["a0"] and tiny.nbytes == 8


def test_the_reservation_is_planned_and_checked(short_converted):
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512, prefix_cache="auto")
    plain = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512)
    assert plan["prefix_cache"] == plain["kv_cache"]  # auto: one max_seq_len row's worth (max_batch 1)
    assert "prefix_cache" not in plain
    with pytest.raises(InputError, match="prefix_cache"):
        jmoe.load(short_converted, prefix_cache="lots")
    assert jmoe.load(short_converted, compute_dtype="float32", prefix_cache=0).prefixes is None


def test_prompts_sharing_a_prefix_reuse_its_blocks_and_get_what_they_get_alone(short_converted):
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=3, prefix_cache="auto")
    plain = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=3)
    system = model.tokenizer.encode(dev_text("prose"))[:3 * PREFIX_BLOCK + 10]
    prompts = [system + model.tokenizer.encode(f" Question {i}: what is {i} + {i}?") for i in range(5)]
    prompts.append(system[:PREFIX_BLOCK + 1])  # one kept block and one token
    alone = [jmoe.generate(plain, p, max_new_tokens=12) for p in prompts]
    with BatchEngine(model, max_batch=3, context=512, warm_up=True) as engine:
        compiles = CompileCounter.count()
        texts = [engine.submit(Request(p, max_tokens=12, as_text=False)) for p in prompts]
        assert [list(s) for s in texts] == alone
        assert CompileCounter.count() == compiles  # copying blocks in and out was compiled by warm_up
    stats = jmoe.stats(model)["prefix_cache"]
    assert stats["lookups"] == len(prompts) and stats["hits"] == len(prompts) - 1
    assert stats["reused_tokens"] == 4 * 3 * PREFIX_BLOCK + PREFIX_BLOCK  # the first prompt prefilled all of it
    assert model.prefixes.nbytes <= model.memory["prefix_cache"]


def test_batched_generate_reuses_kept_prefixes_row_by_row(short_converted):
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=3, prefix_cache="auto")
    plain = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=3)
    system = model.tokenizer.encode(dev_text("code"))[:3 * PREFIX_BLOCK + 5]
    ask = lambda i: system + model.tokenizer.encode(f" # step {i}: {i * 7}")  # noqa: E731
    first = [ask(0), ask(1)]
    assert jmoe.generate(model, first, max_new_tokens=10) == jmoe.generate(plain, first, max_new_tokens=10)
    stats = model.prefixes.stats
    assert (stats.lookups, stats.hits, stats.kept_blocks) == (2, 0, 3)  # one prompt's blocks, kept once
    # rows behind different padding, one finding only the first block: each copies in what it needs
    second = [ask(2), system[:PREFIX_BLOCK + 3], ask(3) + model.tokenizer.encode(" and more")]
    sampled = dict(max_new_tokens=10, temperature=0.8, seed=3)
    assert jmoe.generate(model, second, **sampled) == jmoe.generate(plain, second, **sampled)
    assert (stats.lookups, stats.hits) == (5, 3)
    assert stats.reused_tokens >= 2 * 3 * PREFIX_BLOCK  # the long rows skipped their three blocks
    # the copied keys and values are what a prefill computes: the prompts' last logits agree
    P = 256
    logits = [np.asarray(prefixes.prefill(Decoder(m, second, P, 512), m.prefixes, second)) for m in (model, plain)]
    np.testing.assert_allclose(*logits, rtol=1e-4, atol=1e-4)
    assert (stats.lookups, stats.hits) == (8, 6)
    # a row that finds nothing: its padding covers the others' blocks here (a short prompt), not
    # there (a long one), where nothing is copied; the answers stand. Without the store, the short
    # row's prompt starts past the first of the two 128-token chunks its batch is prefilled in.
    third = [ask(4), tokens(9, 40)]
    assert jmoe.generate(model, third, max_new_tokens=6) == jmoe.generate(plain, third, max_new_tokens=6)
    assert (stats.lookups, stats.hits) == (10, 7)
    fourth = [ask(5), tokens(10, 230)]
    assert jmoe.generate(model, fourth, max_new_tokens=6) == jmoe.generate(plain, fourth, max_new_tokens=6)
    assert (stats.lookups, stats.hits) == (12, 7)
