"""Offloaded decode waits for the host once per token: one blocking read and one executable per
decoded token for every policy, counted by bench/lib/host_io (which patches JAX, independently of
jmoe), and jmoe.stats() counting the same."""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
import pytest

import jmoe
from bench.lib import host_io
from convert import convert_checkpoint
from jmoe.policies import DyMoE, DynaExq
from jmoe.runtime.loader import memory_plan

PROMPT = [5, 17, 99, 3, 42, 250, 7, 61, 1000, 12, 33, 71]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def int4_int2(tmp_path_factory, short_hf_dir):
    return convert_checkpoint(short_hf_dir, tmp_path_factory.mktemp("host_waits") / "m", tiers="int4,int2",
                              progress=False)


def offloaded(path, policy, fraction: float = 0.3):
    """The model under a budget of what load reserves besides the pools plus `fraction` of every int4 expert."""
    plan = memory_plan(path, compute_dtype="float32", policy=policy)
    budget = int(sum(v for k, v in plan.items() if k != "all_experts") + fraction * plan["all_experts"])
    model = jmoe.load(path, compute_dtype="float32", device_budget=budget, policy=policy)
    assert model.residency.offloading
    return model


POLICIES = {  # name: (the policy, the share of every int4 expert its pools get)
    "lru": (lambda: "lru", 0.3),
    "lru+prefetch": (lambda: "lru+prefetch", 0.3),
    "ondemand": (lambda: "ondemand", 0.3),
    "dymoe": (lambda: DyMoE(hi="int4", lo="int2"), 0.3),
    "dynaexq": (lambda: DynaExq(hi="int4", lo="int2", interval=4), 0.7),  # every expert at int2, some at int4
}


def decode_window(model, **sampling) -> tuple[int, host_io.Counts, dict]:
    """Stream a generation; count what happens between its first token and its last: (tokens
    after the first, host_io's counts, jmoe's own decode counters)."""
    stream = jmoe.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stream=True, **sampling)
    next(stream)
    before, own = host_io.counts(), dict(model.stats.io["decode"])
    tokens = sum(1 for _ in stream)
    after = model.stats.io["decode"]
    return tokens, host_io.counts() - before, {k: after[k] - own[k] for k in own}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("policy", POLICIES)
def test_offloaded_decode_reads_once_and_dispatches_once_per_token(int4_int2, policy, temperature):
    make, fraction = POLICIES[policy]
    model = offloaded(int4_int2, make(), fraction)
    sampling = dict(temperature=temperature, seed=3)
    jmoe.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, **sampling)  # compiles every shape the window runs
    host_io.install()
    try:
        tokens, counted, own = decode_window(model, **sampling)
    finally:
        host_io.uninstall()
    stats = jmoe.stats(model)
    assert tokens == NEW_TOKENS - 1 and stats["replays"] == 0
    # each token read back with its step's summary; each step dispatched before the previous one is
    # read, so the window (from the first token to the last) dispatches one step fewer than it reads
    assert counted.reads == tokens and counted.waits == 0
    assert counted.executions == tokens - 1
    assert own["reads"] == counted.reads and own["executions"] == counted.executions
    assert own["transfers"] == counted.transfers and own["transfer_bytes"] == counted.transfer_bytes
    assert stats["miss_rate"] > 0 or stats["degraded"] > 0 or stats["in_step_fetches"] > 0  # really offloading
    model.residency.cache.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_the_offloaded_decode_step_writes_its_pools_in_place(int4_int2, policy):
    """The compiled step copies no pool: a fetch written where XLA cannot order it after an earlier
    layer's read of the same pool (a host-chosen request, say) makes XLA copy the whole pool, per
    fetch, which costs more than the model's every other byte (seen: 10x slower decode)."""
    make, fraction = POLICIES[policy]
    model = offloaded(int4_int2, make(), fraction)
    engine = model.engine
    compiled, decode = [], engine.decode

    def recording(*args, **kwargs):
        if not compiled:
            compiled.append(decode.lower(*args, **kwargs).compile().as_text())
        return decode(*args, **kwargs)

    engine.decode = recording
    try:
        jmoe.generate(model, PROMPT, max_new_tokens=3, temperature=1.0, seed=1)
    finally:
        engine.decode = decode
    assert compiled, "no decode step ran"
    pool_shapes = {(leaf.dtype.name, leaf.shape) for pool in model.residency.pools.values()
                   for leaf in jax.tree.leaves(pool.arrays)}
    dtypes = {"uint8": "u8", "float16": "f16", "bfloat16": "bf16", "float32": "f32", "int8": "s8"}
    copied = [line.strip()[:120] for line in compiled[0].splitlines() if " copy(" in line
              and any(f"= {dtypes.get(d, d)}[{','.join(map(str, shape))}]" in line for d, shape in pool_shapes)]
    assert not copied, copied
    # every stage of a layer carries its name into the executable (what a profile shows)
    for stage in ("layer_0/attention/", "layer_0/moe/router/", "layer_0/moe/fetch/", "layer_0/moe/experts/",
                  f"layer_{len(model.config.moe_layer_indices) - 1}/moe/experts/"):
        assert stage in compiled[0], stage


def test_resident_decode_reads_once_and_dispatches_once_per_token(int4_int2):
    model = jmoe.load(int4_int2, compute_dtype="float32", tier="int4")
    jmoe.generate(model, PROMPT, max_new_tokens=NEW_TOKENS)
    host_io.install()
    try:
        tokens, counted, own = decode_window(model)
    finally:
        host_io.uninstall()
    assert counted.reads == tokens and counted.executions == tokens - 1 and counted.waits == 0
    assert own["reads"] == counted.reads and own["executions"] == counted.executions
    stats = jmoe.stats(model)  # a resident model's uses are not read back: no rate rather than 0.0
    assert stats["expert_uses"] == 0 and stats["hit_rate"] is None and stats["miss_rate"] is None


def test_stats_report_host_interaction_by_phase(int4_int2):
    model = offloaded(int4_int2, "lru")
    started = time.perf_counter()
    jmoe.generate(model, PROMPT, max_new_tokens=NEW_TOKENS)
    spent = time.perf_counter() - started
    stats = jmoe.stats(model)
    io = stats["host"]
    assert set(io) >= {"prefill", "decode"}
    decode_tokens = NEW_TOKENS - 1
    assert io["decode"]["reads_per_token"] == pytest.approx(io["decode"]["reads"] / decode_tokens)
    assert io["decode"]["executions"] == decode_tokens and io["decode"]["reads"] == decode_tokens
    assert io["prefill"]["reads"] >= model.config.num_moe_layers  # the prompt runs layer-wise: a read per layer
    assert np.isfinite(io["decode"]["transfer_bytes_per_token"])
    # the decode steps' dispatches and blocked reads took time, less than the whole run did
    assert 0 < io["decode"]["dispatch_s"] and 0 < io["decode"]["read_wait_s"]
    assert io["decode"]["dispatch_s"] + io["decode"]["read_wait_s"] < spent
    assert json.loads(json.dumps(stats)) == stats  # what `--stats` prints: plain numbers, no numpy scalars


def test_the_selection_is_sent_again_only_when_the_plans_values_change(int4_int2):
    """A plan rebuilt with the same values reuses the selection on the device (no transfer per
    step); a plan array changed in place is sent again."""
    model = offloaded(int4_int2, "lru")
    jmoe.generate(model, PROMPT, max_new_tokens=2)
    res = model.residency
    first = res.selection()
    res.plan = dataclasses.replace(res.plan, hi=res.plan.hi.copy(), ratio=res.plan.ratio.copy())
    assert res.selection() is first
    res.plan.hi[0, 0] = 0  # in place: the policy's own array
    again = res.selection()
    assert again is not first and int(np.asarray(again.hi)[0, 0]) == 0
