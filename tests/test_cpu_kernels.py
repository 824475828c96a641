"""The native CPU kernels against the XLA reference: every tier, every expert feature, real widths."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from convert.quantizers import grid
from convert.quantizers.rtn import quantize_rtn
from cpu_kernels import native, ops
from jmoe.kernels import default_backend, expert_ffn
from jmoe.kernels.expert_ffn.reference import expert_ffn_reference
from jmoe.kernels.shapes import EXPERT_SHAPES
from jmoe.tiers import tier_format
from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.optimised import optimised_jit
from kernel_formats.qarray import (PlainTiles, QuantFormat, dequantize, planes, quantize_groups, take_columns, tile,
                                   tile_plain, untile, untile_plain)

QWEN3, GPT_OSS = EXPERT_SHAPES["qwen3-30b-a3b"], EXPERT_SHAPES["gpt-oss-20b"]  # real models' widths

FORMATS = {
    "bf16": None,
    "int8": QuantFormat(8, 128, True),
    "int4": QuantFormat(4, 64, False),
    "int2": tier_format("int2"),  # groups of 32, 8-bit scales and offsets on per-column bases
    "int3": tier_format("int3"),  # the same, with each group's codes in a 2-bit and a 1-bit section
    "int4-s8": tier_format("int4", scale_bits=8),  # convert --scale-bits 8
    "int2-f16-g64": QuantFormat(2, 64, False),
    "int4-sym-g32": QuantFormat(4, 32, True),
    "int8-asym-g64": QuantFormat(8, 64, False),
}
CLAMPED = GatedActivation("clamped_swiglu", alpha=1.702, limit=7.0)


def test_native_library_is_built_and_chosen_on_the_cpu():
    if os.environ.get("JMOE_CPU_KERNELS", "on").lower() in ("off", "0", "false"):
        pytest.skip("native kernels switched off by JMOE_CPU_KERNELS")
    assert native.loaded(), "cpu_kernels._native was not built by the package's build"
    assert native.isa() in ("avx512-vnni", "avx512", "avx2", "portable")
    assert default_backend() == "cpu"


def test_a_library_this_jaxlib_refuses_falls_back_to_the_reference(monkeypatch, caplog):
    """A handler built for a newer XLA FFI API than the running jaxlib's is refused at registration:
    the kernels are then unavailable, with a warning, and the XLA reference runs."""
    def refuse(name, capsule, platform):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: the handler's API version (0.5) is incompatible")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse)
    with caplog.at_level("WARNING"):
        assert not native.loaded()
    assert "native CPU kernels unavailable" in caplog.text and "API version" in caplog.text
    assert native.isa() is None


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_narrower_instruction_sets_compute_the_same(isa):
    """The paths a CPU without AVX-512 (or without AVX2) runs, on this one: JMOE_CPU_ISA picks one
    when the library loads (a process of its own), and native.using_isa switches this process's
    kernels to it, where the expert, ragged-width and attention checks run again."""
    if os.environ.get("JMOE_CPU_KERNELS", "on").lower() in ("off", "0", "false") or not native.loaded():
        pytest.skip("native kernels switched off or not built")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JMOE_CPU_ISA=isa)
    chosen = subprocess.run([sys.executable, "-c", "from cpu_kernels import native; print(native.isa())"],
                            cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert chosen == isa
    widest = native.isa()
    attention_tests = importlib.import_module("test_blocked_attention")
    with native.using_isa(isa):
        assert native.isa() == isa
        if widest != isa:  # else this module's own tests ran this path already
            test_ragged_widths_and_padded_groups()
            for tier in ("int4", "bf16"):
                test_expert_ffn_qwen3_widths(tier, 16, 6)
            for m, k, n in ((3, 200, 100), (40, 96, 64)):  # int3's fused and panel paths (small: quick)
                test_matmul_matches_float64("int3", m, k, n)
                test_int8_dot_matmul_multiplies_the_int8_inputs("int3", m, k, n)
            int3_int8_dot_at_a_real_width()
            test_a_six_bit_weight_multiplies_as_the_sum_of_its_planes(64, 8, 40, 256, 192)  # the two planes' products
            for m, k, n in ((1, 2880, 32), (40, 96, 24)):  # a narrow float weight's vectors and column tail
                test_narrow_plain_weights_match_float64(jnp.bfloat16, m, k, n)
            for case in attention_tests.NATIVE_CASES:  # every width: AVX2 holds 128 columns in two chunks
                attention_tests.test_native_attention_equals_the_materialised_softmax(case)
    assert native.isa() == widest
    with pytest.raises(ValueError, match="cannot run"):
        with native.using_isa("sse9"):
            pass
    assert native.isa() == widest


def int3_int8_dot_at_a_real_width():
    """Three-bit codes in groups of 32 (one pass) and 64 (two, each half of the low rows with its
    high quad), [K, N] and tiled, few rows and a panel's many: x on its per-group int8 grid times
    the weight."""
    rng = np.random.default_rng(7)
    run = jax.jit(lambda x, w: ops.matmul(x, w, int8_dot=True))
    for fmt in (FORMATS["int3"], QuantFormat(3, 64, False)):
        w = _weight(rng, 2048, 768, fmt)
        for rows in (1, 2, 40):
            x = rng.standard_normal((rows, 2048)).astype(np.float32)
            ref = _groups_int8(x, fmt.group_size).astype(np.float64) @ _dense(w)
            for weight in (w, tile(w)):
                y = np.asarray(run(jnp.asarray(x), weight))
                assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max(), (fmt.group_size, rows)


def test_the_int8_dot_unpacks_codes_by_shifts_as_it_does_with_gfni():
    """A VNNI CPU without GFNI takes every bit field of three-bit codes out by shifts and masks (as
    it does for every other width): on this one, the same products (int3 in groups of 32 and 64, at
    real widths, one and many rows)."""
    if not native.loaded() or native.isa() != "avx512-vnni" or not native.gfni():
        pytest.skip("needs the native kernels on a CPU with AVX-512 VNNI and GFNI")
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((5, 2048)).astype(np.float32))
    run = jax.jit(lambda x, w: ops.matmul(x, w, int8_dot=True))
    for fmt in (FORMATS["int3"], QuantFormat(3, 64, False)):
        w = tile(_weight(rng, 2048, 768, fmt))
        for rows in (x[:1], x):
            with_gfni = np.asarray(run(rows, w))
            with native.using_gfni(False):
                assert not native.gfni()
                by_shifts = np.asarray(run(rows, w))
            assert native.gfni()
            np.testing.assert_array_equal(by_shifts, with_gfni)


def _weight(rng, k, n, fmt, act_scale=None):
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    if fmt is None:
        return jnp.asarray(w.astype(ml_dtypes.bfloat16))
    if act_scale is not None:
        w = w / act_scale[:, None]
    if not grid.searches(fmt):
        return jax.tree.map(jnp.asarray, quantize_rtn(w, fmt, act_scale=act_scale))
    # int2 and int3: round to the min/max grid, not the converter's searched one (some 25 candidates
    # a group, most of these checks' time at real widths); the kernels read either alike
    groups = grid.pad_k(w, fmt).reshape(-1, fmt.group_size, n)
    scale, offset = grid.group_params(groups, fmt)
    codes = grid.encode(groups, scale, offset, fmt).reshape(-1, n)
    return jax.tree.map(jnp.asarray, grid.to_qarray(codes, scale[:, 0], offset[:, 0], fmt, k, act_scale))


def _dense(w):
    return np.asarray(dequantize(w, jnp.float32) if hasattr(w, "fmt") else w.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("name", FORMATS)
# (1, 600, 4200) and (4, 1100, 520): few rows split over K (not a whole number of groups) and a ragged last tile;
# (40, 96, 64), (33, 2048, 1536) and (23, 130, 100): many rows in blocks of the path's row block and a rest,
# the last with a ragged tile
@pytest.mark.parametrize("m,k,n", [(1, 256, 128), (2, 2048, 1536), (3, 200, 100), (9, 768, 2048), (40, 96, 64),
                                   (1, 600, 4200), (4, 1100, 520), (33, 2048, 1536), (23, 130, 100)])
def test_matmul_matches_float64(name, m, k, n):
    rng = np.random.default_rng(m * 1000 + k)
    w = _weight(rng, k, n, FORMATS[name])
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(jax.jit(ops.matmul)(jnp.asarray(x), w))
    ref = x.astype(np.float64) @ _dense(w)
    assert y.dtype == np.float32 and y.shape == (m, n)
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max() + 1e-7


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,n", [(1, 2880, 32), (1, 4096, 8), (2, 300, 1), (40, 96, 24), (3, 200, 100)])
def test_narrow_plain_weights_match_float64(dtype, m, k, n):
    """A float weight narrower than a 64-column tile (a router of 8 or 32 experts, a shared expert's
    [D, 1] gate) is all ragged tile for the native kernel: whole 16-column vectors, then the rest
    column by column; ops.matmul hands it to XLA's dot instead. Both give the product."""
    rng = np.random.default_rng(k + n)
    w = _weight(rng, k, n, None).astype(dtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = x.astype(np.float64) @ _dense(w)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(_dense(w))  # float32 sums' error scales with it
    for columns, native_call in ((ops.XLA_DOT_COLUMNS, n >= ops.XLA_DOT_COLUMNS), (0, True)):
        with mock.patch.object(ops, "XLA_DOT_COLUMNS", columns):
            run = jax.jit(lambda x, w: ops.matmul(x, w))  # a function of its own: traced afresh
            assert (native.MATMUL in run.lower(jnp.asarray(x), w).as_text()) == native_call
            y = np.asarray(run(jnp.asarray(x), w))
        assert y.shape == (m, n)
        assert (np.abs(y - ref) <= 1e-6 * magnitude).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
# latent attention's up-projections at DeepSeek-V2-Lite's widths (keys' [16, 128, 512], values' [16, 512, 128],
# one token and a prefill's 40), and a ragged width
@pytest.mark.parametrize("b,m,k,n", [(16, 1, 128, 512), (16, 1, 512, 128), (16, 40, 128, 512), (3, 5, 200, 100)])
def test_batched_matmul_multiplies_each_entry_by_its_own_weight(dtype, b, m, k, n):
    rng = np.random.default_rng(b * m + k)
    w = jnp.asarray(rng.standard_normal((b, k, n)).astype(np.float32) * 0.05).astype(dtype)
    x = rng.standard_normal((b, m, k)).astype(np.float32)
    run = jax.jit(ops.batched_matmul)
    assert native.MATMUL in run.lower(jnp.asarray(x), w).as_text()
    y = np.asarray(run(jnp.asarray(x), w))
    wd = np.asarray(w.astype(jnp.float32), np.float64)
    ref = np.einsum("bmk,bkn->bmn", x.astype(np.float64), wd)
    magnitude = np.einsum("bmk,bkn->bmn", np.abs(x).astype(np.float64), np.abs(wd))
    assert y.dtype == np.float32 and y.shape == (b, m, n)
    assert (np.abs(y - ref) <= 1e-6 * magnitude + 1e-7).all()


def test_the_cpu_layout_holds_the_same_weight_in_column_tiles():
    """tile() regroups each row's columns into tiles of 64 (tile t of every row one K-major block,
    in column order); untile() gives the [K, N] arrays back; dequantize and take_columns (an
    embedding lookup) read either."""
    rng = np.random.default_rng(3)
    w = _weight(rng, 256, 192, FORMATS["int4"])
    t = tile(w)
    assert t.fmt.tiled and not w.fmt.tiled and t.values.shape == w.values.shape
    rows = w.values.shape[0]
    # tile 1's block is rows x 64 bytes straight after tile 0's: row r of it is columns 64..127 of row r
    flat = np.asarray(t.values).reshape(-1)
    assert np.array_equal(flat[rows * 64 : rows * 128].reshape(rows, 64), np.asarray(w.values)[:, 64:128])
    assert np.array_equal(np.asarray(t.scales).reshape(-1)[: w.scales.shape[0] * 64].reshape(-1, 64),
                          np.asarray(w.scales)[:, :64])
    back = untile(t)
    assert back.fmt == w.fmt and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                     ((back.values, w.values), (back.scales, w.scales), (back.offsets, w.offsets)))
    assert np.array_equal(np.asarray(dequantize(t)), np.asarray(dequantize(w)))
    cols = jnp.asarray([130, 0, 63, 64, 191, 130, 7])  # an embedding lookup's columns: any order, repeated
    wanted = np.asarray(dequantize(w))[:, np.asarray(cols)]
    for q in (w, t):
        taken = take_columns(q, cols)
        assert not taken.fmt.tiled and taken.n == len(cols)
        assert np.array_equal(np.asarray(dequantize(taken)), wanted)
    ragged = _weight(rng, 128, 100, FORMATS["int4"])
    assert tile(ragged) is ragged  # 100 columns are no whole number of tiles: [K, N] stays


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "int2", "int4-sym-g32", "int4-s8"])
@pytest.mark.parametrize("int8_dot", [False, True])
# one row (a whole product per task), few rows split over K, panel rows with a rest, many rows
@pytest.mark.parametrize("m,k,n", [(1, 2048, 1536), (2, 768, 2048), (3, 1100, 128), (9, 512, 640), (40, 256, 192)])
def test_matmul_reads_the_cpu_layout_as_it_reads_k_by_n(name, m, k, n, int8_dot):
    """Every native path (few rows in registers, K split over tasks, panels, float and int8 dot)
    gives a tiled weight the numbers it gives the same weight in [K, N]: the same bits where both
    run the same tasks, within float32 rounding where a product too narrow for every thread is
    split over K in [K, N] but into runs of whole tiles when tiled (so the sums add in another order)."""
    rng = np.random.default_rng(m * 7 + k)
    w = _weight(rng, k, n, FORMATS[name])
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    run = jax.jit(lambda x, w: ops.matmul(x, w, int8_dot=int8_dot))
    expected, tiled = np.asarray(run(x, w)), np.asarray(run(x, tile(w)))
    if m > 16 or n >= 4 * 4096:  # many rows, or enough 4096-column blocks for every thread: the same tasks
        assert np.array_equal(tiled, expected)
    else:
        assert np.abs(tiled - expected).max() <= 1e-6 * np.abs(expected).max()


@pytest.mark.parametrize("int8_dot", [False, True])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_weights_that_share_an_input_in_one_call_give_what_each_call_gives(m, int8_dot):
    """cpu_kernels.matmuls (a layer's q, k and v; an MLP's gate and up): the weights it takes in one
    native call (quantized in the dense format, int8, tiled or [K, N]; a plain bf16 one in tiles)
    give what a matmul each gives, within float32 rounding (a product too narrow for every thread
    is cut differently beside others); the ones it cannot take (HAQ-smoothed inputs, six bits, a
    float weight narrower than a tile) still get their own call, and the results keep their order."""
    rng = np.random.default_rng(31 + m)
    k = 2048
    smooth = rng.uniform(0.5, 2.0, k).astype(np.float16).astype(np.float32)
    weights = [tile(_weight(rng, k, 4096, FORMATS["int4-s8"])), _weight(rng, k, 512, FORMATS["int4-s8"]),
               _weight(rng, k, 512, FORMATS["int8"]), tile_plain(_weight(rng, k, 576, None)),
               _weight(rng, k, 256, QuantFormat(4, 64, False, smooth=True), smooth), _six_bit_weight(rng, k, 256, 64),
               _weight(rng, k, 8, None)]
    tiled = [False, False, False, True, False, False, False]
    dots = [int8_dot] * len(weights)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    together = jax.jit(lambda x, ws: ops.matmuls(x, ws, int8_dot=dots, tiled=tiled))
    each = jax.jit(lambda x, ws: [ops.matmul(x, w, int8_dot=d, tiled=t) for w, d, t in zip(ws, dots, tiled)])
    hlo = together.lower(x, weights).as_text()
    own_calls = 1 + (1 if int8_dot else 2)  # the smoothed weight; six bits, a call a plane without the int8 dot
    assert hlo.count(f"@{native.MATMULS}(") == 1 and hlo.count(f"@{native.MATMUL}(") == own_calls
    for got, want in zip(together(x, weights), each(x, weights)):
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape == (m, want.shape[1])
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,n", [(1, 2048, 1536), (2, 768, 2048), (3, 1100, 128), (9, 512, 640), (40, 256, 192)])
def test_matmul_reads_plain_weights_in_the_cpu_layout(dtype, m, k, n, monkeypatch):
    """A plain bf16/float32 weight in column tiles (tile_plain: tile t of every row one K-major block)
    gives, on every native path, the numbers the [K, N] weight gives (the same bits with many rows,
    within float32 rounding of the exact product where the tasks differ); the XLA reference
    and the model's non-CPU matmul read it through untile_plain, and untile_plain undoes tile_plain."""
    from jmoe.layers import linear

    rng = np.random.default_rng(m * 5 + n)
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32), dtype)
    t = tile_plain(w)
    assert t.shape == w.shape and not np.array_equal(np.asarray(t), np.asarray(w))
    assert np.array_equal(np.asarray(t).reshape(-1)[k * 64: k * 128].reshape(k, 64), np.asarray(w)[:, 64:128])
    assert np.array_equal(np.asarray(untile_plain(t)), np.asarray(w))
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    expected = np.asarray(jax.jit(ops.matmul)(x, w))
    tiled = np.asarray(jax.jit(lambda x, w: ops.matmul(x, w, tiled=True))(x, t))
    exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    if m > 16:
        assert np.array_equal(tiled, expected)
    else:  # float32 sums in another order: each within rounding of the exact product
        for y in (tiled, expected):
            assert np.abs(y - exact).max() <= 2e-6 * np.abs(exact).max()
    monkeypatch.setattr(ops, "available", lambda: False)  # the XLA reference
    assert np.abs(np.asarray(ops.matmul(x, t, tiled=True)) - exact).max() <= 2e-6 * np.abs(exact).max()
    monkeypatch.setattr(linear, "on_cpu", lambda: False)  # the path every other backend takes
    assert np.abs(np.asarray(linear.matmul(x, t, tiled=True)) - exact).max() <= 2e-6 * np.abs(exact).max()
    assert np.array_equal(np.asarray(linear.dense_weight(t, jnp.float32, tiled=True)), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="multiple of 64"):
        ops.matmul(x[:, :k], w[:, : n - 1], tiled=True)


@pytest.mark.parametrize("tier", ["int4", "int3", "int2"])
def test_expert_kernels_read_tiled_pools_as_they_read_k_by_n(tier):
    """The block and routed expert kernels and the one-call-for-every-tier kernel on pools in the
    CPU layout (Qwen3-30B-A3B's widths) give what they give the same pools in [K, N] (within float32
    rounding where a phase has fewer products than threads: test_matmul_reads_the_cpu_layout...;
    under the int8 dot, as _close allows, where the activation's rounding to int8 lands a rare input
    on the neighbouring code); the XLA reference reads tiled pools too."""

    def same(a, b, int8_dot=False):
        a, b = np.asarray(a), np.asarray(b)
        if int8_dot:
            _close(a, b, int8_dot=True)
            return True
        return np.abs(a - b).max() <= 1e-6 * np.abs(b).max()

    rng = np.random.default_rng(21)
    D, F, S = QWEN3.hidden, QWEN3.inner, 3
    gu, dn = _pool(rng, S, D, 2 * F, FORMATS[tier]), _pool(rng, S, F, D, FORMATS[tier])
    tgu, tdn = tile(gu), tile(dn)
    rows = jnp.asarray(rng.standard_normal((8, D)).astype(np.float32))
    bs = jnp.asarray(np.array([0, 2, -1, 1, 1, 0, 2, -1], np.int32))
    for int8_dot in (False, True):
        kw = dict(block_rows=1, int8_dot=int8_dot)
        run = jax.jit(lambda r, b, g, d: expert_ffn(r, b, g, d, backend="cpu", **kw))
        assert same(run(rows, bs, tgu, tdn), run(rows, bs, gu, dn), int8_dot)
        routed = jax.jit(lambda h, s, g, d: ops.routed_expert_ffn(h, jnp.arange(8, dtype=jnp.int32), s, g, d,
                                                                  int8_dot=int8_dot))
        assert same(routed(rows, bs, tgu, tdn), routed(rows, bs, gu, dn), int8_dot)
    tier_of = jnp.asarray(np.array([0, 1, 0, 1, 0, 1, 0, 1], np.int32))
    both = jax.jit(lambda h, s, r, p: ops.routed_expert_ffn_tiers(h, jnp.arange(8, dtype=jnp.int32), s, r, p))
    mixed = [(tgu, tdn, None, None), (gu, dn, None, None)]
    assert same(both(rows, bs, tier_of, mixed), both(rows, bs, tier_of, [(gu, dn, None, None)] * 2))
    ref = optimised_jit(lambda r, b, g, d: expert_ffn_reference(r, b, g, d, block_rows=1))
    np.testing.assert_allclose(np.asarray(ref(rows, bs, tgu, tdn)), np.asarray(ref(rows, bs, gu, dn)), rtol=0, atol=0)


@pytest.mark.parametrize("rows_count", [4, 40])
def test_expert_kernels_read_bf16_pools_in_the_cpu_layout_as_they_read_k_by_n(rows_count):
    """The bf16 tier's pools in the CPU layout (PlainTiles, as `convert --cpu-layout` writes them) at
    GPT-OSS-20B's widths (a gate-up of 5,760 columns: more than one of the kernel's column blocks),
    with biases and the clamped SwiGLU, in decode and in a prefill's many rows: the block, routed
    and every-tier kernels give what they give the [K, N] pools (within float32 rounding); the XLA
    reference reads the tiles too, and the Pallas kernels refuse them."""
    from pallas_kernels.expert_ffn_pallas import supports

    rng = np.random.default_rng(23)
    D, F, S = GPT_OSS.hidden, GPT_OSS.inner, 2
    gu, dn = _pool(rng, S, D, 2 * F, None), _pool(rng, S, F, D, None)
    tgu, tdn = PlainTiles(tile_plain(gu)), PlainTiles(tile_plain(dn))
    assert tgu.shape == gu.shape and not np.array_equal(np.asarray(tgu.values), np.asarray(gu))
    biases = {"gate_up_bias": jnp.asarray(rng.standard_normal((S, 2 * F)).astype(np.float32)),
              "down_bias": jnp.asarray(rng.standard_normal((S, D)).astype(np.float32)), "activation": CLAMPED}
    rows = jnp.asarray(rng.standard_normal((rows_count, D)).astype(np.float32) * 3)
    slot = jnp.asarray(np.where(rng.random(rows_count) < 0.2, -1, rng.integers(0, S, rows_count)).astype(np.int32))
    token = jnp.asarray(rng.permutation(rows_count).astype(np.int32))

    def same(a, b):  # within float32 rounding: the two layouts sum K in different orders
        a, b = np.asarray(a), np.asarray(b)
        return np.abs(a - b).max() <= 1e-5 * np.abs(b).max()

    block = jax.jit(lambda r, b, g, d: expert_ffn(r, b, g, d, block_rows=1, backend="cpu", **biases))
    assert same(block(rows, slot, tgu, tdn), block(rows, slot, gu, dn))
    routed = jax.jit(lambda h, t, s, g, d: ops.routed_expert_ffn(h, t, s, g, d, **biases))
    assert same(routed(rows, token, slot, tgu, tdn), routed(rows, token, slot, gu, dn))
    tier_of = jnp.asarray((np.arange(rows_count) % 2).astype(np.int32))
    both = jax.jit(lambda h, t, s, r, p: ops.routed_expert_ffn_tiers(h, t, s, r, p, activation=CLAMPED))
    pools = [(gu, dn, biases["gate_up_bias"], biases["down_bias"])] * 2
    mixed = [(tgu, tdn, *pools[0][2:]), pools[1]]
    assert same(both(rows, token, slot, tier_of, mixed), both(rows, token, slot, tier_of, pools))
    ref = optimised_jit(lambda r, b, g, d: expert_ffn_reference(r, b, g, d, block_rows=1, **biases))
    np.testing.assert_array_equal(np.asarray(ref(rows, slot, tgu, tdn)), np.asarray(ref(rows, slot, gu, dn)))
    assert supports(rows, gu, dn, 1) and not supports(rows, tgu, tdn, 1)


@pytest.mark.parametrize("hidden,inner", [(QWEN3.hidden, QWEN3.inner), (199, 64)])
def test_the_int8_dot_rounds_a_bf16_pools_inputs_to_bf16_as_its_reference_does(hidden, inner):
    """Under the int8 dot a bf16 expert pool multiplies its inputs rounded to bf16 (llama.cpp's BF16
    dot), gate-up's and the activation's alike: prefill rows on the AVX-512 BF16 dot where the CPU
    has it, decode rows on the float path, [K, N] and tiled pools: within float32 rounding of the XLA
    reference that rounds them the same way, but for a rare activation the kernel's own exp rounds
    to the neighbouring bf16 (so the largest error is held looser than the mean), where float
    inputs are off it by hundreds of times more on average (an odd K pairs its last row with zeros;
    a width of no whole tiles takes the float path)."""
    rng = np.random.default_rng(29)
    D, F, S = hidden, inner, 3
    gu, dn = _pool(rng, S, D, 2 * F, None), _pool(rng, S, F, D, None)
    pools = [(gu, dn)] if D % 64 else [(gu, dn), (PlainTiles(tile_plain(gu)), PlainTiles(tile_plain(dn)))]
    for rows_count in (4, 100):  # 100: more rows an expert than the fused path takes
        rows = jnp.asarray(rng.standard_normal((rows_count, D)).astype(np.float32))
        slot = jnp.asarray(rng.integers(0, S, rows_count).astype(np.int32))
        token = jnp.arange(rows_count, dtype=jnp.int32)
        ref = optimised_jit(lambda r, b, g, d: expert_ffn_reference(r, b, g, d, block_rows=1, int8_dot=True))
        expected = np.asarray(ref(rows, slot, gu, dn))
        for g, d in pools:
            for int8_dot in (True, False):
                y = np.asarray(jax.jit(lambda h, t, s, g, d, dot=int8_dot: ops.routed_expert_ffn(
                    h, t, s, g, d, int8_dot=dot))(rows, token, slot, g, d))
                err = np.abs(y - expected) / np.abs(expected).max()
                assert (err.mean() <= 2e-6) == int8_dot, (rows_count, int8_dot, err.mean())
                assert err.max() <= (5e-4 if int8_dot else 1e-2), (rows_count, int8_dot, err.max())


def test_matmul_keeps_leading_dims_and_takes_bf16_inputs():
    rng = np.random.default_rng(1)
    w = _weight(rng, 128, 192, FORMATS["int4"])
    x = jnp.asarray(rng.standard_normal((2, 3, 128)).astype(np.float32)).astype(jnp.bfloat16)
    y = np.asarray(ops.matmul(x, w))
    ref = np.asarray(x, np.float64).reshape(6, 128) @ _dense(w)
    assert y.shape == (2, 3, 192)
    assert np.abs(y.reshape(6, 192) - ref).max() <= 2e-6 * np.abs(ref).max()


def _pool(rng, slots, k, n, fmt, smooth=False):
    ws = []
    for _ in range(slots):
        scale = rng.uniform(0.5, 2.0, k).astype(np.float16).astype(np.float32) if smooth else None
        ws.append(_weight(rng, k, n, fmt, scale))
    return jax.tree.map(lambda *a: jnp.stack(a), *ws)


def _layout(rng, slots, block_rows, blocks):
    """Block slots as the model lays them out: decode (one row per block, any order, some empty)
    or prefill (sorted, each slot's run of blocks together, an empty block or two)."""
    if block_rows == 1:
        bs = rng.integers(0, slots, blocks)
        bs[rng.random(blocks) < 0.2] = -1
    else:
        bs = np.sort(rng.integers(0, slots, blocks))
        bs[-1] = -1
    return jnp.asarray(bs.astype(np.int32))


def _close(y, ref, int8_dot=False):
    """Within float32 rounding; under the int8 dot the kernel's activation (its own exp) may round a
    rare input to the neighbouring int8 code, so the largest error may be one code's worth, the mean not."""
    scale = np.abs(ref).max()
    assert scale > 0
    err = np.abs(y - ref)
    assert err.max() <= (2e-3 if int8_dot else 1e-5) * scale
    assert err.mean() <= (1e-4 if int8_dot else 1e-5) * scale


def _compare(rows, bs, gu, dn, block_rows, gu_bias=None, dn_bias=None, activation=SILU, int8_dot=False):
    """The block kernel, and the routed kernel on the same rows (one assignment per row), against the reference."""
    _compare_routed(rows, jnp.repeat(bs, block_rows), gu, dn, gu_bias, dn_bias, activation, int8_dot=int8_dot)
    kw = dict(block_rows=block_rows, gate_up_bias=gu_bias, down_bias=dn_bias, activation=activation,
              int8_dot=int8_dot)
    native_y = jax.jit(lambda r, b, g, d: expert_ffn(r, b, g, d, backend="cpu", **kw))(rows, bs, gu, dn)
    ref = optimised_jit(lambda r, b, g, d: expert_ffn_reference(r, b, g, d, **kw))(rows, bs, gu, dn)
    native_y, ref = np.asarray(native_y), np.asarray(ref)
    _close(native_y, ref, int8_dot)
    empty = np.repeat(np.asarray(bs) < 0, block_rows)
    assert (native_y[empty] == 0).all()


def _compare_routed(h, row_slot, gu, dn, gu_bias=None, dn_bias=None, activation=SILU, shuffle=True, int8_dot=False):
    """Assignments in any order, tokens repeated: out[a] = expert row_slot[a] on h[token[a]]."""
    A = h.shape[0]
    rng = np.random.default_rng(A)
    order = rng.permutation(A) if shuffle else np.arange(A)
    token, slot = jnp.asarray(order.astype(np.int32)), row_slot[order]
    kw = dict(gate_up_bias=gu_bias, down_bias=dn_bias, activation=activation, int8_dot=int8_dot)
    y = np.asarray(jax.jit(lambda h, t, s, g, d: ops.routed_expert_ffn(h, t, s, g, d, **kw))(h, token, slot, gu, dn))
    ref = np.asarray(optimised_jit(lambda h, t, s, g, d: expert_ffn_reference(h[t], s, g, d, block_rows=1, **kw))(
        h, token, slot, gu, dn))
    _close(y, ref, int8_dot)
    assert (y[np.asarray(slot) < 0] == 0).all()


@pytest.mark.parametrize("tier", ["bf16", "int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("block_rows,blocks", [(1, 8), (16, 6)])
def test_expert_ffn_qwen3_widths(tier, block_rows, blocks):
    """Qwen3-30B-A3B's expert: D = 2048, F = 768, SwiGLU, no biases."""
    rng = np.random.default_rng(7)
    D, F, S = QWEN3.hidden, QWEN3.inner, 3
    gu, dn = _pool(rng, S, D, 2 * F, FORMATS[tier]), _pool(rng, S, F, D, FORMATS[tier])
    rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
    _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows)


@pytest.mark.parametrize("tier", ["bf16", "int8", "int4", "int2"])  # int3 at these widths: the int8 dot's test
def test_expert_ffn_gpt_oss_widths_with_biases_and_clamped_swiglu(tier):
    """GPT-OSS-20B's expert: D = F = 2880, float32 biases, clamped SwiGLU; decode and prefill blocks."""
    rng = np.random.default_rng(11)
    D, F, S = GPT_OSS.hidden, GPT_OSS.inner, 2
    gu, dn = _pool(rng, S, D, 2 * F, FORMATS[tier]), _pool(rng, S, F, D, FORMATS[tier])
    gu_bias = jnp.asarray(rng.standard_normal((S, 2 * F)).astype(np.float32))
    dn_bias = jnp.asarray(rng.standard_normal((S, D)).astype(np.float32))
    for block_rows, blocks in ((1, 4), (8, 3)):
        rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32) * 3)
        _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows, gu_bias, dn_bias, CLAMPED)


@pytest.mark.parametrize("block_rows", [1, 4])
def test_expert_ffn_haq_smoothing_and_w8a8(block_rows):
    rng = np.random.default_rng(5)
    D, F, S, blocks = 256, 192, 3, 5
    w8a8 = QuantFormat(8, 128, True, act_bits=8, smooth=True)
    gu = _pool(rng, S, D, 2 * F, w8a8, smooth=True)
    dn = _pool(rng, S, F, D, QuantFormat(8, 128, True, act_bits=8))
    rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
    _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows)
    smooth_int4 = QuantFormat(4, 64, False, smooth=True)
    gu = _pool(rng, S, D, 2 * F, smooth_int4, smooth=True)
    dn = _pool(rng, S, F, D, QuantFormat(4, 64, False))
    _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows)


def _tiers_reference(h, token, slot, tier, pools, activation, int8_dot):
    """Each pool's assignments on the XLA reference, the rest zero, added."""
    out = 0
    for t, (gu, dn, gu_bias, dn_bias) in enumerate(pools):
        out = out + expert_ffn_reference(h[token], jnp.where(tier == t, slot, -1), gu, dn, block_rows=1,
                                         gate_up_bias=gu_bias, down_bias=dn_bias, activation=activation,
                                         int8_dot=int8_dot)
    return out


def _compare_tiers(h, token, slot, tier, pools, activation=SILU, int8_dot=False):
    kw = dict(activation=activation, int8_dot=int8_dot)
    y = np.asarray(jax.jit(lambda h, t, s, r, p: ops.routed_expert_ffn_tiers(h, t, s, r, p, **kw))(
        h, token, slot, tier, pools))
    ref = np.asarray(optimised_jit(lambda h, t, s, r, p: _tiers_reference(h, t, s, r, p, **kw))(
        h, token, slot, tier, pools))
    _close(y, ref, int8_dot)
    assert (y[np.asarray(slot) < 0] == 0).all()
    return y


@pytest.mark.parametrize("case", ["one pool", "int8 dot", "two pools", "smoothed"])
def test_routed_ffn_sums_each_tokens_rows_with_their_combine_weights(case):
    """With combine weights the routed kernels return each token's weighted sum of its assignments'
    rows ([N, D], what the MoE layer adds), not the rows: k assignments per token in any order, some
    inactive, more rows than one of the kernel's 512-row chunks, against the rows the kernel returns
    without weights summed in float64."""
    rng = np.random.default_rng(17)
    D, F, S, N, k = 128, 64, 5, 300, 4
    smoothed = case == "smoothed"
    fmt = QuantFormat(4, 64, False, smooth=True) if smoothed else FORMATS["int4"]
    pools = [(_pool(rng, S, D, 2 * F, fmt, smooth=smoothed), _pool(rng, S, F, D, FORMATS["int4"]), None, None)]
    if case == "two pools":
        pools.append((_pool(rng, S, D, 2 * F, FORMATS["int2"]), _pool(rng, S, F, D, FORMATS["int2"]), None, None))
    h = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
    order = rng.permutation(N * k)
    token = jnp.asarray((order // k).astype(np.int32))
    slot = rng.integers(0, S, N * k)
    slot[rng.random(N * k) < 0.1] = -1
    slot = jnp.asarray(slot.astype(np.int32))
    tier = jnp.asarray(rng.integers(0, len(pools), N * k).astype(np.int32))
    weight = jnp.asarray(rng.random(N * k).astype(np.float32))
    int8_dot = case == "int8 dot"
    if case == "two pools":
        run = jax.jit(lambda w: ops.routed_expert_ffn_tiers(h, token, slot, tier, pools, int8_dot=int8_dot, weight=w))
    else:
        gu, dn = pools[0][:2]
        run = jax.jit(lambda w: ops.routed_expert_ffn(h, token, slot, gu, dn, int8_dot=int8_dot, weight=w))
    rows = np.asarray(run(None), np.float64)
    want = np.zeros((N, D))
    np.add.at(want, np.asarray(token), np.asarray(weight, np.float64)[:, None] * rows)
    got = np.asarray(run(weight))
    assert got.shape == (N, D) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("int8_dot", [False, True])
def test_routed_ffn_over_several_pools_runs_each_assignment_at_its_own(int8_dot):
    """One native call for every tier of a layer (DyMoE's and DynaExq's hi and lo pools): int4, int2
    and bf16 pools at Qwen3-30B-A3B's widths, decode and prefill-sized assignment lists, each row as
    its own pool's expert computes it; with the calls counted, one native call for all of them."""
    rng = np.random.default_rng(13)
    D, F, S = QWEN3.hidden, QWEN3.inner, 3
    pools = [(_pool(rng, S, D, 2 * F, FORMATS[t]), _pool(rng, S, F, D, FORMATS[t]), None, None)
             for t in ("int4", "int2", "bf16")]
    for A, N in ((8, 1), (48, 12)):
        h = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
        token = jnp.asarray(rng.integers(0, N, A).astype(np.int32))
        slot = rng.integers(0, S, A).astype(np.int32)
        slot[rng.random(A) < 0.2] = -1
        tier = jnp.asarray(rng.integers(0, len(pools), A).astype(np.int32))
        _compare_tiers(h, token, jnp.asarray(slot), tier, pools, int8_dot=int8_dot)
    hlo = jax.jit(lambda h, t, s, r, p: ops.routed_expert_ffn_tiers(h, t, s, r, p, int8_dot=int8_dot)).lower(
        h, token, jnp.asarray(slot), tier, pools).as_text()
    assert hlo.count(native.ROUTED_FFN_TIERS) == 1 and hlo.count(native.ROUTED_FFN + '"') == 0


@pytest.mark.parametrize("layout", ["k by n", "cpu layout"])
def test_a_tokens_experts_in_one_pass_each_down_product_reads_its_own_finished_activation(layout):
    """The routed call runs gate/up and down in one task list: whoever finishes an expert's last
    gate/up task computes its activation, and its down tasks wait for it. One to eight experts of
    one token at Qwen3-30B-A3B's widths (one expert's gate/up split over K into pieces summed
    before its activation in [K, N]; cut into runs of tiles in the CPU layout), an int4 and an int2
    pool in one call, float inputs and the int8 dot: each as the reference computes it."""
    rng = np.random.default_rng(29)
    D, F, S = QWEN3.hidden, QWEN3.inner, 4
    shape = tile if layout == "cpu layout" else (lambda w: w)
    pools = [(shape(_pool(rng, S, D, 2 * F, FORMATS[t])), shape(_pool(rng, S, F, D, FORMATS[t])), None, None)
             for t in ("int4", "int2")]
    h = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    for A in (1, 2, 8):
        token = jnp.zeros(A, jnp.int32)
        slot = jnp.asarray(rng.integers(0, S, A).astype(np.int32))
        tier = jnp.asarray((np.arange(A) % 2).astype(np.int32))
        for int8_dot in (False, True):
            _compare_tiers(h, token, slot, tier, pools, int8_dot=int8_dot)
            _compare_routed(jnp.repeat(h, A, axis=0), slot, *pools[0][:2], int8_dot=int8_dot)


def test_routed_ffn_over_several_pools_with_biases_and_inputs_of_their_own():
    """Per-pool biases and a clamped activation in the one call; a W8A8 pool (its inputs rounded per
    token) beside an int4 one runs a call per pool and still gives each row its own pool's result."""
    rng = np.random.default_rng(17)
    D, F, S, A = 256, 192, 2, 12
    h = jnp.asarray(rng.standard_normal((4, D)).astype(np.float32) * 3)
    token = jnp.asarray(rng.integers(0, 4, A).astype(np.int32))
    slot = jnp.asarray(rng.integers(0, S, A).astype(np.int32))
    tier = jnp.asarray(rng.integers(0, 2, A).astype(np.int32))
    biased = [(_pool(rng, S, D, 2 * F, FORMATS[t]), _pool(rng, S, F, D, FORMATS[t]),
               jnp.asarray(rng.standard_normal((S, 2 * F)).astype(np.float32)),
               jnp.asarray(rng.standard_normal((S, D)).astype(np.float32))) for t in ("int4", "int8")]
    _compare_tiers(h, token, slot, tier, biased, activation=CLAMPED)
    w8a8 = QuantFormat(8, 128, True, act_bits=8)
    mixed = [(_pool(rng, S, D, 2 * F, w8a8), _pool(rng, S, F, D, w8a8), None, None),
             (_pool(rng, S, D, 2 * F, FORMATS["int4"]), _pool(rng, S, F, D, FORMATS["int4"]), None, None)]
    _compare_tiers(h, token, slot, tier, mixed)


def test_ragged_widths_and_padded_groups():
    """K not a multiple of the group, N not a multiple of the 64-column tile."""
    rng = np.random.default_rng(3)
    D, F, S = 100, 72, 2
    for fmt in (FORMATS["int4"], FORMATS["int8"], None):
        gu, dn = _pool(rng, S, D, 2 * F, fmt), _pool(rng, S, F, D, fmt)
        for block_rows, blocks in ((1, 5), (4, 4)):
            rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
            _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows)


@pytest.mark.parametrize("int8_dot", [False, True])
def test_more_rows_than_a_chunk_split_runs_and_gaps_change_nothing(int8_dot):
    """A prefill's routed rows run in chunks of 512 (cpu_kernels/src/kernels.cc): 1,320 rows, one
    expert's run of about 800 of them (split between chunks), empty blocks between runs."""
    rng = np.random.default_rng(3)
    D, F, S, block_rows, blocks = 128, 64, 3, 4, 330
    gu, dn = _pool(rng, S, D, 2 * F, FORMATS["int4"]), _pool(rng, S, F, D, FORMATS["int4"])
    bs = np.sort(rng.choice(S, blocks, p=[0.6, 0.3, 0.1])).astype(np.int32)
    bs[rng.random(blocks) < 0.1] = -1
    assert (bs == 0).sum() * block_rows > 512 + 64 and (bs < 0).sum() > 10
    rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
    _compare(rows, jnp.asarray(bs), gu, dn, block_rows, int8_dot=int8_dot)


def _groups_int8(x, group):
    """The int8 dot's inputs in numpy float32 (IEEE division, round half to even), as the kernel forms them."""
    m, k = x.shape
    xp = np.zeros((m, -(-k // group) * group), np.float32)
    xp[:, :k] = x
    g = xp.reshape(m, -1, group)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    step = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(g / step), -127, 127)
    return (codes * step).astype(np.float32).reshape(m, -1)[:, :k]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 2048, 1536), (3, 200, 100), (5, 768, 2048), (9, 2880, 128), (40, 96, 64),
                                   (1, 600, 4200), (4, 1100, 520), (33, 2048, 1536)])
def test_int8_dot_matmul_multiplies_the_int8_inputs(name, m, k, n):
    """The int8 dot (integer sums for any number of rows, prefill's too: VNNI, or under AVX2 for codes of
    up to four bits; the float path elsewhere) is x on its per-group int8 grid times the weight; a bf16
    weight takes x rounded to bf16 (the AVX-512 BF16 dot's inputs, where the CPU has it)."""
    rng = np.random.default_rng(m * 100 + k)
    w = _weight(rng, k, n, FORMATS[name])
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x, w: ops.matmul(x, w, int8_dot=True))(jnp.asarray(x), w))
    if FORMATS[name] is None:
        xq = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    else:
        xq = _groups_int8(x, FORMATS[name].group_size)
    ref = xq.astype(np.float64) @ _dense(w)
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max() + 1e-7
    # and it is the rounded inputs it multiplied, close to the float ones
    exact = x.astype(np.float64) @ _dense(w)
    assert 0 < np.abs(y - exact).max() <= 2e-2 * np.abs(exact).max()
    if FORMATS[name] is not None:
        ref_jnp = np.asarray(quantize_groups(jnp.asarray(x), FORMATS[name].group_size))
        # the XLA reference's grid: the same codes (its step may differ in the last bit)
        assert np.abs(ref_jnp - xq).max() <= 1e-6 * np.abs(xq).max()


def _six_bit_weight(rng, k, n, group, scale_bits=16):
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    return jax.tree.map(jnp.asarray, planes(quantize_rtn(w, QuantFormat(6, group, False, scale_bits=scale_bits))))


# float16 scales in each group size; 8-bit ones (codes on per-column bases, the low plane's) in two
@pytest.mark.parametrize("group,scale_bits", [(32, 16), (64, 16), (128, 16), (32, 8), (64, 8)])
# (1, 2048, 1536) and (5, 768, 2048): one row and the many-row path, [K, N] and tiled; (40, 256, 192): rows in
# blocks; (3, 200, 100) and (1, 600, 4200): a ragged last tile (the two planes' products) and K not whole groups
@pytest.mark.parametrize("m,k,n", [(1, 2048, 1536), (5, 768, 2048), (40, 256, 192), (3, 200, 100), (1, 600, 4200)])
def test_a_six_bit_weight_multiplies_as_the_sum_of_its_planes(group, scale_bits, m, k, n):
    """A six-bit weight (the int6 head: an int4 and an int2 plane) under the int8 dot, in one pass over
    both planes' codes, is x on its per-group int8 grid times the weight the two planes add up to; and
    without the int8 dot, x times that weight."""
    rng = np.random.default_rng(m * 10 + group)
    w = _six_bit_weight(rng, k, n, group, scale_bits)
    assert (w.low.scales.dtype == jnp.uint8) == (scale_bits == 8)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = _groups_int8(x, group).astype(np.float64) @ _dense(w)
    exact = x.astype(np.float64) @ _dense(w)
    for weight in (w, tile(w)):
        y = np.asarray(jax.jit(lambda x, w: ops.matmul(x, w, int8_dot=True))(jnp.asarray(x), weight))
        assert y.shape == (m, n) and np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()
        y = np.asarray(jax.jit(ops.matmul)(jnp.asarray(x), weight))
        assert np.abs(y - exact).max() <= 2e-6 * np.abs(exact).max()


def test_the_six_bit_pass_reads_the_low_planes_scales_only():
    """Where the int8 dot takes every tile (AVX-512 VNNI), a six-bit weight is one pass that applies the
    low plane's scales to the whole code (the high plane's are 16 times those): NaN in the high plane's
    scales changes nothing there, where the two planes' products (a narrower CPU's path) read them."""
    if not native.loaded() or native.isa() != "avx512-vnni":
        pytest.skip("needs the native kernels on a CPU with AVX-512 VNNI")
    rng = np.random.default_rng(3)
    w = tile(_six_bit_weight(rng, 2048, 768, 64))
    np.testing.assert_array_equal(np.asarray(w.high.scales, np.float32), 16 * np.asarray(w.low.scales, np.float32))
    spoiled = dataclasses.replace(w, high=dataclasses.replace(w.high, scales=jnp.full_like(w.high.scales, jnp.nan)))
    x = jnp.asarray(rng.standard_normal((2, 2048)).astype(np.float32))
    run = jax.jit(lambda x, w: ops.matmul(x, w, int8_dot=True))
    np.testing.assert_array_equal(np.asarray(run(x, spoiled)), np.asarray(run(x, w)))
    with native.using_isa("avx2"):
        assert np.isnan(np.asarray(run(x, spoiled))).all()
        avx2 = np.asarray(run(x, w))
    ref = _groups_int8(np.asarray(x), 64).astype(np.float64) @ _dense(w)
    assert np.abs(avx2 - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.mark.parametrize("tier", ["int8", "int4", "int3", "int2"])
def test_int8_dot_expert_ffn_at_real_widths(tier):
    """Qwen3-30B-A3B's expert (D 2048, F 768) and GPT-OSS-20B's (D = F = 2880, biases, clamped
    SwiGLU) under the int8 dot against the reference with the same per-group int8 inputs."""
    rng = np.random.default_rng(21)
    D, F, S = QWEN3.hidden, QWEN3.inner, 3
    gu, dn = _pool(rng, S, D, 2 * F, FORMATS[tier]), _pool(rng, S, F, D, FORMATS[tier])
    for block_rows, blocks in ((1, 8), (16, 3)):
        rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
        _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows, int8_dot=True)
    D = F = 2880
    gu, dn = _pool(rng, 2, D, 2 * F, FORMATS[tier]), _pool(rng, 2, F, D, FORMATS[tier])
    gu_bias = jnp.asarray(rng.standard_normal((2, 2 * F)).astype(np.float32))
    dn_bias = jnp.asarray(rng.standard_normal((2, D)).astype(np.float32))
    rows = jnp.asarray(rng.standard_normal((4, D)).astype(np.float32) * 3)
    _compare(rows, _layout(rng, 2, 1, 4), gu, dn, 1, gu_bias, dn_bias, CLAMPED, int8_dot=True)


def test_int8_dot_leaves_w8a8_and_smoothing_as_they_are():
    """W8A8 weights keep their own per-token grid (the int8 dot does not apply); smoothed int4 weights
    quantize the smoothed inputs."""
    rng = np.random.default_rng(5)
    D, F, S, blocks = 256, 192, 3, 5
    rows = jnp.asarray(rng.standard_normal((blocks, D)).astype(np.float32))
    gu = _pool(rng, S, D, 2 * F, QuantFormat(8, 128, True, act_bits=8, smooth=True), smooth=True)
    dn = _pool(rng, S, F, D, QuantFormat(8, 128, True, act_bits=8))
    bs = _layout(rng, S, 1, blocks)
    with_dot = np.asarray(ops.expert_ffn(rows, bs, gu, dn, block_rows=1, int8_dot=True))
    assert (with_dot == np.asarray(ops.expert_ffn(rows, bs, gu, dn, block_rows=1))).all()
    gu = _pool(rng, S, D, 2 * F, QuantFormat(4, 64, False, smooth=True), smooth=True)
    dn = _pool(rng, S, F, D, QuantFormat(4, 64, False))
    _compare(rows, bs, gu, dn, 1, int8_dot=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_write_rows_writes_in_place_what_a_scatter_into_pages_writes(dtype, monkeypatch):
    """Rows written into a paged pool at each row's logical slots: pages in any order, slots past the
    row's pages or in an absent page (-1) skipped; the native kernel in place and the XLA scatter
    write the same."""
    rng = np.random.default_rng(2)
    P, H, page, w, B, n = 9, 2, 4, 8, 3, 3
    pool = np.asarray(jnp.asarray(rng.integers(-60, 60, (P, H, page, w)), dtype))
    table = rng.permutation(P)[: B * n].reshape(B, n).astype(np.int32)
    table[1, 2] = -1  # row 1's last page is absent
    for T, start in ((1, [0, 7, 11]), (5, [0, 6, 9])):  # 9 + 5 > 12 slots a row: the last two skipped
        new = np.asarray(jnp.asarray(rng.integers(-60, 60, (B, H, T, w)), dtype))
        want = np.array(pool)
        for b in range(B):
            for t in range(T):
                s = start[b] + t
                if s < n * page and table[b, s // page] >= 0:
                    want[table[b, s // page], :, s % page] = new[b, :, t]
        start = jnp.asarray(start, jnp.int32)
        got = jax.jit(ops.write_rows, donate_argnums=0)(jnp.array(pool), jnp.asarray(new), start, jnp.asarray(table))
        assert got.dtype == dtype
        assert np.asarray(got).tobytes() == want.tobytes()
        with monkeypatch.context() as m:
            m.setattr(ops, "available", lambda: False)
            fallback = jax.jit(ops.write_rows)(jnp.asarray(pool), jnp.asarray(new), start, jnp.asarray(table))
        assert np.asarray(fallback).tobytes() == want.tobytes()
        assert not (want == pool).all()  # something was written
        pool = want


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.uint8])
def test_write_slots_copies_record_bytes_into_pool_rows_in_place(dtype, monkeypatch):
    """Rows of a pool replaced by a leaf of raw records (at its offset), slots outside the pool skipped;
    the native kernel and the XLA path write the same bytes."""
    rng = np.random.default_rng(3)
    S, shape = 6, (4, 8)
    row_bytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    pool = rng.integers(0, 60, (S, *shape)).astype(dtype)  # small values: every bit pattern a plain number
    records = rng.integers(0, 60, (3, 16 + row_bytes + 8), dtype=np.uint8)
    slots = np.array([4, -1, 1], np.int32)
    want = np.array(pool)
    for record, slot in zip(records, slots):
        if slot >= 0:
            want[slot] = record[16 : 16 + row_bytes].view(want.dtype).reshape(shape)
    write = jax.jit(lambda p, r, s: ops.write_slots(p, r, s, offset=16), donate_argnums=0)
    got = write(jnp.asarray(pool), jnp.asarray(records), jnp.asarray(slots))
    assert np.asarray(got).tobytes() == want.tobytes()
    monkeypatch.setattr(ops, "available", lambda: False)
    fallback = jax.jit(lambda p, r, s: ops.write_slots(p, r, s, offset=16))(jnp.asarray(pool), jnp.asarray(records),
                                                                            jnp.asarray(slots))
    assert np.asarray(fallback).tobytes() == want.tobytes()


def test_copy_records_copies_each_leafs_bytes_of_store_rows_by_index_and_skips_out_of_range_ones():
    """The in-step fetch on the CPU: leaf i's row slots[j] = store row rows[j]'s bytes at leaf i's
    offset, every leaf in one call; a slot or a row out of range (an unused fetch: -1) leaves the
    leaves as they were."""
    rng = np.random.default_rng(5)
    S, E = 5, 7
    shapes, dtypes, offsets = [(3, 4), (2,)], [np.float16, np.int32], [8, 40]
    leaves = [rng.integers(0, 60, (S, *shape)).astype(dtype) for shape, dtype in zip(shapes, dtypes)]
    store = rng.integers(0, 60, (E, 52), dtype=np.uint8)
    rows = np.array([6, 2, -1, 3, 9], np.int32)
    slots = np.array([0, 3, 1, -1, 2], np.int32)
    wants = [np.array(leaf) for leaf in leaves]
    for want, shape, dtype, offset in zip(wants, shapes, dtypes, offsets):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        for r, s in zip(rows, slots):
            if 0 <= r < E and 0 <= s < S:
                want[s] = store[r, offset : offset + nbytes].view(dtype).reshape(shape)
    copy = jax.jit(lambda ls, st, r, s: ops.copy_records(ls, st, r, s, offsets), donate_argnums=0)
    got = copy([jnp.asarray(leaf) for leaf in leaves], jnp.asarray(store), jnp.asarray(rows), jnp.asarray(slots))
    for g, want, leaf in zip(got, wants, leaves):
        assert np.asarray(g).tobytes() == want.tobytes()
        assert not (want == leaf).all()  # something was written


@pytest.fixture(scope="module")
def tiny_int4(tiny_hf_dir, tmp_path_factory):
    return convert_checkpoint(tiny_hf_dir, tmp_path_factory.mktemp("cpu_int4") / "m", tiers="bf16,int4",
                              progress=False)


@pytest.mark.parametrize("tier", ["bf16", "int4"])
def test_whole_model_greedy_tokens_equal_the_xla_path(tiny_int4, tier):
    prompt = "def fibonacci(n):"
    outs = {}
    for backend in ("cpu", "xla"):
        model = jmoe.load(tiny_int4, tier=tier, kernel_backend=backend)
        outs[backend] = jmoe.generate(model, prompt, max_new_tokens=24)
    assert outs["cpu"] == outs["xla"]


def test_cpu_dot_int8_runs_bf16_experts_on_bf16_inputs_as_the_xla_path_does(tiny_int4):
    """The bf16 tier under cpu_dot="int8" (the experts' inputs rounded to bf16, the AVX-512 BF16 dot
    for a long prompt's many rows an expert) gives the XLA path's logits under the same setting over
    a whole sequence (the same top token wherever its lead is clear), nearer than those of float
    inputs. Not bit for bit, nor much nearer: the bf16 dense projections round their inputs too, so
    a last-bit difference between the two paths' experts moves some of the next layer's inputs
    across a bf16 rounding boundary."""
    text = (Path(__file__).parent / "data" / "prose.dev.txt").read_text()
    logits = {}
    for backend, cpu_dot in (("cpu", "int8"), ("xla", "int8"), ("cpu", "float")):
        model = jmoe.load(tiny_int4, tier="bf16", kernel_backend=backend, cpu_dot=cpu_dot)
        sequence = model.tokenizer.encode(text)[:320]  # about 40 rows an expert (top-4 of 32)
        logits[backend, cpu_dot] = np.asarray(jmoe.forward(model, sequence))
    want = logits["xla", "int8"]
    near, far = (np.abs(logits[key] - want).mean() for key in (("cpu", "int8"), ("cpu", "float")))
    assert near * 1.5 < far, (near, far)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1
    assert clear.sum() >= len(want) // 2
    assert (logits["cpu", "int8"].argmax(-1) == want.argmax(-1))[clear].all()


@pytest.fixture(scope="module")
def tiny_dense_int4(tiny_hf_dir, tmp_path_factory):
    return convert_checkpoint(tiny_hf_dir, tmp_path_factory.mktemp("cpu_dense_int4") / "m", tiers="int4",
                              dense_tier="int4", progress=False)


def test_cpu_dot_int8_gives_the_logits_of_its_xla_reference(tiny_dense_int4, monkeypatch):
    """load(cpu_dot="int8") through the native kernels (experts and the int4 dense tier's projections)
    against the XLA reference with the same int8 inputs, teacher-forced over one sequence; an unknown
    cpu_dot is refused.

    The two are not bit-identical (the kernel sums integer products per group, the reference
    multiplies the dequantized values in float): a last-bit difference can move an activation
    across a rounding boundary of the next layer's int8 grid, and eight layers on, a near tie of the
    logits can go either way, differently on each instruction set XLA compiles the reference for.
    So: the same top token wherever the reference's lead is clear, and logits close everywhere
    (a kernel that misread its weights or inputs would be far off)."""
    from jmoe.decoding.engine import clear_compiled
    from jmoe.errors import InputError

    with pytest.raises(InputError, match="cpu_dot"):
        jmoe.load(tiny_dense_int4, cpu_dot="int9")
    native = jmoe.load(tiny_dense_int4, tier="int4", cpu_dot="int8")
    assert native.residency.state.int8_dot
    prompt = native.tokenizer.encode("def fibonacci(n):")
    sequence = list(prompt) + list(jmoe.generate(native, prompt, max_new_tokens=24))
    logits = {"native": np.asarray(jmoe.forward(native, sequence))}
    monkeypatch.setattr(ops, "available", lambda: False)
    clear_compiled()
    logits["xla"] = np.asarray(jmoe.forward(jmoe.load(tiny_dense_int4, tier="int4", cpu_dot="int8"), sequence))
    clear_compiled()
    got, want = logits["native"], logits["xla"]
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= len(sequence) // 2
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()
    assert np.abs(got - want).mean() < 0.05 and np.abs(got - want).max() < 1.0
