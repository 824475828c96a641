"""Parity with Hugging Face transformers (PyTorch, CPU, float32) for every supported family."""

from __future__ import annotations

import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from tests.hf_models import (
    FAMILIES,
    hf_greedy,
    hf_logits,
    make_checkpoint,
    rewrite_config_as_v4,
)

# attention in blocks of 16 keys: the 64-slot caches here take four (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("small_key_blocks")

PROMPT = [5, 17, 99, 3, 42, 250, 7, 61, 128, 9, 77, 31, 200, 14, 88, 2, 190, 45]


def converted(tmp_path, family, *, fused=False, v4=False, overrides=None, randomize=()):
    """(jmoe model in float32, transformers reference) of a random checkpoint of `family`."""
    src = tmp_path / "hf"
    reference = make_checkpoint(family, src, fused=fused, overrides=overrides, randomize=randomize)
    if v4:
        rewrite_config_as_v4(src)
    out = convert_checkpoint(src, tmp_path / "jmoe", progress=False)
    return jmoe.load(out, compute_dtype="float32"), reference


def assert_parity(model, reference, prompt=PROMPT):
    """Full-sequence logits within float32 tolerance, and 32 identical greedy tokens."""
    ours = np.asarray(jmoe.forward(model, prompt))
    theirs = hf_logits(reference, prompt)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert jmoe.generate(model, prompt, max_new_tokens=32) == hf_greedy(reference, prompt, 32)


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_matches_transformers(tmp_path, family):
    model, reference = converted(tmp_path, family)
    assert model.config.family == family
    assert_parity(model, reference)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_matches_transformers(tmp_path, family):
    model, reference = converted(tmp_path, family, fused=True)
    assert_parity(model, reference)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_transformers_4x_config_spelling(tmp_path, family):
    model, reference = converted(tmp_path, family, v4=True)
    assert model.config.num_experts == 8
    assert_parity(model, reference)


def test_family_variants_are_exercised():
    """The random configs really cover each family's distinguishing features."""
    from jmoe.models import config_from_hf
    from tests.hf_models import hf_config

    cfgs = {f: config_from_hf(hf_config(f).to_dict()) for f in FAMILIES}
    assert cfgs["qwen3_moe"].qk_norm == "head" and cfgs["qwen3_moe"].norm_topk_prob
    assert cfgs["qwen3_moe"].moe_layers == (True, False, True)
    assert cfgs["qwen2_moe"].shared_expert_intermediate_size == 48 and cfgs["qwen2_moe"].qkv_bias
    assert not cfgs["qwen2_moe"].norm_topk_prob and cfgs["qwen2_moe"].moe_layers == (False, True, True)
    assert cfgs["mixtral"].sliding_windows == (12, 12, 12) and cfgs["mixtral"].norm_topk_prob
    assert cfgs["olmoe"].qk_norm == "full" and cfgs["olmoe"].clip_qkv == 2.0
