"""Dense weights at a tier (`convert --dense-tier`): what is stored, what the budget counts, accuracy."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import jmoe
from convert import convert_checkpoint
from convert import dense as dense_mod
from convert.quantizers.rtn import quantize_rtn
from jmoe.cli import main as cli_main
from jmoe.errors import FormatError, InputError
from jmoe.layers.linear import Embed, Linear
from jmoe.manifest import read_manifest
from jmoe.runtime.budget import tree_nbytes
from jmoe.runtime.loader import memory_plan
from kernel_formats.qarray import QArray, QPlanes, QuantFormat, code_template, dequantize, planes, template
from tests.conftest import dev_text
from tests.hf_models import make_checkpoint

DENSE_TIERS = ("bf16", "int8", "int6", "int4")


def hf_tensor(path, name):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name).float().numpy()


@pytest.fixture(scope="module")
def qwen2_hf(tmp_path_factory):
    """Shared expert behind a gate, a dense MLP layer, q/k/v biases and tied embeddings."""
    src = tmp_path_factory.mktemp("qwen2") / "hf"
    make_checkpoint("qwen2_moe", src, overrides=dict(tie_word_embeddings=True))
    return src


@pytest.fixture(scope="module")
def qwen2_dirs(qwen2_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    # group 32 so the 64-wide projections need no padding at int8 either
    return {t: convert_checkpoint(qwen2_hf, root / t, dense_tier=t, group_size=32, progress=False)
            for t in DENSE_TIERS}


def leaf(model, *path):
    node = model.dense
    for p in path:
        node = node[p]
    return node.get_value()


def test_manifest_records_the_tier_and_the_budget_counts_its_bytes(qwen2_dirs):
    stored = {}
    for tier, path in qwen2_dirs.items():
        manifest = read_manifest(path)
        dense = manifest["dense"]
        assert dense["tier"] == tier
        assert (dense["format"] is None) == (tier == "bf16")
        assert dense["head_tier"] == {"int4": "int8"}.get(tier, tier)  # int8 beside int4 by default
        assert (dense["head_format"] is None) == (tier == "bf16")
        model = jmoe.load(path)
        assert dense["bytes"] == tree_nbytes(model.dense) == model.memory["dense"] == memory_plan(path)["dense"]
        stored[tier] = dense["bytes"]
        kernel = dense["tensors"]["layers.1.self_attn.q_proj.kernel"]
        assert kernel["dtype"] == ("bfloat16" if tier == "bf16" else tier)
        assert dense["tensors"]["layers.1.mlp.router.kernel"]["dtype"] == "bfloat16"
    assert stored["bf16"] > 1.5 * stored["int8"] and stored["int8"] > 1.2 * stored["int4"]  # int4: an int8 head
    assert stored["int8"] > stored["int6"] > stored["int4"]


def test_projections_are_quantized_norms_routers_and_biases_are_not(qwen2_dirs):
    model = jmoe.load(qwen2_dirs["int4"])
    quantized = [("layers", 1, "self_attn", "q_proj", "kernel"), ("layers", 1, "self_attn", "o_proj", "kernel"),
                 ("layers", 1, "mlp", "shared_expert", "down_proj", "kernel"),
                 ("layers", 0, "mlp", "gate_proj", "kernel"), ("embed_tokens", "embedding")]
    plain = [("layers", 1, "mlp", "router", "kernel"), ("layers", 1, "mlp", "shared_expert_gate", "kernel"),
             ("layers", 1, "self_attn", "q_proj", "bias"), ("layers", 1, "input_layernorm", "weight"), ("norm", "weight")]
    for path in quantized:
        assert isinstance(leaf(model, *path), QArray), path
    for path in plain:
        assert leaf(model, *path).dtype == jnp.bfloat16, path
    assert model.dense.get("lm_head") is None  # tied: the head multiplies by the quantized table
    table = leaf(model, "embed_tokens", "embedding")
    assert table.shape == (model.config.hidden_size, model.config.vocab_size)  # E^T, one column per token
    assert table.fmt.bits == 8 and leaf(model, "layers", 1, "self_attn", "q_proj", "kernel").fmt.bits == 4


def test_head_tier_sets_the_lm_head_and_embedding_alone(qwen2_hf, tmp_path):
    """--head-tier int4 beside --dense-tier int4 quantizes the (untied) LM head and the embedding
    table at int4; int4 dense weights are in groups of 32 with 8-bit scales (4.5 bits per weight, as
    Q4_0) unless a group size is given."""
    hf = tmp_path / "untied"
    make_checkpoint("qwen2_moe", hf, overrides=dict(tie_word_embeddings=False))
    model = jmoe.load(convert_checkpoint(hf, tmp_path / "m", dense_tier="int4", head_tier="int4", progress=False))
    assert leaf(model, "lm_head", "kernel").fmt.bits == 4 and leaf(model, "embed_tokens", "embedding").fmt.bits == 4
    q_proj = leaf(model, "layers", 1, "self_attn", "q_proj", "kernel")
    assert q_proj.fmt.group_size == 32 and q_proj.fmt.scale_bits == 8
    assert 8 * tree_nbytes(q_proj) / (q_proj.k * q_proj.n) <= 4.5 + 64 / q_proj.k  # codes, scales, column bases
    model = jmoe.load(convert_checkpoint(hf, tmp_path / "b", dense_tier="int4", head_tier="bf16", progress=False))
    assert leaf(model, "lm_head", "kernel").dtype == jnp.bfloat16
    assert leaf(model, "embed_tokens", "embedding").dtype == jnp.bfloat16
    assert read_manifest(tmp_path / "b")["dense"]["head_format"] is None
    assert len(jmoe.generate(model, [3, 4, 5], max_new_tokens=3)) == 3


def test_a_manifest_without_a_head_tier_keeps_the_head_at_the_dense_tier(qwen2_hf, tmp_path):
    """Conversions written before the head had a tier of its own still load (their head and
    embedding are at the dense tier)."""
    import json

    path = convert_checkpoint(qwen2_hf, tmp_path / "m", dense_tier="int4", head_tier="int4", progress=False)
    expected = jmoe.generate(jmoe.load(path), [3, 4, 5], max_new_tokens=4)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["dense"]["head_tier"], manifest["dense"]["head_format"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert jmoe.generate(jmoe.load(path), [3, 4, 5], max_new_tokens=4) == expected
    manifest["dense"]["head_tier"] = "int8"  # a tier without its format
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="head_tier and dense.head_format"):
        jmoe.load(path)


def test_blocks_of_rows_give_the_whole_tensors_result(qwen2_hf, tmp_path, monkeypatch):
    """Reading large tensors in blocks of rows changes nothing: bf16 leaves equal the checkpoint,
    quantized ones equal RTN of the whole tensor."""
    monkeypatch.setattr(dense_mod, "BLOCK_BYTES", 1000)  # a few rows per block
    for tier in ("bf16", "int4"):
        model = jmoe.load(convert_checkpoint(qwen2_hf, tmp_path / tier, dense_tier=tier, group_size=32,
                                             progress=False))
        q = hf_tensor(qwen2_hf, "model.layers.1.self_attn.q_proj.weight")
        embed = hf_tensor(qwen2_hf, "model.embed_tokens.weight")
        ours_q, ours_embed = leaf(model, "layers", 1, "self_attn", "q_proj", "kernel"), leaf(model, "embed_tokens",
                                                                                              "embedding")
        if tier == "bf16":
            np.testing.assert_array_equal(np.asarray(ours_q, np.float32), q.T)
            np.testing.assert_array_equal(np.asarray(ours_embed, np.float32), embed)
            continue
        for ours, whole in ((ours_q, q.T), (ours_embed, embed.T)):  # each at its own tier (the head int8)
            ref = quantize_rtn(whole, ours.fmt)
            np.testing.assert_array_equal(np.asarray(ours.values), ref.values)
            np.testing.assert_array_equal(np.asarray(ours.scales), ref.scales)


@pytest.mark.parametrize("fmt", [QuantFormat(4, 32, False), QuantFormat(6, 32, False)], ids=["int4", "int6"])
def test_quantized_linear_and_embedding_compute_with_the_dequantized_weight(fmt):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    q = quantize_rtn(w, fmt)
    q = jax.tree.map(jnp.asarray, planes(q) if fmt.bits == 6 else q)
    lin = Linear(64, 48, bias=False, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), quant=fmt)
    lin.kernel.set_value(q)
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    ref = np.asarray(x) @ np.asarray(dequantize(q))
    np.testing.assert_allclose(np.asarray(lin(x)), ref, rtol=1e-5, atol=1e-5)
    emb = Embed(48, 64, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), quant=fmt)
    emb.embedding.set_value(q)  # E^T [D=64, V=48]
    ids = jnp.asarray([[3, 0, 47], [5, 5, 1]])
    np.testing.assert_array_equal(np.asarray(emb(ids)), np.asarray(dequantize(q)).T[np.asarray(ids)])


def test_embedding_gathers_rows_before_casting():
    """The lookup never converts the whole [V, D] table to the compute dtype."""
    emb = Embed(1000, 16, dtype=jnp.float32, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(emb)
    jaxpr = jax.make_jaxpr(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, jnp.zeros((2, 3), jnp.int32))
    converted = [e.invars[0].aval.shape for e in jaxpr.jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert (1000, 16) not in converted
    assert (2, 3, 16) in converted


def test_greedy_output_runs_at_each_tier_and_offloaded_matches_resident(qwen2_dirs):
    ids = list(range(3, 40, 2))
    for tier, path in qwen2_dirs.items():
        out = jmoe.generate(jmoe.load(path), ids, max_new_tokens=6)
        assert len(out) == 6 and all(0 <= t < 256 for t in out)
    path = qwen2_dirs["int4"]
    plan = memory_plan(path)
    budget = sum(v for k, v in plan.items() if k != "all_experts") + plan["all_experts"] // 2
    offloaded = jmoe.load(path, device_budget=budget, policy="lru", execution="layerwise")
    assert jmoe.generate(offloaded, ids, max_new_tokens=6) == jmoe.generate(jmoe.load(path), ids, max_new_tokens=6)


@pytest.fixture(scope="module")
def tiny_logits(tiny_hf_dir, tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-dense")
    ids = tiny_tokenizer.encode(dev_text("code")[:3000])[:256]
    out = {}
    variants = {tier: dict(dense_tier=tier) for tier in DENSE_TIERS}
    variants["int4, head int4"] = dict(dense_tier="int4", head_tier="int4")
    variants["int4, head int6"] = dict(dense_tier="int4", head_tier="int6")
    for name, options in variants.items():
        model = jmoe.load(convert_checkpoint(tiny_hf_dir, root / name.replace(", ", "-"), progress=False, **options),
                          compute_dtype="float32")
        out[name] = np.asarray(jmoe.forward(model, ids))
    shutil.rmtree(root)  # only the logits are kept: the conversions are 100 MB of the suite's disk
    return out, np.asarray(ids)


def nll(logits, ids):
    logp = logits[:-1] - np.log(np.exp(logits[:-1] - logits[:-1].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits[:-1].max(-1, keepdims=True)
    return float(-np.take_along_axis(logp, ids[1:, None], axis=-1).mean())


def test_int8_dense_stays_close_to_bf16(tiny_logits):
    """Logit error budget (the bundled model, tied head and embedding quantized too)."""
    logits, ids = tiny_logits
    scale = float(np.abs(logits["bf16"]).mean())
    err = {t: float(np.abs(logits[t] - logits["bf16"]).mean()) for t in ("int8", "int4")}
    assert err["int8"] < err["int4"]
    assert err["int8"] < 0.02 * scale
    loss = {t: nll(logits[t], ids) for t in logits}
    assert abs(loss["int8"] - loss["bf16"]) < 0.01 * loss["bf16"]
    assert loss["int4"] < 1.1 * loss["bf16"]


def test_an_int8_head_beside_int4_dense_weights_loses_less_than_an_int4_head(tiny_logits):
    """Why the head defaults to int8 beside an int4 dense tier (the bundled model: its tied table is
    most of its dense weights)."""
    logits, ids = tiny_logits
    loss = {t: nll(logits[t], ids) for t in logits}
    assert loss["int4"] - loss["bf16"] < 0.5 * (loss["int4, head int4"] - loss["bf16"])


def test_an_int6_head_loses_about_what_an_int8_head_does(tiny_logits):
    """Beside int4 dense weights, the int6 head (two planes, 6.5 bits read) adds less than half of what
    the int4 head adds to the int8 head's loss."""
    logits, ids = tiny_logits
    loss = {t: nll(logits[t], ids) for t in logits}
    assert loss["int4, head int6"] - loss["int4"] < 0.5 * (loss["int4, head int4"] - loss["int4"])


def test_int6_is_stored_as_an_int4_and_an_int2_plane_that_add_up_to_its_grid():
    """A 6-bit weight's planes (kernel_formats.qarray.planes) hold its codes' low four and high two
    bits, and their sum is the 6-bit grid's weight up to the float16 rounding of one offset; 6.75
    bits per weight in groups of 64."""
    from convert.quantizers.grid import decode, group_params
    from kernel_formats.qarray import unpack_codes

    rng = np.random.default_rng(1)
    w = (rng.normal(size=(200, 96)) * rng.uniform(0.01, 1.0, size=(1, 96))).astype(np.float32)
    fmt = QuantFormat(6, 64, False)
    q = quantize_rtn(w, fmt)  # one code per byte, as the quantizers write it
    codes = np.asarray(q.values)
    assert codes.shape == (256, 96) and codes.max() <= 63
    p = planes(q)
    assert isinstance(p, QPlanes) and (p.low.fmt.bits, p.high.fmt.bits) == (4, 2) and p.high.fmt.symmetric
    np.testing.assert_array_equal(np.asarray(unpack_codes(p.low.values, p.low.fmt)), codes & 15)
    np.testing.assert_array_equal(np.asarray(unpack_codes(p.high.values, p.high.fmt)), codes >> 4)
    groups = np.pad(w, ((0, 56), (0, 0))).reshape(4, 64, 96)
    scale, offset = (np.asarray(a) for a in group_params(groups, fmt))
    grid = np.asarray(decode(codes.reshape(4, 64, 96), scale, offset, fmt)).reshape(256, 96)[:200]
    step = np.repeat(scale[:, 0], 64, axis=0)[:200]
    got = np.asarray(dequantize(p))
    low_offset = np.repeat(np.abs(offset + 32 * scale)[:, 0], 64, axis=0)[:200]
    assert np.all(np.abs(got - grid) <= 2.0 ** -11 * low_offset + 1e-6)  # that offset rounded to float16
    assert np.all(np.abs(got - w) <= 0.51 * step + 1e-6)  # every weight within half a step of its own
    bits = 8 * sum(a.nbytes for a in jax.tree.leaves(p)) / w.size * (200 / 256)
    assert bits == pytest.approx(6.75)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), template(fmt, 200, 96)) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), p)
    assert code_template(fmt, 200, 96).values.shape == (256, 96)
    with pytest.raises(ValueError, match="6 bits are asymmetric"):
        QuantFormat(6, 64, True)
    with pytest.raises(InputError, match="int6 tier is asymmetric"):
        dense_mod.dense_format("int6", symmetric=True)


def test_int6_with_8_bit_scales_stores_the_low_planes_codes_and_adds_up_to_its_grid_exactly():
    """With 8-bit scales a 6-bit weight's offset codes hold its grid's value at code 32 (the low
    plane's offset), so the low plane keeps the quantizer's scale and offset codes as they are; its
    scale base has three significant bits, so the high plane's float16 scales are 16 times the low
    plane's exactly, and the planes add up to the coded 6-bit grid. 7 bits per weight in groups of 32
    (codes, two 8-bit codes a group, the high plane's float16 scale), 6.5 in groups of 64, and two float32
    bases a column (64 / K bits)."""
    from convert.quantizers.grid import group_params
    from kernel_formats.qarray import group_scales, unpack_codes

    rng = np.random.default_rng(4)
    w = (rng.normal(size=(256, 128)) * rng.uniform(0.01, 1.0, size=(1, 128))).astype(np.float32)
    for group, bits_per_weight in ((32, 7.0), (64, 6.5)):
        fmt = QuantFormat(6, group, False, scale_bits=8)
        q = quantize_rtn(w, fmt)
        p = planes(q)
        assert p.low.fmt.scale_bits == 8 and p.high.fmt.scale_bits == 16
        for name in ("scales", "offsets", "bases"):
            np.testing.assert_array_equal(np.asarray(getattr(p.low, name)), np.asarray(getattr(q, name)))
        np.testing.assert_array_equal(np.asarray(unpack_codes(p.high.values, p.high.fmt)), np.asarray(q.values) >> 4)
        mantissa, _ = np.frexp(np.asarray(q.bases[0]))
        np.testing.assert_array_equal(mantissa * 8, np.round(mantissa * 8))
        scale, offset = (np.asarray(a) for a in group_scales(jax.tree.map(jnp.asarray, q)))
        low_scale, low_offset = (np.asarray(a) for a in group_scales(jax.tree.map(jnp.asarray, p.low)))
        np.testing.assert_array_equal(np.asarray(p.high.scales, np.float32), 16 * low_scale)
        np.testing.assert_array_equal(low_scale, scale)
        np.testing.assert_allclose(low_offset, offset + 32 * scale, rtol=0, atol=1e-6 * np.abs(low_offset).max())
        grid = np.asarray(dequantize(jax.tree.map(jnp.asarray, q)))
        np.testing.assert_allclose(np.asarray(dequantize(p)), grid, rtol=0, atol=1e-6 * np.abs(grid).max())
        step = np.repeat(np.asarray(group_params(w.reshape(-1, group, 128), fmt)[0])[:, 0], group, axis=0)
        assert np.all(np.abs(grid - w) <= 0.51 * step + 0.01 * np.abs(w).max(axis=0))  # codes' error, and the scales'
        assert 8 * sum(a.nbytes for a in jax.tree.leaves(p)) / w.size == bits_per_weight + 64 / 256
        assert jax.tree.map(lambda a: (a.shape, a.dtype), template(fmt, 256, 128)) == \
            jax.tree.map(lambda a: (a.shape, a.dtype), p)


def test_gptq_writes_an_int6_weight_as_its_planes():
    """GPTQ on the 6-bit grid in blocks of columns (convert/dense_gptq.py) gives the planes of the
    whole weight's 6-bit GPTQ."""
    from convert.dense_gptq import gptq_columns
    from convert.quantizers.gptq import gptq_quantize

    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 40)).astype(np.float32)  # [K, N]
    x = rng.normal(size=(300, 64))
    fmt = QuantFormat(6, 32, False)
    got = gptq_columns(lambda rows: w.T[rows], x.T @ x, template(fmt, 64, 40))
    assert isinstance(got, QPlanes)
    whole = planes(jax.tree.map(np.asarray, gptq_quantize(w, x.T @ x, fmt)))
    np.testing.assert_array_equal(np.asarray(dequantize(got)), np.asarray(dequantize(whole)))


def test_head_group_size_sets_the_head_and_embedding_groups_alone(qwen2_hf, tmp_path, capsys):
    """--head-group-size 64 with an int6 head: the LM head and embedding table in groups of 64 (6.5
    bits per weight: 4 + 2 bits of codes, two 8-bit codes and a float16 scale a group, and two float32
    bases a column), every other dense weight at its own groups; the default's groups of 32 store
    7 bits; refused for a bf16 head and for a size no kernel reads."""
    hf = tmp_path / "untied"
    make_checkpoint("qwen2_moe", hf, overrides={"tie_word_embeddings": False})
    assert cli_main(["convert", str(hf), "-o", str(tmp_path / "m"), "--dense-tier", "int4", "--head-tier", "int6",
                     "--head-group-size", "64", "--no-progress"]) == 0
    model = jmoe.load(tmp_path / "m")
    for path in (("lm_head", "kernel"), ("embed_tokens", "embedding")):
        head = leaf(model, *path)
        assert head.fmt.bits == 6 and head.fmt.group_size == 64 and head.fmt.scale_bits == 8
        assert 8 * tree_nbytes(head) / (head.k * head.n) == pytest.approx(6.5 + 64 / head.k)
    assert leaf(model, "layers", 1, "self_attn", "q_proj", "kernel").fmt.group_size == 32
    default = jmoe.load(convert_checkpoint(hf, tmp_path / "d", dense_tier="int4", head_tier="int6", progress=False))
    head = leaf(default, "lm_head", "kernel")
    assert head.fmt.group_size == 32 and 8 * tree_nbytes(head) / (head.k * head.n) == pytest.approx(7 + 64 / head.k)
    assert len(jmoe.generate(model, [3, 4, 5], max_new_tokens=3)) == 3
    with pytest.raises(InputError, match="the head tier is bf16"):
        convert_checkpoint(hf, tmp_path / "out", dense_tier="int4", head_tier="bf16", head_group_size=32,
                           progress=False)
    assert cli_main(["convert", str(hf), "-o", str(tmp_path / "out"), "--dense-tier", "int4",
                     "--head-group-size", "48"]) == 2
    assert "head_group_size must be one of 32, 64, 128" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_dense_tier_is_refused(qwen2_hf, tmp_path, capsys):
    for bad in ("int2", "fp8", 4, None, ["int4"]):
        with pytest.raises(InputError, match="dense_tier must be one of bf16, int8, int6, int4"):
            convert_checkpoint(qwen2_hf, tmp_path / "out", dense_tier=bad, progress=False)
    assert not (tmp_path / "out").exists()
    assert cli_main(["convert", str(qwen2_hf), "-o", str(tmp_path / "out"), "--dense-tier", "int2"]) == 2
    assert "dense_tier must be one of" in capsys.readouterr().err
    with pytest.raises(InputError, match="head_tier must be one of bf16, int8, int6, int4"):
        convert_checkpoint(qwen2_hf, tmp_path / "out", dense_tier="int4", head_tier="int2", progress=False)
    assert not (tmp_path / "out").exists()


def test_manifest_whose_dense_format_contradicts_its_tier_is_refused(qwen2_dirs, tmp_path):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(qwen2_dirs["int4"], path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["dense"]["format"] = None
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="dense tier int4"):
        jmoe.load(path)


def test_calibrated_conversion_with_a_quantized_dense_tier(tmp_path, monkeypatch):
    """GPTQ calibrates through the quantized dense weights (the inputs the experts will see) and
    quantizes those weights again against the inputs each one saw (convert/dense_gptq.py): every
    quantized projection of every layer, layer 0's q_proj against X^T X of its normed embeddings,
    then the integer LM head against the last hidden states."""
    import shutil

    from convert import dense_gptq
    from convert.calibration import calibration_tokens
    from jmoe.tokenizer import load_tokenizer
    from tests.conftest import CALIB_FILES, TINY_HF

    src = tmp_path / "hf"
    make_checkpoint("qwen2_moe", src, overrides=dict(vocab_size=4096))  # the bundled tokenizer's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY_HF / name, src / name)
    seen, requantized = {}, dense_gptq.calibrated_weight

    def recording(source, cfg, path, spec, hessian, progress=False):
        seen[path] = hessian
        return requantized(source, cfg, path, spec, hessian, progress)

    monkeypatch.setattr(dense_gptq, "calibrated_weight", recording)
    path = convert_checkpoint(src, tmp_path / "gptq", tiers="int4", dense_tier="int4", method="gptq",
                              calib=CALIB_FILES, calib_sequences=4, calib_seq_len=32, progress=False)
    model = jmoe.load(path)
    cfg = model.config
    q_proj = leaf(model, "layers", 0, "self_attn", "q_proj", "kernel")
    assert isinstance(q_proj, QArray)
    dense = read_manifest(path)["dense"]
    assert dense["method"] == "gptq" and dense["head_method"] == "gptq"
    projections = [p for p in seen if p[0] == "layers"]
    assert len(projections) == cfg.num_layers * 7  # q, k, v, o and the shared expert's gate, up, down
    assert ("lm_head", "kernel") in seen

    tokens = calibration_tokens(load_tokenizer(src), CALIB_FILES, 4, 32).reshape(-1)
    table = np.asarray(dequantize(leaf(model, "embed_tokens", "embedding")), np.float64).T  # untied: RTN rows
    x = table[tokens]
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    x = x * np.asarray(leaf(model, "layers", 0, "input_layernorm", "weight"), np.float64)
    np.testing.assert_allclose(seen[("layers", 0, "self_attn", "q_proj", "kernel")], x.T @ x, rtol=1e-3,
                               atol=1e-3 * np.abs(x.T @ x).max())
    assert len(jmoe.generate(model, [5, 6, 7, 8], max_new_tokens=4)) == 4
