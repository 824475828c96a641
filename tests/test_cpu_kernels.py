"""The native CPU kernels against the XLA reference: every tier, every expert feature, real widths."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmoe
from convert import convert_checkpoint
from convert.quantizers.rtn import quantize_rtn
from cpu_kernels import native, ops
from pallas_kernels.expert_ffn import default_backend, expert_ffn, expert_ffn_reference
from pallas_kernels.glu import SILU, GatedActivation
from pallas_kernels.qarray import QuantFormat, dequantize

FORMATS = {
    "bf16": None,
    "int8": QuantFormat(8, 128, True),
    "int4": QuantFormat(4, 64, False),
    "int2": QuantFormat(2, 64, False),
    "int4-sym-g32": QuantFormat(4, 32, True),
    "int8-asym-g64": QuantFormat(8, 64, False),
}
CLAMPED = GatedActivation("clamped_swiglu", alpha=1.702, limit=7.0)


def test_native_library_is_built_and_chosen_on_the_cpu():
    if os.environ.get("JMOE_CPU_KERNELS", "on").lower() in ("off", "0", "false"):
        pytest.skip("native kernels switched off by JMOE_CPU_KERNELS")
    assert native.loaded(), "cpu_kernels._native was not built by the package's build"
    assert native.isa() in ("avx512", "avx2", "portable")
    assert default_backend() == "cpu"


def _weight(rng, k, n, fmt, act_scale=None):
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    if fmt is None:
        return jnp.asarray(w.astype(ml_dtypes.bfloat16))
    if act_scale is not None:
        w = w / act_scale[:, None]
    return jax.tree.map(jnp.asarray, quantize_rtn(w, fmt, act_scale=act_scale))


def _dense(w):
    return np.asarray(dequantize(w, jnp.float32) if hasattr(w, "fmt") else w.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 256, 128), (2, 2048, 1536), (3, 200, 100), (9, 768, 2048), (40, 96, 64)])
def test_matmul_matches_float64(name, m, k, n):
    rng = np.random.default_rng(m * 1000 + k)
    w = _weight(rng, k, n, FORMATS[name])
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(jax.jit(ops.matmul)(jnp.asarray(x), w))
    ref = x.astype(np.float64) @ _dense(w)
    assert y.dtype == np.float32 and y.shape == (m, n)
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max() + 1e-7


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


def _compare(rows, bs, gu, dn, block_rows, gu_bias=None, dn_bias=None, activation=SILU):
    """The block kernel, and the routed kernel on the same rows (one assignment per row), against the reference."""
    _compare_routed(rows, jnp.repeat(bs, block_rows), gu, dn, gu_bias, dn_bias, activation)
    kw = dict(block_rows=block_rows, gate_up_bias=gu_bias, down_bias=dn_bias, activation=activation)
    native_y = jax.jit(lambda r, b, g, d: expert_ffn(r, b, g, d, backend="cpu", **kw))(rows, bs, gu, dn)
    ref = jax.jit(lambda r, b, g, d: expert_ffn_reference(r, b, g, d, **kw))(rows, bs, gu, dn)
    native_y, ref = np.asarray(native_y), np.asarray(ref)
    scale = np.abs(ref).max()
    assert scale > 0
    assert np.abs(native_y - ref).max() <= 1e-5 * scale
    empty = np.repeat(np.asarray(bs) < 0, block_rows)
    assert (native_y[empty] == 0).all()


def _compare_routed(h, row_slot, gu, dn, gu_bias=None, dn_bias=None, activation=SILU, shuffle=True):
    """Assignments in any order, tokens repeated: out[a] = expert row_slot[a] on h[token[a]]."""
    A = h.shape[0]
    rng = np.random.default_rng(A)
    order = rng.permutation(A) if shuffle else np.arange(A)
    token, slot = jnp.asarray(order.astype(np.int32)), row_slot[order]
    kw = dict(gate_up_bias=gu_bias, down_bias=dn_bias, activation=activation)
    y = np.asarray(jax.jit(lambda h, t, s, g, d: ops.routed_expert_ffn(h, t, s, g, d, **kw))(h, token, slot, gu, dn))
    ref = np.asarray(jax.jit(lambda h, t, s, g, d: expert_ffn_reference(h[t], s, g, d, block_rows=1, **kw))(
        h, token, slot, gu, dn))
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    assert (y[np.asarray(slot) < 0] == 0).all()


@pytest.mark.parametrize("tier", ["bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("block_rows,blocks", [(1, 8), (16, 6)])
def test_expert_ffn_qwen3_widths(tier, block_rows, blocks):
    """Qwen3-30B-A3B's expert: D = 2048, F = 768, SwiGLU, no biases."""
    rng = np.random.default_rng(7)
    D, F, S = 2048, 768, 3
    gu, dn = _pool(rng, S, D, 2 * F, FORMATS[tier]), _pool(rng, S, F, D, FORMATS[tier])
    rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
    _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows)


@pytest.mark.parametrize("tier", ["bf16", "int8", "int4", "int2"])
def test_expert_ffn_gpt_oss_widths_with_biases_and_clamped_swiglu(tier):
    """GPT-OSS-20B's expert: D = F = 2880, float32 biases, clamped SwiGLU; decode and prefill blocks."""
    rng = np.random.default_rng(11)
    D, F, S = 2880, 2880, 2
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


def test_ragged_widths_and_padded_groups():
    """K not a multiple of the group, N not a multiple of the 64-column tile."""
    rng = np.random.default_rng(3)
    D, F, S = 100, 72, 2
    for fmt in (FORMATS["int4"], FORMATS["int8"], None):
        gu, dn = _pool(rng, S, D, 2 * F, fmt), _pool(rng, S, F, D, fmt)
        for block_rows, blocks in ((1, 5), (4, 4)):
            rows = jnp.asarray(rng.standard_normal((blocks * block_rows, D)).astype(np.float32))
            _compare(rows, _layout(rng, S, block_rows, blocks), gu, dn, block_rows)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_rows_writes_in_place_what_dynamic_update_slice_writes(dtype):
    rng = np.random.default_rng(2)
    B, H, S, w = 3, 2, 16, 8
    cache = jnp.asarray(rng.standard_normal((B, H, S, w)), dtype)
    for T, start in ((1, [0, 7, 15]), (4, [0, 13, 5])):  # 13 + 4 > 16: clamped, as dynamic_update_slice is
        new = jnp.asarray(rng.standard_normal((B, H, T, w)), dtype)
        start = jnp.asarray(start, jnp.int32)
        put = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (0, s, 0)))
        want = np.asarray(put(cache, new, start).astype(jnp.float32))
        got = jax.jit(ops.write_rows, donate_argnums=0)(jnp.array(cache), new, start)
        assert got.dtype == dtype
        assert (np.asarray(got.astype(jnp.float32)) == want).all()


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
