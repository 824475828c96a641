"""The serving engine's paged KV cache (jmoe/serving/kv_pages.py): rows of one pool hold only the
pages their tokens reach, admission waits for pages, and when the pool runs short the newest
request gives its pages back and is resumed later. Requests still get what they get alone, no
page is lost or held twice, and the KV reservation load() makes is what the engine runs in."""

from __future__ import annotations

import numpy as np
import pytest

import jmoe
from jmoe.decoding.engine import KV_PAGE, cache_nbytes
from jmoe.errors import InputError
from jmoe.serving import BatchEngine, Request
from jmoe.serving.kv_pages import NO_PAGE, PagePool

PROMPTS = ["The quick brown fox jumps over the lazy dog " * 5, "def main():\n    ", "12 + 35 =", "Python is",
           "The quick brown fox jumps over the lazy dog " * 3, "import os\nimport", "class Stack:", "Beware of"]


def test_the_pool_hands_out_pages_lowest_first_and_takes_every_one_back(short_model):
    pool = PagePool(short_model, pages=5, context=200, page=64)
    assert pool.row_pages == 4 and pool.free == 5
    a, b = pool.new_table(1), pool.new_table(1)
    assert pool.take(a[0], 10, 70)  # slots 10..69: pages 0 and 1 of the row
    assert a[0].tolist() == [0, 1, NO_PAGE, NO_PAGE]
    assert pool.take(a[0], 60, 129)  # only the page it lacks
    assert a[0].tolist() == [0, 1, 2, NO_PAGE]
    assert not pool.take(b[0], 0, 190) and b[0].tolist() == [NO_PAGE] * 4  # three wanted, two free: none taken
    assert pool.take(b[0], 0, 100) and b[0].tolist() == [3, 4, NO_PAGE, NO_PAGE]
    pool.check([a, b])
    pool.release(a[0])
    assert a[0].tolist() == [NO_PAGE] * 4 and pool.free == 3
    assert pool.take(b[0], 0, 200) and b[0].tolist() == [3, 4, 0, 1]  # the lowest free first
    b[0, 3] = 3  # a page held twice, counted once (and page 1 held by no one)
    with pytest.raises(AssertionError, match="holders"):
        pool.check([b])


def test_a_shared_page_is_free_only_once_its_last_holder_lets_go(short_model):
    pool = PagePool(short_model, pages=4, context=128, page=64)
    a, b = pool.new_table(1), pool.new_table(1)
    assert pool.take(a[0], 0, 128) and a[0].tolist() == [0, 1]
    pool.share(b[0], 0, 0)  # b's first page is a's
    assert pool.take(b[0], 64, 100) and b[0].tolist() == [0, 2]
    assert pool.holders(0) == 2 and pool.free == 1
    pool.check([a, b])
    pool.release(a[0])
    assert pool.free == 2 and pool.holders(0) == 1  # page 1 back, page 0 still b's
    pool.check([a, b])
    pool.release(b[0])
    assert pool.free == 4
    pool.check([a, b])
    pool.hold(3)  # a holder nobody's table names
    with pytest.raises(AssertionError, match="page 3 has 0 holders"):
        pool.check([a, b])


def test_pages_promised_to_an_admitted_prompt_go_to_no_one_else(short_model):
    pool = PagePool(short_model, pages=3, context=128, page=64)
    assert pool.reserve(2) and pool.available == 1 and not pool.reserve(2)
    a = pool.new_table(1)
    assert not pool.take(a[0], 0, 128) and a[0].tolist() == [NO_PAGE] * 2  # two wanted, one unpromised
    assert pool.take(a[0], 0, 64) and pool.spare_page() is None
    pool.unreserve(2)  # the prompt's prefill starts: it takes what it was promised
    assert pool.take(a[0], 64, 128) and pool.spare_page() == 2
    pool.drop(2)
    pool.check([a])


def test_rows_sharing_a_pool_smaller_than_their_contexts_get_what_they_get_alone(short_model):
    """Four slots of 256 tokens over 6 pages of 64 (a quarter of four contexts): prompts wait for
    pages, rows grow a page at a time, and the newest rows are set aside and resumed; every greedy
    answer is generate's, and every page is back in the pool at the end."""
    alone = [jmoe.generate(short_model, p, max_new_tokens=60) for p in PROMPTS]
    with BatchEngine(short_model, max_batch=4, context=256, kv_pages=6) as engine:
        streams = [engine.submit(Request(short_model.tokenizer.encode(p), max_tokens=60)) for p in PROMPTS]
        texts = [s.text() for s in streams]
        assert engine.running == 0 and not engine.prefilling and not engine.set_aside
        assert engine.preemptions > 0  # the pool did run short
        assert engine.pool.free == 6 and engine.pool.reserved == 0
        engine.pool.check([engine.table])
    assert texts == alone
    assert all(s.finish_reason in ("length", "stop") and s.error is None for s in streams)


def test_a_row_that_fills_the_pool_alone_ends_at_its_length(short_model):
    """A pool of one context: a second request waits until the first, which the pool cannot let
    grow past its context, is done; both get their whole answers."""
    with BatchEngine(short_model, max_batch=2, context=128, kv_pages=2) as engine:
        first = engine.submit(Request(short_model.tokenizer.encode(PROMPTS[1]), max_tokens=200))
        second = engine.submit(Request(short_model.tokenizer.encode(PROMPTS[2]), max_tokens=20))
        first.text()
        second_text = second.text()
        engine.pool.check([engine.table])
    assert first.finish_reason == "length" and second.finish_reason in ("length", "stop")
    assert second_text == jmoe.generate(short_model, PROMPTS[2], max_new_tokens=20)


def test_load_reserves_the_kv_cache_it_is_given_and_the_engine_runs_in_it(short_converted):
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=8)
    small = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=8, kv_cache="1MiB")
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=8, kv_cache="1MiB")
    page = cache_nbytes(model.config, 1, KV_PAGE, model.kv_dtype)
    assert small["kv_cache"] == (1 << 20) // page * page < plan["kv_cache"]
    assert {k: v for k, v in small.items() if k != "kv_cache"} == {k: v for k, v in plan.items() if k != "kv_cache"}
    assert model.memory["kv_cache"] == small["kv_cache"]
    with BatchEngine(model, max_batch=8, context=256) as engine:
        assert engine.pool.pages == small["kv_cache"] // page
        assert engine.submit(Request(model.tokenizer.encode(PROMPTS[3]), max_tokens=8)).text() == jmoe.generate(
            model, PROMPTS[3], max_new_tokens=8)
    with pytest.raises(InputError, match="fewer than one 256-token context"):
        jmoe.memory_plan(short_converted, max_seq_len=256, kv_cache=page * 3)


def test_a_budget_bounds_the_pool_and_more_rows_than_whole_contexts_run(short_converted):
    """Under a budget the KV pool is what load() reserved (two contexts here), and an engine of
    eight slots runs its requests through it."""
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=2,
                      device_budget=sum(v for k, v in jmoe.memory_plan(
                          short_converted, compute_dtype="float32", max_seq_len=256, max_batch=2).items()))
    with BatchEngine(model, max_batch=8, context=256) as engine:
        assert engine.pool.pages == 2 * 256 // KV_PAGE
        streams = [engine.submit(Request(model.tokenizer.encode(p), max_tokens=24)) for p in PROMPTS]
        texts = [s.text() for s in streams]
        engine.pool.check([engine.table])
    assert texts == [jmoe.generate(model, p, max_new_tokens=24) for p in PROMPTS]
    assert np.all(engine.table == NO_PAGE)
