"""A short bounded load on the server (bench/serve_load.py runs the long one): 12 clients for 10
seconds with random lengths, streamed and whole answers, hang-ups mid-stream, over an offloaded
model whose four slots share a KV pool of two contexts. No failure, every slot and KV page free
after, the offload cache's bookkeeping intact, the budget held, and the server still answering as
jmoe.generate does."""

from __future__ import annotations

import jmoe
from bench.serve_load import serve_and_drive


def test_a_bounded_load_leaves_no_error_no_slot_and_intact_bookkeeping(short_converted):
    # prompts of up to 300 characters (about 100 tokens) and answers of up to 48 tokens fit 256 positions
    # a KV cache of two contexts for four slots: rows take pages as they grow, and wait or are set
    # aside when the pool runs short
    kv_cache = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=2)["kv_cache"]
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32", max_seq_len=256, max_batch=4, kv_cache=kv_cache)
    # two thirds of the experts' bytes: the staging and fetch slots take about half, pools a quarter of the experts
    budget = plan["dense"] + plan["kv_cache"] + plan["workspace"] + plan["all_experts"] * 2 // 3
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=budget, max_seq_len=256, max_batch=4,
                      kv_cache=kv_cache)
    result = serve_and_drive(model, "tiny", seconds=10, streams=12, max_batch=4, context=256)
    assert result["failures"] == 0, result["failure_examples"]
    assert result["requests"] >= 12 and result["hung_up"] > 0 and result["tokens"] > 0
    assert result["running_after"] == 0 and result["waiting_after"] == 0
    assert result["kv_pages"] == 2 * 256 // 64 and result["kv_pages_free_after"] == result["kv_pages"]  # none lost
    model.residency.cache.check()
    assert model.residency.slots < model.config.num_moe_layers * model.config.num_experts  # offloaded
    assert sum(model.memory.values()) <= budget
    assert jmoe.stats(model)["peak_resident_expert_bytes"] <= model.memory["experts"]
    assert result["final_text"] == jmoe.generate(model, "12 + 35 =", max_new_tokens=12)
