"""Speculative decoding with the model's own low-precision draft: exactness, the sampler's
distribution, the lookahead buffer's phases, the draft's budget, the governor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

import jmoe
from convert import convert_checkpoint
from jmoe.decoding.sampling import HISTORY_DTYPE, PROMPT_MARK, SamplingOptions
from jmoe.decoding.speculative import EXPLORE, PLAIN_RUN, Governor, _processed, accept
from jmoe.layers.experts import VERIFY_BLOCK_ROWS, grouped_expert_ffn
from tests.hf_models import FAMILIES, make_checkpoint

PROMPT = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12]
NEW = 24


@pytest.fixture(scope="module")
def three_tiers(tmp_path_factory, short_hf_dir):
    return convert_checkpoint(short_hf_dir, tmp_path_factory.mktemp("spec") / "m", tiers="bf16,int4,int2",
                              progress=False)


@pytest.fixture(scope="module")
def plain_greedy(three_tiers):
    return jmoe.generate(jmoe.load(three_tiers, compute_dtype="float32", tier="bf16"), PROMPT, max_new_tokens=NEW)


def budgeted(path, fraction: float, draft: str, **kw):
    plan = jmoe.memory_plan(path, tier="bf16", compute_dtype="float32", draft=draft, policy="lru")
    fixed = sum(v for k, v in plan.items() if k != "all_experts")  # with the draft, staging and fetch slots
    return jmoe.load(path, compute_dtype="float32", tier="bf16", draft=draft, policy="lru",
                     device_budget=fixed + int(fraction * plan["all_experts"]), **kw)


# ---------------------------------------------------------------- greedy: identical to plain greedy


@pytest.mark.parametrize("draft", ["int4", "int2"])
def test_greedy_speculative_equals_greedy_all_resident(three_tiers, plain_greedy, draft):
    # a fixed k: the automatic one follows measured times and may stop drafting on a busy machine
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    out = jmoe.generate(model, PROMPT, max_new_tokens=NEW, speculative=dict(draft=draft, k=3))
    assert out == plain_greedy
    spec = jmoe.stats(model)["speculative"]
    assert spec["accepted_tokens"] > 0 and spec["drafted_tokens"] >= spec["accepted_tokens"]


@pytest.mark.parametrize("fraction,execution", [(0.25, "auto"), (0.6, "auto"), (0.25, "layerwise"), (0.6, "resident")])
def test_greedy_speculative_equals_greedy_offloaded(three_tiers, plain_greedy, fraction, execution):
    model = budgeted(three_tiers, fraction, "int4", execution=execution)
    assert jmoe.generate(model, PROMPT, max_new_tokens=NEW, speculative={"draft": "int4", "k": 3}) == plain_greedy
    model.residency.cache.check()
    assert sum(model.memory.values()) <= model.device_budget


@pytest.mark.parametrize("k", [1, 5, "auto"])  # verification blocks of 2 and 8 (6 padded), and the governor's
def test_greedy_speculative_any_k(three_tiers, plain_greedy, k):
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    assert jmoe.generate(model, PROMPT, max_new_tokens=NEW, speculative={"draft": "int2", "k": k}) == plain_greedy


def test_greedy_speculative_with_presence_and_frequency_penalties_equals_plain(three_tiers):
    """The draft's steps and the verification count the drafted tokens before each position (a
    verification that missed them would keep drafts the plain penalised decode never picks)."""
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    kw = dict(max_new_tokens=NEW, presence_penalty=0.5, frequency_penalty=1.5)
    expected = jmoe.generate(model, PROMPT, **kw)
    assert expected != jmoe.generate(model, PROMPT, max_new_tokens=NEW)  # the penalties change the output
    assert jmoe.generate(model, PROMPT, speculative=dict(draft="int4", k=3), **kw) == expected
    spec = jmoe.stats(model)["speculative"]
    assert spec["accepted_tokens"] > 0


def test_a_verification_block_counts_the_drafts_before_each_position():
    """processed_block at position j equals processed with the history plus drafts[:j] recorded one
    by one (a token drafted twice counted twice), the prompt's mark left out of the counts."""
    from jmoe.decoding.acceptance import processed_block
    from jmoe.decoding.sampling import prompt_history, record

    V, T = 16, 4
    sampling = SamplingOptions(temperature=0.9, presence_penalty=0.3, frequency_penalty=1.1, repetition_penalty=1.2)
    params = sampling.device_params(V)
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(2, T, V)) * 2, jnp.float32)
    drafts = jnp.asarray([[3, 3, 9], [1, 4, 1]], jnp.int32)
    history = record(jnp.asarray(prompt_history([[3, 7], [2]], V, sampling)), jnp.arange(2), jnp.asarray([9, 1]))
    probs, picks = processed_block(logits, history, drafts, *params)
    step = history
    for j in range(T):
        p, pick = _processed(logits[:, j], step, *params)
        np.testing.assert_allclose(np.asarray(probs[:, j]), np.asarray(p), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(picks[:, j]), np.asarray(pick))
        if j < T - 1:
            step = record(step, jnp.arange(2), drafts[:, j])
    # the block's last position: token 3 of row 0 drafted twice, its logit 2 * 1.1 + 0.3 lower (after
    # the repetition penalty, the prompt holding it) than token 0's, which nothing penalises
    raw, free = float(logits[0, -1, 3]), float(logits[0, -1, 0])
    penalised = (raw * 1.2 if raw < 0 else raw / 1.2) - 2 * 1.1 - 0.3
    expected = float(probs[0, -1, 0]) * np.exp((penalised - free) / 0.9)
    np.testing.assert_allclose(float(probs[0, -1, 3]), expected, rtol=1e-4)


def test_rows_of_a_batch_accept_different_counts(three_tiers):
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 4000, size=n).tolist() for n in (4, 11, 7)]
    expected = jmoe.generate(model, prompts, max_new_tokens=20)
    assert jmoe.generate(model, prompts, max_new_tokens=20, speculative={"draft": "int2", "k": 4}) == expected
    spec = jmoe.stats(model)["speculative"]
    assert 0 < spec["acceptance_rate"] < 1  # rows were rejected at different places


def test_text_streaming_and_stop_strings_match(three_tiers):
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    kw = dict(max_new_tokens=30, stop=["\n\n"])
    expected = jmoe.generate(model, "def main():\n", **kw)
    streamed = "".join(jmoe.generate(model, "def main():\n", stream=True, speculative="int4", **kw))
    assert streamed == expected


# The tiny model (Qwen3-MoE) runs every case above; each other family speculates once, resident or
# offloaded in turn (their draft and verification steps differ in the MoE layer, not the schedule).
OTHER_FAMILIES = [(family, ("resident", "offloaded")[i % 2]) for i, family in enumerate(FAMILIES[1:])]


@pytest.mark.parametrize("family,placement", OTHER_FAMILIES, ids=[f for f, _ in OTHER_FAMILIES])
def test_greedy_speculative_equals_greedy_per_family(tmp_path, family, placement):
    make_checkpoint(family, tmp_path / "hf")
    path = convert_checkpoint(tmp_path / "hf", tmp_path / "m", tiers="bf16,int4", progress=False)
    ids = [3, 14, 15, 92, 65, 35]
    resident = jmoe.load(path, compute_dtype="float32", tier="bf16")
    expected = jmoe.generate(resident, ids, max_new_tokens=16)
    model = resident if placement == "resident" else budgeted(path, 0.3, "int4")
    assert jmoe.generate(model, ids, max_new_tokens=16, speculative="int4") == expected
    if placement == "offloaded":
        assert model.residency.slots < model.config.num_moe_layers * model.config.num_experts


# ---------------------------------------------------------------- sampling: the target's distribution


def test_speculative_sampling_follows_the_target_distribution():
    """accept() (the device's, as verification runs it) on many rows of one fixed (p, q) pair: the
    emitted first token must follow p (the
    target's distribution after penalty, temperature, top-k and top-p), and the second (drawn from
    p_1 when both drafts are kept) must too. Chi-square at a false-alarm rate of 1e-3 per test."""
    V, B, k = 12, 40_000, 2
    rng = np.random.default_rng(0)
    sampling = SamplingOptions(temperature=0.8, top_k=8, top_p=0.95, repetition_penalty=1.3, seed=1)
    params = sampling.device_params(V)
    seen = np.zeros((B, V), HISTORY_DTYPE)
    seen[:, [2, 5]] = PROMPT_MARK  # the prompt's tokens
    target = rng.normal(size=(k + 1, V)) * 2
    draft = target + rng.normal(size=(k + 1, V))  # a close but different draft
    q0 = np.asarray(_processed(jnp.asarray(np.tile(draft[0], (B, 1)), jnp.float32), jnp.asarray(seen), *params)[0])
    d1 = np.array([rng.choice(V, p=row / row.sum()) for row in q0[:1].astype(np.float64).repeat(B, 0)])
    seen1 = seen.copy()
    seen1[np.arange(B), d1] += 1
    q1 = np.asarray(_processed(jnp.asarray(np.tile(draft[1], (B, 1)), jnp.float32), jnp.asarray(seen1), *params)[0])
    d2 = np.array([rng.choice(V, p=row / row.sum()) for row in q1.astype(np.float64)])
    drafts = jnp.asarray(np.stack([d1, d2], axis=1), jnp.int32)
    logits = jnp.asarray(np.tile(target[None], (B, 1, 1)), jnp.float32)
    accepted, nxt, _, _ = accept(logits, drafts, jnp.stack([jnp.asarray(q0), jnp.asarray(q1)], axis=1), jnp.asarray(seen),
                                 jax.random.key(7), params, greedy=False)  # on the device, as verification does
    accepted, nxt = np.asarray(accepted), np.asarray(nxt)
    first = np.where(accepted >= 1, d1, nxt)
    p0 = np.asarray(_processed(logits[:1, 0], jnp.asarray(seen[:1]), *params)[0], np.float64)[0]
    assert chi_square_p(first, p0) > 1e-3
    # the second token, among rows whose first token is the most common one (so one history)
    mode = np.bincount(first).argmax()
    rows = first == mode
    second = np.where(accepted[rows] >= 2, d2[rows], nxt[rows])
    seen_m = seen[:1].copy()
    seen_m[0, mode] += 1
    p1 = np.asarray(_processed(logits[:1, 1], jnp.asarray(seen_m), *params)[0], np.float64)[0]
    assert chi_square_p(second, p1) > 1e-3
    assert 0 < (accepted == 0).mean() < 1  # both branches (accept, residual) were exercised
    # the test has power: the draft's own distribution is rejected
    assert chi_square_p(d1, p0) < 1e-6


def chi_square_p(samples: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(p))
    if counts[p == 0].sum():  # a token the target excludes: certainly not drawn from p
        return 0.0
    keep = p * len(samples) >= 5
    expected = p[keep] * len(samples)
    observed = counts[keep]
    observed = np.append(observed, counts[~keep].sum())
    expected = np.append(expected, p[~keep].sum() * len(samples))
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return float(gammaincc((len(observed) - 1) / 2, statistic / 2))  # the chi-square survival function


def test_sampled_speculative_generation_is_reproducible(three_tiers):
    """A seed and a fixed draft length give the same tokens (with k="auto" the cycles' lengths follow
    measured times, and where a cycle ends decides how a position's token is drawn)."""
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=40, seed=11, speculative=dict(draft="int4", k=3))
    a, b = jmoe.generate(model, PROMPT, **kw), jmoe.generate(model, PROMPT, **kw)
    assert a == b and 1 <= len(a) <= 16 and all(0 <= t < model.config.vocab_size for t in a)


# ---------------------------------------------------------------- lookahead buffer, counters, budget


def test_lookahead_phases_and_counters(three_tiers):
    model = budgeted(three_tiers, 0.3, "int4")
    steps_before = model.stats.steps
    jmoe.generate(model, PROMPT, max_new_tokens=NEW, speculative={"draft": "int4", "k": 4})
    stats = jmoe.stats(model)
    spec = stats["speculative"]
    assert spec["lookahead_fetched"] > 0  # verification fetched what the draft routed to before routing itself
    assert 0 < spec["draft_routing_fidelity"] <= 1 and spec["verify_hit_rate"] is not None
    io = stats["host"]["verify"]  # a cycle: one executable each for the draft and the verification, two reads
    assert spec["cycles"] <= io["executions"] <= 2 * spec["cycles"] and spec["cycles"] <= io["reads"] <= 2 * spec["cycles"]
    assert len(spec["acceptance_by_position"]) == 4
    # the draft's steps are not the target's: one target step for the prompt, one per cycle
    assert stats["steps"] - steps_before == 1 + spec["cycles"]
    assert model.drafts["int4"].stats.steps == spec["drafted_tokens"]
    model.residency.cache.check()
    specs = model.residency.in_step.specs  # plain steps between cycles do not carry the verification's look-ahead
    assert specs["decode"].lookahead < specs["verify"].lookahead


def test_plain_decode_steps_keep_their_own_fetch_slots_beside_a_draft():
    """A draft sizes the verification's look-ahead (and, on the CPU, its misses) for k + 1 tokens a
    row; a plain decode step between cycles routes one token a row and keeps the slots it has without
    a draft (on an accelerator each look-ahead slot moves a record every step)."""
    from types import SimpleNamespace

    from jmoe.policies import make_policy
    from jmoe.runtime.fetching import fetch_slots

    cfg = SimpleNamespace(top_k=8, num_experts=64)  # all the slots depend on
    policy = make_policy("lru+prefetch", "bf16")
    for guarded in (False, True):
        plain = fetch_slots(cfg, policy, None, 1, False, draft_tokens=0, guarded=guarded)
        drafted = fetch_slots(cfg, policy, None, 1, False, draft_tokens=8, guarded=guarded)
        assert drafted.lookahead > plain.lookahead and drafted.misses >= plain.misses
        assert drafted.decode == (plain.misses, plain.lookahead) and plain.decode is None
        assert drafted.extra >= plain.extra  # the pools hold the verification's scratch


def test_the_draft_is_reserved_within_the_budget(tiny_hf_dir, tmp_path):
    # the whole tiny model: half of a 2-layer model's experts is less than the draft's staging
    three_tiers = convert_checkpoint(tiny_hf_dir, tmp_path / "m", tiers="bf16,int4,int2", progress=False)
    plan = jmoe.memory_plan(three_tiers, tier="bf16", compute_dtype="float32", draft="int2")
    fixed = plan["dense"] + plan["kv_cache"] + plan["workspace"]
    budget = fixed + plan["draft"] + plan["all_experts"] // 2
    with_draft = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16", device_budget=budget, draft="int2")
    without = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16", device_budget=budget)
    assert with_draft.memory["draft"] == plan["draft"] > 0
    assert sum(with_draft.memory.values()) <= budget
    assert with_draft.residency.slots < without.residency.slots
    with pytest.raises(jmoe.BudgetError):  # a budget that holds the draft but not the fixed parts
        jmoe.load(three_tiers, compute_dtype="float32", tier="bf16", device_budget=fixed + plan["draft"] // 2,
                  draft="int2")


# ---------------------------------------------------------------- governor and grouped verification


def test_governor_trades_acceptance_against_cycle_time():
    g = Governor(k_max=8)
    assert g.choose() == 4  # nothing measured yet
    g.update(4, np.array([4]), draft_s=4 * 0.001, verify_s=0.01, missing_bytes=0)
    assert g.choose() == 0  # plain steps timed once before drafting is weighed against them
    g.update(0, None, draft_s=0.0, verify_s=0.01, missing_bytes=0)
    for _ in range(20):  # cheap drafts that are always right: draft long
        g.update(8, np.array([8]), draft_s=8 * 0.001, verify_s=0.01, missing_bytes=0)
    assert g.choose() == 8
    g = Governor(k_max=8)
    for _ in range(20):  # drafts that are always wrong: none at all (a plain step)
        g.update(4, np.array([0]), draft_s=4 * 0.01, verify_s=0.01, missing_bytes=0)
    assert g.choose() == 0
    g = Governor(k_max=8, max_cycle_s=0.0155)  # k_max from a latency target: 5 x 1 ms + 10 ms fits
    g.update(0, None, draft_s=0.0, verify_s=0.01, missing_bytes=0)
    for _ in range(20):
        g.update(8, np.array([8]), draft_s=8 * 0.001, verify_s=0.01, missing_bytes=0)
    assert g.choose() == 5
    choices = [g.choose() for _ in range(2 * 16)]  # drafting pays: plain steps only to keep their time fresh
    assert choices.count(0) == 2 and set(choices) == {0, 5}
    assert Governor(k_max=8, fixed=3).choose() == 3


def test_grouped_verification_reads_each_expert_once_and_matches_the_gather(rng_pool):
    h, slots, active, pool = rng_pool
    gathered = grouped_expert_ffn(h, slots, active, pool, 8)
    grouped = grouped_expert_ffn(h, slots, active, pool, 8, group_rows=VERIFY_BLOCK_ROWS)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(gathered), rtol=1e-5, atol=1e-5)


@pytest.fixture
def rng_pool():
    import jax

    from jmoe.quant import ExpertWeights

    rng = np.random.default_rng(0)
    N, k, D, F, slots_n = 5, 2, 32, 16, 8
    h = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    slots = jnp.asarray(rng.integers(0, slots_n, size=(N, k)), jnp.int32)
    active = jnp.asarray(rng.random((N, k)) > 0.2)
    pool = ExpertWeights(gate_up=jax.device_put(rng.normal(size=(slots_n, D, 2 * F)).astype(np.float32)),
                         down=jax.device_put(rng.normal(size=(slots_n, F, D)).astype(np.float32)))
    return h, slots, active, pool


def test_governor_stops_drafting_when_it_cannot_pay():
    g = Governor(k_max=8)
    for _ in range(10):  # a draft step costs as much as verification: drafting never pays
        g.update(4, np.array([3]), draft_s=4 * 0.01, verify_s=0.01, missing_bytes=0)
    choices = []
    for _ in range(2 * 16):
        k = g.choose()
        choices.append(k)
        g.update(k, np.array([min(k, 3)]), draft_s=k * 0.01, verify_s=0.01, missing_bytes=0)
    assert choices.count(0) >= 28 and max(choices) >= 1  # plain steps, with a look at drafting now and then


def test_plain_cycles_up_to_the_next_look_at_drafting_run_as_one_run():
    """Each run of plain steps ends with a wait on its last step, so the governor hands out every
    plain cycle up to its next look at drafting at once, and that look comes when it would have."""
    g = Governor(k_max=8)
    for _ in range(10):  # drafting never pays
        g.update(4, np.array([3]), draft_s=4 * 0.01, verify_s=0.01, missing_bytes=0)
    g.update(0, None, draft_s=0.0, verify_s=0.01, missing_bytes=0)
    runs, steps = [], 0
    while len(runs) < 4:
        k = g.choose()
        if k:
            runs.append(steps)
            steps = 0
        else:
            steps += g.plain_steps()
    assert runs[1:] == [(EXPLORE - 1) * PLAIN_RUN] * 3  # between looks: the cycles one-at-a-time choosing gave
    fixed = Governor(k_max=8, fixed=0)
    assert fixed.choose() == 0 and fixed.plain_steps() == PLAIN_RUN


def test_the_serving_engine_speculates_with_the_same_texts(three_tiers, plain_greedy):
    """jmoe serve --speculative: greedy rows keep what the target agrees with (the plain greedy
    tokens), a sampled row draws from the verification's first position (its seeded tokens), and
    logprobs come from the verification's logits; drafts were accepted."""
    from jmoe.serving import BatchEngine, Request
    from jmoe.serving.compiles import CompileCounter

    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16", max_seq_len=64, max_batch=2)
    prompts = [PROMPT, PROMPT[3:], PROMPT[::-1], [9, 8, 7, 6, 5]]
    alone = [jmoe.generate(model, p, max_new_tokens=NEW) for p in prompts[1:]]
    sampled = jmoe.generate(model, PROMPT, max_new_tokens=NEW, temperature=0.9, top_k=40, seed=7)
    with BatchEngine(model, max_batch=2, context=64, speculative=dict(draft="int4", k=3), warm_up=True) as engine:
        compiled = CompileCounter.count()
        streams = [engine.submit(Request(p, NEW, as_text=False, logprobs=1)) for p in prompts]
        streams.append(engine.submit(Request(PROMPT, NEW, SamplingOptions(temperature=0.9, top_k=40, seed=7),
                                             as_text=False)))
        pairs = [list(s.with_logprobs()) for s in streams]
        assert CompileCounter.count() == compiled  # warm-up compiled the draft and verification shapes too
    assert [p for p, _ in pairs[0]] == plain_greedy
    assert [[p for p, _ in row] for row in pairs[1:4]] == alone
    assert [p for p, _ in pairs[4]] == sampled
    assert all(lp[0].token == p and lp[0].top[0][0] == p for row in pairs[:4] for p, lp in row)  # greedy: likeliest
    assert model.stats.spec.accepted > 0


def test_the_governor_is_the_models_and_carries_over_to_the_next_request(three_tiers):
    """What one request measured steers the next one's first cycles: a request with the same draft,
    draft length and rows takes up the same governor; other rows get their own."""
    model = jmoe.load(three_tiers, compute_dtype="float32", tier="bf16")
    greedy = jmoe.generate(model, PROMPT, max_new_tokens=NEW)
    assert jmoe.generate(model, PROMPT, max_new_tokens=NEW, speculative="int4") == greedy
    (governor,) = model.governors.values()
    assert governor.t_draft is not None  # the first request's first cycle drafted, and was timed
    timed = dict(governor.t_verify)
    assert jmoe.generate(model, PROMPT, max_new_tokens=NEW, speculative="int4") == greedy
    assert list(model.governors.values()) == [governor] and governor.t_verify != timed
    jmoe.generate(model, [PROMPT, PROMPT[::-1]], max_new_tokens=4, speculative="int4")
    assert len(model.governors) == 2
