"""The real-shapes benchmark's own pieces: random checkpoints the converter accepts, with the hub's
names and shapes, and the round statistics (medians, ranges, per-round ratios)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from bench.lib.random_checkpoint import MODELS, RealModel, write_checkpoint
from bench.lib.real_shapes_report import markdown, ratios, summarize
from bench.real_shapes import cpus_busy
from jmoe.models import config_from_hf
from jmoe.models.checkpoint import expert_tensor_names, fused_expert_names

# Each family's widths shrunk (same structure), so a checkpoint is written and converted in seconds.
SMALL = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_shared_experts=1, vocab_size=4200)


def small(key: str) -> RealModel:
    real = MODELS[key]
    cfg = {k: (SMALL[k] if k in SMALL else v) for k, v in real.config.items()}
    return RealModel(real.name, real.hub_id, cfg, real.layer_tensors, real.per_layer_keys)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_real_configs_are_read_by_their_family(key):
    real = MODELS[key]
    cfg = config_from_hf(real.config_for(2))
    assert cfg.num_layers == 2 and cfg.vocab_size == real.config["vocab_size"]
    hf = real.config_for(2)
    names = {t.name: t.shape for i in range(2) for t in real.layer_tensors(hf, i)}
    moe_layer = 1  # DeepSeek-V2-Lite's layer 0 is dense
    if key == "gpt-oss-20b":
        gate_up, down = fused_expert_names(cfg, moe_layer)[0]
        assert names[gate_up] == (cfg.num_experts, cfg.hidden_size, 2 * cfg.moe_intermediate_size)
        assert names[down] == (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    else:
        gate, up, down = expert_tensor_names(cfg, moe_layer, cfg.num_experts - 1)
        assert names[gate] == names[up] == (cfg.moe_intermediate_size, cfg.hidden_size)
        assert names[down] == (cfg.hidden_size, cfg.moe_intermediate_size)


def test_layer_count_is_checked():
    with pytest.raises(ValueError, match="1..48"):
        MODELS["qwen3-30b-a3b"].config_for(49)
    with pytest.raises(ValueError, match="dense"):
        MODELS["deepseek-v2-lite"].config_for(1)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_written_checkpoint_converts(key, tmp_path):
    from transformers import AutoTokenizer

    from convert import convert_checkpoint

    spec = small(key)
    out = write_checkpoint(spec, tmp_path / "hf", layers=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    hf = spec.config_for(2)
    expected = [t for i in range(2) for t in spec.layer_tensors(hf, i)]
    for t in expected:
        with safe_open(str(out / index[t.name]), "np") as f:
            value = f.get_slice(t.name)
            assert tuple(value.get_shape()) == t.shape and value.get_dtype() == "BF16", t.name
    assert len(AutoTokenizer.from_pretrained(str(out))) == hf["vocab_size"]
    jm = convert_checkpoint(out, tmp_path / "jmoe", tiers="bf16,int4", progress=False)
    manifest = json.loads((jm / "manifest.json").read_text())
    assert set(manifest["tiers"]) == {"bf16", "int4"}


def test_round_statistics():
    runs = [{"kind": "jmoe", "label": "a", "round": r, "decode_tok_s@0": v} for r, v in enumerate((2.0, 4.0, 3.0))]
    runs += [{"kind": "llama.cpp", "label": "b", "round": r, "decode_tok_s@0": v} for r, v in enumerate((4.0, 4.0, 2.0))]
    s = summarize(runs)
    assert s["a"]["decode_tok_s@0"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    r = ratios(runs, [("a", "b")], ("decode_tok_s@0",))["a / b"]["decode_tok_s@0"]
    assert r == {"median": 1.0, "min": 0.5, "max": 1.5, "n": 3}  # within each round: 0.5, 1.0, 1.5
    result = {"summary": s, "ratios": {"a / b": {"decode_tok_s@0": r}}, "conversions": {},
              "settings": {"prompt": 512, "rounds": 3}, "model": {"name": "M", "layers": 2},
              "machine": {"cpu": "cpu", "cpu_count": 2}}
    text = markdown(result)
    assert "| a | – | 3.00 [2.00–4.00] |" in text and "1.00 [0.50–1.50]" in text
    assert np.isfinite(r["median"])
    assert "not idle" not in text
    busy = dict(result, runs=[{"cpus_busy_before": 0.1}, {"cpus_busy_before": 0.9}])
    assert "up to 0.9 CPUs busy" in markdown(busy)
    assert "not idle" not in markdown(dict(result, runs=[{"cpus_busy_before": 0.1}, {"cpus_busy_before": None}]))


def test_busy_cpus_are_measured_while_the_bench_waits():
    idle = cpus_busy(0.2)
    assert idle is not None and 0 <= idle <= (os.cpu_count() or 1)


def test_the_mixed_mode_is_planned_against_llama_cpp_and_a_conversion_lacking_a_tier_is_not_reused(tmp_path):
    """--mixed: DyMoE int4/int2 without a budget on its own conversion, judged against both tiers'
    bytes and paired with Q4_0; --reuse converts again an output that lacks a tier it needs."""
    from bench import real_shapes
    from convert import convert_checkpoint
    from jmoe import memory_plan

    src = write_checkpoint(small("qwen3-30b-a3b"), tmp_path / "hf", layers=2)
    mixed = convert_checkpoint(src, tmp_path / "mixed", tiers="int4,int2", dense_tier="int4", progress=False)
    main = convert_checkpoint(src, tmp_path / "main", tiers="int4", progress=False)
    args = real_shapes.parse_args(["--tiers", "int4", "--mixed", "--cpu-dots", "int8", "--placements", "resident",
                                   "--skip-startup", "--prompt", "8", "--new-tokens", "4"])
    conversions = {"jmoe": {"path": str(main)}, real_shapes.MIXED: {"path": str(mixed)}}
    measured, _, pairs = real_shapes.plan_configs(args, conversions, {"Q4_0": {"path": "q.gguf", "bytes": 1}})
    label = real_shapes.MIXED_LABEL + ", int8 dot"
    cfg = next(c for c in measured if c["label"] == label)
    assert cfg["spec"]["policy"] == "dymoe" and cfg["spec"]["budget"] is None and cfg["spec"]["path"] == str(mixed)
    plans = {t: memory_plan(mixed, tier=t, max_seq_len=cfg["spec"]["max_seq_len"]) for t in ("int4", "int2")}
    fixed = sum(v for k, v in plans["int4"].items() if k in ("dense", "kv_cache", "workspace"))
    assert cfg["loaded_bytes"] == fixed + plans["int4"]["all_experts"] + plans["int2"]["all_experts"]
    assert (label, "llama.cpp Q4_0") in pairs
    assert cfg["spec"]["policy_options"] == {"r": 0.75}
    # --mixed-r: the same conversion at several DyMoE ratios, each its own label, paired with Q4_0
    args = real_shapes.parse_args(["--tiers", "int4", "--mixed", "--mixed-r", "0.75,0.5", "--cpu-dots", "int8",
                                   "--placements", "resident", "--skip-startup"])
    measured, _, pairs = real_shapes.plan_configs(args, conversions, {"Q4_0": {"path": "q.gguf", "bytes": 1}})
    half = next(c for c in measured if c["label"] == real_shapes.mixed_label(0.5) + ", int8 dot")
    assert half["label"] != label and any(c["label"] == label for c in measured)
    assert half["spec"]["policy_options"] == {"r": 0.5} and (half["label"], "llama.cpp Q4_0") in pairs
    # --dense-int4-only: each low tier beside dense int4 on the one conversion, paired with Q3_K_M too
    args = real_shapes.parse_args(["--tiers", "int4,int2", "--dense-int4-only", "--cpu-dots", "int8",
                                   "--placements", "resident", "--llama-types", "Q4_0,Q3_K_M"])
    ggufs = {q: {"path": f"{q}.gguf", "bytes": 1} for q in ("Q4_0", "Q3_K_M")}
    measured, startup, pairs = real_shapes.plan_configs(args, {"jmoe dense int4": {"path": str(mixed)}}, ggufs)
    ours = [c for c in measured if c["kind"] == "jmoe"]
    assert [(c["label"], c["spec"]["tier"]) for c in ours] == [("jmoe int4 + dense int4 resident, int8 dot", "int4"),
                                                               ("jmoe int2 + dense int4 resident, int8 dot", "int2")]
    assert startup == [] and ("jmoe int2 + dense int4 resident, int8 dot", "llama.cpp Q3_K_M") in pairs
    with pytest.raises(SystemExit):
        real_shapes.parse_args(["--tiers", "int3", "--dense-int4-only"])
    for bad in ("0.4", "x", ","):  # below DyMoE's range, not a number, none given
        with pytest.raises(SystemExit):
            real_shapes.parse_args(["--mixed", "--mixed-r", bad])
    again = real_shapes.convert_jmoe(src, main, ["int4", "int2"], [], True, tmp_path / "convert.log")
    assert again["seconds"] is not None  # converted again, not reused
    assert set(json.loads((main / "manifest.json").read_text())["tiers"]) == {"int4", "int2"}
    assert real_shapes.convert_jmoe(src, main, ["int2"], [], True, tmp_path / "convert.log")["seconds"] is None


def test_a_conversion_whose_dense_formats_are_not_the_converters_is_not_reused(tmp_path):
    """--reuse keeps a conversion only where its dense and head formats are what this converter
    writes for the same options (an int6 head from a run with another group size is converted
    again), and the result records the formats it measured."""
    from bench import real_shapes
    from convert import convert_checkpoint

    src = write_checkpoint(small("qwen3-30b-a3b"), tmp_path / "hf", layers=1)
    out = convert_checkpoint(src, tmp_path / "m", tiers="int4", dense_tier="int4", head_tier="int6",
                             progress=False)
    options = ["--dense-tier", "int4", "--head-tier", "int6"]
    assert real_shapes.stale_dense_formats(out, options) is None
    assert "head format" in real_shapes.stale_dense_formats(out, ["--dense-tier", "int4"])  # int8 by default
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["dense"]["head_format"].update(group_size=64, scale_bits=16)  # as written before the default was 32
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert "group_size': 64" in real_shapes.stale_dense_formats(out, options)
    again = real_shapes.convert_jmoe(src, out, ["int4"], options, True, tmp_path / "convert.log")
    assert again["seconds"] is not None and again["head_format"]["group_size"] == 32
    assert again["head_format"]["scale_bits"] == 8
    kept = real_shapes.convert_jmoe(src, out, ["int4"], options, True, tmp_path / "convert.log")
    assert kept["seconds"] is None and kept["head_tier"] == "int6"
    assert "group_size': 32" in real_shapes.stale_dense_formats(out, [*options, "--head-group-size", "64"])


def test_llama_perplexity_is_read_when_a_stream_lost_its_last_lines():
    """llama-perplexity's logging threads can drop their last lines at exit: a run that reached its
    final estimate scored every window it announced, even where stdout lost the last one."""
    from bench.lib.llama_cpp import read_perplexity

    log = "perplexity: calculating perplexity over 3 chunks, n_ctx=256\nFinal estimate: PPL = 5.6863 +/- 0.07251\n"
    assert read_perplexity("[1]6.1,[2]5.9,", log) == {"ppl": 5.6863, "plus_minus": 0.07251, "chunks": 3}
    # no final estimate (stderr lost it): the running estimate, as far as it went
    assert read_perplexity("[1]6.1,[2]5.9,", "perplexity: calculating perplexity over 3 chunks\n") == {
        "ppl": 5.9, "plus_minus": None, "chunks": 2}
    with pytest.raises(RuntimeError, match="no estimate"):
        read_perplexity("", "")


def test_a_llama_cpp_run_killed_by_an_illegal_instruction_says_so(tmp_path):
    """A build for instructions the machine does not run (AMX in a virtual machine that lists it)
    dies of SIGILL: the error names the signal and the likeliest cause, not a bare negative code."""
    from bench.lib.llama_cpp import run_measured

    with pytest.raises(RuntimeError, match="SIGILL: .*AMX"):
        run_measured(["sh", "-c", "kill -ILL $$"], log=tmp_path / "log")
    with pytest.raises(RuntimeError, match=r"exit status 3"):
        run_measured(["sh", "-c", "exit 3"], log=tmp_path / "log")


def test_a_quantized_gguf_is_reused_without_its_bf16_source(tmp_path):
    """At real shapes the BF16 GGUF is the largest file: once the types asked for are there it may be
    deleted, and a rerun neither converts again nor reports it; asked for, it is made again."""
    from bench.lib.llama_cpp import LlamaCpp, convert

    missing = tmp_path / "no-build"  # running any of its tools fails
    llama = LlamaCpp(bin_dir=missing, src_dir=missing, python=str(missing / "python"))
    (tmp_path / "model-Q4_0.gguf").write_bytes(b"q" * 10)
    out = convert(llama, tmp_path / "hf", tmp_path, ["Q4_0"])
    assert set(out) == {"Q4_0"} and out["Q4_0"]["bytes"] == 10
    with pytest.raises((OSError, RuntimeError)):
        convert(llama, tmp_path / "hf", tmp_path, ["BF16", "Q4_0"])


def test_llama_perplexity_runs_again_when_its_output_lost_a_window(tmp_path, monkeypatch):
    """A run whose streams both lost their last lines shows fewer windows than asked for: it is run
    again (llama-perplexity is deterministic), and the complete run's figures are kept."""
    from bench.lib import llama_cpp

    runs = []

    def fake_run(cmd, log, **kwargs):
        runs.append(cmd)
        complete = len(runs) > 1
        log.write_text("calculating perplexity over 3 chunks\n" + ("Final estimate: PPL = 5.5 +/- 0.1\n" if complete else ""))
        return "[1]6.1,[2]5.9," + ("[3]5.5," if complete else ""), 1.0, None

    monkeypatch.setattr(llama_cpp, "run_measured", fake_run)
    llama = llama_cpp.LlamaCpp(tmp_path, tmp_path, "python")
    (tmp_path / "llama-perplexity").touch(mode=0o755)
    got = llama_cpp.perplexity(llama, tmp_path / "m.gguf", tmp_path / "t.txt", ctx=256, chunks=3, log=tmp_path / "l")
    assert len(runs) == 2 and got["chunks"] == 3 and got["ppl"] == 5.5


def test_quality_rows_are_chosen_by_words_and_a_word_naming_none_is_refused():
    """bench.quality --rows: the rows whose label holds a word, bf16 always (the others' reference);
    words that name no row stop the run instead of scoring bf16 alone."""
    from bench.quality import BESIDE_LLAMA, chosen_rows

    chosen = chosen_rows(BESIDE_LLAMA, "int3")
    assert "bf16" in chosen and len(chosen) > 1 and all("int3" in label for label in chosen if label != "bf16")
    assert chosen_rows(BESIDE_LLAMA, None) == BESIDE_LLAMA
    with pytest.raises(SystemExit, match="names none"):
        chosen_rows(BESIDE_LLAMA, "int5")


def test_decode_bytes_count_the_dense_checkpoint_and_a_tokens_experts(short_hf_dir, tmp_path):
    """What a decode token reads: the dense arrays load() places (the tiny model's embedding table is
    its LM head, so all of them), and top_k experts a MoE layer, the mixed mode between its two tiers."""
    import jmoe
    from bench.decode_bytes import jmoe_bytes
    from convert import convert_checkpoint

    path = convert_checkpoint(short_hf_dir, tmp_path / "m", tiers="int4,int2", progress=False)
    got = jmoe_bytes(path, [0.75, 0.5])
    model = jmoe.load(path, tier="int4")
    cfg = model.config
    placed = sum(int(a.nbytes) for a in jax.tree.leaves(nnx.to_pure_dict(model.dense)))
    assert cfg.tie_word_embeddings  # the tiny model's head is its embedding table: read whole
    assert got["dense_bytes_read"] == placed and got["embedding_bytes"] == 0
    rows = got["bytes_per_token"]
    records = {t: model.store.record_nbytes(t) for t in ("int4", "int2")}
    assert rows["int4 experts"] - rows["int2 experts"] == cfg.top_k * cfg.num_moe_layers * (records["int4"] - records["int2"])
    assert rows["int4 experts"] > rows["int4/int2 at r = 0.75"] > rows["int4/int2 at r = 0.5"] > rows["int2 experts"]
    # a six-bit head's high-plane scales, which the int8 dot's one pass does not read, counted apart
    six = convert_checkpoint(short_hf_dir, tmp_path / "six", tiers="int4", dense_tier="int4", head_tier="int6",
                             progress=False)
    got = jmoe_bytes(six, [])
    head = jmoe.load(six, tier="int4").dense["embed_tokens"]["embedding"].get_value()
    assert got["six_bit_high_scale_bytes"] == int(head.high.scales.nbytes) > 0
    # a refined head: the int4 head whole, and of its int8 rows (the embedding table) `top` a token
    refined = convert_checkpoint(short_hf_dir, tmp_path / "refined", tiers="int4", dense_tier="int4",
                                 head_tier="int4", refine_head=16, progress=False)
    got = jmoe_bytes(refined, [])
    dense = jmoe.load(refined, tier="int4").dense
    table = [int(dense["embed_tokens"][leaf].get_value().nbytes) for leaf in ("rows", "scales")]
    whole = sum(int(a.nbytes) for a in jax.tree.leaves(nnx.to_pure_dict(dense)))
    assert got["refine_top"] == 16 and got["refine_row_bytes"] == got["embedding_bytes"] == sum(table)
    assert got["dense_bytes_read"] == whole - sum(table) + sum(n * 16 // cfg.vocab_size for n in table)
