"""The bundled tiny Qwen3-MoE: same greedy text and perplexity as transformers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import jmoe
from tests.conftest import dev_text

PROMPTS = {
    "prose": ["The tutorial", "Errors should never pass silently"],
    "code": ["def fibonacci(n):", "import os\nimport sys\n\nclass "],
    "math": ["261 + 120 = ", "Solve 6x + -47 = -131. x ="],
}


def hf_text(hf_model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("domain", sorted(PROMPTS))
def test_greedy_text_matches_transformers(tiny_model, tiny_hf_model, tiny_tokenizer, domain):
    for prompt in PROMPTS[domain]:
        ours = jmoe.generate(tiny_model, prompt, max_new_tokens=48)
        assert ours == hf_text(tiny_hf_model, tiny_tokenizer, prompt, 48), prompt
        assert len(ours) > 0


def hf_window_nll(hf_model, ids: np.ndarray, window: int, context: int = 0) -> tuple[float, int]:
    """Sum of NLL over non-overlapping windows, each scoring its tokens after position `context`."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start : start + window], dtype=torch.long)[None]
        if chunk.shape[1] < 2:
            break
        with torch.no_grad():
            logits = hf_model(chunk).logits[0, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits[context:], chunk[0, context + 1:], reduction="sum")
        total += float(nll)
        count += chunk.shape[1] - 1 - context
    return total, count


@pytest.mark.parametrize("domain", ["prose", "code", "math"])
def test_perplexity_matches_transformers(tiny_model, tiny_hf_model, tiny_tokenizer, domain):
    ids = np.asarray(tiny_tokenizer.encode(dev_text(domain)[:20000]), np.int32)[:2000]
    ours = jmoe.perplexity(tiny_model, ids, window=256)
    total, count = hf_window_nll(tiny_hf_model, ids, 256)
    theirs = math.exp(total / count)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert 1.5 < ours < 100  # a trained model, not noise over a 4096-token vocabulary


def test_perplexity_over_each_windows_second_half_matches_transformers(tiny_model, tiny_hf_model, tiny_tokenizer):
    """llama.cpp's perplexity protocol (each window's second half scored), the one bench/quality.py
    runs beside llama-perplexity."""
    ids = np.asarray(tiny_tokenizer.encode(dev_text("code")[:20000]), np.int32)[:1024]
    ours = jmoe.perplexity(tiny_model, ids, window=256, context=128)
    total, count = hf_window_nll(tiny_hf_model, ids, 256, context=128)
    assert count == 4 * 127
    assert ours == pytest.approx(math.exp(total / count), rel=1e-5)
    assert ours != pytest.approx(jmoe.perplexity(tiny_model, ids, window=256), rel=1e-3)
    with pytest.raises(jmoe.InputError, match="context"):
        jmoe.perplexity(tiny_model, ids, window=256, context=255)


def test_loads_of_one_structure_build_the_model_once_and_each_gets_its_own_weights(tiny_converted, short_converted):
    """The abstract model is built once per structure (jmoe/runtime/loader.py abstract_split), yet a
    load restores into a state of its own: two loads share no array, and a model of another
    structure gets its own."""
    import jax
    import jax.numpy as jnp

    from jmoe.manifest import dense_format, head_format, read_manifest
    from jmoe.runtime import loader

    loader._abstract_split.cache_clear()
    first = jmoe.load(tiny_converted, compute_dtype="float32")
    second = jmoe.load(tiny_converted, compute_dtype="float32")
    short = jmoe.load(short_converted, compute_dtype="float32")
    info = loader._abstract_split.cache_info()
    assert (info.misses, info.hits) == (2, 1)
    assert first.graphdef is second.graphdef and short.graphdef != first.graphdef
    a, b = jax.tree.leaves(first.dense), jax.tree.leaves(second.dense)
    assert len(a) == len(b) > 0 and all(x is not y and np.array_equal(x, y) for x, y in zip(a, b))
    ids = [5, 17, 99, 3]
    assert np.array_equal(jmoe.forward(first, ids), jmoe.forward(second, ids))
    assert len(jax.tree.leaves(short.dense)) < len(a)
    manifest = read_manifest(tiny_converted)
    _, state = loader.abstract_split(first.config, jnp.float32, dense_format(manifest), head_format(manifest))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(state))  # no load filled it in
