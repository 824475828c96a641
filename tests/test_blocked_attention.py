"""Blocked attention (online softmax over blocks of keys) against attention that materialises every
[query, key] score, for every variant the attention modules use: several score terms (MLA's latent
and rotary keys), grouped query heads, sliding windows, sinks, left padding, rows at different
positions, chunks of several tokens, caches that are not a multiple of the block, int8 caches; and the DyMoE
importance of the current tokens against the attention each cache slot received."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jmoe.layers.attention import (
    AttentionMeta,
    QuantizedRows,
    attention_scores_nbytes,
    blocked_attention,
    current_importance,
    dequantize_rows,
    key_block,
    quantize_rows,
)

NEG = jnp.finfo(jnp.float32).min


def _paged(cache, table, pages, fill):
    """A contiguous cache [B, K, S, w] as a pool of pages [pages, K, page, w]: row b's page p at
    table[b, p] (absent where out of range); pages no row holds filled with `fill`."""
    B, K, S, w = cache.shape
    page = S // table.shape[1]
    pool = np.full((pages, K, page, w), fill, cache.dtype)
    for b, row in enumerate(table):
        for p, at in enumerate(row):
            if 0 <= at < pages:
                pool[at] = cache[b, :, p * page : (p + 1) * page]
    return pool


def paged(cache, page: int, rng, spare: int = 2):
    """A [B, K, S, w] cache (or QuantizedRows of such) as a pool of pages in shuffled order, with
    `spare` pages no row uses (zeros), and its page table [B, ceil(S / page)]: what attention reads."""
    leaves = cache if isinstance(cache, QuantizedRows) else (cache,)
    B, _, S, _ = leaves[0].shape
    n = -(-S // page)
    table = rng.permutation(B * n + spare)[: B * n].reshape(B, n).astype(np.int32)

    def pool(leaf):
        leaf = np.asarray(leaf)
        padded = np.zeros((*leaf.shape[:2], n * page, leaf.shape[3]), leaf.dtype)
        padded[:, :, :S] = leaf
        return jnp.asarray(_paged(padded, table, B * n + spare, 0))

    pools = [pool(leaf) for leaf in leaves]
    return (QuantizedRows(*pools) if isinstance(cache, QuantizedRows) else pools[0]), jnp.asarray(table)


def meta_of(start, key_start, T, table) -> AttentionMeta:
    B = len(start)
    return AttentionMeta(jnp.asarray(start, jnp.int32), jnp.asarray(key_start, jnp.int32), jnp.zeros((B, T, 2)),
                         jnp.zeros((B, T, 2)), table)


def _scores(queries, keys, start, key_start, T, *, groups, scale, window):
    """Every [query, key] score [B, K, G, T, S], which of them each token may attend to [B, T, S], and
    the tokens' slots [B, T]."""
    B, K, M, _ = queries[0].shape
    S = keys[0].shape[2]
    scores = sum(np.einsum("bkmd,bksd->bkms", q, k) for q, k in zip(queries, keys)).reshape(B, K, groups, T, S) * scale
    q_slot = start[:, None] + np.arange(T)[None]  # [B, T]
    k_slot = np.arange(S)[None, None]
    allowed = (k_slot <= q_slot[:, :, None]) & (k_slot >= key_start[:, None, None])
    if window is not None:
        allowed &= q_slot[:, :, None] - k_slot < window
    return scores, allowed, q_slot


def materialised(queries, keys, values, start, key_start, T, *, groups, scale, window, sink):
    """The whole [query, key] score matrix, a masked softmax over it, and the attention each cache
    slot received from the valid current queries (the formulation blocked attention replaces)."""
    B, K, M, _ = queries[0].shape
    S = keys[0].shape[2]
    scores, allowed, q_slot = _scores(queries, keys, start, key_start, T, groups=groups, scale=scale, window=window)
    scores = np.where(allowed[:, None, None], scores, NEG)
    top = scores.max(-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink[None, :, :, None, None])
    e = np.exp(scores - top)
    denominator = e.sum(-1, keepdims=True)
    if sink is not None:
        denominator = denominator + np.exp(sink[None, :, :, None, None] - top)
    probs = e / denominator
    out = np.einsum("bkms,bksd->bkmd", probs.reshape(B, K, M, S), values)
    valid = (q_slot >= key_start[:, None]).astype(np.float64)
    received = np.einsum("bkgts,bt->bs", probs, valid) / (K * groups * np.maximum(valid.sum(-1, keepdims=True), 1))
    current = np.take_along_axis(received, q_slot, axis=1)
    return out, current, valid.astype(bool)


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    K = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    T = draw(st.integers(1, 5))
    S = draw(st.integers(T + 1, 70))
    terms = draw(st.integers(1, 2))
    widths = [draw(st.sampled_from([4, 8])) for _ in range(terms)]
    window = draw(st.one_of(st.none(), st.integers(1, 20)))
    block = draw(st.integers(1, S))
    start = np.array([draw(st.integers(0, S - T)) for _ in range(B)], np.int32)
    key_start = np.array([draw(st.integers(0, s + T)) for s in start], np.int32)  # rows of padding too
    return dict(B=B, K=K, G=G, T=T, S=S, widths=widths, window=window, block=block, start=start,
                key_start=key_start, sink=draw(st.booleans()), int8=draw(st.booleans()),
                page=draw(st.sampled_from([1, 4, 8, 16, 128])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_blocked_attention_equals_the_materialised_softmax(case, reachable_only):
    rng = np.random.default_rng(case["seed"])
    B, K, G, T, S = (case[n] for n in "BKGTS")
    queries = [rng.normal(size=(B, K, G * T, w)).astype(np.float32) for w in case["widths"]]
    keys = [rng.normal(size=(B, K, S, w)).astype(np.float32) for w in case["widths"]]
    values = rng.normal(size=(B, K, S, 6)).astype(np.float32)
    sink = rng.normal(size=(K, G)).astype(np.float32) if case["sink"] else None
    start, key_start, window, scale = case["start"], case["key_start"], case["window"], 0.5
    kw = dict(groups=G, scale=scale, window=window, precision=jax.lax.Precision.HIGHEST)

    def run(queries, keys, values, sink, new_keys, table):
        meta = meta_of(start, key_start, T, table)
        out, softmax = blocked_attention(queries, keys, values, meta, sink=sink, block=case["block"],
                                         reachable_only=reachable_only, **kw)
        return out, current_importance(queries, new_keys, meta, softmax, **kw)

    cached_keys, cached_values = keys, values
    if case["int8"]:  # an int8 cache against the materialised softmax of what it holds
        cached_keys, cached_values = [quantize_rows(k) for k in keys], quantize_rows(values)
        keys = [np.asarray(dequantize_rows(k, jnp.float32)) for k in cached_keys]
        values = np.asarray(dequantize_rows(cached_values, jnp.float32))
    new_keys = [np.stack([k[b, :, s:s + T] for b, s in enumerate(start)]) for k in keys]
    def pages(cache):  # the same shuffled pages for every cached array
        return paged(cache, case["page"], np.random.default_rng(case["seed"] + 1))

    pools = [pages(c)[0] for c in cached_keys]
    value_pool, table = pages(cached_values)
    out, importance = jax.jit(run)(queries, pools, value_pool, sink, new_keys, table)
    want_out, want_importance, valid = materialised(queries, keys, values, start, key_start, T, sink=sink,
                                                    **{k: v for k, v in kw.items() if k != "precision"})
    # queries with a key to attend to: the same output; left-padding queries (none allowed): zeros
    # there, an arbitrary average in the materialised form, never read by a valid token
    has_key = np.broadcast_to(valid[:, None, None], (B, K, G, T)).reshape(B, K, G * T)
    np.testing.assert_allclose(np.asarray(out)[has_key], want_out[has_key], rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(out)[~has_key] == 0)
    np.testing.assert_allclose(np.asarray(importance)[valid], want_importance[valid], rtol=2e-5, atol=1e-6)


def test_a_decode_step_reads_only_the_blocks_its_rows_reach():
    """On the CPU the loop runs from the block of the lowest reachable key to the block of the last
    query: keys past every row's position (zeros here, NaN below) are never read."""
    B, K, G, S, w = 2, 1, 2, 64, 4
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(B, K, S, w)).astype(np.float32)
    values = rng.normal(size=(B, K, S, w)).astype(np.float32)
    keys[:, :, 24:], values[:, :, 24:] = np.nan, np.nan  # never written: no row has reached them
    q = rng.normal(size=(B, K, G, w)).astype(np.float32)
    (key_pool, table), (value_pool, _) = (paged(c, 8, np.random.default_rng(1)) for c in (keys, values))
    meta = meta_of([10, 20], [0, 3], 1, table)
    out, _ = jax.jit(lambda q, k, v: blocked_attention((q,), (k,), v, meta, groups=G, scale=0.5, window=None,
                                                       precision=None, block=8, reachable_only=True))(
        q, key_pool, value_pool)
    assert np.all(np.isfinite(np.asarray(out)))
    want, _, _ = materialised([q], [keys[:, :, :24]], values[:, :, :24], np.array([10, 20]), np.array([0, 3]), 1,
                              groups=G, scale=0.5, window=None, sink=None)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_the_workspace_is_a_block_of_keys_not_the_context():
    heads, chunk = 32, 512
    # a 512-token chunk at a 32K context holds 128 keys' scores per head and token, 16 MiB per row
    assert key_block(heads, chunk, 32768) == 128
    assert attention_scores_nbytes(heads, chunk, 32768) == 2 * heads * chunk * 128 * 4
    assert attention_scores_nbytes(heads, chunk, 32768) == attention_scores_nbytes(heads, chunk, 4096)
    assert key_block(heads, 1, 65536) == 32768  # decode: longer blocks (4 MiB of scores too)
    assert key_block(heads, 1, 100) == 100  # a cache shorter than a block is one block


def test_a_prefill_chunk_at_a_32k_context_needs_a_block_of_scores_not_the_context():
    """Qwen3-30B-A3B's attention (32 query heads on 4 cache heads of 128) for a 512-token chunk over a
    32,768-slot cache, compiled: its temporary buffers stay within the workspace the budget reserves
    for it (materialised scores alone would be 2 GiB per row), read through pages of 64 slots."""
    B, K, G, T, S, hd, page = 1, 4, 8, 512, 32768, 128, 64
    meta = meta_of([0], [0], T, jnp.arange(S // page, dtype=jnp.int32)[None])

    def attend(q, k, v):
        return blocked_attention((q,), (k,), v, meta, groups=G, scale=hd**-0.5, window=None, precision=None)[0]

    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    pool = shape(S // page, K, page, hd)
    compiled = jax.jit(attend).lower(shape(B, K, G * T, hd), pool, pool).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    accumulator = B * K * G * T * hd * 4  # the float32 output being summed (the plan counts it as activations)
    assert temp <= attention_scores_nbytes(K * G, T, S) + accumulator, (temp, attention_scores_nbytes(K * G, T, S))
    assert 2 * K * G * T * S * 4 > 60 * temp


def _softmax_stats(queries, keys, start, key_start, T, *, groups, scale, window, sink):
    """The materialised softmax's maximum and normaliser [B, K, G, T] (float64; -inf and 0 where a
    query has no key and no sink)."""
    scores, allowed, _ = _scores([queries.astype(np.float64)], [keys], start, key_start, T, groups=groups,
                                 scale=scale, window=window)
    scores = np.where(allowed[:, None, None], scores, -np.inf)
    top = scores.max(-1)
    if sink is not None:
        top = np.maximum(top, sink[None, :, :, None])
    safe = np.where(np.isfinite(top), top, 0.0)
    norm = np.exp(scores - safe[..., None]).sum(-1)
    if sink is not None:
        norm = norm + np.exp(sink[None, :, :, None] - safe)
    return top, norm


# (B, K, G, T, S, width, cache, window, sink, page, absent padding): Qwen3-30B-A3B's heads at decode
# and at a speculative verification of 4 tokens; one cache head over 1,104 keys (its range cut into
# chunks merged at the end); rows of padding, a window and int8; a width that is no multiple of 16;
# pages of 64, 16 and sizes that are no power of two; pages wholly within a row's left padding absent.
NATIVE_CASES = [(1, 4, 8, 1, 704, 128, "float32", None, False, 64, False),
                (2, 4, 8, 4, 600, 128, "int8", None, False, 24, False),
                (1, 1, 4, 1, 1104, 64, "bfloat16", None, True, 16, False),
                (3, 2, 4, 2, 300, 32, "int8", 50, True, 20, False),
                (2, 1, 3, 2, 70, 24, "float32", 9, True, 7, False),
                (3, 2, 4, 1, 320, 32, "int8", None, True, 4, True),
                # prompt chunks of a model with few, narrow heads (jmoe.kernels.attention.native_tokens)
                (2, 2, 2, 64, 320, 32, "float32", None, False, 64, False),
                (3, 2, 2, 48, 256, 32, "int8", 40, True, 16, True),
                # queries as lanes (16 or more a cache head): bfloat16, and a ragged last block of lanes
                (1, 2, 4, 16, 512, 64, "bfloat16", None, False, 64, False),
                (2, 1, 3, 7, 140, 24, "float32", 30, True, 20, False)]


def attention_case(case):
    """One NATIVE_CASES case: ((q, keys, values, sink) as the kernels take them, (start, key_start, table),
    the keyword arguments, and the float64 materialised softmax over what each cache holds: (out, top,
    norm, which queries have a key)). The caches are pages in shuffled order among pages no row holds
    (NaN, so any read of them would show)."""
    B, K, G, T, S, w, cache, window, has_sink, page, absent_padding = case
    assert S % page == 0, "the table holds whole pages: S slots a row"
    rng = np.random.default_rng(S)
    q = rng.normal(size=(B, K, G * T, w)).astype(np.float32)
    keys = rng.normal(size=(B, K, S, w)).astype(np.float32)
    values = rng.normal(size=(B, K, S, w)).astype(np.float32)
    sink = rng.normal(size=(K, G)).astype(np.float32) if has_sink else None
    start = np.array([S - T - 7 * b for b in range(B)], np.int32)
    key_start = np.array([0, 5, start[-1] + T][:B], np.int32)  # the third row is all padding
    n = S // page
    pages = B * n + 2
    table = rng.permutation(pages)[: B * n].reshape(B, n).astype(np.int32)
    if absent_padding:  # pages before each row's first real token: none held
        table[(np.arange(n)[None] + 1) * page <= key_start[:, None]] = -1
    if cache == "int8":
        cached_keys, cached_values = quantize_rows(keys), quantize_rows(values)
        keys, values = (np.asarray(dequantize_rows(c, jnp.float32)) for c in (cached_keys, cached_values))
        paged_keys, paged_values = (type(c)(jnp.asarray(_paged(np.asarray(c.values), table, pages, 0)),
                                            jnp.asarray(_paged(np.asarray(c.scales), table, pages, np.nan)))
                                    for c in (cached_keys, cached_values))
    else:
        cached_keys, cached_values = (np.asarray(jnp.asarray(c, cache)) for c in (keys, values))
        keys, values = (np.asarray(c, np.float32) for c in (cached_keys, cached_values))
        paged_keys, paged_values = (jnp.asarray(_paged(c, table, pages, np.nan)) for c in (cached_keys, cached_values))
    kw = dict(groups=G, scale=w**-0.5, window=window)
    keys64, values64 = keys.astype(np.float64), values.astype(np.float64)
    want, _, valid = materialised([q.astype(np.float64)], [keys64], values64, start, key_start, T, sink=sink, **kw)
    want_top, want_norm = _softmax_stats(q, keys64, start, key_start, T, sink=sink, **kw)
    has_key = np.broadcast_to(valid[:, None, None], (B, K, G, T)).reshape(B, K, G * T)
    return (q, paged_keys, paged_values, sink), (start, key_start, table), kw, (want, want_top, want_norm, has_key)


def check_attention(got, want, rtol=1e-5, atol=1e-5):
    """(out, top, norm) against attention_case's float64 softmax: queries without a key get zeros."""
    (out, top, norm), (want, want_top, want_norm, has_key) = [np.asarray(a) for a in got], want
    np.testing.assert_allclose(out[has_key], want[has_key], rtol=rtol, atol=atol)
    assert np.all(out[~has_key] == 0)
    np.testing.assert_allclose(top, want_top, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: f"{c[6]}-w{c[5]}-T{c[3]}-page{c[9]}")
def test_native_attention_equals_the_materialised_softmax(case):
    """cpu_kernels.attention (what blocked_attention runs for a few tokens on the CPU) against the
    materialised softmax in float64 over what each cache holds, read from pages in shuffled order
    among pages no row holds (NaN, so any read of them would show): outputs, maxima and normalisers."""
    import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("native kernels switched off or not built")
    (q, keys, values, sink), (start, key_start, table), kw, want = attention_case(case)
    got = jax.jit(lambda q, k, v, s: cpu_kernels.attention(q, k, v, start, key_start, table, sink=s, **kw))(
        q, keys, values, sink)
    check_attention(got, want)


# (B, G, T, S, key width, second term's width, cache, page): latent attention's shapes scaled down,
# one cache head for every query head, the first term's keys also the values: decode and a
# verification of 3 tokens at 16 query heads (queries as lanes), and fewer heads (a query at a time).
TWO_TERM_CASES = [(2, 16, 1, 300, 64, 16, "bfloat16", 16), (1, 16, 3, 200, 64, 16, "int8", 24),
                  (2, 4, 1, 150, 40, 8, "float32", 7), (2, 4, 2, 90, 32, 16, "int8", 16)]


@pytest.mark.parametrize("case", TWO_TERM_CASES, ids=lambda c: f"{c[6]}-G{c[1]}-T{c[2]}")
def test_native_attention_with_two_score_terms_equals_the_materialised_softmax(case):
    """cpu_kernels.attention with a second score term (latent attention's rotary keys: the query's last
    columns times their own cache), the first term's cache read as the values too, against the float64
    softmax of the summed scores over what each cache holds (an int8 row times its own scale): outputs,
    maxima and normalisers."""
    import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("native kernels switched off or not built")
    B, G, T, S, kw, w2, cache, page = case
    rng = np.random.default_rng(S)
    queries = [rng.normal(size=(B, 1, G * T, w)).astype(np.float32) for w in (kw, w2)]
    keys = [rng.normal(size=(B, 1, S, w)).astype(np.float32) for w in (kw, w2)]
    if cache == "int8":
        cached = [quantize_rows(k) for k in keys]
        keys = [np.asarray(dequantize_rows(c, jnp.float32), np.float64) for c in cached]
    else:
        cached = [jnp.asarray(k, cache) for k in keys]
        keys = [np.asarray(c, np.float64) for c in cached]
    pools = [paged(c, page, np.random.default_rng(7))[0] for c in cached]  # the same pages for both
    table = paged(cached[0], page, np.random.default_rng(7))[1]
    start = np.array([S - T - 5 * b for b in range(B)], np.int32)
    key_start = np.array([0, 3][:B], np.int32)
    heads = {"groups": G, "scale": 0.1, "window": None}

    def attend(q, latent, rotary):  # the latent keys are the values too
        return cpu_kernels.attention(q, latent, latent, start, key_start, table, keys2=rotary, **heads)

    q = np.concatenate(queries, axis=-1)
    out, top, norm = (np.asarray(a) for a in jax.jit(attend)(q, *pools))
    want, _, valid = materialised([x.astype(np.float64) for x in queries], keys, keys[0], start, key_start, T,
                                  sink=None, **heads)
    want_top, want_norm = _softmax_stats(q, np.concatenate(keys, axis=-1), start, key_start, T, sink=None, **heads)
    has_key = np.broadcast_to(valid[:, None, None], (B, 1, G, T)).reshape(B, 1, G * T)
    np.testing.assert_allclose(out[has_key], want[has_key], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(top.reshape(want_top.shape), want_top, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(norm.reshape(want_norm.shape), want_norm, rtol=1e-5, atol=1e-6)


# The Pallas kernel takes widths that are powers of two (>= 16): NATIVE_CASES' others, and float32 with
# a window over pages of 7 slots, absent pages in the padding, 3 query heads of 2 tokens (6 query rows
# padded to 16); and fp8 caches (float8_e4m3fn, which the native kernel does not take).
PALLAS_CASES = [c for c in NATIVE_CASES if c[5] % 16 == 0] + [
    (3, 1, 3, 2, 70, 16, "float32", 9, False, 7, True),
    (2, 4, 8, 4, 600, 128, "float8_e4m3fn", None, False, 24, False),
    (3, 2, 4, 1, 320, 32, "float8_e4m3fn", 50, True, 4, True)]
# Prompt chunks: more current tokens than one tile's MAX_QUERY_ROWS rows hold, run as several tiles
# (the last one partly past the chunk's end), each reaching only up to its own last token.
PROMPT_CASES = [(2, 2, 8, 37, 300, 32, "float32", None, False, 20, False),
                (3, 1, 16, 20, 200, 16, "int8", 24, True, 8, True),
                (1, 2, 4, 70, 260, 64, "bfloat16", None, True, 20, False)]


@pytest.mark.parametrize("case", PALLAS_CASES, ids=lambda c: f"{c[6]}-w{c[5]}-T{c[3]}-page{c[9]}")
def test_pallas_decode_attention_equals_the_materialised_softmax(case):
    """pallas_kernels.decode_attention (what blocked_attention runs for a few tokens on a GPU), in
    interpret mode, against the same float64 softmax as the native kernel: each row's reach split over
    3 programs (a short reach leaves some with no block) and merged after the kernel. A bfloat16
    cache's probabilities are rounded to bfloat16 before they multiply its values, as in the XLA
    formulation."""
    from pallas_kernels.decode_attention import decode_attention

    (q, keys, values, sink), (start, key_start, table), kw, want = attention_case(case)
    got = jax.jit(lambda q, k, v, s: decode_attention(q, k, v, start, key_start, table, sink=s, splits=3,
                                                      precision=jax.lax.Precision.HIGHEST, interpret=True, **kw))(
        q, keys, values, sink)
    check_attention(got, want, **(dict(rtol=1e-2, atol=2e-3) if case[6] == "bfloat16" else {}))


@pytest.mark.parametrize("case", PROMPT_CASES, ids=lambda c: f"{c[6]}-w{c[5]}-T{c[3]}-page{c[9]}")
def test_pallas_prompt_chunk_attention_equals_the_materialised_softmax(case):
    """The same kernel over a prompt chunk, in interpret mode: its tokens in tiles of a few each (every
    query head of a cache head in one tile), each tile's reach split over 2 programs, against the
    float64 softmax."""
    from pallas_kernels.decode_attention import MAX_QUERY_ROWS, decode_attention, supports, tile_tokens

    (q, keys, values, sink), (start, key_start, table), kw, want = attention_case(case)
    G, T = case[2], case[3]
    assert tile_tokens(G, T) < T and G * T > MAX_QUERY_ROWS  # several tiles, more rows than one holds
    assert supports(q, keys, values, G) and not supports(q, keys, values)
    got = jax.jit(lambda q, k, v, s: decode_attention(q, k, v, start, key_start, table, sink=s, splits=2,
                                                      precision=jax.lax.Precision.HIGHEST, interpret=True, **kw))(
        q, keys, values, sink)
    check_attention(got, want, **(dict(rtol=1e-2, atol=2e-3) if case[6] == "bfloat16" else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("case", PALLAS_CASES + PROMPT_CASES, ids=lambda c: f"{c[6]}-w{c[5]}-T{c[3]}-page{c[9]}")
def test_compiled_pallas_decode_attention_equals_the_materialised_softmax_on_gpu(case):
    from pallas_kernels.decode_attention import decode_attention

    (q, keys, values, sink), (start, key_start, table), kw, want = attention_case(case)
    # float32 queries multiplied in float32 (HIGHEST), as the model asks for at float32 compute: the
    # GPU's default for float32 dots is TF32 (10-bit mantissas)
    got = jax.jit(lambda q, k, v, s: decode_attention(q, k, v, start, key_start, table, sink=s, splits=3,
                                                      precision=jax.lax.Precision.HIGHEST, **kw))(q, keys, values, sink)
    check_attention(got, want, **(dict(rtol=1e-2, atol=2e-3) if case[6] == "bfloat16" else dict(rtol=1e-4, atol=1e-4)))


def test_a_decode_step_on_the_cpu_runs_attention_in_one_native_call():
    """blocked_attention hands a decode token to the native kernel on the CPU (its one custom call
    in the compiled step, no XLA dot), with the result of the blocked XLA formulation."""
    import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("native kernels switched off or not built")
    B, K, G, S, w = 2, 2, 4, 96, 32
    rng = np.random.default_rng(1)
    q = rng.normal(size=(B, K, G, w)).astype(np.float32)
    (keys, table), (values, _) = (paged(rng.normal(size=(B, K, S, w)).astype(np.float32), 16,
                                        np.random.default_rng(2)) for _ in range(2))
    meta = meta_of([40, 95], [0, 10], 1, table)
    kw = dict(groups=G, scale=0.3, window=None, precision=jax.lax.Precision.HIGHEST)
    native = jax.jit(lambda q, k, v: blocked_attention((q,), (k,), v, meta, **kw))
    hlo = native.lower(q, keys, values).compile().as_text()
    assert "jmoe_cpu_attention" in hlo and " dot(" not in hlo
    xla = jax.jit(lambda q, k, v: blocked_attention((q,), (k,), v, meta, reachable_only=True, **kw))
    (out, (top, norm)), (want, (want_top, want_norm)) = native(q, keys, values), xla(q, keys, values)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(top), np.asarray(want_top), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(norm), np.asarray(want_norm), rtol=1e-5, atol=1e-6)


def test_the_attention_entry_point_tries_the_kernels_in_order_and_falls_back_to_the_formulation(monkeypatch):
    """jmoe/kernels/attention.py: more current tokens than native_tokens (of both score terms' width
    where there are two, as MLA's) go to the formulation; otherwise the native CPU kernel runs them;
    where it refuses (the native kernels not in use), the Pallas kernel is chosen only when lowered for
    CUDA, so on the CPU the formulation runs."""
    import cpu_kernels.ops
    from jmoe.kernels.attention import MAX_KERNEL_TOKENS, decode_attention, native_tokens

    B, K, G, S, w = 2, 2, 4, 64, 32
    rng = np.random.default_rng(4)
    (keys, table), (values, _) = (paged(rng.normal(size=(B, K, S, w)).astype(np.float32), 16,
                                        np.random.default_rng(5)) for _ in range(2))
    formulation = object()  # what reference() returns: which path ran is told by identity
    kw = dict(groups=G, scale=0.3, window=None, reference=lambda: formulation)
    start, key_start = jnp.asarray([20, 40], jnp.int32), jnp.zeros(B, jnp.int32)

    def attend(tokens, terms=1):
        q = jnp.asarray(rng.normal(size=(B, K, G * tokens, w)).astype(np.float32))
        return decode_attention((q,) * terms, (keys,) * terms, values, start, key_start, table, num_tokens=tokens,
                                **kw)

    assert native_tokens(8, 128) == MAX_KERNEL_TOKENS  # Qwen3-30B-A3B's heads: decode and verification
    most = native_tokens(G, w)
    assert most == 64  # these few, narrow heads: prompt chunks of up to 64 tokens too
    out, _ = attend(1, terms=2)  # two score terms: the native kernel too
    assert out.shape == (B, K, G, w)
    assert attend(native_tokens(G, 2 * w) + 1, terms=2) is formulation
    assert attend(most + 1) is formulation
    out, (top, norm) = attend(most)  # the native kernel
    assert out.shape == (B, K, G * most, w) and top.shape == norm.shape == (B, K, G, most)
    monkeypatch.setattr(cpu_kernels.ops, "available", lambda: False)
    with pytest.raises(NotImplementedError):
        cpu_kernels.ops.attention(jnp.zeros((B, K, G, w)), keys, values, start, key_start, table, groups=G,
                                  scale=0.3, window=None)
    assert attend(1) is formulation


def test_a_decode_step_lowered_for_a_gpu_runs_the_pallas_kernel_and_gathers_no_keys(monkeypatch):
    """Lowered for CUDA (the choice between the kernel and the XLA loop is made when lowered), a decode
    token over a bfloat16 or int8 cache, or a prompt chunk of 40 tokens, is one Pallas kernel and no
    gather of the cache; latent attention's two score terms keep the XLA loop. A process that will
    not lower for a GPU (no GPU backend, JMOE_TRACE_GPU_KERNELS unset) does not trace the kernel. The
    same function on the CPU without its native kernels runs the XLA loop, with the explicit
    formulation's result."""
    import cpu_kernels.ops

    monkeypatch.setattr(cpu_kernels.ops, "available", lambda: False)  # the native kernels run only on the CPU
    monkeypatch.setenv("JMOE_TRACE_GPU_KERNELS", "1")
    B, K, G, S, w, page = 2, 2, 8, 256, 64, 16
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    kw = dict(groups=G, scale=w**-0.5, window=None, precision=None)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")

    def lowered(queries, keys, values, tokens=1):
        meta = meta_of([40, 200], [0, 10], tokens, shape(B, S // page, dtype=jnp.int32))
        attend = jax.jit(lambda q, k, v, table: blocked_attention(q, k, v, meta._replace(table=table), **kw)[0])
        # from jax 0.11 the Pallas Triton lowering asks for the GPU it targets: an abstract mesh names one
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
            text = attend.trace(queries, keys, values, meta.table).lower(lowering_platforms=("cuda",)).as_text()
        return text.count("__gpu$xla.gpu.triton"), "gather" in text

    q, pool = shape(B, K, G, w), shape(B * S // page, K, page, w)
    int8 = QuantizedRows(shape(*pool.shape, dtype=jnp.int8), shape(*pool.shape[:3], 1, dtype=jnp.float32))
    assert lowered((q,), (pool,), pool) == (1, False)
    assert lowered((q,), (int8,), int8) == (1, False)
    assert lowered((shape(B, K, G * 40, w),), (pool,), pool, tokens=40) == (1, False)
    assert lowered((q, q), (pool, pool), pool) == (0, True)
    monkeypatch.delenv("JMOE_TRACE_GPU_KERNELS")
    assert lowered((q,), (pool,), pool) == (0, True)

    rng = np.random.default_rng(3)
    q = rng.normal(size=(B, K, G, w)).astype(np.float32)
    (keys, table), (values, _) = (paged(rng.normal(size=(B, K, S, w)).astype(np.float32), page,
                                        np.random.default_rng(4)) for _ in range(2))
    meta = meta_of([40, 200], [0, 10], 1, table)
    on_cpu = jax.jit(lambda q, k, v: blocked_attention((q,), (k,), v, meta, **kw))
    assert "triton" not in on_cpu.lower(q, keys, values).compile().as_text()
    explicit = jax.jit(lambda q, k, v: blocked_attention((q,), (k,), v, meta, reachable_only=True, **kw))
    for got, want in zip(jax.tree.leaves(on_cpu(q, keys, values)), jax.tree.leaves(explicit(q, keys, values))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
