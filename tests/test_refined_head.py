"""The refined LM head (`convert --refine-head`): a coarse head, its largest logits computed again from int8 rows."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from jmoe.cli import main as cli_main
from jmoe.errors import FormatError, InputError
from jmoe.layers.refined_head import DEFAULT_TOP, ROW_GROUP, ROW_QMAX, RowTable, quantize_rows, refine
from jmoe.manifest import read_manifest
from kernel_formats.qarray import dequantize
from tests.conftest import TINY_HF, dev_text
from tests.hf_models import make_checkpoint


def table_of(codes: np.ndarray, scales: np.ndarray) -> RowTable:
    table = RowTable(*codes.shape, dtype=jnp.float32)
    table.rows.set_value(jnp.asarray(codes))
    table.scales.set_value(jnp.asarray(scales))
    return table


def dequantized_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, d = codes.shape
    grouped = codes.reshape(n, d // ROW_GROUP, ROW_GROUP).astype(np.float64) * scales.astype(np.float64)[..., None]
    return grouped.reshape(n, d)


def test_rows_are_coded_within_half_a_step_of_their_scale_and_a_zero_group_stays_zero():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(40, 96)).astype(np.float32) * rng.uniform(0.01, 3, size=(40, 1)).astype(np.float32)
    w[3, 32:64] = 0
    codes, scales = quantize_rows(w)
    assert codes.dtype == np.int8 and scales.dtype == np.float16 and scales.shape == (40, 3)
    assert np.abs(codes).max() <= ROW_QMAX
    step = np.repeat(scales.astype(np.float64), ROW_GROUP, axis=1)
    assert np.all(np.abs(dequantized_rows(codes, scales) - w) <= 0.5 * step + 1e-6 * np.abs(w))
    assert not codes[3, 32:64].any() and scales[3, 1] == 0
    assert np.all(np.abs(codes).reshape(40, 3, ROW_GROUP).max(-1)[scales > 0] >= ROW_QMAX - 1)


def test_refine_takes_the_largest_coarse_logits_again_from_the_rows_and_keeps_the_rest():
    rng = np.random.default_rng(1)
    vocab, d, top = 300, 64, 16
    codes, scales = quantize_rows(rng.normal(size=(vocab, d)).astype(np.float32))
    x = rng.normal(size=(2, 3, d)).astype(np.float32)
    coarse = rng.normal(size=(2, 3, vocab)).astype(np.float32)
    bias = rng.normal(size=vocab).astype(np.float32)
    got = np.asarray(refine(jnp.asarray(coarse), jnp.asarray(x), table_of(codes, scales), top, jnp.asarray(bias)))
    fine = x.astype(np.float64) @ dequantized_rows(codes, scales).T + bias
    for b in range(2):
        for t in range(3):
            chosen = np.argsort(-coarse[b, t])[:top]
            rest = np.setdiff1d(np.arange(vocab), chosen)
            np.testing.assert_allclose(got[b, t, chosen], fine[b, t, chosen], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(got[b, t, rest], coarse[b, t, rest])
    # a top past the vocabulary refines every logit
    every = np.asarray(refine(jnp.asarray(coarse), jnp.asarray(x), table_of(codes, scales), 10 * vocab))
    np.testing.assert_allclose(every, fine - bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_conversion_stores_a_coarse_head_and_int8_rows_that_hold_the_embedding_table(tmp_path, tied):
    """Tied: the rows are the embedding table and the head refines from them, the coarse head a
    Linear of its own read from the same tensor; untied: the embedding table's rows and the head's
    apart. Every row within half a step of the checkpoint's; the model generates."""
    hf = tmp_path / "hf"
    reference = make_checkpoint("qwen2_moe", hf, overrides={"tie_word_embeddings": tied})
    path = convert_checkpoint(hf, tmp_path / "m", tiers="int4", dense_tier="int4", head_tier="int4", refine_head=8,
                              progress=False)
    dense = read_manifest(path)["dense"]
    assert dense["head_tier"] == "int4" and dense["head_rows"] == {"bits": 8, "group_size": ROW_GROUP, "top": 8}
    tensors = dense["tensors"]
    embed_name = "model.embed_tokens.weight"
    assert tensors["lm_head.kernel"]["hf_name"] == (embed_name if tied else "lm_head.weight")
    embed_shape = list(reference.model.embed_tokens.weight.shape)
    assert tensors["embed_tokens.rows"] == {"hf_name": embed_name, "shape": embed_shape, "dtype": "int8"}
    assert ("head_rows.rows" in tensors) != tied
    model = jmoe.load(path)
    state = model.dense
    sources = {"embed_tokens": reference.model.embed_tokens.weight,
               **({} if tied else {"head_rows": reference.lm_head.weight})}
    for module, weight in sources.items():
        codes, scales = (np.asarray(state[module][leaf].get_value()) for leaf in ("rows", "scales"))
        w = weight.detach().float().numpy()
        step = np.repeat(scales.astype(np.float64), ROW_GROUP, axis=1)
        assert np.all(np.abs(dequantized_rows(codes, scales) - w) <= 0.5 * step + 1e-3 * np.abs(w))
    head = state["lm_head"]["kernel"].get_value()
    assert head.fmt.bits == 4
    head_source = (reference.model.embed_tokens if tied else reference.lm_head).weight.detach().float().numpy()
    assert np.abs(np.asarray(dequantize(head)).T - head_source).max() < 0.2 * np.abs(head_source).max()
    assert len(jmoe.generate(model, [3, 4, 5], max_new_tokens=4)) == 4


def test_refine_head_is_refused_for_a_bf16_head_and_a_count_below_one(tmp_path, capsys):
    hf = tmp_path / "hf"
    make_checkpoint("qwen2_moe", hf)
    with pytest.raises(InputError, match="refines an integer head"):
        convert_checkpoint(hf, tmp_path / "out", refine_head=16, progress=False)
    for bad in (0, -3, 1.5, "many"):
        with pytest.raises(InputError, match="refine_head"):
            convert_checkpoint(hf, tmp_path / "out", dense_tier="int4", head_tier="int4", refine_head=bad,
                               progress=False)
    assert cli_main(["convert", str(hf), "-o", str(tmp_path / "out"), "--dense-tier", "int4", "--refine-head",
                     "0"]) == 2
    assert "refine_head" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_clis_refine_head_without_a_count_takes_the_default():
    from jmoe.cli import build_parser

    args = build_parser().parse_args(["convert", "src", "-o", "out", "--refine-head"])
    assert args.refine_head == DEFAULT_TOP  # the parser keeps a literal so the CLI starts without flax


def test_a_manifest_refining_a_bf16_head_is_refused(tmp_path):
    hf = tmp_path / "hf"
    make_checkpoint("qwen2_moe", hf)
    path = convert_checkpoint(hf, tmp_path / "m", dense_tier="int4", head_tier="int4", refine_head=4, progress=False)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["dense"].update(head_tier="bf16", head_format=None)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="head_rows refines an integer head"):
        jmoe.load(path)


def log_softmax(logits):
    shifted = np.asarray(logits, np.float64) - np.max(logits, -1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_an_int4_head_refined_loses_far_less_than_the_int4_head_alone(tiny_tokenizer, tmp_path):
    """On the bundled model (int4 dense weights and experts): computing the 256 largest of its 4096
    logits again from int8 rows takes back more than half of what an int4 head adds over an int6 head
    to the divergence from the bf16 model's next-token distributions (KL, averaged over the tokens:
    steadier than perplexity on a few hundred tokens)."""
    ids = tiny_tokenizer.encode(dev_text("code")[:3000])[:256]
    logp = {}
    for name, options in {"bf16": {}, "int6": {"dense_tier": "int4", "head_tier": "int6"},
                          "int4": {"dense_tier": "int4", "head_tier": "int4"},
                          "int4 refined": {"dense_tier": "int4", "head_tier": "int4", "refine_head": 256}}.items():
        path = convert_checkpoint(TINY_HF, tmp_path / name.replace(" ", "-"), tiers="int4", progress=False, **options)
        logp[name] = log_softmax(jmoe.forward(jmoe.load(path, compute_dtype="float32"), ids))
        shutil.rmtree(path)
    ref = logp["bf16"]
    kl = {name: float((np.exp(ref) * (ref - value)).sum(-1).mean()) for name, value in logp.items()}
    assert kl["int6"] < kl["int4"]
    assert kl["int4 refined"] - kl["int6"] < 0.5 * (kl["int4"] - kl["int6"])
