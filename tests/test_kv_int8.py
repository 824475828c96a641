"""The int8 KV cache (jmoe.load(..., kv_dtype="int8")): each cached head's values rounded to int8
with a float32 scale per slot, read by attention without a dequantised copy; and the fp8 one
(kv_dtype="fp8": float8_e4m3fn, no scale, saturating). The reservation is
the bytes the cache holds; generation, batching and speculation run on it; quality stays close to
the compute-dtype cache (bench/long_context.py records the trained model's perplexity)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from jmoe.decoding.engine import cache_nbytes, new_cache
from jmoe.decoding.evaluate import perplexity
from jmoe.errors import InputError
from jmoe.layers.attention import AttentionMeta, QuantizedRows, dequantize_rows, quantize_rows, write_cache
from jmoe.serving import BatchEngine, Request
from tests.conftest import dev_text


def test_rounding_is_within_half_a_step_of_each_rows_scale():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5, 16)).astype(np.float32) * rng.uniform(0.01, 50, size=(2, 3, 5, 1))
    x[0, 0, 0] = 0.0  # an all-zero row keeps a zero scale and zeros
    q = quantize_rows(jnp.asarray(x))
    scales = np.asarray(q.scales)
    assert q.values.dtype == jnp.int8 and q.scales.shape == (2, 3, 5, 1)
    np.testing.assert_allclose(scales, np.abs(x).max(-1, keepdims=True) / 127, rtol=1e-6)
    error = np.abs(np.asarray(dequantize_rows(q, jnp.float32)) - x)
    assert np.all(error <= scales / 2 + 1e-6 * np.abs(x))
    assert np.all(np.asarray(q.values)[0, 0, 0] == 0) and scales[0, 0, 0, 0] == 0


def test_a_write_stores_each_rows_tokens_at_its_own_slots_and_returns_what_it_stored():
    rng = np.random.default_rng(1)
    cache = QuantizedRows(jnp.zeros((2, 1, 8, 4), jnp.int8), jnp.zeros((2, 1, 8, 1), jnp.float32))
    new = jnp.asarray(rng.normal(size=(2, 1, 3, 4)).astype(np.float32))
    meta = AttentionMeta(jnp.array([0, 4], jnp.int32), None, None, None, jnp.array([[0], [1]], jnp.int32))
    written, stored = write_cache(cache, new, meta)
    held = np.asarray(dequantize_rows(written, jnp.float32))
    np.testing.assert_array_equal(held[0, :, 0:3], np.asarray(stored)[0])
    np.testing.assert_array_equal(held[1, :, 4:7], np.asarray(stored)[1])
    assert np.all(held[0, :, 3:] == 0) and np.all(held[1, :, :4] == 0) and np.all(held[1, :, 7:] == 0)
    np.testing.assert_allclose(np.asarray(stored), np.asarray(new), atol=np.abs(np.asarray(new)).max() / 127)


def test_the_reservation_is_the_bytes_the_cache_holds(short_model):
    cfg = short_model.config
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn):
        cache = new_cache(cfg, 3, 64, dtype)
        held = sum(leaf.nbytes for leaf in jax.tree.leaves(cache.layers))
        assert held == cache_nbytes(cfg, 3, 64, dtype)
    # four bytes a number against one and a float32 scale per head's width
    width = cfg.head_dim
    assert cache_nbytes(cfg, 1, 64, jnp.int8) * 4 * width == cache_nbytes(cfg, 1, 64, jnp.float32) * (width + 4)


def test_load_reserves_the_int8_cache_and_refuses_other_kv_dtypes(short_converted):
    plain = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=4)
    int8 = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=4, kv_dtype="int8")
    assert int8["kv_cache"] < plain["kv_cache"] / 3.5
    assert {k: v for k, v in int8.items() if k != "kv_cache"} == {k: v for k, v in plain.items() if k != "kv_cache"}
    bf16 = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512, max_batch=4, kv_dtype="bfloat16")
    assert bf16["kv_cache"] * 2 == plain["kv_cache"]
    with pytest.raises(InputError, match="kv_dtype"):
        jmoe.load(short_converted, kv_dtype="int4")
    with pytest.raises(InputError, match="kv_dtype"):
        jmoe.memory_plan(short_converted, kv_dtype="float8")


@pytest.fixture(scope="module")
def int8_model(short_converted):
    return jmoe.load(short_converted, compute_dtype="float32", kv_dtype="int8", max_seq_len=256, max_batch=3,
                     draft="bf16")


def test_perplexity_stays_within_a_percent_of_the_float_cache(short_model, int8_model):
    ids = short_model.tokenizer.encode(dev_text("prose"))[:384]
    plain = perplexity(short_model, ids, window=128)
    rounded = perplexity(int8_model, ids, window=128)
    assert rounded != plain  # the int8 cache is what attention read
    assert abs(rounded / plain - 1) < 0.01, (plain, rounded)


def test_a_bfloat16_cache_under_float32_compute_holds_bfloat16_and_keeps_perplexity(short_model, short_converted):
    """kv_dtype="bfloat16" beside a float32 compute dtype (llama.cpp's f16 cache's bytes): the cache
    holds bfloat16, and the trained model's perplexity moves by well under a percent."""
    model = jmoe.load(short_converted, compute_dtype="float32", kv_dtype="bfloat16", max_seq_len=256)
    assert {leaf.dtype for leaf in jax.tree.leaves(new_cache(model.config, 1, 8, model.kv_dtype).layers)} == {
        jnp.dtype(jnp.bfloat16)}
    ids = short_model.tokenizer.encode(dev_text("prose"))[:256]
    plain, rounded = perplexity(short_model, ids, window=128), perplexity(model, ids, window=128)
    assert rounded != plain
    assert abs(rounded / plain - 1) < 0.005, (plain, rounded)


def test_batching_and_speculation_on_an_int8_cache_give_what_plain_decoding_gives(int8_model):
    prompts = ["The quick brown fox", "def main():\n    ", "12 + 35 =", "Python is"]
    alone = [jmoe.generate(int8_model, p, max_new_tokens=16) for p in prompts]
    speculated = [jmoe.generate(int8_model, p, max_new_tokens=16, speculative="bf16") for p in prompts]
    assert speculated == alone
    with BatchEngine(int8_model, max_batch=3, context=256) as engine:
        streams = [engine.submit(Request(int8_model.tokenizer.encode(p), max_tokens=16)) for p in prompts]
        assert [s.text() for s in streams] == alone
        leaves = jax.tree.leaves(engine.cache.layers)
        assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.int8), jnp.dtype(jnp.float32)}


def test_an_fp8_cache_saturates_holds_a_byte_a_number_and_serves_what_generate_gives(short_model, short_converted):
    """kv_dtype="fp8" (float8_e4m3fn, as GPUs with fp8 hold it): a value past its range is held at its
    largest (448), never NaN; the reservation is a byte a number; the trained model's perplexity
    moves by a few percent at most; the serving engine's pages answer as generate does."""
    assert jmoe.load(short_converted, compute_dtype="float32", kv_dtype="float8_e4m3fn",
                     max_seq_len=64).kv_dtype == jnp.float8_e4m3fn
    cache = new_cache(short_model.config, 2, 8, jnp.float8_e4m3fn).layers[0][0]
    meta = AttentionMeta(jnp.asarray([0, 4], jnp.int32), jnp.zeros(2, jnp.int32), None, None,
                         jnp.arange(2, dtype=jnp.int32)[:, None])
    new = jnp.asarray(np.random.default_rng(0).normal(size=(2, cache.shape[1], 3, cache.shape[3])), jnp.float32)
    new = new.at[0, 0, 0, 0].set(1000.0).at[1, 0, 2, 1].set(-1e6)
    written, stored = write_cache(cache, new, meta)
    held = np.asarray(written.astype(jnp.float32))
    assert written.dtype == jnp.float8_e4m3fn and np.isfinite(held).all()
    assert held[0, 0, 0, 0] == 448 and held[1, 0, 6, 1] == -448
    np.testing.assert_array_equal(held[0, :, 0:3], np.asarray(stored)[0])
    np.testing.assert_allclose(np.asarray(stored)[0, 1:], np.asarray(new)[0, 1:], rtol=2**-4, atol=2**-10)
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512, kv_dtype="fp8")
    assert plan["kv_cache"] * 4 == jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=512)["kv_cache"]

    model = jmoe.load(short_converted, compute_dtype="float32", kv_dtype="fp8", max_seq_len=256, max_batch=3)
    ids = short_model.tokenizer.encode(dev_text("prose"))[:256]
    plain, rounded = perplexity(short_model, ids, window=128), perplexity(model, ids, window=128)
    assert rounded != plain
    assert abs(rounded / plain - 1) < 0.03, (plain, rounded)
    prompts = ["The quick brown fox", "def main():\n    ", "12 + 35 ="]
    alone = [jmoe.generate(model, p, max_new_tokens=12) for p in prompts]
    with BatchEngine(model, max_batch=3, context=256) as engine:
        streams = [engine.submit(Request(model.tokenizer.encode(p), max_tokens=12)) for p in prompts]
        assert [s.text() for s in streams] == alone
        assert {leaf.dtype for leaf in jax.tree.leaves(engine.cache.layers)} == {jnp.dtype(jnp.float8_e4m3fn)}
