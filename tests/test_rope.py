"""RoPE variants read from config.json, each against transformers: the frequencies and attention
scaling of its init functions, the per-step update of dynamic NTK and LongRoPE, whole models, the
4.x spelling, and bad values."""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

import jmoe
from convert import convert_checkpoint
from jmoe.config import ModelConfig
from jmoe.errors import ConfigError
from jmoe.layers.rope import inverse_frequencies, rope_tables
from jmoe.models import config_from_hf
from tests.hf_models import hf_config, make_checkpoint
from tests.test_family_parity import assert_parity, converted

THETA = 10000.0
SHORT = [1.0, 1.05, 1.2, 1.5, 2.0, 3.0, 4.5, 6.0]  # one per frequency of the 16-wide test heads
LONG = [1.0, 1.3, 2.1, 3.5, 5.0, 8.0, 12.0, 16.0]

# name -> (rope_parameters, other config fields); max_position_embeddings is 256 unless given.
CASES = {
    "default": ({"rope_type": "default"}, {}),
    "default-theta-1e6": ({"rope_type": "default", "rope_theta": 1e6}, {}),
    "linear-2": ({"rope_type": "linear", "factor": 2.0}, {}),
    "linear-0.5-theta-5e5": ({"rope_type": "linear", "factor": 0.5, "rope_theta": 5e5}, {}),
    "dynamic-2": ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 24}),
    "dynamic-4.5": ({"rope_type": "dynamic", "factor": 4.5, "rope_theta": 1e6}, {"max_position_embeddings": 100}),
    "dynamic-partial": ({"rope_type": "dynamic", "factor": 3.0, "partial_rotary_factor": 0.5},
                        {"max_position_embeddings": 24}),
    "yarn-4": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {}),
    "yarn-betas-untruncated": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, {}),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                     "mscale_all_dim": 0.707}, {}),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                               "attention_factor": 1.3}, {}),
    "yarn-factor-from-lengths": ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}, {}),
    "yarn-top-level-original": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                {"original_max_position_embeddings": 32}),
    "yarn-partial": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "partial_rotary_factor": 0.5}, {}),
    "longrope-factor-from-lengths": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                      "original_max_position_embeddings": 24}, {}),
    "longrope-factor": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 3.0,
                         "original_max_position_embeddings": 64}, {}),
    "longrope-attention-factor": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                   "attention_factor": 1.1, "original_max_position_embeddings": 16}, {}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, {}),
    "llama3-theta-5e5": ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                          "original_max_position_embeddings": 200, "rope_theta": 5e5}, {}),
}
SEQ_LENS = [None, 1, 16, 23, 24, 25, 64, 65, 100, 101, 1000]  # both sides of every switch point above


def hf_rope_config(name: str):
    rope, fields = CASES[name]
    return hf_config("qwen3_moe", rope_parameters={"rope_theta": THETA, **rope}, **fields)


def jmoe_config(hf) -> ModelConfig:
    """The jmoe config of a transformers config; partial rotary as the family that has it sets it."""
    cfg = config_from_hf(hf.to_dict())
    fraction = hf.rope_parameters.get("partial_rotary_factor", 1.0)
    return dataclasses.replace(cfg, rope_dim=int(cfg.head_dim * fraction)) if fraction != 1.0 else cfg


def reference_frequencies(hf, seq_len):
    if hf.rope_parameters["rope_type"] == "default":
        return Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("name", CASES)
def test_frequencies_match_transformers(name):
    hf = hf_rope_config(name)
    cfg = jmoe_config(hf)  # parsed before transformers' init functions rewrite hf.rope_parameters
    jitted = jax.jit(lambda seq_len: inverse_frequencies(cfg, seq_len))
    for seq_len in SEQ_LENS:
        theirs, their_scale = reference_frequencies(hf, seq_len)
        ours, our_scale = inverse_frequencies(cfg, seq_len)
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=2e-6, atol=0, err_msg=f"{seq_len=}")
        assert our_scale == pytest.approx(their_scale, rel=1e-12)
        if seq_len is not None:  # inside jit the sequence length is traced
            traced, traced_scale = jitted(jnp.int32(seq_len))
            np.testing.assert_allclose(np.asarray(traced), theirs.numpy(), rtol=2e-6, atol=0, err_msg=f"{seq_len=}")
            assert float(traced_scale) == pytest.approx(their_scale, rel=1e-6)


def assert_steps_match(module, cfg: ModelConfig) -> None:
    """cos/sin of transformers' rotary `module` and jmoe's rope_tables along a prompt, one token per
    step past every switch point, then fresh prompts (one below, one past the trained length)."""
    tables = jax.jit(lambda positions: rope_tables(positions, cfg))
    steps = [(0, 18)] + [(p, p + 1) for p in range(18, 41)] + [(0, 10), (0, 30), (30, 31)]
    for start, stop in steps:
        positions = np.arange(start, stop)[None]
        their_cos, their_sin = module(torch.zeros(1), torch.tensor(positions))
        our_cos, our_sin = tables(jnp.asarray(positions, jnp.int32))
        np.testing.assert_allclose(np.asarray(our_cos), their_cos.numpy(), atol=1e-5, err_msg=f"{start}..{stop}")
        np.testing.assert_allclose(np.asarray(our_sin), their_sin.numpy(), atol=1e-5, err_msg=f"{start}..{stop}")


@pytest.mark.parametrize("name", ["dynamic-2", "dynamic-partial", "longrope-factor-from-lengths",
                                  "longrope-attention-factor"])
def test_per_step_update_matches_transformers(name):
    """transformers' rotary module recomputes dynamic/LongRoPE frequencies from max(position) + 1 each
    forward; dynamic only grows them, and resets below the trained length. jmoe recomputes them from
    each step's positions, which agrees along any generation (a prompt, then one token per step)."""
    hf = hf_rope_config(name)
    cfg = jmoe_config(hf)
    assert_steps_match(Qwen3MoeRotaryEmbedding(hf), cfg)


def test_per_side_mscale_matches_phimoe():
    """Phi-3.5-MoE's rotary module recomputes the short-factor frequencies every step and scales
    cos/sin by short_mscale or long_mscale by length: long_factor = short_factor plus the two mscales."""
    from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

    rope = {"rope_type": "longrope", "rope_theta": THETA, "short_factor": SHORT, "long_factor": LONG,
            "original_max_position_embeddings": 24}
    cfg = config_from_hf(hf_config("qwen3_moe", rope_parameters=rope).to_dict())
    params = {**cfg.rope_param, "long_factor": tuple(SHORT), "short_mscale": 1.1, "long_mscale": 1.35}
    cfg = dataclasses.replace(cfg, rope_params=tuple(sorted(params.items())))
    hf = hf_config("phimoe", rope_parameters={**rope, "short_mscale": 1.1, "long_mscale": 1.35})
    assert_steps_match(PhimoeRotaryEmbedding(hf), cfg)


# One model per type; dynamic and LongRoPE switch during the 18-token prompt + 32 generated tokens.
MODELS = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, {}),
    "dynamic-switch-in-generation": ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 24}),
    "dynamic-switch-in-prompt": ({"rope_type": "dynamic", "factor": 3.0}, {"max_position_embeddings": 16}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0}, {}),
    "longrope": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 24}, {}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, {}),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_matches_transformers(tmp_path, name):
    rope, fields = MODELS[name]
    overrides = {"rope_parameters": {"rope_theta": THETA, **rope}, **fields}
    if "max_position_embeddings" in fields:
        # generation runs past max_position_embeddings, jmoe's default max_seq_len
        reference = make_checkpoint("qwen3_moe", tmp_path / "hf", overrides=overrides)
        out = convert_checkpoint(tmp_path / "hf", tmp_path / "jmoe", progress=False)
        model = jmoe.load(out, compute_dtype="float32", max_seq_len=64)
    else:
        model, reference = converted(tmp_path, "qwen3_moe", overrides=overrides)
    assert model.config.rope_type == rope["rope_type"]
    assert_parity(model, reference)


def as_v4(hf: dict) -> dict:
    """A config.json as transformers 4.x wrote it: rope_theta on top, rope_scaling with `type`, and
    original_max_position_embeddings left out where it equals max_position_embeddings."""
    hf = copy.deepcopy(hf)
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    if rope.get("original_max_position_embeddings") == hf["max_position_embeddings"]:
        del rope["original_max_position_embeddings"]
    hf["rope_scaling"] = None if rope["type"] == "default" else rope
    hf["transformers_version"] = "4.51.0"
    return hf


@pytest.mark.parametrize("name", [n for n in CASES if "partial" not in n])
def test_transformers_4x_spelling_reads_the_same(name):
    v5 = hf_rope_config(name).to_dict()
    assert config_from_hf(as_v4(v5)) == config_from_hf(v5)


def test_transformers_4x_spelling_model(tmp_path):
    """A 4.x config.json (yarn without original_max_position_embeddings: it falls back to
    max_position_embeddings) against transformers running the 5.x config it was written from."""
    src = tmp_path / "hf"
    reference = make_checkpoint("qwen3_moe", src, overrides={"rope_parameters": {
        "rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "beta_fast": 64.0}})
    v4 = as_v4(json.loads((src / "config.json").read_text()))
    assert "original_max_position_embeddings" not in v4["rope_scaling"]
    (src / "config.json").write_text(json.dumps(v4))
    model = jmoe.load(convert_checkpoint(src, tmp_path / "jmoe", progress=False), compute_dtype="float32")
    assert model.config.rope_param["original_max_position_embeddings"] == 256
    assert_parity(model, reference)


@pytest.mark.parametrize("name", ["yarn-mscale", "longrope-factor", "dynamic-2"])
def test_rope_params_survive_json(name):
    cfg = jmoe_config(hf_rope_config(name))
    back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and hash(back) == hash(cfg)


def _rope(**rope):
    hf = hf_config("qwen3_moe").to_dict()
    hf["rope_parameters"] = {"rope_theta": THETA, **rope}
    return hf


BAD = [
    ("unknown-type", _rope(rope_type="mrope", mrope_section=[2, 3, 3]), r"rope_type 'mrope'.*supported: default"),
    ("unknown-4x-type", {**_rope(), "rope_scaling": {"type": "su", "factor": 2.0}}, r"rope_scaling rope_type 'su'"),
    ("negative-factor", _rope(rope_type="linear", factor=-2.0), r"rope_parameters 'factor' must be > 0"),
    ("zero-yarn-factor", _rope(rope_type="yarn", factor=0, original_max_position_embeddings=64), r"'factor'"),
    ("string-factor", _rope(rope_type="dynamic", factor="2"), r"'factor' must be a number"),
    ("no-factor", _rope(rope_type="linear"), r"no 'factor' \(needed for linear RoPE\)"),
    ("llama3-no-low-freq", _rope(rope_type="llama3", factor=8.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32), r"'low_freq_factor'"),
    ("longrope-wrong-length", _rope(rope_type="longrope", short_factor=SHORT[:3], long_factor=LONG,
                                    original_max_position_embeddings=24), r"'short_factor' has 3 entries.*needs 8"),
    ("longrope-negative-entry", _rope(rope_type="longrope", short_factor=SHORT, long_factor=[-1.0] * 8,
                                      original_max_position_embeddings=24), r"'long_factor'\[0\] must be > 0"),
    ("longrope-not-a-list", _rope(rope_type="longrope", short_factor=2.0, long_factor=LONG,
                                  original_max_position_embeddings=24), r"'short_factor' must be a list"),
    ("yarn-bad-original", _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=0),
     r"'original_max_position_embeddings' must be >= 1"),
    ("per-layer-rope", _rope(full_attention={"rope_type": "default"}), r"per layer type"),
]


@pytest.mark.parametrize("hf,message", [(hf, m) for _, hf, m in BAD], ids=[name for name, _, _ in BAD])
def test_bad_rope_config(hf, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf(hf)


def test_edited_rope_params_are_checked():
    cfg = jmoe_config(hf_rope_config("yarn-4")).to_dict()
    cfg["rope_params"] = [p for p in cfg["rope_params"] if p[0] != "beta_fast"]
    with pytest.raises(ConfigError, match=r"missing \['beta_fast'\]"):
        ModelConfig.from_dict(cfg)
    cfg["rope_type"] = "ntk"
    with pytest.raises(ConfigError, match=r"rope type 'ntk' is not supported"):
        ModelConfig.from_dict(cfg)
