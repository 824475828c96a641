"""The run trace and the GPU time model that replays it (bench/lib/gpu_model.py)."""

from __future__ import annotations

import pytest

import jmoe
from bench.lib.gpu_model import GpuParams, dense_bytes_of, replay
from jmoe.runtime.trace import StepRecord

IDS = [5, 17, 99, 3, 42, 250, 7, 61]


@pytest.mark.parametrize("execution", ["auto", "layerwise"])
def test_trace_books_every_step_and_every_transferred_byte(tiny_converted, execution):
    plan = jmoe.memory_plan(tiny_converted, compute_dtype="float32")
    budget = plan["dense"] + plan["kv_cache"] + plan["workspace"] + plan["all_experts"] // 4
    model = jmoe.load(tiny_converted, compute_dtype="float32", device_budget=budget, trace=True,
                      execution=execution)
    jmoe.generate(model, IDS, max_new_tokens=6)
    records = model.trace.records()
    stats = jmoe.stats(model)
    assert [r.phase for r in records] == ["prefill"] + ["decode"] * (len(records) - 1)
    assert len(records) == 6  # the prefill yields the first token, five decode steps the rest
    assert sum(b for r in records for b, _ in r.transfers) == stats["bytes_h2d"]
    kinds = ("demand", "prefetch", "transition", "step-demand", "step-prefetch")  # step-: fetched by a step itself
    assert all(kind in kinds for r in records for _, kind in r.transfers)
    if execution == "auto":  # decode steps fetch inside themselves: on a GPU, by chains of conditionals
        gpu, layers = model.residency.in_step.accelerator, model.config.num_moe_layers
        assert gpu.chained and gpu.misses and gpu.lookahead  # the default policy, lru+prefetch
        chains = layers + layers - 1  # misses in every MoE layer, look-ahead from the second on
        assert all(r.chains == chains for r in records[1:]) and records[0].chains == 0
        assert all(r.slot_bytes_late == 0 for r in records)  # chains move only what the step fetched
    # every MoE layer read some expert bytes in every step, and the prefill read at least as much
    assert all(len(r.expert_bytes) == model.config.num_layers for r in records)
    assert sum(records[0].expert_bytes.values()) >= max(sum(r.expert_bytes.values()) for r in records[1:])
    assert sum(r.waited_bytes for r in records) <= stats["bytes_h2d"]


def test_trace_of_an_all_resident_run_has_no_transfers(tiny_converted):
    model = jmoe.load(tiny_converted, compute_dtype="float32", trace=True)
    jmoe.generate(model, IDS, max_new_tokens=4)
    records = model.trace.records()
    assert len(records) == 4 and not any(r.transfers or r.waited_bytes for r in records)
    modelled = replay(records, dense_bytes=dense_bytes_of(model), num_layers=model.config.num_layers)
    params = GpuParams()
    hbm = params.hbm_gb_per_s * 1e9 * params.efficiency
    launches = model.config.num_layers * params.kernels_per_layer * params.launch_us * 1e-6
    decode = records[1:]
    floor = sum((dense_bytes_of(model) + sum(r.expert_bytes.values())) / hbm + launches for r in decode) / len(decode)
    assert modelled["modelled_tpot_s"] >= floor  # syncs only add


def _step(phase="decode", **kw) -> StepRecord:
    record = StepRecord(0, phase, 1)
    for key, value in kw.items():
        setattr(record, key, value)
    return record


def test_replay_overlaps_background_copies_and_stalls_on_waited_ones():
    params = GpuParams(hbm_gb_per_s=1.0, efficiency=1.0, h2d_gb_per_s=1.0, launch_us=0.0, sync_us=0.0)
    compute_only = replay([_step(expert_bytes={0: 10**9})], dense_bytes=0, num_layers=1, params=params)
    assert compute_only["modelled_tpot_s"] == pytest.approx(1.0)
    # a prefetch smaller than the step's compute hides behind it
    hidden = replay([_step(expert_bytes={0: 10**9}, transfers=[(5 * 10**8, "prefetch")])], dense_bytes=0,
                    num_layers=1, params=params)
    assert hidden["modelled_tpot_s"] == pytest.approx(1.0)
    # a demand fetch the host waited for adds its copy time
    waited = replay([_step(expert_bytes={0: 10**9}, transfers=[(5 * 10**8, "demand")], waited_bytes=5 * 10**8)],
                    dense_bytes=0, num_layers=1, params=params)
    assert waited["modelled_tpot_s"] == pytest.approx(1.5)
    # background copies longer than a step spill into the next one: a waited fetch queues behind them
    spill = replay([_step(expert_bytes={0: 10**9}, transfers=[(3 * 10**9, "transition")]),
                    _step(expert_bytes={0: 10**9}, transfers=[(10**9, "demand")], waited_bytes=10**9)],
                   dense_bytes=0, num_layers=1, params=params)
    assert spill["modelled_tpot_s"] == pytest.approx((1.0 + (1.0 + 2.0 + 1.0)) / 2)


def test_replay_of_a_step_fetching_its_own_experts():
    """What a step's fetch slots move on a GPU: misses stall it, requests and look-ahead overlap its compute."""
    params = GpuParams(hbm_gb_per_s=1.0, efficiency=1.0, h2d_gb_per_s=1.0, launch_us=0.0, sync_us=0.0)
    step = _step(expert_bytes={0: 10**9}, slot_bytes_early=5 * 10**8, slot_bytes_late=2 * 10**8,
                 transfers=[(10**8, "step-demand")])  # a fetch the run needed: inside the slots, not again
    modelled = replay([step], dense_bytes=0, num_layers=1, params=params)
    assert modelled["modelled_tpot_s"] == pytest.approx(1.2)


def test_replay_of_a_step_fetching_through_chains():
    """Chained fetches move only what the step fetched (misses stall, look-ahead overlaps) and cost
    a predicate read per chain and per fetch in it; fixed request slots still move every step."""
    params = GpuParams(hbm_gb_per_s=1.0, efficiency=1.0, h2d_gb_per_s=1.0, launch_us=0.0, sync_us=0.0,
                       predicate_us=1e5)  # 0.1 s a predicate read
    step = _step(expert_bytes={0: 10**9}, slot_bytes_early=2 * 10**8, chains=3,
                 transfers=[(3 * 10**8, "step-demand"), (4 * 10**8, "step-prefetch"), (10**8, "step-request")])
    modelled = replay([step], dense_bytes=0, num_layers=1, params=params)
    # compute 1.0 + the missed bytes 0.3 + 5 predicate reads (3 chains, 2 chained fetches) 0.5
    assert modelled["modelled_tpot_s"] == pytest.approx(1.8)
