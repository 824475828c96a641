"""One loaded model shared between threads, and calls that fail or are abandoned half-way."""

from __future__ import annotations

import threading

import pytest

import jmoe
from jmoe.policies import Policy

PROMPTS = ["def fibonacci(n):", "261 + 120 = ", "The tutorial", "import os\n", "class Parser:\n",
           "Errors should never", "12 * 7 =", "for i in range(10):"]
NEW_TOKENS = 8
THREADS, ROUNDS = 8, 10


@pytest.fixture(scope="module")
def reference(short_converted):
    model = jmoe.load(short_converted, compute_dtype="float32")
    return model, {p: jmoe.generate(model, p, max_new_tokens=NEW_TOKENS) for p in PROMPTS}


def offloading_budget(resident_model, fraction: float = 0.3) -> int:
    fixed = sum(v for k, v in resident_model.memory.items() if k != "experts")
    return int(fixed + fraction * resident_model.memory["experts"])


def assert_consistent(model) -> None:
    rt = model.residency
    rt.cache.settle()
    rt.cache.check()
    assert rt.cache.pinned == set()
    assert rt.tracker.total <= model.device_budget
    assert rt.cache.staging.total == 0


def run_threads(worker, count: int) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def guarded(index):
        try:
            barrier.wait()
            worker(index)
        except BaseException as e:  # noqa: BLE001 - collected and reported by the test
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("policy,execution",
                         [("lru+prefetch", "auto"), ("lru+prefetch", "layerwise"), ("lru", "resident")])
def test_eight_threads_share_one_offloading_model(short_converted, reference, policy, execution):
    resident_model, expected = reference
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=offloading_budget(resident_model),
                      policy=policy, execution=execution)
    assert model.residency.slots < model.config.num_moe_layers * model.config.num_experts  # really offloading
    results: dict[int, list] = {i: [] for i in range(THREADS)}

    def worker(index):
        for r in range(ROUNDS):
            prompt = PROMPTS[(index + r) % len(PROMPTS)]
            if r % 3 == 2:  # a stream abandoned after two pieces
                pieces = jmoe.generate(model, prompt, max_new_tokens=NEW_TOKENS, stream=True)
                head = "".join(next(pieces) for _ in range(2))
                pieces.close()
                results[index].append((prompt, head, "head"))
            else:
                results[index].append((prompt, jmoe.generate(model, prompt, max_new_tokens=NEW_TOKENS), "whole"))

    errors = run_threads(worker, THREADS)
    assert not errors, errors[:3]
    for outputs in results.values():
        assert len(outputs) == ROUNDS
        for prompt, text, kind in outputs:
            if kind == "whole":
                assert text == expected[prompt], prompt
            else:
                assert expected[prompt].startswith(text) and text, prompt
    assert_consistent(model)
    assert jmoe.stats(model)["expert_uses"] > 0
    assert jmoe.generate(model, PROMPTS[0], max_new_tokens=NEW_TOKENS) == expected[PROMPTS[0]]


class FailingPolicy(Policy):
    """LRU whose eviction choice raises at a chosen call: a step that fails half-way through."""

    def __init__(self, fail_at: int):
        super().__init__(name="failing", tier="bf16")
        self.calls, self.fail_at = 0, fail_at

    def victim(self, tier, candidates):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("policy failed")
        return super().victim(tier, candidates)


@pytest.mark.parametrize("execution", ["auto", "layerwise", "resident"])
def test_a_call_that_fails_half_way_leaves_the_model_usable(short_converted, reference, execution):
    resident_model, expected = reference
    policy = FailingPolicy(fail_at=5)  # the fifth eviction, in the middle of fetching a step's experts
    model = jmoe.load(short_converted, compute_dtype="float32", device_budget=offloading_budget(resident_model),
                      policy=policy, execution=execution)
    with pytest.raises(RuntimeError, match="policy failed"):
        jmoe.generate(model, PROMPTS[0], max_new_tokens=NEW_TOKENS)
    assert_consistent(model)
    assert [jmoe.generate(model, p, max_new_tokens=NEW_TOKENS) for p in PROMPTS[:3]] == [expected[p] for p in PROMPTS[:3]]
    assert_consistent(model)


def test_threads_share_an_all_resident_model(reference):
    model, expected = reference

    def worker(index):
        for r in range(3):
            prompt = PROMPTS[(index + r) % len(PROMPTS)]
            assert jmoe.generate(model, prompt, max_new_tokens=NEW_TOKENS) == expected[prompt]

    assert not run_threads(worker, 4)
