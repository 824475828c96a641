"""Shared prompt prefixes (jmoe/decoding/prefixes.py, jmoe/serving/kv_prefixes.py): a serving engine
and batched generate keep the blocks of each prompt they prefilled, and a later prompt starting
with the same tokens reuses them instead of prefilling them: in the engine its row reads the kept
pages in place, in generate they are copied in. Its tokens do not change, the kept bytes stay
within the reservation, the least recently used blocks go first, the engine's pool takes back the
pages only the store holds when rows need them, and nothing compiles on the request path."""

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
from jmoe.serving.kv_pages import PagePool
from jmoe.serving.kv_prefixes import PagePrefixes
from jmoe.serving.metrics import EngineMetrics
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


def test_a_block_can_go_only_with_every_block_kept_after_it():
    store = PrefixCache(capacity=10 * 8, block_nbytes=8, block=4)
    store.keep(tokens(4, 13), lambda j: f"a{j}")  # a0 <- a1 <- a2
    assert store.evictable(lambda b: True) == 3
    assert store.evictable(lambda b: b != "a1") == 1  # a2 only: a1 stays, and a0 before it
    assert store.evictable(lambda b: b != "a2") == 0
    assert not store.evict(lambda b: b != "a2") and store.evict(lambda b: b != "a1")
    assert store.blocks() == ["a0", "a1"]


def test_the_engines_store_keeps_pages_in_place_shares_them_and_gives_back_only_its_own(short_model):
    pool = PagePool(short_model, pages=6, context=256, page=PREFIX_BLOCK)
    store = PagePrefixes(pool, blocks=3, shared=PrefixCache(capacity=3, block_nbytes=1))
    first = pool.new_table(1)
    prompt = tokens(5, 2 * PREFIX_BLOCK + 5)
    assert pool.take(first[0], 0, len(prompt))  # pages 0, 1, 2, prefilled from slot 0
    store.keep(prompt, first[0], key_start=0)  # its two full blocks, in place
    assert sorted(store.pages()) == [0, 1] and pool.holders(0) == pool.holders(1) == 2
    assert store.reclaimable() == 0  # the row still reads them
    pool.check([first])
    pool.release(first[0])
    assert pool.free == 4 and store.reclaimable() == 2
    # a prompt starting with both blocks: placed from slot 0, the first page shared, the second
    # copied (the prefill's 32-token bucket starts inside it), the rest its own
    later = prompt[:2 * PREFIX_BLOCK] + tokens(6, 30)
    second = pool.new_table(1)
    assert store.place(later, second[0]) == len(later) - 32
    assert second[0, 0] == 0 and pool.holders(0) == 2 and second[0, 1] not in (1, -1)
    pool.check([second])
    # a third row wanting a whole context (4 pages) with 2 free: the store gives back the page only
    # it holds, not the one the second row reads, and that is not enough
    third = pool.new_table(1)
    assert pool.free == 2 and store.reclaimable() == 1
    assert not pool.take(third[0], 0, 4 * PREFIX_BLOCK) and third[0].tolist() == [-1] * 4
    assert store.pages() == [0] and pool.free == 3
    pool.release(second[0])
    assert pool.take(third[0], 0, 4 * PREFIX_BLOCK) and store.pages() == [0]  # free pages first
    fourth = pool.new_table(1)
    assert pool.take(fourth[0], 0, 2 * PREFIX_BLOCK) and store.pages() == []  # then the store's last
    pool.check([second, third, fourth])
    # blocks off page boundaries (behind padding) are copied onto free pages, while there are any
    pool.release(third[0])
    pool.release(fourth[0])
    assert pool.take(third[0], 10, 10 + len(prompt))
    store.keep(prompt, third[0], key_start=10)
    assert len(store.pages()) == 2 and all(pool.holders(p) == 1 for p in store.pages())
    pool.check([third])


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
        engine.observer = shared = SharedPages(engine)
        compiles = CompileCounter.count()
        texts = [engine.submit(Request(p, max_tokens=12, as_text=False)) for p in prompts]
        assert [list(s) for s in texts] == alone
        assert CompileCounter.count() == compiles  # the page copies were compiled by warm_up
        assert shared.most >= 2  # running rows read the kept system prompt's pages in place
        engine.pool.check([engine.table])  # every page counted by its rows and the store
        assert len(engine.prefixes.pages()) <= model.memory["prefix_cache"] // model.prefixes.block_nbytes
    stats = jmoe.stats(model)["prefix_cache"]
    assert stats["lookups"] == len(prompts) and stats["hits"] == len(prompts) - 1
    assert stats["reused_tokens"] == 4 * 3 * PREFIX_BLOCK + PREFIX_BLOCK  # the first prompt prefilled all of it
    assert model.prefixes.nbytes == 0  # the engine's blocks are pages of its pool


class SharedPages:
    """An engine observer: the most pages held by two or more running rows at one decode step."""

    def __init__(self, engine):
        self.engine, self.most = engine, 0

    def step(self, seconds, rows) -> None:
        held = self.engine.table[self.engine.table >= 0]
        self.most = max(self.most, int((np.bincount(held) >= 2).sum()) if held.size else 0)

    def token(self, stream, seconds) -> None:
        pass

    def finished(self, stream) -> None:
        pass


def test_rows_get_the_pages_only_the_store_holds_when_the_pool_runs_short(short_converted):
    """Four slots of 256 tokens over a pool of 4 row pages and 8 kept-block pages: once the store
    holds 8 blocks, two long requests together need pages only it holds, and get them without
    either being set aside; every answer is generate's."""
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=512, prefix_cache="auto")
    plain = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=512)
    fill = [tokens(20 + i, 2 * PREFIX_BLOCK + 9) for i in range(4)]
    long = [tokens(30 + i, 100) for i in range(2)]
    with BatchEngine(model, max_batch=4, context=256, kv_pages=4) as engine:
        assert engine.pool.pages == 4 + 8
        for p in fill:  # one at a time: each keeps its two blocks
            answer = list(engine.submit(Request(p, max_tokens=4, as_text=False)))
            assert answer == jmoe.generate(plain, p, max_new_tokens=4)
        assert len(engine.prefixes.pages()) == 8 and engine.pool.free == 4
        streams = [engine.submit(Request(p, max_tokens=120, as_text=False)) for p in long]
        outputs = [list(s) for s in streams]
        assert [len(o) for o in outputs] == [120, 120]  # 4 pages each: more than the 4 free
        assert engine.preemptions == 0 and len(engine.prefixes.pages()) < 8
        engine.pool.check([engine.table])
        exposition = EngineMetrics(engine).exposition()[0].decode()
        assert f"jmoe_prefix_cache_pages {float(len(engine.prefixes.pages()))}" in exposition
        assert f"jmoe_kv_pages_free {float(engine.pool.free)}" in exposition
    assert outputs == [jmoe.generate(plain, p, max_new_tokens=120) for p in long]


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


def test_rows_sharing_kept_pages_under_a_small_pool_get_what_they_get_alone(short_converted):
    """Twelve requests over three shared prefixes (one off page boundaries) and a pool that runs
    short: rows read kept pages, are set aside and resumed (finding their own kept blocks), and
    the store gives back pages; every greedy answer is generate's, every page is counted by its
    holders throughout, and none is promised or held by a row at the end."""
    model = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=256, prefix_cache="auto")
    plain = jmoe.load(short_converted, compute_dtype="float32", max_seq_len=256)
    prefixes = [tokens(40, 70), tokens(41, 130), tokens(42, 2 * PREFIX_BLOCK)]
    prompts = [prefixes[i % 3] + tokens(50 + i, 5 + 3 * i) for i in range(12)]  # none reaches the context's end
    with BatchEngine(model, max_batch=4, context=256, kv_pages=7) as engine:
        engine.observer = checked = CheckedPool(engine)
        streams = [engine.submit(Request(p, max_tokens=30 + 5 * (i % 4), as_text=False)) for i, p in enumerate(prompts)]
        outputs = [list(s) for s in streams]
        assert engine.preemptions > 0 and checked.steps > 0
        assert model.prefixes.stats.hits >= 6
        engine.pool.check([engine.table])
        assert engine.pool.reserved == 0 and (engine.table == -1).all()
        assert engine.pool.free + len(engine.prefixes.pages()) == engine.pool.pages
    assert outputs == [jmoe.generate(plain, p, max_new_tokens=30 + 5 * (i % 4)) for i, p in enumerate(prompts)]


class CheckedPool(SharedPages):
    """An engine observer checking the pool's holder counts at every decode step."""

    def __init__(self, engine):
        super().__init__(engine)
        self.steps = 0

    def step(self, seconds, rows) -> None:
        self.engine.pool.check([self.engine.table] + [p.table for p in self.engine.prefilling])
        self.steps += 1
