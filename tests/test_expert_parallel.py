"""Expert parallelism over a mesh of the suite's 8 CPU devices: the tokens of one device, for every
family's MoE layer, resident and offloaded under a per-device budget, with DyMoE and speculation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from jmoe.errors import InputError
from jmoe.policies import DyMoE, DynaExq
from jmoe.runtime.loader import memory_plan
from tests.hf_models import make_checkpoint
from tests.test_family_deepseek import DEEPSEEK_V3, RANDOMIZED
from tests.test_family_gpt_oss import EVERY_BIAS

# meshes of the suite's 8 CPU devices: on a GPU machine the default devices are the GPU's
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU devices only")

PROMPT = "The Python standard library"
TOKENS = 24
MESHES = ["ep=2", "ep=4", "ep=8", "ep=4,tp=2"]
SEQ = 256


@pytest.fixture(scope="module")
def tiny_tiers(tmp_path_factory, short_hf_dir):
    return convert_checkpoint(short_hf_dir, tmp_path_factory.mktemp("ep") / "tiny", tiers="bf16,int4,int2",
                              progress=False)


@pytest.fixture(scope="module")
def tiny_reference(tiny_tiers):
    return jmoe.generate(jmoe.load(tiny_tiers, compute_dtype="float32", max_seq_len=SEQ), PROMPT,
                         max_new_tokens=TOKENS)


def load(path, **kw):
    return jmoe.load(path, compute_dtype="float32", max_seq_len=SEQ, **kw)


def offload_budget(path, shards: int, tier: str = "bf16", share: int = 3, policy: str = "lru") -> int:
    """A per-device budget that holds a `share`-th of a device's experts (and everything else)."""
    plan = memory_plan(path, compute_dtype="float32", max_seq_len=SEQ, tier=tier, policy=policy, mesh=f"ep={shards}")
    return sum(v for k, v in plan.items() if k != "all_experts") + plan["all_experts"] // shards // share


def shard_occupancy(model) -> dict[str, list[int]]:
    """Resident versions per tier and shard."""
    cache = model.residency.cache
    out = {}
    for tier, pool in cache.pools.items():
        counts = [0] * pool.shards
        for key, versions in cache.resident.items():
            if tier in versions:
                counts[pool.owner(key[1])] += 1
        out[tier] = counts
    return out


@pytest.mark.parametrize("mesh", MESHES)
def test_tiny_resident_mesh_gives_one_device_tokens(tiny_tiers, tiny_reference, mesh):
    model = load(tiny_tiers, mesh=mesh)
    pool = model.residency.pool.gate_up
    shards = model.placement.shards
    # each ep shard holds 1/shards of the experts (replicated over tp)
    assert {s.data.shape[0] for s in pool.addressable_shards} == {pool.shape[0] // shards}
    assert len(pool.addressable_shards) == len(model.placement.mesh.devices.flat)
    assert jmoe.generate(model, PROMPT, max_new_tokens=TOKENS) == tiny_reference


@pytest.mark.parametrize("mesh,execution", [("ep=2", "auto"), ("ep=4,tp=2", "layerwise"), ("ep=4", "resident")])
def test_tiny_offloaded_per_device_budget(tiny_tiers, tiny_reference, mesh, execution):
    shards = int(mesh.split(",")[0].split("=")[1])
    budget = offload_budget(tiny_tiers, shards)
    model = load(tiny_tiers, mesh=mesh, device_budget=budget, policy="lru", execution=execution)
    assert sum(model.memory.values()) <= budget  # what one device holds
    assert jmoe.generate(model, PROMPT, max_new_tokens=TOKENS) == tiny_reference
    cache = model.residency.cache
    cache.check()  # includes: every version sits in its own shard's slots
    stats = model.stats
    assert stats.transfers > 0 and stats.evictions > 0  # the budget forced offloading
    pool = cache.pools["bf16"]
    assert all(n <= pool.shard_slots for n in shard_occupancy(model)["bf16"])
    assert pool.shard_slots < model.config.num_moe_layers * model.config.num_experts // shards


def test_dymoe_on_a_mesh_gives_one_device_tokens(tiny_tiers):
    """Offloaded (a budget of every int4 expert, split evenly between the two tiers' pools: too
    little for both tiers whole, far above one layer's working set) and with both tiers whole (no
    budget), each as on one device."""
    policy = lambda: DyMoE(hi="int4", lo="int2", pool_shares={"int4": 0.5, "int2": 0.5})  # noqa: E731
    one = load(tiny_tiers, policy=policy(), tier="int4", device_budget=offload_budget(
        tiny_tiers, 1, tier="int4", share=1, policy="dymoe"))
    want = jmoe.generate(one, PROMPT, max_new_tokens=TOKENS)
    budget = offload_budget(tiny_tiers, 4, tier="int4", share=1, policy="dymoe")
    model = load(tiny_tiers, mesh="ep=4", policy=policy(), tier="int4", device_budget=budget)
    assert jmoe.generate(model, PROMPT, max_new_tokens=TOKENS) == want
    model.residency.cache.check()
    assert model.stats.transfers > 0
    whole = jmoe.generate(load(tiny_tiers, policy="dymoe", tier="int4"), PROMPT, max_new_tokens=TOKENS)
    model = load(tiny_tiers, mesh="ep=4", policy="dymoe", tier="int4")
    assert not model.residency.offloading and model.residency.tiers == ("int4", "int2")
    assert jmoe.generate(model, PROMPT, max_new_tokens=TOKENS) == whole


@pytest.mark.parametrize("keep_lo", [True, False])
def test_dynaexq_keeps_a_hi_set_per_shard(tiny_tiers, keep_lo):
    budget = offload_budget(tiny_tiers, 4, tier="int4", share=1, policy="dynaexq")
    model = load(tiny_tiers, mesh="ep=4", policy=DynaExq(keep_lo=keep_lo), tier="int4", device_budget=budget)
    text = jmoe.generate(model, PROMPT * 4, max_new_tokens=TOKENS)
    assert text
    policy, cache = model.policy, model.residency.cache
    cache.check()
    layers = model.config.num_moe_layers
    members = policy.members.reshape(layers, 4, -1)
    assert (members.sum(axis=(0, 2)) <= policy.n_model).all()  # each shard's own hi set, over its layers
    assert policy.n_model >= policy.n_hi * layers
    assert policy.members.any()
    assert all(n <= cache.pools["int4"].shard_slots for n in shard_occupancy(model)["int4"])


def test_speculative_on_a_mesh_gives_greedy_tokens(tiny_tiers, tiny_reference):
    model = load(tiny_tiers, mesh="ep=2,tp=2")
    assert jmoe.generate(model, PROMPT, max_new_tokens=TOKENS, speculative="int4") == tiny_reference
    draft_leaf = jax.tree.leaves(model.draft("int4").pool)[0]
    assert draft_leaf.sharding == model.placement.experts  # the draft's experts are sharded too


def test_serving_engine_on_a_mesh_gives_generate_texts(tiny_tiers):
    from jmoe.serving import BatchEngine, Request

    model = load(tiny_tiers, mesh="ep=4")
    prompts = ["The Python standard library", "def parse(self, text):", "12 + 35 ="]
    want = [jmoe.generate(model, p, max_new_tokens=12) for p in prompts]
    with BatchEngine(model, max_batch=2) as engine:
        streams = [engine.submit(Request(model.tokenizer.encode(p), 12)) for p in prompts]
        assert [s.text() for s in streams] == want


# The tiny model (Qwen3-MoE, its first layers) runs on every mesh above; each other family's MoE layer runs on the
# meshes where what it adds meets sharding: DeepSeek-V3's shared experts and sigmoid routing with
# one expert per shard and beside tensor parallelism, GPT-OSS's expert biases and clamped SwiGLU
# split over experts and tensor parallelism at once.
FAMILY_CASES = {
    "deepseek_v3": dict(overrides=DEEPSEEK_V3["grouped-interleaved"], randomize=RANDOMIZED,
                        meshes=["ep=8", "ep=4,tp=2"]),
    "gpt_oss": dict(overrides=None, randomize=EVERY_BIAS, meshes=["ep=2,tp=2"]),
}


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def family_model(request, tmp_path_factory):
    family = request.param
    case = FAMILY_CASES[family]
    root = tmp_path_factory.mktemp(family)
    make_checkpoint(family, root / "hf", overrides=case["overrides"], randomize=case["randomize"])
    out = convert_checkpoint(root / "hf", root / "jmoe", progress=False)
    prompt = list(range(3, 15))
    return out, case["meshes"], prompt, jmoe.generate(load(out), [prompt], max_new_tokens=16)[0]


def test_other_families_on_a_mesh(family_model):
    out, meshes, prompt, want = family_model
    for mesh in meshes:
        got = jmoe.generate(load(out, mesh=mesh), [prompt], max_new_tokens=16)[0]
        assert got == want, mesh
        shards = int(mesh.split(",")[0].split("=")[1])
        # half of a device's experts: with 8 experts over 8 shards, one slot per layer's one expert
        model = load(out, mesh=mesh, device_budget=offload_budget(out, shards, share=2), policy="lru")
        assert jmoe.generate(model, [prompt], max_new_tokens=16)[0] == want, f"{mesh}, offloaded"
        model.residency.cache.check()
        assert model.stats.transfers > 0 and model.stats.evictions > 0


@pytest.mark.parametrize("mesh,message", [("ep=3", "divide"), ("ep=16", "devices"), ("dp=2", "unknown axis"),
                                          ("ep=two", "AXIS=SIZE"), ("ep=2,ep=2", "twice"), ("ep=0", "positive")])
def test_bad_mesh_names_the_problem(tiny_tiers, mesh, message):
    with pytest.raises(InputError, match=message):
        load(tiny_tiers, mesh=mesh)


def test_cpu_execution_is_refused_on_a_mesh(tiny_tiers):
    with pytest.raises(InputError, match=r"\+cpu"):
        load(tiny_tiers, mesh="ep=2", policy="lru+cpu", device_budget=offload_budget(tiny_tiers, 2))


def test_expert_parallel_layer_equals_one_device():
    """The shard_map'd routed experts against the one-device layer, on random pools and routing."""
    from jmoe.distributed.mesh import Placement
    from jmoe.layers.experts import LayerExperts, Routing, routed_experts
    from jmoe.quant import ExpertWeights

    L_E, D, F, N, k = 8, 16, 24, 5, 2
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((L_E, D, 2 * F), np.float32) * 0.2
    down = rng.standard_normal((L_E, F, D), np.float32) * 0.2
    h = jax.numpy.asarray(rng.standard_normal((N, D), np.float32))
    ids = jax.numpy.asarray(rng.integers(0, L_E, (N, k)), jax.numpy.int32)
    routing = Routing(ids, jax.numpy.asarray(rng.random((N, k), np.float32)))
    chosen = jax.numpy.full((N, k), 4, jax.numpy.int32)  # bf16's code everywhere
    valid = jax.numpy.ones((N,), bool)
    codes = jax.numpy.full((L_E,), 4, jax.numpy.int32)

    def layer(pool, slots, ep):
        return LayerExperts({"bf16": slots}, {"bf16": pool}, codes, codes, jax.numpy.float32(1), jax.numpy.float32(.1),
                            "xla", ep=ep)

    one = ExpertWeights(jax.numpy.asarray(gate_up), jax.numpy.asarray(down))
    want = routed_experts(h, routing, chosen, valid, layer(one, jax.numpy.arange(L_E, dtype=jax.numpy.int32), None))
    placement = Placement.for_mesh("ep=4")
    sharded = ExpertWeights(jax.device_put(gate_up, placement.experts), jax.device_put(down, placement.experts))
    got = jax.jit(routed_experts)(h, routing, chosen, valid,
                                  layer(sharded, jax.numpy.arange(L_E, dtype=jax.numpy.int32), placement.expert_parallel))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    text = jax.jit(routed_experts).lower(h, routing, chosen, valid, layer(
        sharded, jax.numpy.arange(L_E, dtype=jax.numpy.int32), placement.expert_parallel)).compile().as_text()
    assert text.count("all-reduce(") + text.count("all-reduce-start(") == 1  # one psum per layer
