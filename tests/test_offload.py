"""Offload runtime: exactness of every policy and path, the budget, the cache rules, the counters."""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jmoe
import jmoe.runtime.loader
from convert import convert_checkpoint
from jmoe.errors import BudgetError, InputError
from jmoe.manifest import read_manifest
from jmoe.policies import Plan, Policy
from jmoe.runtime.budget import BudgetTracker
from jmoe.runtime.cache import CacheManager
from jmoe.runtime.cpu_exec import MAX_CRITICAL_TOKENS, CostModel
from jmoe.runtime.handles import HandleTable
from jmoe.runtime.host_store import HostStore
from jmoe.runtime.pools import TierPool, plan_pools
from jmoe.runtime.stats import Stats
from jmoe.runtime.store import ExpertStore
from jmoe.tiers import TIER_CODES
from tests.hf_models import FAMILIES, make_checkpoint

PROMPTS = ["def fibonacci(n):", "261 + 120 = "]
POLICIES = ["ondemand", "lru", "lru+prefetch", "lru+cpu", "lru+prefetch+cpu"]
PATHS = ["auto", "layerwise", "resident"]


def budget_for(model, fraction: float, policy: str = "lru+prefetch") -> int:
    """What load reserves besides the pools' cache (by default for the policy that reserves most,
    lru+prefetch) plus a fraction of every expert at the model's tier."""
    plan = jmoe.runtime.loader.memory_plan(model.path, tier=model.residency.tier, compute_dtype="float32",
                                           policy=policy)
    return int(sum(v for k, v in plan.items() if k != "all_experts") + fraction * plan["all_experts"])


def planned_budget(path, tier: str, fraction: float) -> tuple[int, int]:
    """(fixed reservations, budget = fixed + a fraction of every expert at `tier`), before loading."""
    plan = jmoe.runtime.loader.memory_plan(path, tier=tier, compute_dtype="float32")
    fixed = plan["dense"] + plan["kv_cache"] + plan["workspace"]
    return fixed, int(fixed + fraction * plan["all_experts"])


@pytest.fixture(scope="module")
def resident_reference(short_converted):
    model = jmoe.load(short_converted, compute_dtype="float32")
    return model, [jmoe.generate(model, p, max_new_tokens=16) for p in PROMPTS]


@pytest.mark.parametrize("execution", PATHS)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_and_path_gives_the_resident_tokens(short_converted, resident_reference, policy, execution):
    reference_model, reference = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy=policy, execution=execution, cpu_critical_tokens=2)
    assert model.residency.slots < model.config.num_moe_layers * model.config.num_experts  # really offloading
    assert [jmoe.generate(model, p, max_new_tokens=16) for p in PROMPTS] == reference
    stats = jmoe.stats(model)
    assert stats["degraded"] == 0 and stats["skipped"] == 0  # baselines never degrade or skip
    assert stats["expert_uses"] > 0
    assert stats["transfers"] > 0 and stats["bytes_h2d"] > 0
    if "cpu" in policy:
        assert stats["cpu_expert_runs"] > 0
    model.residency.cache.check()


COMBINATIONS = [(policy, execution) for policy in POLICIES for execution in PATHS]


def combinations_for(family: str) -> list[tuple[str, str]]:
    """Every (policy, path) for the first family; three for each other, in turn, so that the other
    families also cover every combination between them (a fifth of the loads)."""
    i = FAMILIES.index(family)
    if i == 0:
        return COMBINATIONS
    return [COMBINATIONS[(3 * (i - 1) + j) % len(COMBINATIONS)] for j in range(3)]


def test_the_other_families_cover_every_policy_and_path():
    assert {c for family in FAMILIES[1:] for c in combinations_for(family)} == set(COMBINATIONS)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_model_of_each_family_is_exact_when_offloaded(tmp_path, family):
    src = tmp_path / "hf"
    make_checkpoint(family, src)
    out = convert_checkpoint(src, tmp_path / "jmoe", progress=False)
    ids = [5, 17, 99, 3, 42, 250, 7, 61]
    reference_model = jmoe.load(out, compute_dtype="float32")
    reference = jmoe.generate(reference_model, ids, max_new_tokens=16)
    budget = budget_for(reference_model, 0.4)
    for policy, execution in combinations_for(family):
        model = jmoe.load(out, compute_dtype="float32", device_budget=budget, policy=policy, execution=execution,
                          cpu_critical_tokens=1)
        assert model.residency.slots < model.config.num_moe_layers * model.config.num_experts
        assert jmoe.generate(model, ids, max_new_tokens=16) == reference, (policy, execution)


def test_budget_too_small_for_one_layer_names_the_minimum(short_converted, resident_reference):
    reference_model, _ = resident_reference
    fixed = budget_for(reference_model, 0.0, "lru")
    with pytest.raises(BudgetError, match=r"one layer's working set: needs at least ([0-9.]+) MiB") as err:
        jmoe.load(short_converted, device_budget=fixed + 1000, policy="lru")
    minimum = float(err.value.args[0].split("needs at least ")[1].split(" MiB")[0])
    model = jmoe.load(short_converted, device_budget=f"{minimum + 0.01}MiB", policy="lru", compute_dtype="float32")
    assert model.residency.slots == model.config.top_k
    assert jmoe.generate(model, "x = ", max_new_tokens=4)
    with pytest.raises(BudgetError, match="before any expert"):
        jmoe.load(short_converted, device_budget="1MiB", policy="lru")


def test_bytes_moved_are_the_fetched_versions(short_converted, resident_reference, monkeypatch):
    reference_model, _ = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy="lru+prefetch")
    moved = []
    real_put = jax.device_put
    host_kind = model.residency.host.memory_kind

    def counting_put(x, *args, **kwargs):  # count transfers whose source is an expert's host record
        # a host jax array on an accelerator; on the CPU a buffer read from the expert file
        if getattr(getattr(x, "sharding", None), "memory_kind", None) == host_kind or (
                isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 1):
            moved.append(x.nbytes)
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting_put)
    jmoe.generate(model, PROMPTS[0], max_new_tokens=12)
    stats = jmoe.stats(model)
    record = model.store.record_nbytes("bf16")
    # the prompt's transfers are the host's own; decode steps fetch inside themselves
    assert moved and stats["in_step_fetches"] > 0
    assert sum(moved) == len(moved) * record
    assert stats["transfers"] == len(moved) + stats["in_step_fetches"]
    assert stats["bytes_h2d"] == stats["transfers"] * record
    assert stats["bytes_h2d_per_token"] == stats["bytes_h2d"] / stats["tokens"]


def test_predictor_recall_and_prefetch_are_measured(short_converted, resident_reference):
    reference_model, _ = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.5),
                      policy="lru+prefetch")
    jmoe.generate(model, PROMPTS[1], max_new_tokens=24)
    stats = jmoe.stats(model)
    assert 0.3 < stats["predictor_recall"] <= 1.0  # the next layer's router on this layer's state
    assert stats["prefetch_issued"] > 0 and 0.0 < stats["prefetch_accuracy"] <= 1.0
    assert stats["ttft_s"] > 0 and stats["tpot_s"] > 0 and stats["tokens"] == 24


def test_cpu_cost_model_is_calibrated(short_converted, resident_reference):
    reference_model, _ = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy="lru+cpu")
    cost = model.residency.cpu.cost
    assert model.residency.critical_tokens == cost.critical_tokens
    if jax.devices()[0].platform == "cpu":  # the device is the CPU: the copy against one more call, all or none
        assert cost.same_memory and cost.transfer_s > 0 and cost.cpu_call_s > 0
        assert cost.critical_tokens == (MAX_CRITICAL_TOKENS if cost.cpu_call_s < cost.transfer_s else 0)
    else:
        assert cost.transfer_s > 0 and cost.cpu_per_token_s >= 0 and not cost.same_memory


def test_cold_experts_run_on_the_native_kernels_beside_an_accelerator(short_converted, resident_reference,
                                                                      monkeypatch):
    """Where the default backend is an accelerator, the CPU executor's own jit still runs on the
    host CPU device, so it multiplies with the native kernels (not the XLA reference), and gets what
    the device's expert computes."""
    import cpu_kernels
    from cpu_kernels import native
    from jmoe.kernels import expert_ffn
    from jmoe.runtime import cpu_exec

    if not native.loaded():
        pytest.skip("the native CPU kernels are not built")
    reference_model, _ = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy="lru+cpu")
    executor, tier = model.residency.cpu, model.residency.tier
    rows = jax.random.normal(jax.random.key(0), (3, model.config.hidden_size), jnp.float32)
    pool = executor.one_slot_pool(tier, 1, 2)
    expected = np.asarray(expert_ffn(rows, jnp.zeros((1,), jnp.int32), pool.gate_up, pool.down, block_rows=3,
                                     backend="xla", gate_up_bias=pool.gate_up_bias, down_bias=pool.down_bias,
                                     activation=executor.activation))
    executor.store.release(tier, 1, 2)
    calls = []
    real_call = native.call
    monkeypatch.setattr(native, "call", lambda *a, **k: calls.append(a[0]) or real_call(*a, **k))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not cpu_kernels.available()
    cpu_exec._one_expert.clear_cache()  # traced again, under the accelerator's default backend
    got = np.asarray(executor.run(rows, tier, 1, 2))
    assert native.EXPERT_FFN in calls
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_cpu_cost_model_compares_a_transfer_with_the_cpu_slowdown():
    assert CostModel(1e-3, 2e-4, 1e-4).critical_tokens == 10  # T_transfer / (cpu - device) per token
    assert CostModel(1e-3, 1e-4, 2e-4).critical_tokens == MAX_CRITICAL_TOKENS  # the CPU is no slower
    assert CostModel(1e-3, 2e-4, 1e-4, cpu_call_s=5e-4).critical_tokens == 5  # a call's fixed cost comes first
    assert CostModel(1e-3, 1e-4, 1e-4, cpu_call_s=2e-3, same_memory=True).critical_tokens == 0
    assert CostModel(1e-3, 1e-4, 1e-4, cpu_call_s=5e-4, same_memory=True).critical_tokens == MAX_CRITICAL_TOKENS


# ---------------------------------------------------------------- the cache manager on its own


@pytest.fixture(scope="module")
def two_tier_model(tmp_path_factory, tiny_hf_dir):  # the whole model: the cache tests address its 8 layers
    return convert_checkpoint(tiny_hf_dir, tmp_path_factory.mktemp("tiers") / "m", tiers="int4,int2", progress=False)


@pytest.fixture(scope="module")
def short_two_tier(tmp_path_factory, short_hf_dir):  # for running models: compiles in a fraction of the time
    return convert_checkpoint(short_hf_dir, tmp_path_factory.mktemp("tiers") / "s", tiers="int4,int2", progress=False)


@pytest.fixture(scope="module")
def two_tier_store(two_tier_model):
    out = two_tier_model
    manifest = read_manifest(out)
    return ExpertStore(out, manifest, jmoe.ModelConfig.from_dict(manifest["config"]))


@pytest.fixture(scope="module")
def two_tier_host(two_tier_store):
    return HostStore(two_tier_store, ("int4", "int2"), jax.devices()[0])


def make_cache(store, host, slots: dict[str, int], staging_transfers: int):
    device = jax.devices()[0]
    pools = {tier: TierPool(store, tier, n, device) for tier, n in slots.items()}
    staging = BudgetTracker(staging_transfers * store.record_nbytes("int4"))
    handles = HandleTable(store.num_layers, store.num_experts, tuple(pools), device)
    return CacheManager(host, pools, handles, staging, Stats(), device)


def test_steps_in_flight_leave_a_layers_working_set_unlocked(two_tier_store, two_tier_host):
    """Each dispatched step locks its landing candidates until it is read; several in flight (a
    thread's next step, other threads' on the same model) must still leave one token's experts of
    a layer (top_k slots) to a step run again layer by layer, or a small pool has nothing to fetch into."""
    cache = make_cache(two_tier_store, two_tier_host, {"int4": 6}, 2)
    for expert in range(3):
        assert cache.request((0, expert), "int4") == "started"
    cache.settle()
    top_k = 4
    taken = [cache.landing_candidates("int4", 6, keep_unlocked=top_k) for _ in range(3)]  # three steps in flight
    assert [len(t) for t in taken] == [2, 0, 0] and len(cache.locked["int4"]) == 2
    slots = [slot for slot, _ in taken[0]]
    keys = {(1, e) for e in range(top_k)}  # a layer none of whose experts is resident: all four to fetch
    assert cache.room("int4", keys) >= 1  # what a pass run layer by layer may fill
    cache.unlock("int4", slots)  # the step is read: its candidates are free to lock again
    assert len(cache.landing_candidates("int4", 6, keep_unlocked=top_k)) == 2
    assert len(cache.landing_candidates("int4", 6)) == 4  # without the reserve a step would lock the rest


def test_promotion_replaces_and_lower_requests_reuse(two_tier_store, two_tier_host):
    cache = make_cache(two_tier_store, two_tier_host, {"int4": 2, "int2": 2}, 2)
    key = (3, 5)
    assert cache.request(key, "int2") == "started"
    cache.settle()
    assert cache.code_of(key) == TIER_CODES["int2"]
    assert cache.request(key, "int4") == "started"  # a higher tier is a miss
    assert cache.code_of(key) == TIER_CODES["int2"]  # the old version stays published until the copy lands
    cache.settle()
    assert cache.code_of(key) == TIER_CODES["int4"] and len(cache.free["int2"][0]) == 2  # promoted, int2 slot freed
    assert cache.request(key, "int2") == "hit"  # a lower tier reuses the higher version
    cache.check()
    # the slot really holds the int4 record
    slot = cache.resident[key]["int4"]
    written = np.concatenate([np.asarray(a[slot]).view(np.uint8).ravel()
                              for a in jax.tree.leaves(cache.pools["int4"].arrays)])
    expected = np.concatenate([np.asarray(a).view(np.uint8).ravel()
                               for a in jax.tree.leaves(two_tier_store.record("int4", 3, 5))])
    np.testing.assert_array_equal(written, expected)


def test_pinned_experts_are_not_evicted(two_tier_store, two_tier_host):
    cache = make_cache(two_tier_store, two_tier_host, {"int4": 2}, 1)
    for e in (0, 1):
        cache.request((0, e), "int4")
    cache.settle()
    cache.pinned = {(0, 0), (0, 1)}
    assert cache.request((0, 2), "int4") == "full"
    cache.pinned = {(0, 0)}
    assert cache.request((0, 2), "int4") == "started"
    cache.settle()
    assert cache.code_of((0, 1)) == 0 and cache.code_of((0, 0)) == TIER_CODES["int4"]
    cache.check()


KEYS = (st.integers(0, 7), st.integers(0, 31))
operation = st.one_of(
    st.tuples(st.just("request"), *KEYS, st.sampled_from(["int4", "int2"]), st.sampled_from(["demand", "prefetch"])),
    st.tuples(st.just("transition"), *KEYS, st.sampled_from(["int4", "int2"])),  # background promotion/demotion
    st.tuples(st.just("poll")),
    st.tuples(st.just("wait"), *KEYS),
    st.tuples(st.just("pin"), *KEYS),
    st.tuples(st.just("unpin")),
    st.tuples(st.just("drop"), *KEYS),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget_mib=st.floats(0.02, 1.5), keep_lower=st.booleans(), refuse=st.integers(0, 3),
       trace=st.lists(operation, min_size=1, max_size=120))
def test_budget_is_never_exceeded(two_tier_store, two_tier_host, budget_mib, keep_lower, refuse, trace):
    """Random budgets and traces of demand fetches, prefetches, background promotions and demotions,
    a cache that keeps lower versions or replaces them, and a victim rule that sometimes refuses:
    every reservation stays within the budget and the books stay consistent after every operation."""
    run_trace(two_tier_store, two_tier_host, int(budget_mib * 2**20), keep_lower, refuse, trace)


def test_ten_thousand_random_operations_keep_the_budget(two_tier_store, two_tier_host):
    """The same invariants over 10,000 operations drawn at random (several budgets, both cache rules)."""
    rng = np.random.default_rng(0)
    done = 0
    while done < 10_000:
        trace = []
        for _ in range(500):
            kind = rng.choice(["request", "transition", "poll", "wait", "pin", "unpin", "drop", "lock", "unlock"],
                              p=[0.33, 0.2, 0.14, 0.1, 0.07, 0.04, 0.08, 0.02, 0.02])
            key = (int(rng.integers(8)), int(rng.integers(32)))
            tier = str(rng.choice(["int4", "int2"]))
            trace.append({"request": ("request", *key, tier, str(rng.choice(["demand", "prefetch"]))),
                          "transition": ("transition", *key, tier), "poll": ("poll",), "wait": ("wait", *key),
                          "pin": ("pin", *key), "unpin": ("unpin",), "drop": ("drop", *key),
                          "lock": ("lock", tier, int(rng.integers(1, 4))), "unlock": ("unlock",)}[kind])
        budget = int(rng.uniform(0.45, 1.5) * 2**20)
        done += run_trace(two_tier_store, two_tier_host, budget, bool(rng.integers(2)), int(rng.integers(4)), trace)


def run_trace(two_tier_store, two_tier_host, budget, keep_lower, refuse, trace) -> int:
    """Apply `trace` to a cache under `budget`, checking the invariants after every operation;
    returns how many operations ran (0 when the budget cannot hold the pools)."""
    tracker = BudgetTracker(budget)
    try:  # half of the budget per tier, as a two-tier policy might split it
        plan = plan_pools(two_tier_store, Policy("split", "int4", pool_shares={"int4": 0.5, "int2": 0.5}), 0, budget,
                          staging_transfers=1)
    except BudgetError:
        return 0
    tracker.reserve("pools", plan.nbytes)
    tracker.reserve("staging", plan.staging_nbytes)  # one staging area, sized for the larger record
    cache = make_cache(two_tier_store, two_tier_host, plan.slots, 1)
    cache.keep_lower = keep_lower
    calls = [0]

    def victim(tier, candidates):  # every `refuse`-th choice refuses to evict (0: never)
        calls[0] += 1
        return None if refuse and calls[0] % (refuse + 1) == 0 else candidates[-1]

    cache.victim = victim
    assert tracker.total <= budget
    locked = []
    for op in trace:
        kind = op[0]
        if kind == "request":
            cache.request((op[1], op[2]), op[3], op[4])
        elif kind == "transition":
            cache.request((op[1], op[2]), op[3], "transition", exact=True)
        elif kind == "poll":
            cache.poll()
        elif kind == "wait":
            cache.wait([(op[1], op[2])])
        elif kind == "pin":
            cache.pinned.add((op[1], op[2]))
        elif kind == "unpin":
            cache.pinned.clear()
        elif kind == "drop":
            cache.drop((op[1], op[2]))
        elif kind == "lock":  # a step in flight holds landing candidates
            locked.append((op[1], [slot for slot, _ in cache.landing_candidates(op[1], op[2])]))
        elif kind == "unlock":
            for tier, slots in locked:
                cache.unlock(tier, slots)
            locked.clear()
        for tier in cache.pools:  # the eviction order read off the handle table is the walk over the keys
            movable = cache.movable(tier, shard=0)
            walked = heapq.nsmallest(len(movable), movable, key=lambda k: (cache.last_used[k], k))
            assert cache._least_recent(tier, len(movable) + 1) == walked
            assert cache._least_recent(tier, 2) == walked[:2]
        assert tracker.total <= budget
        assert cache.staging.total <= cache.staging.budget
        assert cache.stats.resident_bytes <= plan.nbytes
        cache.check()
        if not keep_lower:  # without keep_lower an expert has one published version at most
            assert all(len(v) == 1 for v in cache.resident.values())
    cache.settle()
    assert cache.staging.total == 0  # every staging reservation came back
    cache.check()
    return len(trace)


class RecordingPolicy(Policy):
    """A baseline LRU that records what the policy interface hands it."""

    def __init__(self):
        super().__init__(name="recording", tier="bf16", wants_importance=True)
        self.seen: list = []

    def observe(self, routings, counters):
        for routing in routings:
            self.seen.append((routing.phase, routing.layer, routing.num_layers, routing.ids.shape, routing.importance,
                              counters.total.sum()))


@pytest.mark.parametrize("execution", ["layerwise", "resident"])
def test_policies_see_routing_importance_depth_and_counters(short_converted, resident_reference, execution,
                                                            monkeypatch):
    reference_model, reference = resident_reference
    policy = RecordingPolicy()
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.5),
                      policy=policy, execution=execution)
    assert jmoe.generate(model, PROMPTS[0], max_new_tokens=16) == reference[0]
    prefill = [s for s in policy.seen if s[0] == "prefill"]
    decode = [s for s in policy.seen if s[0] == "decode"]
    layers = model.config.num_moe_layers
    assert {s[1] for s in prefill} == set(range(layers)) and all(s[2] == layers for s in policy.seen)
    for _, _, _, shape, importance, _ in prefill:
        assert importance is not None and importance.shape == (shape[0],)
        assert np.all(importance >= 0) and 0.0 < importance.sum() <= 1.0 + 1e-5  # a share of the attention
    assert all(s[4] is None for s in decode) and decode[0][3] == (1, 4)
    assert decode[-1][5] > decode[0][5]  # long-horizon counters keep growing


def test_reset_stats_keeps_the_cache_and_starts_counting_afresh(short_converted, resident_reference):
    reference_model, _ = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.5),
                      policy="lru+prefetch")
    jmoe.generate(model, PROMPTS[0], max_new_tokens=8)
    resident = dict(model.residency.cache.resident)
    model.residency.reset_stats()
    assert jmoe.stats(model)["expert_uses"] == 0 and model.residency.cache.resident == resident
    assert jmoe.stats(model)["hit_rate"] is None  # nothing counted yet: no rate (0.0 would read as all misses)
    jmoe.generate(model, PROMPTS[1], max_new_tokens=8)
    stats = jmoe.stats(model)
    assert stats["prefetch_issued"] > 0 and stats["prefetch_accuracy"] <= 1.0


# ---------------------------------------------------------------- one pool per tier


class TwoTierPolicy(Policy):
    """Even experts at int4, odd ones at int2, each tier in its own pool (a mixed-precision
    policy's shape; the placement rule is arbitrary but fixed, so runs are comparable)."""

    def __init__(self, shares=None):
        super().__init__(name="two-tier", tier="int4", pool_shares=shares or {"int4": 0.6, "int2": 0.4})

    def plan(self, view):
        codes = np.where(np.arange(view.num_experts) % 2 == 0, TIER_CODES["int4"], TIER_CODES["int2"])
        return Plan.wanting(np.broadcast_to(codes, (view.num_layers, view.num_experts)))


@pytest.mark.parametrize("execution", PATHS)
def test_a_pool_per_tier_under_a_budget_matches_the_unbudgeted_run(short_two_tier, execution):
    ids = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12]
    unbudgeted = jmoe.load(short_two_tier, compute_dtype="float32", policy=TwoTierPolicy())
    reference = jmoe.generate(unbudgeted, ids, max_new_tokens=12)
    fixed, budget = planned_budget(short_two_tier, "int4", 0.45)
    model = jmoe.load(short_two_tier, compute_dtype="float32", policy=TwoTierPolicy(), execution=execution,
                      device_budget=budget)
    assert jmoe.generate(model, ids, max_new_tokens=12) == reference
    rt = model.residency
    every = model.config.num_experts * len(model.config.moe_layer_indices)
    assert set(rt.pools) == {"int4", "int2"} and all(p.slots < every // 2 for p in rt.pools.values())
    assert sum(p.nbytes for p in rt.pools.values()) + rt.tracker.reserved["staging"] <= model.device_budget - fixed
    stats = jmoe.stats(model)
    by_tier = stats["bytes_h2d_by_tier"]
    assert set(by_tier) == {"int4", "int2"} and sum(by_tier.values()) == stats["bytes_h2d"]
    for tier, nbytes in by_tier.items():
        assert nbytes % model.store.record_nbytes(tier) == 0
    assert all(set(versions) == {"int4" if e % 2 == 0 else "int2"} for (_, e), versions in rt.cache.resident.items())
    rt.cache.check()
    # int2 experts really ran: the logits differ from the same model with every expert at int4
    int4_only = jmoe.load(short_two_tier, compute_dtype="float32", tier="int4")
    assert not np.allclose(jmoe.forward(model, ids), jmoe.forward(int4_only, ids), atol=1e-3)


def test_pool_shares_and_tiers_are_checked(short_two_tier, short_converted):
    with pytest.raises(InputError, match="add up to 1.2"):
        jmoe.load(short_two_tier, policy=TwoTierPolicy({"int4": 0.8, "int2": 0.4}), device_budget="64MiB")
    with pytest.raises(InputError, match="has no int4 pool"):
        jmoe.load(short_two_tier, policy=TwoTierPolicy({"int2": 1.0}), device_budget="64MiB")
    with pytest.raises(jmoe.FormatError, match="converted without tier 'int4'"):
        jmoe.load(short_converted, policy=TwoTierPolicy(), device_budget="64MiB")
    one_pool = jmoe.load(short_two_tier, compute_dtype="float32", policy=TwoTierPolicy({"int4": 1.0}),
                         device_budget="64MiB")
    with pytest.raises(InputError, match="asked for int2 .* but has no int2 pool"):
        jmoe.generate(one_pool, [5, 17, 99], max_new_tokens=2)


class PromoteInDecode(Policy):
    """int2 for the prompt, int4 once decoding: every expert kept from prefill is below its wanted
    tier in decode, which the resident path may then run degraded."""

    def plan(self, view):
        return Plan.uniform(view.num_layers, view.num_experts, "int2" if view.phase == "prefill" else "int4")


def test_decode_runs_misses_exact_in_the_step_or_degraded_when_the_policy_allows(two_tier_model):
    ids = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12]
    _, budget = planned_budget(two_tier_model, "int4", 0.5)
    runs = {}
    for degrade in ((), ("decode",)):
        policy = PromoteInDecode(name="promote", tier="int4", pool_shares={"int4": 0.5, "int2": 0.5},
                                 degrade_phases=degrade)
        model = jmoe.load(two_tier_model, compute_dtype="float32", policy=policy, execution="resident",
                          device_budget=budget)
        runs[degrade] = (jmoe.generate(model, ids, max_new_tokens=12), jmoe.stats(model))
        model.residency.cache.check()
    (exact, exact_stats), (kept, kept_stats) = runs[()], runs[("decode",)]
    assert kept[0] == exact[0]  # the prompt is never degraded: the first token is the exact one
    # exact: what decode lacked was fetched and run inside its steps, never replayed
    assert exact_stats["degraded"] == exact_stats["skipped"] == exact_stats["replays"] == 0
    assert exact_stats["in_step_fetches"] > 0 and exact_stats["miss_rate"] > 0
    assert kept_stats["degraded"] > 0 and kept_stats["replays"] == 0  # int2 versions ran where int4 was wanted
    assert exact[1:] != kept[1:]  # ... which changes the answer
    assert kept_stats["bytes_h2d_by_tier"]["int4"] > 0  # ... and int4 was fetched for later steps
    counted = kept_stats["hit_rate"] + kept_stats["miss_rate"] + kept_stats["late_rate"]
    counted += (kept_stats["degraded"] + kept_stats["skipped"]) / kept_stats["expert_uses"]
    assert counted == pytest.approx(1.0)
    with pytest.raises(InputError, match="degrade_phases"):
        jmoe.load(two_tier_model, policy=PromoteInDecode(name="p", tier="int4", degrade_phases=("always",)))


@pytest.mark.parametrize("execution", PATHS)
def test_sampled_output_under_offloading_is_the_all_resident_one(short_converted, resident_reference, execution):
    """Decode steps sample inside themselves; a step that lacked more experts than its one miss slot
    per layer holds is run again and its token drawn again with the same key and history (and its
    successor taken back), so sampling is exact too."""
    reference_model, _ = resident_reference
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=7)
    expected = jmoe.generate(reference_model, PROMPTS[0], **kw)
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy="lru", execution=execution, miss_slots=1)
    assert jmoe.generate(model, PROMPTS[0], **kw) == expected
    stats = jmoe.stats(model)
    assert stats["miss_rate"] > 0
    if execution != "layerwise":
        assert stats["replays"] > 0 and stats["in_step_fetches"] > 0  # some misses served in steps, some not
    model.residency.cache.check()


def test_a_step_that_lacked_more_than_its_miss_slots_runs_again_in_one_executable(short_converted,
                                                                                   resident_reference, monkeypatch):
    """An overflowed fetching step is run again whole over resident experts (the host fetches what its
    summary says ran short), not layer by layer: layer by layer costs reads and executions per layer."""
    reference_model, expected = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy="lru", miss_slots=1)
    layerwise = []
    real = model.executor._layerwise
    monkeypatch.setattr(model.executor, "_layerwise", lambda *a, **kw: layerwise.append(a[-1]) or real(*a, **kw))
    assert [jmoe.generate(model, p, max_new_tokens=16) for p in PROMPTS] == expected
    stats = jmoe.stats(model)
    assert stats["replays"] > 0 and stats["in_step_fetches"] > 0
    assert "decode" not in layerwise  # prefill runs layer-wise ("auto"); no decode step did
    model.residency.cache.check()


def test_device_handle_tables_do_not_follow_later_host_changes():
    # On the CPU, device_put may alias an aligned numpy buffer: a step dispatched before a publish
    # must still read the table it was given.
    from jmoe.runtime.handles import HandleTable

    table = HandleTable(8, 32, ("bf16", "int4"), jax.devices()[0])
    for tier, host in table.slot.items():  # 64-byte aligned host tables, as the allocator may give them
        raw = np.empty(host.nbytes + 64, np.uint8)
        offset = -raw.ctypes.data % 64
        table.slot[tier] = raw[offset : offset + host.nbytes].view(np.int32).reshape(host.shape)
        table.slot[tier][...] = host
    before = table.on_device()
    table.publish(0, 0, "bf16", 5)
    table.retract(0, 0, "bf16")
    table.publish(3, 7, "int4", 9)
    assert (np.asarray(before["bf16"]) == -1).all() and (np.asarray(before["int4"]) == -1).all()
    assert int(table.on_device()["int4"][3, 7]) == 9


def test_layer_passes_fetch_into_the_slots_of_the_experts_that_ran_first():
    """A layer whose routed experts already fill a pool, with more to fetch: the resident ones run
    first, so the passes after them may take their slots (this raised a BudgetError in prefill)."""
    from types import SimpleNamespace

    from jmoe.runtime.residency import Offloaded

    resident = {(0, 0), (0, 1)}  # the int2 pool's two slots hold layer 0's experts 0 and 1

    class Cache:
        def serves(self, key, code):
            return key in resident

        def room(self, tier, keep, shard):  # no free slot: the versions a fetch could evict, less `keep`
            return sum(key not in keep for key in resident)

    pool = SimpleNamespace(shards=1, shard_slots=2, owner=lambda expert: 0)
    fake = SimpleNamespace(cache=Cache(), pools={"int2": pool}, landing_tier=lambda key, code: "int2")
    wanted = {e: "int2" for e in range(5)}
    assert Offloaded.split_passes(fake, 0, wanted) == [{0: "int2", 1: "int2"}, {2: "int2", 3: "int2"}, {4: "int2"}]


@pytest.mark.parametrize("policy", ["lru", "lru+prefetch"])
def test_an_accelerators_chained_fetches_give_the_resident_models_tokens(short_converted, resident_reference,
                                                                         monkeypatch, policy):
    """On an accelerator a layer's misses and look-ahead are fetched by chains of conditionals (an
    unused fetch moves nothing), with as many slots as top_k: run here with the slots and the code an
    accelerator gets (no native copy, no per-fetch guard), they give the resident model's tokens
    and serve every miss inside the step."""
    import jmoe.runtime.fetching as fetching

    monkeypatch.setattr(fetching, "device_is_host", lambda device: False)
    reference_model, expected = resident_reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget_for(reference_model, 0.3),
                      policy=policy)
    spec = model.residency.in_step.spec
    assert spec.chained and not spec.guarded and not spec.native
    assert spec.misses == model.config.top_k  # not a quarter of it: an unused slot costs no record
    assert [jmoe.generate(model, p, max_new_tokens=16) for p in PROMPTS] == expected
    stats = jmoe.stats(model)
    assert stats["replays"] == 0 and stats["in_step_misses"] > 0
    model.residency.cache.check()


def test_a_fetch_chain_moves_the_records_up_to_its_last_used_slot():
    """fetch.fetch_chain: slot j is fetched while any slot from j on is used (its conditional is
    entered), zeros past the last used one; the records are the store's rows of the ids asked for."""
    import jax.numpy as jnp

    from jmoe.layers.fetch import fetch_chain

    store = np.arange(6 * 4, dtype=np.uint8).reshape(6, 4)
    ids = jnp.asarray([4, 1, 5, 0], jnp.int32)
    for valid, fetched in (([True, True, False, False], 2), ([True, False, True, False], 3),
                           ([False] * 4, 0), ([True] * 4, 4)):
        got = np.asarray(jax.jit(fetch_chain)(jnp.asarray(store), ids, jnp.asarray(valid)))
        want = np.zeros_like(got)
        want[:fetched] = store[np.asarray(ids)[:fetched]]
        np.testing.assert_array_equal(got, want)


def test_an_accelerators_fixed_slots_count_every_record_they_move(short_two_tier, monkeypatch):
    """jmoe.stats counts what moves: on an accelerator a fixed fetch slot (degrade mode's misses and
    look-ahead, every request slot) moves its record every step, used or not, so each decode step
    counts them all; the experts fetched through them are not counted again."""
    import jmoe.runtime.fetching as fetching
    from jmoe.policies import DyMoE

    monkeypatch.setattr(fetching, "device_is_host", lambda device: False)
    plan = jmoe.runtime.loader.memory_plan(short_two_tier, compute_dtype="float32", policy=DyMoE(hi="int4", lo="int2"))
    budget = int(sum(v for k, v in plan.items() if k != "all_experts") + 0.3 * plan["all_experts"])
    model = jmoe.load(short_two_tier, compute_dtype="float32", device_budget=budget, policy=DyMoE(hi="int4", lo="int2"))
    spec = model.residency.in_step.spec
    assert not spec.chained and not spec.guarded and spec.misses and spec.requests  # degrade mode: fixed slots
    moved = []
    real = model.residency.count_moved
    monkeypatch.setattr(model.residency, "count_moved", lambda tier, n: moved.append((tier, n)) or real(tier, n))
    before = jmoe.stats(model)["bytes_h2d"]
    jmoe.generate(model, PROMPTS[0], max_new_tokens=6, temperature=1.0, seed=2)
    L = model.config.num_moe_layers
    per_step = L * (spec.requests + spec.misses) + (L - 1) * spec.lookahead  # look-ahead from the second layer
    steps = [n for tier, n in moved if n == per_step]
    assert len(steps) == 2 * 5  # both tiers, every decode step (the prefill runs layer by layer)
    record = {tier: model.residency.host.nbytes(tier) for tier in spec.tiers}
    fixed = sum(n * record[tier] for tier, n in moved if n == per_step)
    assert jmoe.stats(model)["bytes_h2d"] - before >= fixed > 0
    assert jmoe.stats(model)["in_step_fetches"] > 0
