"""The runtime's seams: precision chosen inside the one-jit step, policy plans, the Decoder."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from jmoe.decoding.decoder import Decoder
from jmoe.policies import Plan, Policy
from jmoe.runtime.residency import AllResident
from jmoe.tiers import TIER_CODES

INT4, INT2 = TIER_CODES["int4"], TIER_CODES["int2"]
IDS = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12]


@pytest.fixture(scope="module")
def two_tiers(tmp_path_factory, tiny_hf_dir):  # the whole model: its prompt routes the experts SkipAndLower picks
    return convert_checkpoint(tiny_hf_dir, tmp_path_factory.mktemp("seams") / "m", tiers="bf16,int4,int2",
                              progress=False)


class SkipAndLower(Policy):
    """Every routed expert at int4, except one skipped and one run at int2 (in every layer); the
    top `ratio` of the rest by importance stay at int4 and the others drop to int2."""

    def __init__(self):
        super().__init__(name="skip-and-lower", tier="int4", pool_shares={"int4": 0.5, "int2": 0.5})
        self.skip, self.lower, self.ratio = 3, 7, 1.0

    def plan(self, view):
        hi = np.full((view.num_layers, view.num_experts), INT4, np.int32)
        hi[:, self.skip], hi[:, self.lower] = 0, INT2
        lo = np.where(hi == INT4, INT2, hi)
        return Plan(hi, lo, np.full(view.num_layers, self.ratio, np.float32))


@contextlib.contextmanager
def counting_compilations():
    """Counts XLA backend compilations (of anything) inside the block."""
    count = [0]

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_the_one_jit_step_skips_and_lowers_experts_without_recompiling(two_tiers):
    runs, logits = {}, {}
    for path in ("resident", "layerwise"):
        policy = SkipAndLower()
        model = jmoe.load(two_tiers, compute_dtype="float32", policy=policy, execution=path)
        runs[path] = [jmoe.generate(model, IDS, max_new_tokens=10)]
        stats = jmoe.stats(model)
        assert stats["skipped"] > 0 and stats["bytes_h2d_by_tier"]["int2"] > 0 and stats["degraded"] == 0
        with counting_compilations() as compiled:
            for skip, lower, ratio in ((11, 2, 1.0), (3, 7, 0.5), (0, 1, 0.25)):  # new choices each run
                policy.skip, policy.lower, policy.ratio = skip, lower, ratio
                runs[path].append(jmoe.generate(model, IDS, max_new_tokens=10))
        if path == "resident":
            assert compiled[0] == 0  # choosing differently never recompiled anything
            assert jmoe.stats(model)["replays"] > 0  # misses were fetched and the step re-run
        model.residency.cache.check()
        logits[path] = np.asarray(jmoe.forward(model, IDS))
    assert runs["resident"] == runs["layerwise"]  # both paths honour skip, lower tiers and the ratio
    np.testing.assert_allclose(logits["resident"], logits["layerwise"], rtol=1e-4, atol=1e-4)
    int4 = np.asarray(jmoe.forward(jmoe.load(two_tiers, compute_dtype="float32", tier="int4"), IDS))
    assert np.abs(logits["resident"] - int4).max() > 1e-2  # the choices really changed what ran


class DemoteAndPrefetch(Policy):
    """int4 for everything until told to demote one expert and prefetch another at int2."""

    def __init__(self):
        super().__init__(name="demote", tier="int4", pool_shares={"int4": 0.5, "int2": 0.5})
        self.demote = self.prefetch_key = None

    def plan(self, view):
        hi = np.full((view.num_layers, view.num_experts), INT4, np.int32)
        if self.demote is None:
            return Plan.wanting(hi)
        hi[self.demote] = INT2
        return Plan.wanting(hi, transitions=[(self.demote, "int2")], prefetch=[(self.prefetch_key, "int2")])


def test_a_plan_demotes_one_expert_and_prefetches_another_at_a_lower_tier(two_tiers):
    policy = DemoteAndPrefetch()
    model = jmoe.load(two_tiers, compute_dtype="float32", policy=policy)
    jmoe.generate(model, IDS, max_new_tokens=4)
    res = model.residency
    res.cache.settle()
    demote = next(k for k, v in res.cache.resident.items() if v == {"int4": res.cache.resident[k]["int4"]})
    prefetch_key = next((layer, e) for layer in range(model.config.num_moe_layers) for e in range(32)
                        if (layer, e) not in res.cache.resident)
    policy.demote, policy.prefetch_key = demote, prefetch_key
    res.begin_step("decode")  # the plan starts the demotion and the prefetch in the background
    assert res.cache.code_of(demote) == INT4  # the int4 version serves until int2 is published
    res.end_step()
    res.cache.settle()
    assert res.cache.resident[demote].keys() == {"int2"}  # demoted: int4 freed once int2 landed
    assert res.cache.resident[prefetch_key].keys() == {"int2"}
    res.cache.check()
    assert jmoe.generate(model, IDS, max_new_tokens=4)  # and the model runs on
    res.cache.settle()
    res.cache.check()


def test_a_draft_verify_loop_through_the_decoder_gives_the_greedy_tokens(two_tiers):
    target = jmoe.load(two_tiers, compute_dtype="float32", tier="bf16")
    draft = AllResident(target.store, "int4", jax.devices()[0])
    new_tokens, k = 24, 4
    expected = jmoe.generate(target, IDS, max_new_tokens=new_tokens)
    decoder = Decoder(target, [IDS], len(IDS), len(IDS) + new_tokens + k + 1)
    token = int(jnp.argmax(decoder.prefill()[0]))
    out, accepted = [token], []
    while len(out) < new_tokens:
        drafts, t = [], token
        for _ in range(k):  # the int4 copy drafts k tokens into the shared cache
            t = int(jnp.argmax(decoder.decode(jnp.asarray([t]), residency=draft)[0]))
            drafts.append(t)
        decoder.advance(-k)
        checked = np.asarray(jnp.argmax(decoder.verify(jnp.asarray([[token, *drafts]]))[0], axis=-1))  # k + 1 logits
        n = 0
        while n < k and drafts[n] == checked[n]:
            n += 1
        out += drafts[:n] + [int(checked[n])]
        accepted.append(n)
        decoder.advance(n + 1)
        token = out[-1]
    assert out[:new_tokens] == expected
    assert sum(accepted) > 0  # the draft was right sometimes: verification really accepted its tokens


def test_rows_of_a_batch_advance_by_different_amounts(short_model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 4000, size=n).tolist() for n in (5, 9, 3)]
    P = 9
    decoder = Decoder(short_model, prompts, P, 32)
    decoder.prefill()
    block = rng.integers(1, 4000, size=(3, 3))
    verified = np.asarray(decoder.verify(jnp.asarray(block, jnp.int32)))  # [3, 3, V]
    moves = [1, 2, 3]
    decoder.advance(moves)
    nxt = rng.integers(1, 4000, size=3)
    stepped = np.asarray(decoder.decode(jnp.asarray(nxt, jnp.int32)))  # [3, V]
    for b, prompt in enumerate(prompts):
        for j in range(3):
            reference = np.asarray(jmoe.forward(short_model, prompt + block[b, : j + 1].tolist()))[-1]
            np.testing.assert_allclose(verified[b, j], reference, rtol=1e-4, atol=1e-4)
        kept = prompt + block[b, : moves[b]].tolist() + [int(nxt[b])]
        np.testing.assert_allclose(stepped[b], np.asarray(jmoe.forward(short_model, kept))[-1], rtol=1e-4, atol=1e-4)


def test_all_resident_steps_keep_their_routing_on_the_device(short_model):
    before = jmoe.stats(short_model)["steps"]
    jmoe.generate(short_model, "def f(x):", max_new_tokens=3)
    signals = short_model.residency.signals
    layers = short_model.config.num_moe_layers
    assert isinstance(signals.ids, jax.Array) and signals.ids.shape == (layers, 1, 1, 4)  # [layers, B, T, k]
    assert (np.asarray(signals.wanted) == TIER_CODES["bf16"]).all()
    assert (np.asarray(signals.chosen) == TIER_CODES["bf16"]).all() and not np.asarray(signals.missing).any()
    stats = jmoe.stats(short_model)
    assert stats["steps"] > before and stats["host_syncs"] == 0
