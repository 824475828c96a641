"""DyMoE and DynaExq: their rules, exactness at the limits, and background transitions that never stall a step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from jmoe.layers.experts import ExpertState, Routing, Selection, expert_importance, run_experts
from jmoe.policies import DyMoE, DynaExq, make_policy
from jmoe.policies.dymoe import critical_share, depth_schedule
from jmoe.policies.dynaexq import refill_hi_set
from jmoe.runtime.loader import memory_plan
from jmoe.quant import ExpertWeights
from jmoe.tiers import TIER_CODES

IDS = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12]
PATHS = ["auto", "layerwise", "resident"]


@pytest.fixture(scope="module")
def int4_int2(tmp_path_factory, short_hf_dir):
    return convert_checkpoint(short_hf_dir, tmp_path_factory.mktemp("policies") / "m", tiers="int4,int2",
                              progress=False)


@pytest.fixture(scope="module")
def uniform_int4(int4_int2):
    return jmoe.generate(jmoe.load(int4_int2, compute_dtype="float32", tier="int4"), IDS, max_new_tokens=16)


# ---------------------------------------------------------------- DyMoE


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_depth_schedule_keeps_early_layers_and_has_the_stated_mean(lam):
    r = depth_schedule(8, lam)
    assert r[0] == pytest.approx(1.0) and r[-1] == pytest.approx(lam)
    assert np.all(np.diff(r) <= 1e-7)  # never more critical experts deeper down
    assert depth_schedule(2001, lam).mean() == pytest.approx((1 + lam) / 2, abs=1e-3)  # the continuous mean
    assert DyMoE(r=(1 + lam) / 2).lam == pytest.approx(lam)


@pytest.mark.parametrize("layers,top_k", [(8, 4), (8, 8), (48, 8), (1, 2), (32, 6)])
def test_critical_share_is_what_the_step_runs_at_hi_for_one_token(layers, top_k):
    """The benchmarks' bits per expert weight rest on critical_share: per layer, the step keeps
    ceil(ratio * routed) experts critical with ratio a float32 (jmoe/layers/experts.py), so the
    share must match that float32 rule, including where r(l) k lands on a whole number."""
    for lam in (0.0, 0.25, 0.5, 0.75, 1.0):
        ratio = jnp.asarray(depth_schedule(layers, lam), jnp.float32)
        kept = jnp.ceil(ratio * jnp.int32(top_k)).astype(jnp.int32).clip(0, top_k)
        assert critical_share(layers, top_k, lam) == pytest.approx(float(kept.sum()) / (layers * top_k))
    assert critical_share(layers, top_k, 1.0) == 1.0


def test_importance_is_gate_score_in_decode_and_heavy_hitters_in_prefill():
    ids = jnp.asarray([[0, 1], [0, 2], [3, 1], [2, 0]], jnp.int32)
    weights = jnp.asarray([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.7, 0.3]], jnp.float32)
    valid = jnp.asarray([True, True, True, False])
    score, routed = expert_importance(Routing(ids, weights), valid, None, jnp.float32(0.5), 5)
    np.testing.assert_allclose(score, [1.1, 0.5, 0.5, 0.9, 0.0])  # padding token 3 does not count
    np.testing.assert_array_equal(routed, [True, True, True, True, False])
    # with half the real tokens as heavy hitters (ceil(1.5) = 2: tokens 2 and 0, by attention; the
    # padding token's 0.9 does not count): expert 1 got both, 0 and 3 one each (0 wins the tie on
    # tokens routed: 2 against 1), expert 2 none
    attention = jnp.asarray([0.3, 0.1, 0.6, 0.9], jnp.float32)
    score, _ = expert_importance(Routing(ids, weights), valid, attention, jnp.float32(0.5), 5)
    order = np.argsort(-np.asarray(score), kind="stable")
    assert list(order[:4]) == [1, 0, 3, 2]


def test_four_zero_skips_the_unimportant_experts_without_renormalising(short_hf_dir):
    rng = np.random.default_rng(0)
    D, F, E, N, k = 16, 8, 6, 5, 2
    pool = ExpertWeights(rng.normal(size=(E, D, 2 * F)).astype(np.float32) * 0.3,
                         rng.normal(size=(E, F, D)).astype(np.float32) * 0.3)
    codes = np.full((1, E), TIER_CODES["int4"], np.int32)
    state = ExpertState.from_codes(codes, np.arange(E)[None], {"int4": jax.tree.map(jnp.asarray, pool)})
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.random(size=(N, k)).astype(np.float32)
    h = rng.normal(size=(N, D)).astype(np.float32)
    four_zero = ExpertState(state.slots, state.pools, Selection.of(codes, np.zeros_like(codes), [0.5]))
    out = run_experts(jnp.asarray(h), Routing(jnp.asarray(ids), jnp.asarray(weights)), jnp.ones(N, bool),
                      four_zero.layer(0))
    gate = np.zeros(E)
    np.add.at(gate, ids.ravel(), weights.ravel())
    routed = np.unique(ids)
    keep = set(sorted(routed, key=lambda e: (-gate[e], e))[: math.ceil(0.5 * len(routed))])
    expected = np.zeros((N, D))
    for n in range(N):
        for j in range(k):
            e = ids[n, j]
            if e in keep:  # original router weight, no renormalisation over the kept experts
                g, u = np.split(h[n] @ pool.gate_up[e], 2)
                expected[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * u) @ pool.down[e])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)


def offloading_budget(path, policy) -> int:
    """Everything load reserves besides experts, plus every expert at int4 only: too little to hold
    DyMoE's two tiers whole, so it offloads (pools caching part of each tier)."""
    plan = memory_plan(path, compute_dtype="float32", policy=policy)
    return sum(v for k, v in plan.items() if k != "all_experts") + plan["all_experts"]


@pytest.mark.parametrize("execution", PATHS)
def test_dymoe_with_r_one_is_uniform_hi(int4_int2, uniform_int4, execution):
    policy = DyMoE(r=1.0)
    model = jmoe.load(int4_int2, compute_dtype="float32", policy=policy, execution=execution, misses="exact",
                      device_budget=offloading_budget(int4_int2, policy))
    assert model.residency.offloading
    assert jmoe.generate(model, IDS, max_new_tokens=16) == uniform_int4
    assert set(jmoe.stats(model)["uses_by_tier"]) == {"int4"}


def test_dymoe_without_a_budget_holds_both_tiers_and_picks_inside_the_step(int4_int2, uniform_int4):
    """No budget: both tiers whole on the device, nothing fetched, and each layer of a decode step
    runs ceil(r(l) * routed) of its routed experts at int4 (by gate score), the rest at int2."""
    model = jmoe.load(int4_int2, compute_dtype="float32", policy=DyMoE(r=0.75))
    assert not model.residency.offloading and model.residency.tiers == ("int4", "int2")
    store = model.store
    assert model.memory["experts"] == sum(store.record_nbytes(t) for t in ("int4", "int2")) * (
        model.config.num_moe_layers * model.config.num_experts)
    text = jmoe.generate(model, IDS, max_new_tokens=8)
    assert len(text) == 8
    counts, _, chosen = np.asarray(model.residency.signals.per_expert)  # the last decode step's
    r = ((1 - 0.5) * (np.cos(np.pi * np.arange(2) / 1) + 1) / 2 + 0.5)  # lam = 2 r - 1 = 0.5, two layers
    gate = np.asarray(model.residency.signals.gate)
    for layer in range(counts.shape[0]):
        routed = np.flatnonzero(counts[layer])
        hi = math.ceil(r[layer] * len(routed))
        by_gate = routed[np.argsort(-gate[layer, routed], kind="stable")]
        assert (chosen[layer, by_gate[:hi]] == TIER_CODES["int4"]).all(), layer
        assert (chosen[layer, by_gate[hi:]] == TIER_CODES["int2"]).all(), layer
    assert model.stats.transfers == 0
    # r = 1: every routed expert at int4, the tokens of the model loaded at int4
    assert jmoe.generate(jmoe.load(int4_int2, compute_dtype="float32", policy=DyMoE(r=1.0)), IDS,
                         max_new_tokens=16) == uniform_int4


def test_dymoe_runs_a_share_low_and_paths_agree_from_the_same_cache(int4_int2):
    """A lower tier is served by a higher resident version when there is one (DyMoE's reuse), so
    what runs depends on what the cache holds; from a cold cache, without look-ahead prefetch,
    the one-jit and layer-wise paths fetch and run the same versions."""
    logits = {}
    for execution in ("auto", "layerwise"):
        policy = DyMoE()
        policy.prefetch = False
        model = jmoe.load(int4_int2, compute_dtype="float32", policy=policy, execution=execution,
                          device_budget=offloading_budget(int4_int2, policy))
        logits[execution] = np.asarray(jmoe.forward(model, IDS))
        uses = jmoe.stats(model)["uses_by_tier"]
        assert uses["int2"] > 0 and uses["int4"] > uses["int2"]
    np.testing.assert_allclose(logits["auto"], logits["layerwise"], rtol=1e-4, atol=1e-4)


def test_named_policies_and_their_options_are_checked():
    assert isinstance(make_policy("dymoe", "int8"), DyMoE) and make_policy("dymoe", None).hi == "int4"
    with pytest.raises(jmoe.InputError, match="lower tier"):
        DyMoE(hi="int2", lo="int4")
    with pytest.raises(jmoe.InputError, match="r must be"):
        DyMoE(r=0.2)
    with pytest.raises(jmoe.InputError, match="interval"):
        DynaExq(interval=0)
    with pytest.raises(jmoe.InputError, match="takes no options"):
        make_policy("lru", "int4", r=0.5)


@pytest.mark.parametrize("policy", ["dymoe-r1", "dynaexq", "dymoe"])
def test_the_serving_engine_runs_the_precision_policies(int4_int2, uniform_int4, policy):
    """Three requests through two rows of jmoe serve's engine: where a policy runs every expert at
    hi (DyMoE with r = 1, DynaExq with room for all), each answer is the uniform-int4 one; DyMoE's
    default mix runs some experts at int2 and every request still completes."""
    from jmoe.serving import BatchEngine, Request

    made = {"dymoe-r1": DyMoE(r=1.0), "dynaexq": DynaExq(), "dymoe": DyMoE()}[policy]
    model = jmoe.load(int4_int2, compute_dtype="float32", policy=made, max_seq_len=64, max_batch=2)
    with BatchEngine(model, max_batch=2, context=64) as engine:
        streams = [engine.submit(Request(list(IDS), 16, as_text=False)) for _ in range(3)]
        outputs = [list(s) for s in streams]
    if policy == "dymoe":
        assert all(len(o) == 16 and s.finish_reason == "length" for o, s in zip(outputs, streams))
        counts, _, chosen = np.asarray(model.residency.signals.per_expert)  # both tiers whole: the last step's
        assert TIER_CODES["int2"] in chosen[counts > 0]
    else:
        assert outputs == [uniform_int4] * 3


# ---------------------------------------------------------------- DynaExq


def test_routing_trace_weights_add_up_to_the_gate_weight_each_expert_received(int4_int2):
    """jmoe.trace_routing(..., with_weights=True) (the hindsight ceiling's input in bench/policies.py):
    its combine weights, summed per expert, are the gate weight the step reports to the policies,
    and its routing is that of jmoe.trace_routing without weights."""
    model = jmoe.load(int4_int2, compute_dtype="float32", tier="int4")
    ids = IDS * 3
    routed, weights = jmoe.trace_routing(model, ids, window=len(ids), with_weights=True)
    assert routed.shape == weights.shape == (len(ids), model.config.num_moe_layers, model.config.top_k)
    assert np.array_equal(routed, jmoe.trace_routing(model, ids, window=len(ids)))
    gate = np.zeros((model.config.num_moe_layers, model.config.num_experts))
    layers = np.broadcast_to(np.arange(routed.shape[1])[None, :, None], routed.shape)
    np.add.at(gate, (layers.ravel(), routed.ravel()), weights.ravel())
    assert np.allclose(gate, np.asarray(model.residency.signals.gate), atol=1e-5)
    assert np.all(weights > 0)


@pytest.mark.parametrize("execution", PATHS)
def test_dynaexq_with_room_for_every_expert_at_hi_is_uniform_hi(int4_int2, uniform_int4, execution):
    model = jmoe.load(int4_int2, compute_dtype="float32", policy=DynaExq(), execution=execution)
    assert jmoe.generate(model, IDS, max_new_tokens=16) == uniform_int4
    assert jmoe.stats(model)["policy_state"]["resident_hi"] == model.config.num_moe_layers * 32


def test_hot_set_follows_hotness_with_hysteresis():
    policy = DynaExq(margin=0.05)
    policy._start(1, 6, 2)
    policy.hot[0] = [0.30, 0.25, 0.20, 0.15, 0.06, 0.04]
    policy._update_members()
    assert set(np.flatnonzero(policy.members[0])) == {0, 1}
    policy.hot[0] = [0.30, 0.22, 0.26, 0.15, 0.03, 0.04]  # expert 2 now beats 1, but by less than the margin
    policy._update_members()
    assert set(np.flatnonzero(policy.members[0])) == {0, 1}
    policy.hot[0] = [0.30, 0.10, 0.26, 0.15, 0.15, 0.04]  # by more than the margin: they swap
    policy._update_members()
    assert set(np.flatnonzero(policy.members[0])) == {0, 2}


def test_the_hi_set_goes_where_routing_is_concentrated():
    """Model-wide (the default), the hottest experts of all layers share the hi copies: a layer that
    sends most tokens to three experts holds three, a layer that spreads them evenly holds one; per
    layer, each holds two. Neither holds more than its slots."""
    concentrated = [0.40, 0.30, 0.20, 0.04, 0.03, 0.03, 0.0, 0.0]
    even = [0.14, 0.13, 0.125, 0.125, 0.12, 0.12, 0.12, 0.12]
    for allocation, want in (("model", [{0, 1, 2}, {0}]), ("layer", [{0, 1}, {0, 1}])):
        policy = DynaExq(allocation=allocation)
        policy._start(2, 8, 2)
        policy.hot[:] = [concentrated, even]
        policy._update_members()
        assert [set(np.flatnonzero(m)) for m in policy.members] == want, allocation
        assert policy.members.sum() == 4


def one_swap_at_a_time(hot, members, room, margin) -> bool:
    """The hi set's update as the rule reads: fill free places with the hottest outsider, then swap
    the weakest member for the hottest outsider while it wins by more than the margin."""
    changed = False
    while members.sum() < room and (~members).any():
        best = np.flatnonzero(~members)[np.argmax(hot[~members])]
        if hot[best] <= 0:
            break
        members[best] = changed = True
    while members.any() and (~members).any():
        weakest = np.flatnonzero(members)[np.argmin(hot[members])]
        strongest = np.flatnonzero(~members)[np.argmax(hot[~members])]
        if hot[strongest] <= hot[weakest] + margin:
            break
        members[weakest], members[strongest] = False, True
        changed = True
    return changed


def test_the_hi_set_update_swaps_at_once_as_one_at_a_time():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.integers(1, 40))
        room = int(rng.integers(0, n + 1))
        hot = rng.random(n) * (rng.random(n) > 0.2)
        if rng.random() < 0.3:
            hot = np.round(hot, 1)  # ties
        members = np.zeros(n, bool)
        members[rng.choice(n, min(room, int(rng.integers(0, n + 1))), replace=False)] = True
        margin = float(rng.choice([0.0, 0.01, 0.1]))
        want, got = members.copy(), members.copy()
        assert refill_hi_set(hot, got, room, margin) == one_swap_at_a_time(hot, want, room, margin)
        assert np.array_equal(got, want)


def routed(policy: DynaExq, probs: np.ndarray, tokens: int, rng) -> None:
    """`tokens` tokens, each routed to 4 experts of each layer drawn from probs (gate 1/4 each)."""
    layers, experts = policy.hot.shape
    for _ in range(tokens):
        counts = np.zeros((layers, experts))
        for layer in range(layers):
            counts[layer, rng.choice(experts, 4, replace=False, p=probs)] = 1
        policy.observe_experts(counts, counts / 4, 1)


def tokens_to_follow(policy: DynaExq, before: np.ndarray, after: np.ndarray, rng) -> int:
    """Tokens after a shift from `before` routing to `after` until every layer's hi set serves 90% of
    the routing its best n experts would."""
    routed(policy, before, 640, rng)
    best = np.sort(after)[-policy.n_hi:].sum()
    for token in range(1, 2001):
        routed(policy, after, 1, rng)
        if all(after[m].sum() >= 0.9 * best for m in policy.members):
            return token
    return 2001


def test_a_shift_in_routing_is_followed_within_a_few_intervals():
    """With `shift`, a layer whose routing moves takes its recent routing as its hotness: its hi set
    follows the new workload within a few 16-token intervals, where the slow EMA (a half-life of about
    100 tokens) takes several times longer. In a stationary stream it rarely fires."""
    rng = np.random.default_rng(0)
    before = rng.dirichlet(np.full(32, 0.3))
    after = rng.permutation(before)
    follow = {}
    for shift in (None, 3.0):
        policy = DynaExq(shift=shift)
        policy._start(4, 32, 8)
        follow[shift] = tokens_to_follow(policy, before, after, np.random.default_rng(1))
    assert follow[3.0] <= 80 and 2 * follow[3.0] <= follow[None], follow  # measured: 64 against 208

    policy = DynaExq(shift=3.0)
    policy._start(4, 32, 8)
    routed(policy, before, 4000, rng)
    assert policy.shifts / (4 * 4000 // 16) < 0.05  # false alarms per layer and interval


def test_promotions_ride_in_decode_steps_and_no_step_waits_for_one(int4_int2):
    """A promotion is a request the next decode step fetches into the slot the host chose (published at
    once): no transfer of its own, no wait, one read per decoded token."""
    policy = DynaExq(hi_per_layer=8, interval=4)
    model = jmoe.load(int4_int2, compute_dtype="float32", policy=policy)
    out = jmoe.generate(model, IDS, max_new_tokens=24)
    stats = jmoe.stats(model)
    assert len(out) == 24 and stats["promotions"] > 0 and stats["in_step_fetches"] >= stats["promotions"]
    decode = stats["host"]["decode"]
    assert decode["reads"] == stats["tokens"] - 1 and decode["executions"] == stats["tokens"] - 1
    state = stats["policy_state"]
    assert state["promoting"] == 0 and 0 < state["resident_hi"] <= model.config.num_moe_layers * 8
    model.residency.cache.check()


def dynaexq_budget(path, hi_per_layer: int) -> tuple[int, dict[str, int]]:
    """A device budget with every expert at int2 and `hi_per_layer` int4 copies per layer beside them,
    and the int4 and int2 records' bytes."""
    from jmoe.manifest import read_manifest

    manifest = read_manifest(path)
    cfg = manifest["config"]
    layers, experts = sum(cfg["moe_layers"]), cfg["num_experts"]
    plan = memory_plan(path, compute_dtype="float32", policy=DynaExq(hi_per_layer=hi_per_layer))
    record = {tier: manifest["tiers"][tier]["record_nbytes"] for tier in ("int4", "int2")}
    fixed = sum(v for k, v in plan.items() if k != "all_experts")
    return fixed + layers * experts * record["int2"] + layers * hi_per_layer * record["int4"], record


def test_one_version_an_expert_holds_more_hi_experts_and_always_has_one(int4_int2):
    """keep_lo=False: in the budget of every expert at int2 plus 8 int4 copies a layer, an expert
    holds its int4 or its int2 version, so the hi experts are those the budget buys at what int4 adds
    over int2. Promotions and demotions (now a copy of the int2 version) ride in the decode steps:
    every expert has one published version after every token, no step waits and none skips one."""
    budget, record = dynaexq_budget(int4_int2, 8)
    kept = jmoe.load(int4_int2, compute_dtype="float32", policy=DynaExq(hi_per_layer=8, keep_lo=True),
                     device_budget=budget)
    layers = kept.config.num_moe_layers
    total = layers * kept.config.num_experts
    assert {t: p.slots for t, p in kept.residency.pools.items()} == {"int2": total, "int4": 8 * layers}

    policy = DynaExq(interval=4, keep_lo=False)
    model = jmoe.load(int4_int2, compute_dtype="float32", policy=policy, device_budget=budget)
    slots = {t: p.slots for t, p in model.residency.pools.items()}
    swap = DynaExq.SWAP_SLOTS
    hi = (8 * layers * record["int4"] - swap * (record["int4"] + record["int2"])) // (record["int4"] - record["int2"])
    assert slots == {"int2": total - hi + swap, "int4": hi + swap} and hi >= 2 * 8 * layers
    cache = model.residency.cache
    prompts = [IDS, [900, 14, 77, 3000, 5, 5, 61, 2048], [1, 2, 3, 4, 3999, 3998, 17]]
    for prompt in prompts:  # different text routes differently: the hi set moves
        for _ in jmoe.generate(model, prompt, max_new_tokens=24, temperature=1.0, seed=3, stream=True):
            assert all(len(v) == 1 for v in cache.resident.values()) and len(cache.resident) == total
    stats = jmoe.stats(model)
    assert stats["promotions"] > 0 and stats["demotions"] > 0 and stats["skipped"] == 0
    assert stats["bytes_h2d_by_tier"].get("int2", 0) > 0  # a demotion copies its int2 version in
    decode = stats["host"]["decode"]
    assert decode["reads"] == decode["executions"] == stats["tokens"] - len(prompts)
    assert policy.members.sum() == hi
    cache.check()

    every_lo = budget - 8 * layers * record["int4"]  # room for every int2 version, none for a copy in flight
    with pytest.raises(jmoe.errors.InputError, match="copies in flight"):
        jmoe.load(int4_int2, compute_dtype="float32", policy=DynaExq(), device_budget=every_lo)


def test_a_dynaexq_step_takes_no_miss_slots(int4_int2):
    """Every expert keeps a published version, so a step that degrades never fetches a miss: no miss
    slots, no scratch for them in the pools."""
    from jmoe.config import ModelConfig
    from jmoe.manifest import read_manifest
    from jmoe.runtime.fetching import fetch_slots

    cfg = ModelConfig.from_dict(read_manifest(int4_int2)["config"])
    cpu = jax.devices("cpu")[0]
    for keep_lo in (True, False):
        slots = fetch_slots(cfg, DynaExq(keep_lo=keep_lo), cpu, rows=1, degrade=True)
        assert slots.misses == 0 and slots.lookahead == 0 and slots.extra == 1 and slots.requests == 4
    assert fetch_slots(cfg, DyMoE(), cpu, rows=1, degrade=True).misses == cfg.top_k  # a cache can lack one


def test_the_cli_builds_dynaexq_with_the_hi_sets_it_names():
    from argparse import Namespace

    from jmoe.cli import cli_policy

    args = dict(policy="dynaexq", hi=None, lo=None, r=None, hi_per_layer=8, tier=None)
    assert cli_policy(Namespace(**args, hi_sets="layer", keep_lo=None)).allocation == "layer"
    assert cli_policy(Namespace(**args, hi_sets=None, keep_lo=None)).allocation == "model"
    assert not cli_policy(Namespace(**args, hi_sets=None, keep_lo=None)).keep_lo
    assert cli_policy(Namespace(**args, hi_sets=None, keep_lo=True)).keep_lo
