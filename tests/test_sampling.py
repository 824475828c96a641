"""Sampling filters are transformers' logits processors, ties and top_p=1 included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jmoe.decoding.sampling import HISTORY_DTYPE, SamplingOptions, apply_repetition_penalty, greedy_tokens, warp


def hf_processed(logits: np.ndarray, history: torch.Tensor | None, opts: SamplingOptions) -> np.ndarray:
    """What transformers' generate() makes of the logits with these options (sampling mode)."""
    steps = []
    if opts.repetition_penalty != 1.0:
        steps.append(RepetitionPenaltyLogitsProcessor(opts.repetition_penalty))
    if opts.temperature != 1.0:
        steps.append(TemperatureLogitsWarper(opts.temperature))
    if opts.top_k:
        steps.append(TopKLogitsWarper(opts.top_k))
    if opts.top_p < 1.0:
        steps.append(TopPLogitsWarper(opts.top_p))
    if opts.min_p > 0.0:
        steps.append(MinPLogitsWarper(opts.min_p))
    ids = history if history is not None else torch.zeros((logits.shape[0], 0), dtype=torch.long)
    return LogitsProcessorList(steps)(ids, torch.tensor(logits)).numpy()


def ours(logits: np.ndarray, seen: np.ndarray, opts: SamplingOptions) -> np.ndarray:
    temperature, top_k, one_minus_top_p, penalty, min_p, bias, _, _ = opts.device_params(logits.shape[-1])
    out = apply_repetition_penalty(jnp.asarray(logits) + bias, jnp.asarray(seen), penalty)
    return np.asarray(warp(out, temperature, top_k, one_minus_top_p, min_p))


def assert_same_filter(a: np.ndarray, b: np.ndarray, *, identities: bool = True) -> None:
    """Same number of kept tokens per row with the same values (to float32 rounding: XLA's CPU
    division by a scalar may differ from torch's in the last bit), and the same kept token ids
    unless ties straddle the cut (torch's CPU sort is not stable, so which of several tied tokens
    survives is its implementation's choice)."""
    np.testing.assert_array_equal(np.isinf(a).sum(-1), np.isinf(b).sum(-1))
    for row_a, row_b in zip(a, b):
        np.testing.assert_allclose(np.sort(row_a[np.isfinite(row_a)]), np.sort(row_b[np.isfinite(row_b)]), rtol=1e-6)
    if identities:
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))


OPTIONS = [
    SamplingOptions(temperature=1.0, top_p=0.9),
    SamplingOptions(temperature=0.7, top_k=5),
    SamplingOptions(temperature=1.3, top_k=10, top_p=0.5),
    SamplingOptions(temperature=1.0, top_p=0.05),
    SamplingOptions(temperature=0.5, top_k=50, top_p=0.99, repetition_penalty=1.4),
    SamplingOptions(temperature=2.0, top_k=400),  # k beyond the vocabulary
    SamplingOptions(temperature=1.0, top_p=1.0),  # no filter at all
    SamplingOptions(temperature=1.0, min_p=0.1),
    SamplingOptions(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
]


@pytest.mark.parametrize("opts", OPTIONS,
                         ids=lambda o: f"t{o.temperature}-k{o.top_k}-p{o.top_p}-r{o.repetition_penalty}-m{o.min_p}")
def test_random_logits_filter_exactly_like_transformers(opts):
    rng = np.random.default_rng(opts.top_k * 100 + int(opts.top_p * 100))
    logits = (rng.normal(size=(4, 300)) * 3).astype(np.float32)
    history = torch.tensor(rng.integers(0, 300, size=(4, 12)))
    seen = np.zeros(logits.shape, bool)
    for b, row in enumerate(history.tolist()):
        seen[b, row] = True
    assert_same_filter(ours(logits, seen, opts), hf_processed(logits, history, opts))


@pytest.mark.parametrize("top_p,kept", [(0.25, 1), (0.5, 2), (0.26, 2), (0.75, 3), (1.0, 4)])
def test_tied_logits_keep_as_many_as_transformers(top_p, kept):
    logits = np.zeros((1, 4), np.float32)  # four equally likely tokens
    opts = SamplingOptions(temperature=1.0, top_p=top_p)
    mine = ours(logits, np.zeros_like(logits, bool), opts)
    assert np.isfinite(mine).sum() == kept
    assert_same_filter(mine, hf_processed(logits, None, opts))  # below 16 tokens torch's sort is stable


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.3), (7, 0.6), (0, 0.95)])
def test_many_ties_in_a_large_vocabulary(top_k, top_p):
    rng = np.random.default_rng(top_k + int(top_p * 10))
    logits = rng.integers(-3, 3, size=(3, 500)).astype(np.float32)  # every value shared by ~80 tokens
    opts = SamplingOptions(temperature=1.0, top_k=top_k, top_p=top_p)
    assert_same_filter(ours(logits, np.zeros_like(logits, bool), opts), hf_processed(logits, None, opts),
                       identities=top_p == 1.0)


@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (0, 0.95), (1000, 1.0), (0, 0.5)])
def test_a_real_vocabulary_of_bf16_logits_filters_like_transformers(top_k, top_p):
    """Qwen3's 151,936 tokens, logits rounded through bfloat16 (a GPU step's): ties everywhere, and
    -inf for tokens a bias banned."""
    rng = np.random.default_rng(top_k)
    logits = np.array(jnp.asarray(rng.normal(size=(2, 151_936)) * 4, jnp.bfloat16).astype(jnp.float32))
    logits[:, rng.integers(0, 151_936, 100)] = -np.inf
    opts = SamplingOptions(temperature=0.7, top_k=top_k, top_p=top_p)
    assert_same_filter(ours(logits, np.zeros_like(logits, bool), opts), hf_processed(logits, None, opts),
                       identities=False)


def test_top_p_one_keeps_the_far_tail():
    logits = np.array([[30.0, 0.0, -40.0, -80.0]], np.float32)  # tail probabilities underflow float32 sums
    kept = ours(logits, np.zeros_like(logits, bool), SamplingOptions(temperature=1.0, top_p=1.0))
    np.testing.assert_array_equal(kept, logits)


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 50)).astype(np.float32)
    logits[0, 5] = 0.0  # zero stays zero either way
    history = torch.tensor([[1, 5, 7, 5], [0, 49, 3, 3]])
    seen = np.zeros((2, 50), bool)
    for b, row in enumerate(history.tolist()):
        seen[b, row] = True
    mine = apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), jnp.float32(1.7))
    ref = RepetitionPenaltyLogitsProcessor(1.7)(history, torch.tensor(logits))
    np.testing.assert_array_equal(np.asarray(mine), ref.numpy())


def test_seeds_use_all_64_bits():
    keys = {s: SamplingOptions(seed=s).rng() for s in (0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1)}
    data = {s: tuple(np.asarray(jax.random.key_data(k)).ravel().tolist()) for s, k in keys.items()}
    assert len(set(data.values())) == len(data)  # no two seeds share a stream
    assert data[1] == tuple(np.asarray(jax.random.key_data(jax.random.key(1))).ravel().tolist())


def test_greedy_tokens_take_the_first_largest_logit_as_argmax_does():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 5003)).astype(np.float32)  # not a whole number of vectors
    logits[1, [7, 4000]] = 9.0  # a tie: the first index wins
    logits[2, :] = -np.inf  # nothing allowed: index 0, as argmax
    logits[3, 5002] = np.inf
    logits[4] = np.round(logits[4])  # many ties
    got = np.asarray(greedy_tokens(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got.dtype == np.int32
    nan_row = np.asarray(greedy_tokens(jnp.full((1, 10), jnp.nan)))
    assert 0 <= int(nan_row[0]) < 10


def test_logit_bias_is_added_before_everything_and_bans_greedy_tokens():
    """A bias of -100 takes a token out of greedy decoding and sampling alike; +100 forces one; the
    biased logits are what the penalty and the warpers then see."""
    from jmoe.decoding.sampling import sample_tokens

    logits = jnp.asarray([[5.0, 4.0, 1.0, 0.0]] * 2, jnp.float32)
    seen = jnp.zeros((2, 4), HISTORY_DTYPE)  # nothing generated, no prompt marked

    def draw(opts, greedy, key=0):
        return np.asarray(sample_tokens(logits, seen, jax.random.key(key), *opts.device_params(4), greedy=greedy))

    assert (draw(SamplingOptions(), True) == 0).all()
    banned = SamplingOptions(logit_bias={"0": -100})  # JSON's string keys
    assert (draw(banned, True) == 1).all()
    assert not banned.plain_greedy and SamplingOptions().plain_greedy
    forced = SamplingOptions(temperature=1.0, logit_bias={3: 100.0})
    assert all((draw(forced, False, key) == 3).all() for key in range(5))
    kept = SamplingOptions(temperature=1.0, top_k=1, logit_bias={2: 4.5})  # 1 + 4.5 beats 5 and 4
    assert (draw(kept, False) == 2).all()


@pytest.mark.parametrize("bias,error", [({0: 101}, "logit_bias"), ({-1: 1}, "logit_bias token"),
                                        ({"x": 1}, "logit_bias token"), ({0: float("nan")}, "logit_bias"),
                                        ([1, 2], "logit_bias")])
def test_bad_logit_bias_is_refused(bias, error):
    from jmoe.errors import InputError

    with pytest.raises(InputError, match=error):
        SamplingOptions(logit_bias=bias)


def test_a_logit_bias_token_beyond_the_vocabulary_is_refused():
    from jmoe.errors import InputError

    with pytest.raises(InputError, match="vocabulary"):
        SamplingOptions(logit_bias={400: 1.0}).device_params(300)


@pytest.mark.parametrize("opts,filters", [
    (SamplingOptions(temperature=1.0), ()),
    (SamplingOptions(temperature=0.8, top_k=3), ("top_k",)),
    (SamplingOptions(temperature=1.0, top_p=0.7), ("top_p",)),
    (SamplingOptions(temperature=1.2, min_p=0.2, repetition_penalty=1.3), ("min_p",)),
    (SamplingOptions(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05), ("top_k", "top_p", "min_p")),
    (SamplingOptions(repetition_penalty=1.5, top_k=5, top_p=0.5), ()),  # greedy: no warper changes the argmax
])
def test_a_step_compiles_only_the_warpers_a_request_switches_on(opts, filters):
    """The warpers a request leaves off are not in its step (no bisection over the vocabulary without
    top-k or top-p, and no vocabulary-wide sort at all), and its draws are those of the step with
    every warper at its off value."""
    from jmoe.decoding.sampling import ALL_FILTERS, KEY_BITS, sample_tokens

    assert opts.filters == filters
    V = 64
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, V)) * 3, jnp.float32)
    seen = jnp.asarray(np.random.default_rng(1).random((3, V)) < 0.2)
    params = opts.device_params(V)

    def draw(chosen, key):
        return np.asarray(sample_tokens(logits, seen, jax.random.key(key), *params, greedy=opts.greedy,
                                        filters=chosen))

    for key in range(8):
        np.testing.assert_array_equal(draw(filters, key), draw(ALL_FILTERS, key))
    traced = jax.jit(lambda x: sample_tokens(x, seen, jax.random.key(0), *params, greedy=opts.greedy,
                                             filters=filters)).trace(logits)
    jaxpr = str(traced.jaxpr)
    assert "sort" not in jaxpr
    # nor a loop on a GPU (it would split the step's one command buffer; a CPU's bisection loops)
    assert "while" not in traced.lower(lowering_platforms=("cuda",)).as_text()
    # top-k and top-p each bisect over the vocabulary in KEY_BITS passes (one reduction each)
    assert (jaxpr.count("reduce_sum") >= KEY_BITS) == ("top_k" in filters or "top_p" in filters)


# ---------------------------------------------------------------- OpenAI's presence and frequency penalties
# (transformers has no processor for them: the reference is their definition, as OpenAI and vLLM give it)


def reference_penalties(logits, prompts, generated, opts: SamplingOptions) -> np.ndarray:
    """float64 numpy: the bias, the repetition penalty over prompt and output, then
    logits[t] -= frequency * count[t] + presence * (count[t] > 0) over the generated tokens only."""
    out = logits.astype(np.float64).copy()
    for token, value in opts.logit_bias:
        out[:, token] += value
    for b in range(len(out)):
        seen = sorted(set(prompts[b]) | set(generated[b]))
        r = opts.repetition_penalty
        out[b, seen] = np.where(out[b, seen] < 0, out[b, seen] * r, out[b, seen] / r)
        count = np.bincount(np.asarray(generated[b], int), minlength=out.shape[1])
        out[b] -= opts.frequency_penalty * count + opts.presence_penalty * (count > 0)
    return out


def history_of(prompts, generated, opts: SamplingOptions, V: int):
    """A history as decoding builds it: the prompt's, then each generated token recorded in turn."""
    from jmoe.decoding.sampling import prompt_history, record

    history = jnp.asarray(prompt_history(prompts, V, opts))
    for j in range(max(len(g) for g in generated)):
        rows = [b for b, g in enumerate(generated) if j < len(g)]
        history = record(history, jnp.asarray(rows), jnp.asarray([generated[b][j] for b in rows]))
    return history


PENALTIES = [
    SamplingOptions(frequency_penalty=0.7),
    SamplingOptions(presence_penalty=1.5),
    SamplingOptions(presence_penalty=-0.8, frequency_penalty=2.0),  # negative: encourages repeats
    SamplingOptions(presence_penalty=0.4, frequency_penalty=-2.0, repetition_penalty=1.3, logit_bias={3: 2.5}),
]


@pytest.mark.parametrize("opts", PENALTIES, ids=lambda o: f"p{o.presence_penalty}-f{o.frequency_penalty}")
def test_presence_and_frequency_penalties_follow_their_definition(opts):
    """Over a hand-made history: token 3 generated three times, 5 once, 7 only in the prompt (which
    the repetition penalty counts and these penalties do not); the processed logits, and greedy and
    top-k=1 draws from them, are the definition's."""
    from jmoe.decoding.sampling import biased, sample_tokens

    V = 10
    logits = np.array([[0.5, -1.0, 2.0, 3.2, 0.0, 2.9, -0.3, 3.0, 1.0, -2.0],
                       [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9]], np.float32)  # no ties: top-k=1 is greedy
    prompts = [[7, 1], [2]]
    generated = [[3, 5, 3, 3], [9, 9]]
    history = history_of(prompts, generated, opts, V)
    params = opts.device_params(V)
    temperature, top_k, one_minus_top_p, penalty, min_p, bias, presence, frequency = params
    expected = reference_penalties(logits, prompts, generated, opts)
    mine = np.asarray(biased(jnp.asarray(logits), history, penalty, bias, presence, frequency))
    np.testing.assert_allclose(mine, expected, rtol=1e-6, atol=1e-6)
    assert not opts.plain_greedy
    greedy = np.asarray(sample_tokens(jnp.asarray(logits), history, jax.random.key(0), *params, greedy=True))
    np.testing.assert_array_equal(greedy, expected.argmax(-1))
    top1 = SamplingOptions(temperature=1.0, top_k=1, presence_penalty=opts.presence_penalty,
                           frequency_penalty=opts.frequency_penalty, repetition_penalty=opts.repetition_penalty,
                           logit_bias=opts.logit_bias)
    drawn = np.asarray(sample_tokens(jnp.asarray(logits), history, jax.random.key(1), *top1.device_params(V),
                                     greedy=False, filters=top1.filters))
    np.testing.assert_array_equal(drawn, expected.argmax(-1))


def test_penalties_at_zero_change_nothing_and_the_prompt_is_not_counted():
    from jmoe.decoding.sampling import biased

    V = 6
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(1, V)) * 4, jnp.float32)
    off = SamplingOptions()
    history = history_of([[0, 1, 2]], [[4, 4]], off, V)
    _, _, _, penalty, _, bias, presence, frequency = off.device_params(V)
    np.testing.assert_array_equal(np.asarray(biased(logits, history, penalty, bias, presence, frequency)),
                                  np.asarray(logits))
    on = SamplingOptions(presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=2.0)
    history = history_of([[0, 1, 2]], [[]], on, V)  # a prompt, nothing generated yet
    _, _, _, penalty, _, bias, presence, frequency = on.device_params(V)
    got = np.asarray(biased(logits, history, penalty, bias, presence, frequency))
    np.testing.assert_allclose(got, reference_penalties(np.asarray(logits), [[0, 1, 2]], [[]], on), rtol=1e-6)
    np.testing.assert_array_equal(got[0, 3:], np.asarray(logits)[0, 3:])


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -2.01, float("nan"), float("inf"), 1e308 * 10, "x", True, None])
def test_bad_presence_and_frequency_penalties_are_refused(field, value):
    from jmoe.errors import InputError

    with pytest.raises(InputError, match=field):
        SamplingOptions(**{field: value})


def test_presence_and_frequency_penalties_take_their_whole_range():
    for value in (-2, -2.0, 0, 1.25, 2):
        opts = SamplingOptions(presence_penalty=value, frequency_penalty=value)
        assert opts.presence_penalty == opts.frequency_penalty == float(value)
        assert opts.plain_greedy == (value == 0)


@pytest.mark.parametrize("seed", [3, 2**40])
def test_what_a_sampler_costs_the_host_is_what_it_moves(seed):
    """Sampler.cost (what jmoe counts for making one: its parameters, penalties included, the
    history, the key) against bench/lib/host_io's count of the transfers it makes."""
    from bench.lib import host_io
    from jmoe.decoding.engine import _sample_jit
    from jmoe.decoding.sampling import Sampler

    class Engine:
        sample = _sample_jit

    opts = SamplingOptions(temperature=0.7, seed=seed, presence_penalty=0.5, frequency_penalty=-1.0)
    history = np.zeros((2, 300), np.int32)
    Sampler(Engine, opts, history)  # compiled before counting
    host_io.install()
    try:
        before = host_io.counts()
        Sampler(Engine, opts, history)
        moved = host_io.counts() - before
    finally:
        host_io.uninstall()
    cost = Sampler.cost(opts, history)
    assert (moved.executions, moved.transfers, moved.transfer_bytes) == (cost["executions"], cost["transfers"],
                                                                         cost["nbytes"])


def test_a_samplers_later_draws_run_the_executable_of_its_first():
    """A sampler's arrays committed to the model's device, its first draw (arrays made on the host)
    and the later ones (given the arrays each draw returned) run one executable: an uncommitted
    array and a committed one would make jit compile it twice (docs/design.md)."""
    from jmoe.decoding.engine import _sample_jit
    from jmoe.decoding.sampling import Sampler
    from jmoe.serving.compiles import CompileCounter

    class Engine:
        sample = _sample_jit

    where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    logits = jax.device_put(np.linspace(-3, 3, 2 * 333, dtype=np.float32).reshape(2, 333), where)  # as a step's
    sampler = Sampler(Engine, SamplingOptions(temperature=0.9, top_k=5, seed=11), np.zeros((2, 333), HISTORY_DTYPE),
                      where)
    before = CompileCounter.count()
    first = np.asarray(sampler(logits))
    compiled = CompileCounter.count() - before
    later = [np.asarray(sampler(logits)) for _ in range(2)]
    assert compiled >= 1 and CompileCounter.count() - before == compiled
    assert all(t.shape == (2,) and ((0 <= t) & (t < 333)).all() for t in [first, *later])
