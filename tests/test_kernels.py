"""Pallas grouped expert FFN vs its jnp reference: interpret-mode parity on CPU for every tier,
lowering for CUDA (Triton lowering errors fail here without a GPU), and compiled runs on a GPU."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.quantizers.rtn import quantize_rtn
from jmoe.kernels import expert_ffn, expert_ffn_tiers
from jmoe.kernels.expert_ffn.reference import expert_ffn_reference
from jmoe.kernels.shapes import EXPERT_SHAPES
from jmoe.layers.experts import GATHER_MAX_ASSIGNMENTS, ExpertState, Routing, run_experts
from jmoe.quant import ExpertWeights
from jmoe.tiers import TIER_CODES
from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import QArray, QuantFormat, pack_codes, template
from pallas_kernels import expert_ffn_pallas, expert_ffn_pallas_tiers, supports, supports_tiers
from pallas_kernels.expert_ffn_pallas import offsets_fit

# real models' widths (jmoe/kernels/shapes.py)
QWEN3_30B = dict(D=EXPERT_SHAPES["qwen3-30b-a3b"].hidden, F=EXPERT_SHAPES["qwen3-30b-a3b"].inner)
MIXTRAL = dict(D=EXPERT_SHAPES["mixtral-8x7b"].hidden, F=EXPERT_SHAPES["mixtral-8x7b"].inner)
GPT_OSS = dict(D=EXPERT_SHAPES["gpt-oss-20b"].hidden, F=EXPERT_SHAPES["gpt-oss-20b"].inner)

SLOTS = 7  # odd on purpose: nothing may assume a power-of-two pool
DECODE_SLOTS = (3, -1, 6, 0, 3, 5)  # one row per block; repeats, an empty block, the last slot
PREFILL_SLOTS = (6, -1, 2)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.5e-2}  # relative (Frobenius) error vs the reference
# W8A8 re-quantizes h per token to int8, so a bf16 rounding difference in h becomes a whole int8 step:
# the bf16 reference itself sits ~1.5-2% from its float32 run.
W8A8_BF16_TOLERANCE = 3e-2


# ----------------------------------------------------------------------------- pools


def rtn_pool(rng, K: int, N: int, fmt: QuantFormat) -> QArray:
    """RTN-quantized random weights; with fmt.smooth, a random act_scale folded out of each slot's weights.

    Groups run along K, so quantizing the slots side by side as one [K, S * N] weight gives each
    slot's own quantization in one call.
    """
    w = rng.normal(size=(SLOTS, K, N)).astype(np.float32) * 0.1
    act_scale = rng.uniform(0.5, 2.0, size=(SLOTS, K)).astype(np.float32) if fmt.smooth else None
    if act_scale is not None:
        w = w / act_scale[:, :, None]
    q = quantize_rtn(np.concatenate(list(w), axis=1), dataclasses.replace(fmt, smooth=False))
    per_slot = lambda a: jnp.asarray(np.stack(np.split(np.asarray(a), SLOTS, axis=-1)))  # noqa: E731
    return QArray(
        values=per_slot(q.values),
        scales=per_slot(q.scales),
        offsets=None if q.offsets is None else per_slot(q.offsets),
        act_scale=None if act_scale is None else jnp.asarray(act_scale, jnp.float16),
        fmt=fmt,
        k=K,
        bases=None if q.bases is None else per_slot(q.bases),
    )


def random_code_pool(rng, K: int, N: int, fmt: QuantFormat) -> QArray:
    """Uniformly random codes (padding rows too: they must meet zero activations), scales, offsets."""
    kp, groups = fmt.padded_k(K), fmt.padded_k(K) // fmt.group_size
    codes = rng.integers(0, fmt.qmax + 1, size=(SLOTS, kp, N))
    scales = rng.uniform(0.5, 1.5, size=(SLOTS, groups, N)) * (0.2 / fmt.midpoint)
    offsets = None if fmt.symmetric else rng.normal(size=(SLOTS, groups, N)) * 0.05
    act_scale = rng.uniform(0.5, 2.0, size=(SLOTS, K)) if fmt.smooth else None
    f16 = lambda a: None if a is None else jnp.asarray(a, jnp.float16)  # noqa: E731
    if fmt.scale_bits == 8:  # random codes on random per-column bases
        codes8 = lambda: jnp.asarray(rng.integers(0, 256, size=(SLOTS, groups, N)), jnp.uint8)  # noqa: E731
        bases = np.stack([rng.uniform(0.5, 1.5, size=(SLOTS, N)) * 0.2 / 255, rng.uniform(0.5, 1.5, size=(SLOTS, N))
                          * 0.1 / 127], axis=1)
        return QArray(pack_codes(jnp.asarray(codes), fmt), codes8(), codes8(), None, fmt, K,
                      jnp.asarray(bases, jnp.float32))
    return QArray(pack_codes(jnp.asarray(codes), fmt), f16(scales), f16(offsets), f16(act_scale), fmt, K)


def plain_pool(rng, K: int, N: int) -> jax.Array:
    return jnp.asarray(rng.normal(size=(SLOTS, K, N)) * 0.1, jnp.bfloat16)


def make_pools(rng, fmt: QuantFormat | None, D: int, F: int, codes: str) -> tuple:
    """(gate_up [S, D, 2F], down [S, F, D]) at a tier; smoothing applies to gate_up only."""
    if fmt is None:
        return plain_pool(rng, D, 2 * F), plain_pool(rng, F, D)
    build = rtn_pool if codes == "rtn" else random_code_pool
    return build(rng, D, 2 * F, fmt), build(rng, F, D, dataclasses.replace(fmt, smooth=False))


def relative_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def fmt(bits, group, symmetric=True, **kw) -> QuantFormat:
    return QuantFormat(bits=bits, group_size=group, symmetric=symmetric, **kw)


# ----------------------------------------------------------------------------- interpret parity

# (format or None for the bf16 tier, D, F, block_rows, rows dtype, how codes are made)
PARITY_CASES = {
    "bf16-decode-f32": (None, 64, 96, 1, jnp.float32, "rtn"),
    "bf16-prefill-bf16": (None, 64, 48, 16, jnp.bfloat16, "rtn"),
    "int8-g128-decode-f32-k_pad": (fmt(8, 128), 128, 96, 1, jnp.float32, "rtn"),
    "int8-g32-prefill-bf16": (fmt(8, 32), 64, 64, 32, jnp.bfloat16, "random"),
    "int4-g64-asym-decode-bf16-k_pad": (fmt(4, 64, False), 64, 96, 1, jnp.bfloat16, "rtn"),
    "int4-g32-prefill-f32": (fmt(4, 32), 64, 48, 16, jnp.float32, "random"),
    "int2-g64-asym-decode-f32": (fmt(2, 64, False), 64, 96, 1, jnp.float32, "rtn"),
    "int2-g32-decode-bf16-odd_groups": (fmt(2, 32), 64, 96, 1, jnp.bfloat16, "random"),
    "int2-g32-asym-prefill-f32-two_groups_per_step": (fmt(2, 32, False), 64, 64, 16, jnp.float32, "random"),
    "int2-g128-asym-prefill-bf16": (fmt(2, 128, False), 128, 96, 16, jnp.bfloat16, "random"),
    # the int2 tier's default: groups of 32, 8-bit scales and offsets on per-column bases
    "int2-g32-s8-decode-bf16": (fmt(2, 32, False, scale_bits=8), 64, 96, 1, jnp.bfloat16, "rtn"),
    "int2-g32-s8-prefill-f32-two_groups_per_step": (fmt(2, 32, False, scale_bits=8), 64, 64, 16, jnp.float32,
                                                    "random"),
    "int4-g64-s8-decode-bf16": (fmt(4, 64, False, scale_bits=8), 64, 96, 1, jnp.bfloat16, "rtn"),  # --scale-bits 8
    # the int3 tier's default (as int2's, each group's codes in a 2-bit and a 1-bit section), and others
    "int3-g32-s8-decode-bf16": (fmt(3, 32, False, scale_bits=8), 64, 96, 1, jnp.bfloat16, "rtn"),
    "int3-g32-s8-prefill-f32-two_groups_per_step": (fmt(3, 32, False, scale_bits=8), 64, 64, 16, jnp.float32,
                                                    "random"),
    "int3-g64-decode-f32-k_pad": (fmt(3, 64), 64, 96, 1, jnp.float32, "random"),
    "int3-g128-asym-prefill-bf16": (fmt(3, 128, False), 128, 96, 16, jnp.bfloat16, "random"),
    "int4-smooth-decode-f32": (fmt(4, 64, False, smooth=True), 64, 96, 1, jnp.float32, "rtn"),
    "int4-smooth-prefill-bf16": (fmt(4, 32, smooth=True), 64, 48, 16, jnp.bfloat16, "random"),
    "w8a8-g128-decode-f32": (fmt(8, 128, act_bits=8), 128, 96, 1, jnp.float32, "rtn"),
    "w8a8-smooth-g64-prefill-bf16": (fmt(8, 64, act_bits=8, smooth=True), 64, 96, 16, jnp.bfloat16, "rtn"),
    "w8a8-g32-prefill-f32": (fmt(8, 32, act_bits=8), 64, 64, 32, jnp.float32, "random"),
}


def case_inputs(name: str, seed: int = 0):
    quant, D, F, block_rows, dtype, codes = PARITY_CASES[name]
    rng = np.random.default_rng(seed)
    gate_up, down = make_pools(rng, quant, D, F, codes)
    block_slot = jnp.asarray(DECODE_SLOTS if block_rows == 1 else PREFILL_SLOTS, jnp.int32)
    rows = jnp.asarray(rng.normal(size=(block_slot.shape[0] * block_rows, D)), dtype)
    return rows, block_slot, gate_up, down, block_rows


def native_cpu_kernel(block_rows: int):
    import cpu_kernels

    assert cpu_kernels.available()  # built by the package's install: the suite needs them
    return functools.partial(cpu_kernels.expert_ffn, block_rows=block_rows)


# Every implementation the shared cases run against without a GPU (the Mosaic kernel takes int4 decode only:
# MOSAIC_CASES, on a GPU).
IMPLEMENTATIONS = {
    "pallas-interpret": lambda block_rows: functools.partial(expert_ffn_pallas, block_rows=block_rows, interpret=True),
    "cpu-native": native_cpu_kernel,
}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_every_kernel_matches_the_reference_on_the_shared_cases(name, implementation):
    """PARITY_CASES, one list, against every implementation of the expert FFN on this machine (each
    runs every case: none refuses)."""
    rows, block_slot, gate_up, down, block_rows = case_inputs(name)
    assert supports(rows, gate_up, down, block_rows, interpret=True)
    kernel = jax.jit(IMPLEMENTATIONS[implementation](block_rows))
    reference = jax.jit(functools.partial(expert_ffn_reference, block_rows=block_rows))
    ours = kernel(rows, block_slot, gate_up, down)
    ref = reference(rows, block_slot, gate_up, down)
    assert ours.shape == ref.shape and ours.dtype == rows.dtype
    w8a8 = isinstance(gate_up, QArray) and gate_up.fmt.act_bits == 8
    tolerance = W8A8_BF16_TOLERANCE if w8a8 and rows.dtype == jnp.bfloat16 else TOLERANCE[rows.dtype.name]
    assert relative_error(ours, ref) < tolerance
    empty = np.repeat(np.asarray(block_slot) < 0, block_rows)
    assert np.all(np.asarray(ours, np.float32)[empty] == 0)  # empty blocks write zeros
    assert np.all(np.abs(np.asarray(ours, np.float32)[~empty]).max(axis=-1) > 0)


def test_supports_excludes_what_the_kernel_cannot_tile():
    rng = np.random.default_rng(1)
    rows = jnp.zeros((32, 64), jnp.float32)
    gate_up, down = make_pools(rng, fmt(2, 32), 64, 96, "random")
    assert supports(rows[:6], gate_up, down, block_rows=1)
    assert not supports(rows, gate_up, down, block_rows=16)  # F=96: 3 int2 groups of 8 packed rows, K < 16
    gate_up, down = make_pools(rng, None, 64, 96, "rtn")
    assert supports(rows, gate_up, down, block_rows=16, interpret=True)
    # compiled, float32 dots spill (bench/gpu_compile.py): float32 prefill runs the reference on a GPU
    assert not supports(rows, gate_up, down, block_rows=16)
    assert supports(rows.astype(jnp.bfloat16), gate_up, down, block_rows=16)
    assert supports(rows[:6], gate_up, down, block_rows=1)  # float32 decode compiles without spills
    assert not supports(rows, gate_up, down, block_rows=8, interpret=True)  # tl.dot needs M >= 16
    assert not supports(rows.astype(jnp.float16), gate_up, down, block_rows=16, interpret=True)
    gate_up, down = make_pools(rng, None, 64, 40, "rtn")
    assert not supports(rows, gate_up, down, block_rows=16, interpret=True)  # N tile of F=40 would be 8 wide


def test_dispatch_routes_to_the_kernel_or_falls_back():
    rows, block_slot, gate_up, down, block_rows = case_inputs("int4-g32-prefill-f32")
    call = functools.partial(expert_ffn, block_rows=block_rows)
    jaxpr = lambda backend: str(jax.make_jaxpr(functools.partial(call, backend=backend))(  # noqa: E731
        rows, block_slot, gate_up, down))
    assert "pallas_call" in jaxpr("interpret") and "pallas_call" not in jaxpr("xla")
    # unsupported inputs (int2/G32 prefill with an odd group count) run the reference
    rng = np.random.default_rng(2)
    gate_up, down = make_pools(rng, fmt(2, 32), 64, 96, "random")
    rows = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    slots = jnp.asarray([4, -1], jnp.int32)
    fallback = expert_ffn(rows, slots, gate_up, down, block_rows=16, backend="interpret")
    np.testing.assert_array_equal(fallback, expert_ffn_reference(rows, slots, gate_up, down, block_rows=16))
    with pytest.raises(ValueError, match="unknown kernel backend"):
        expert_ffn(rows, slots, gate_up, down, block_rows=16, backend="cuda")


def test_each_kernel_refuses_what_it_cannot_run_and_the_next_in_order_runs_it(monkeypatch):
    """A backend's kernels refuse inputs they do not take with NotImplementedError, before tracing
    anything; the entry points then run the next kernel in the backend's order (the reference last).
    Routed assignments go to the backends whose kernel takes them, else to the reference."""
    import cpu_kernels.ops
    from jmoe.kernels import routed_expert_ffn, takes_assignments
    from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic

    rows, block_slot, gate_up, down, block_rows = case_inputs("int4-g64-asym-decode-bf16-k_pad")
    call = dict(block_rows=block_rows)
    with pytest.raises(NotImplementedError, match="int8"):
        expert_ffn_pallas(rows, block_slot, gate_up, down, interpret=True, int8_dot=True, **call)
    with pytest.raises(NotImplementedError, match="int8"):
        expert_ffn_mosaic(rows, block_slot, gate_up, down, int8_dot=True, **call)
    with pytest.raises(NotImplementedError, match="shapes"):  # tl.dot needs M >= 16
        expert_ffn_pallas(jnp.zeros((16, rows.shape[1])), jnp.zeros((2,), jnp.int32), gate_up, down, block_rows=8,
                          interpret=True)
    int8_reference = expert_ffn_reference(rows, block_slot, gate_up, down, int8_dot=True, **call)
    for backend in ("interpret", "mosaic", "xla"):
        jaxpr = str(jax.make_jaxpr(functools.partial(expert_ffn, backend=backend, int8_dot=True, **call))(
            rows, block_slot, gate_up, down))
        assert "pallas_call" not in jaxpr  # a refusal leaves nothing of the kernel behind
        np.testing.assert_array_equal(expert_ffn(rows, block_slot, gate_up, down, backend=backend, int8_dot=True,
                                                 **call), int8_reference)
    assert takes_assignments("cpu") and not any(takes_assignments(b) for b in ("xla", "pallas", "interpret"))
    token = jnp.asarray([0, 2, 1, 2], jnp.int32)
    slot = jnp.asarray([3, 0, -1, 6], jnp.int32)
    routed_reference = expert_ffn_reference(rows[token], slot, gate_up, down, block_rows=1)
    monkeypatch.setattr(cpu_kernels.ops, "available", lambda: False)  # the native kernels refuse
    with pytest.raises(NotImplementedError, match="not loaded"):
        cpu_kernels.ops.expert_ffn(rows, block_slot, gate_up, down, **call)
    weight = jnp.asarray([0.5, 0.25, 2.0, 1.0], jnp.float32)
    summed = np.zeros((rows.shape[0], rows.shape[1]), np.float32)  # each token's weighted rows (slot -1: zeros)
    for a in range(4):
        summed[int(token[a])] += float(weight[a]) * np.asarray(routed_reference[a], np.float32)
    for backend in ("cpu", "xla", "interpret"):
        np.testing.assert_array_equal(routed_expert_ffn(rows, token, slot, gate_up, down, backend=backend),
                                      routed_reference)
        np.testing.assert_allclose(routed_expert_ffn(rows, token, slot, gate_up, down, backend=backend, weight=weight),
                                   summed, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(expert_ffn(rows, block_slot, gate_up, down, backend="cpu", **call),
                                  expert_ffn_reference(rows, block_slot, gate_up, down, **call))


# ----------------------------------------------------------------------------- model path


def small_expert_state(backend: str | None) -> tuple[ExpertState, int]:
    """One MoE layer, 6 experts: 0-2 in the bf16 pool, 3-4 in an int4 pool, 5 skipped."""
    rng = np.random.default_rng(3)
    D, F = 64, 48
    pools = {
        "bf16": ExpertWeights(*make_pools(rng, None, D, F, "rtn")),
        "int4": ExpertWeights(*make_pools(rng, fmt(4, 32, False), D, F, "rtn")),
    }
    tier = np.array([TIER_CODES["bf16"]] * 3 + [TIER_CODES["int4"]] * 2 + [0], np.int32)
    slot = np.array([4, 0, 6, 1, 3, 0], np.int32)
    state = ExpertState.from_codes(tier[None], slot[None], pools, backend)
    return state, D


@pytest.mark.parametrize("variant", ["swiglu", "biased-clamped"])
@pytest.mark.parametrize("tokens", [3, 40])  # decode (one row per assignment) and prefill (blocks of 32)
def test_routed_experts_run_the_kernel(tokens, variant):
    E, k = 6, 2
    rng = np.random.default_rng(tokens)
    ids = jnp.asarray(np.stack([rng.choice(E, size=k, replace=False) for _ in range(tokens)]), jnp.int32)
    routing = Routing(ids, jnp.asarray(rng.random(size=(tokens, k)), jnp.float32))
    valid = jnp.asarray(rng.random(tokens) > 0.2)
    make_state, activation = {"swiglu": (small_expert_state, SILU),
                              "biased-clamped": (biased_expert_state, CLAMPED)}[variant]
    outputs = {}
    for backend in ("interpret", "xla"):
        state, D = make_state(backend)
        h = jnp.asarray(np.random.default_rng(9).normal(size=(tokens, D)), jnp.float32)
        run = jax.jit(lambda h, r, v, s: run_experts(h, r, v, s.layer(0), activation=activation))
        outputs[backend] = run(h, routing, valid, state)
        if backend == "interpret":
            assert "pallas_call" in str(jax.make_jaxpr(run)(h, routing, valid, state))
    np.testing.assert_allclose(outputs["interpret"], outputs["xla"], rtol=1e-5, atol=1e-5)
    # invalid tokens get nothing (no bias leaks into padding)
    assert np.all(np.asarray(outputs["xla"])[~np.asarray(valid)] == 0)


# ----------------------------------------------------------------------------- lowering for CUDA

LOWERING_FORMATS = {
    "bf16": None,
    "int8-g128": fmt(8, 128),
    "int8-g32-asym": fmt(8, 32, False),
    "int4-g64-asym": fmt(4, 64, False),
    "int4-g32": fmt(4, 32),
    "int2-g64-asym": fmt(2, 64, False),
    "int2-g32": fmt(2, 32),
    "int2-g128": fmt(2, 128),
    "int2-g32-s8": fmt(2, 32, False, scale_bits=8),
    "int3-g32-s8": fmt(3, 32, False, scale_bits=8),
    "int3-g64": fmt(3, 64),
    "int4-smooth": fmt(4, 64, False, smooth=True),
    "w8a8-smooth": fmt(8, 128, act_bits=8, smooth=True),
}


def pool_shapes(quant: QuantFormat | None, D: int, F: int, slots: int = SLOTS):
    if quant is None:
        return (jax.ShapeDtypeStruct((slots, D, 2 * F), jnp.bfloat16), jax.ShapeDtypeStruct((slots, F, D), jnp.bfloat16))
    return template(quant, D, 2 * F, (slots,)), template(dataclasses.replace(quant, smooth=False), F, D, (slots,))


H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


def lower_for_cuda(jitted, *args):
    """Trace and lower a jitted function for CUDA on a machine without a GPU. From jax 0.11 the
    Pallas Triton lowering asks for the GPU it targets: an abstract mesh, active while tracing,
    names one (an H100); jax 0.10 takes it as well."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",))


def triton_calls(lowered) -> int:
    return lowered.as_text().count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_rows", [1, 32])
@pytest.mark.parametrize("name", list(LOWERING_FORMATS))
def test_every_variant_lowers_for_cuda(name, block_rows, dtype):
    # Lowering for CUDA runs the Pallas -> Triton IR lowering on this machine (no GPU or plugin
    # needed); Triton's own compilation to PTX happens only on a GPU.
    gate_up, down = pool_shapes(LOWERING_FORMATS[name], 128, 192)  # K=192 pads to G=128: Kp=256
    rows = jax.ShapeDtypeStruct((4 * block_rows, 128), dtype)
    block_slot = jax.ShapeDtypeStruct((4,), jnp.int32)
    if dtype == jnp.float32 and block_rows > 1:  # compiled float32 dots spill: the reference runs these
        assert not supports(rows, gate_up, down, block_rows) and supports(rows, gate_up, down, block_rows,
                                                                           interpret=True)
        return
    assert supports(rows, gate_up, down, block_rows)
    f = functools.partial(expert_ffn_pallas, block_rows=block_rows)
    lowered = lower_for_cuda(jax.jit(f), rows, block_slot, gate_up, down)
    assert triton_calls(lowered) == 2  # gate/up + SiLU, then down


@pytest.mark.parametrize("tokens", [3, 40])
def test_model_path_lowers_for_cuda(tokens):
    state, D = small_expert_state("pallas")
    h = jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16)
    routing = Routing(jax.ShapeDtypeStruct((tokens, 2), jnp.int32), jax.ShapeDtypeStruct((tokens, 2), jnp.float32))
    valid = jax.ShapeDtypeStruct((tokens,), jnp.bool_)
    run = jax.jit(lambda h, r, v, s: run_experts(h, r, v, s.layer(0)))
    lowered = lower_for_cuda(run, h, routing, valid, state)
    # decode: one launch per stage for both tiers (a tier index per row); prefill: two per tier
    assert triton_calls(lowered) == (2 if tokens * 2 <= GATHER_MAX_ASSIGNMENTS else 4)


# ----------------------------------------------------------------------------- expert biases, gated activations

# GPT-OSS's clamped SwiGLU with a limit these activations cross (gate ~ N(0, 0.8) here)
CLAMPED = GatedActivation("clamped_swiglu", alpha=1.702, limit=0.3)
BIAS_CASES = ["bf16-decode-f32", "bf16-prefill-bf16", "int4-g64-asym-decode-bf16-k_pad", "int4-g32-prefill-f32",
              "int2-g32-asym-prefill-f32-two_groups_per_step", "w8a8-smooth-g64-prefill-bf16",
              "int8-g128-decode-f32-k_pad"]


def bias_pools(rng, gate_up, down, slots: int = SLOTS) -> tuple[jax.Array, jax.Array]:
    """float32 bias pools gate_up_bias [S, 2F], down_bias [S, D]."""
    return (jnp.asarray(rng.normal(size=(slots, gate_up.shape[-1])) * 0.3, jnp.float32),
            jnp.asarray(rng.normal(size=(slots, down.shape[-1])) * 0.3, jnp.float32))


@pytest.mark.parametrize("activation", [SILU, CLAMPED], ids=["silu", "clamped_swiglu"])
@pytest.mark.parametrize("name", BIAS_CASES)
def test_biases_and_gated_activation_match_reference(name, activation):
    rows, block_slot, gate_up, down, block_rows = case_inputs(name)
    gate_up_bias, down_bias = bias_pools(np.random.default_rng(5), gate_up, down)
    assert supports(rows, gate_up, down, block_rows, gate_up_bias, down_bias, interpret=True)
    kw = dict(block_rows=block_rows, activation=activation)
    kernel = jax.jit(functools.partial(expert_ffn_pallas, interpret=True, **kw))
    reference = jax.jit(functools.partial(expert_ffn_reference, **kw))
    ours = kernel(rows, block_slot, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias)
    ref = reference(rows, block_slot, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias)
    w8a8 = isinstance(gate_up, QArray) and gate_up.fmt.act_bits == 8
    tolerance = W8A8_BF16_TOLERANCE if w8a8 and rows.dtype == jnp.bfloat16 else TOLERANCE[rows.dtype.name]
    assert relative_error(ours, ref) < tolerance
    empty = np.repeat(np.asarray(block_slot) < 0, block_rows)
    assert np.all(np.asarray(ours, np.float32)[empty] == 0)  # empty blocks write zeros, not the bias
    # the biases and the activation really act (a kernel ignoring them would fail above)
    plain = expert_ffn_reference(rows, block_slot, gate_up, down, block_rows=block_rows)
    assert relative_error(ref, plain) > 0.02


def test_gated_activations_follow_their_formulas():
    rng = np.random.default_rng(6)
    gate, up = (rng.normal(size=(4, 64)).astype(np.float32) * 2 for _ in range(2))
    silu = gate / (1 + np.exp(-gate)) * up
    g, u = np.minimum(gate, 0.3), np.clip(up, -0.3, 0.3)
    clamped = (u + 1) * g / (1 + np.exp(-1.702 * g))  # GPT-OSS: (up + 1) * gate * sigmoid(alpha * gate)
    for activation, expected in ((SILU, silu), (CLAMPED, clamped)):
        np.testing.assert_allclose(activation(jnp.asarray(gate), jnp.asarray(up)), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(activation.in_kernel(jnp.asarray(gate), jnp.asarray(up)), expected, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(activation.on_host(gate, up), expected, rtol=1e-5, atol=1e-6)
    assert np.all(SILU.on_host(np.float32([-1e4]), np.float32([3.0])) == 0)  # exp overflows to inf: silu is 0
    assert GatedActivation("silu", alpha=2.0, limit=1.0) == SILU  # silu ignores alpha and limit
    with pytest.raises(ValueError, match="unknown gated activation"):
        GatedActivation("gelu")


def test_supports_checks_bias_pools():
    rows, block_slot, gate_up, down, block_rows = case_inputs("int4-g32-prefill-f32")
    gate_up_bias, down_bias = bias_pools(np.random.default_rng(7), gate_up, down)
    check = functools.partial(supports, rows, gate_up, down, block_rows, interpret=True)
    assert check(gate_up_bias, down_bias)
    assert not check(gate_up_bias[:, :-16], down_bias)  # wrong width
    assert not check(gate_up_bias, down_bias[:3])  # wrong slot count
    assert not check(gate_up_bias.astype(jnp.bfloat16), down_bias)


def biased_expert_state(backend: str | None) -> tuple[ExpertState, int]:
    """small_expert_state with float32 biases in both pools."""
    state, D = small_expert_state(backend)
    rng = np.random.default_rng(8)
    pools = {t: ExpertWeights(p.gate_up, p.down, *bias_pools(rng, p.gate_up, p.down)) for t, p in state.pools.items()}
    return dataclasses.replace(state, pools=pools), D


@pytest.mark.parametrize("block_rows", [1, 32])  # decode splits the down projection's K: bias on split 0 only
@pytest.mark.parametrize("name", ["bf16", "int4-g64-asym", "int2-g32", "w8a8-smooth"])
def test_biased_clamped_variants_lower_for_cuda(name, block_rows):
    gate_up, down = pool_shapes(LOWERING_FORMATS[name], 128, 192)
    biases = (jax.ShapeDtypeStruct((SLOTS, 2 * 192), jnp.float32), jax.ShapeDtypeStruct((SLOTS, 128), jnp.float32))
    rows = jax.ShapeDtypeStruct((4 * block_rows, 128), jnp.bfloat16)
    block_slot = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert supports(rows, gate_up, down, block_rows, *biases)

    def f(rows, block_slot, gate_up, down, gate_up_bias, down_bias):
        return expert_ffn_pallas(rows, block_slot, gate_up, down, block_rows=block_rows, gate_up_bias=gate_up_bias,
                                 down_bias=down_bias, activation=CLAMPED)

    lowered = lower_for_cuda(jax.jit(f), rows, block_slot, gate_up, down, *biases)
    assert triton_calls(lowered) == 2


# ----------------------------------------------------------------------------- compiled (GPU)

GPU_FORMATS = ["bf16", "int8-g128", "int4-g64-asym", "int2-g64-asym", "int2-g32", "int2-g32-s8", "int3-g32-s8",
               "int4-smooth",
               "w8a8-smooth"]


@pytest.mark.gpu
@pytest.mark.parametrize("block_rows", [1, 32])
@pytest.mark.parametrize("name", GPU_FORMATS)
def test_compiled_matches_reference_on_gpu(name, block_rows):
    rng = np.random.default_rng(4)
    D, F = QWEN3_30B["D"], QWEN3_30B["F"]
    gate_up, down = make_pools(rng, LOWERING_FORMATS[name], D, F, "random")
    block_slot = jnp.asarray((5, -1, 0, 6, 5, 2, 3, 1), jnp.int32)
    rows = jnp.asarray(rng.normal(size=(block_slot.shape[0] * block_rows, D)), jnp.bfloat16)
    assert supports(rows, gate_up, down, block_rows)
    ours = jax.jit(functools.partial(expert_ffn_pallas, block_rows=block_rows))(rows, block_slot, gate_up, down)
    ref = expert_ffn_reference(rows, block_slot, gate_up, down, block_rows=block_rows)
    w8a8 = isinstance(gate_up, QArray) and gate_up.fmt.act_bits == 8
    assert relative_error(ours, ref) < (W8A8_BF16_TOLERANCE if w8a8 else TOLERANCE["bfloat16"])
    assert np.all(np.asarray(ours, np.float32)[np.repeat(np.asarray(block_slot) < 0, block_rows)] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("block_rows", [1, 32])
@pytest.mark.parametrize("name", ["bf16", "int4-g64-asym", "w8a8-smooth"])
def test_compiled_biased_clamped_experts_match_reference_on_gpu(name, block_rows):
    rng = np.random.default_rng(10)
    D, F = GPT_OSS["D"], GPT_OSS["F"]
    gate_up, down = make_pools(rng, LOWERING_FORMATS[name], D, F, "random")
    gate_up_bias, down_bias = bias_pools(rng, gate_up, down)
    block_slot = jnp.asarray((5, -1, 0, 6, 5, 2, 3, 1), jnp.int32)
    rows = jnp.asarray(rng.normal(size=(block_slot.shape[0] * block_rows, D)), jnp.bfloat16)
    kw = dict(block_rows=block_rows, gate_up_bias=gate_up_bias, down_bias=down_bias,
              activation=GatedActivation("clamped_swiglu", limit=7.0))
    assert supports(rows, gate_up, down, block_rows, gate_up_bias, down_bias)
    ours = jax.jit(functools.partial(expert_ffn_pallas, **kw))(rows, block_slot, gate_up, down)
    ref = expert_ffn_reference(rows, block_slot, gate_up, down, **kw)
    w8a8 = isinstance(gate_up, QArray) and gate_up.fmt.act_bits == 8
    assert relative_error(ours, ref) < (W8A8_BF16_TOLERANCE if w8a8 else TOLERANCE["bfloat16"])


# ----------------------------------------------------------------------------- 32-bit offsets at real sizes


def triton_irs(lowered) -> list[str]:
    """The Triton IR (text) of every Pallas kernel in a lowering for CUDA."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    attrs = inner.attributes
                    if inner.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in attrs:
                        config = ir.DictAttr(attrs["mhlo.backend_config"])
                        if "ir" in config:
                            found.append(ir.StringAttr(config["ir"]).value_bytes)
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = []
    for bytecode in found:
        context = ir.Context()
        tt_dialect.register_dialect(context)
        context.allow_unregistered_dialects = True
        with context:
            texts.append(str(ir.Module.parse(bytecode)))
    return texts


def offset_widths(ttir: str) -> dict[int, set[str]]:
    """Kernel argument -> the integer widths of the offsets added to pointers derived from it."""
    import re

    origin: dict[str, int] = {}
    widths: dict[int, set[str]] = {}
    for line in ttir.splitlines():
        splat = re.match(r"\s*(%\S+) = tt\.splat %arg(\d+) ", line)
        if splat:
            origin[splat.group(1)] = int(splat.group(2))
        add = re.match(r"\s*(%\S+) = tt\.addptr (%\S+), %\S+ : .*, (?:tensor<.*x)?(i\d+)>?$", line.strip())
        if add:
            base = add.group(2)
            arg = int(base[4:]) if base.startswith("%arg") else origin.get(base)
            if arg is not None:
                origin[add.group(1)] = arg
                widths.setdefault(arg, set()).add(add.group(3))
    return widths




@pytest.mark.parametrize("shape, quant, slots", [
    (QWEN3_30B, fmt(4, 64), 1000),  # below 2**31 elements
    (QWEN3_30B, fmt(4, 64), 2000),  # 2**31 elements < values < 2**32 bytes: the 32-bit overflow window
    (QWEN3_30B, fmt(4, 64), 3000),  # above 2**32 bytes: the lowering switches to 64-bit offsets
    (QWEN3_30B, fmt(8, 128), 1000),  # int8 window
    (QWEN3_30B, fmt(2, 64), 4000),  # int2 window
    (QWEN3_30B, None, 6144),  # every bf16 expert of the model
    (MIXTRAL, fmt(4, 64), 50),  # Mixtral int4 window
    (MIXTRAL, fmt(4, 64), 256),
])
@pytest.mark.parametrize("block_rows", [1, 32])
def test_no_kernel_indexes_a_pool_with_overflowing_32bit_offsets(shape, quant, slots, block_rows):
    D, F = shape["D"], shape["F"]
    gate_up, down = pool_shapes(quant, D, F, slots)
    rows = jax.ShapeDtypeStruct((4 * block_rows, D), jnp.bfloat16)
    block_slot = jax.ShapeDtypeStruct((4,), jnp.int32)
    f = functools.partial(expert_ffn, block_rows=block_rows, backend="pallas")
    irs = triton_irs(lower_for_cuda(jax.jit(f), rows, block_slot, gate_up, down))
    for ttir, pool in zip(irs, (gate_up, down)):
        arrays = [pool] if quant is None else [a for a in (pool.values, pool.scales, pool.offsets) if a is not None]
        widths = offset_widths(ttir)
        for i, array in enumerate(arrays, start=2):  # kernel arguments: block_slot, x, then the pool's arrays
            if math.prod(array.shape) >= 2**31:
                assert widths.get(i) == {"i64"}, f"argument {i} {array.shape} {array.dtype}: offsets {widths.get(i)}"
    window = any(not offsets_fit(a) for p in (gate_up, down) for a in ([p] if quant is None else [p.values]))
    assert (len(irs) == 0) == window  # the kernels run wherever their offsets are safe


# ----------------------------------------------------------------------------- compile failure fallback


@pytest.mark.parametrize("budgeted, execution", [(False, "auto"), (True, "auto"), (True, "layerwise")])
def test_kernels_that_fail_to_compile_fall_back_to_xla_with_one_warning(short_converted, caplog, budgeted,
                                                                         execution):
    # On the CPU, compiled (non-interpret) Pallas kernels cannot be built: the failure a GPU with an
    # unsupported Triton would give. The model warns once and runs the XLA reference path.
    import jmoe

    if jax.default_backend() == "gpu":
        pytest.skip("the compiled kernels build on a GPU")
    ids = [5, 17, 99, 3]
    reference = jmoe.generate(jmoe.load(short_converted, compute_dtype="float32"), ids, max_new_tokens=6)
    plan = jmoe.memory_plan(short_converted, compute_dtype="float32")
    budget = plan["dense"] + plan["kv_cache"] + plan["workspace"] + plan["all_experts"] // 3 if budgeted else None
    model = jmoe.load(short_converted, compute_dtype="float32", kernel_backend="pallas", device_budget=budget,
                      execution=execution)
    with caplog.at_level("WARNING", logger="jmoe.runtime"):
        assert jmoe.generate(model, ids, max_new_tokens=6) == reference
        assert jmoe.generate(model, ids, max_new_tokens=6) == reference
    warnings = [r for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(warnings) == 1 and model.residency.backend == "xla"


def test_a_failure_is_taken_for_the_kernels_only_when_they_do_not_build_alone(short_converted):
    """What decides is compiling the kernels on the model's pools, not an error's text: an error
    naming Pallas and Triton from a step whose kernels build (interpret mode here) is raised as it
    is and the kernels stay; the compiled Pallas kernels, which cannot be built on a CPU, are found
    at fault."""
    import jmoe
    from jmoe.kernels import compile_error
    from jmoe.runtime.kernel_fallback import with_kernel_fallback

    if jax.default_backend() == "gpu":
        pytest.skip("the compiled kernels build on a GPU")
    model = jmoe.load(short_converted, compute_dtype="float32", kernel_backend="interpret")
    pools = model.residency.pool_arrays().values()
    assert compile_error("interpret", pools) is None
    assert compile_error("pallas", pools) is not None

    def fail():
        raise ValueError("a pallas_call in triton failed (ptx)")

    with pytest.raises(ValueError, match="pallas_call"):
        with_kernel_fallback([model.residency], fail)
    assert model.residency.backend == "interpret"


# ----------------------------------------------------------------------------- split-K in decode


def test_decode_splits_k_to_fill_the_gpu():
    from pallas_kernels.device_config import current
    from pallas_kernels.expert_ffn_pallas import _plan, _splits

    TARGET_PROGRAMS = current().target_programs
    assert TARGET_PROGRAMS == 4 * 132  # traced without a GPU: the H100 SXM's (what gpu-compile targets)

    for shape, experts, quant in ((MIXTRAL, 2, fmt(4, 64)), (QWEN3_30B, 8, fmt(4, 64)), (MIXTRAL, 2, None)):
        D, F = shape["D"], shape["F"]
        gate_up, down = pool_shapes(quant, D, F, 8)
        # both stages: the gate/up partials are summed (and activated) outside the kernel
        for w, n_out, up_offset in ((down, D, None), (gate_up, F, F)):
            plan = _plan(w, 1, n_out, up_offset, jnp.bfloat16)
            splits = _splits([plan], experts, n_out)
            programs = experts * (n_out // plan.block_n)
            assert splits > 1 and plan.num_steps % splits == 0
            assert programs * splits <= max(TARGET_PROGRAMS, programs) * 2  # not wildly beyond the target
        assert _splits([_plan(down, 32, D, None, jnp.bfloat16)], experts, D) == 1  # prefill has programs enough
    # the lowered Mixtral down kernel runs a third grid axis of that many splits
    gate_up, down = pool_shapes(fmt(4, 64), MIXTRAL["D"], MIXTRAL["F"], 8)
    rows = jax.ShapeDtypeStruct((2, MIXTRAL["D"]), jnp.bfloat16)
    lowered = lower_for_cuda(jax.jit(functools.partial(expert_ffn_pallas, block_rows=1)),
                             rows, jax.ShapeDtypeStruct((2,), jnp.int32), gate_up, down)
    expected = _splits([_plan(down, 1, MIXTRAL["D"], None, jnp.bfloat16)], 2, MIXTRAL["D"])
    assert f"grid_z = {expected} : i32" in lowered.as_text()


def test_gpu_launch_settings_follow_the_device():
    from types import SimpleNamespace as Device

    from pallas_kernels.device_config import DEFAULT, for_device

    assert for_device(Device(platform="cpu", device_kind="cpu")) == DEFAULT
    # the device's own multiprocessor count first, then its name, then the default
    assert for_device(Device(platform="gpu", device_kind="NVIDIA H100 PCIe", core_count=114)).target_programs == 456
    assert for_device(Device(platform="gpu", device_kind="NVIDIA H100 PCIe")).multiprocessors == 114
    assert for_device(Device(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB")).multiprocessors == 108
    assert for_device(Device(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")).multiprocessors == 132
    assert for_device(Device(platform="gpu", device_kind="some new GPU")) == DEFAULT


# ----------------------------------------------------------------------------- several tiers in one launch

# (tier formats (None: bf16), rows dtype, biases and the clamped SwiGLU): tiers whose N tiles and
# K steps differ (bf16 64 columns vs packed 128; int2/G32 has twice the K steps of int4/G64)
TIER_MIXES = {
    "bf16+int4-asym-f32": ((None, fmt(4, 64, False)), jnp.float32, False),
    "int8+int2-g32-bf16": ((fmt(8, 128), fmt(2, 32)), jnp.bfloat16, False),
    "int4+int2-s8-f32": ((fmt(4, 64, False), fmt(2, 32, False, scale_bits=8)), jnp.float32, False),
    "w8a8-smooth+int4-smooth+bf16-f32": ((fmt(8, 64, act_bits=8, smooth=True), fmt(4, 64, False, smooth=True), None),
                                         jnp.float32, False),
    "bf16+int4-biased-clamped-f32": ((None, fmt(4, 32)), jnp.float32, True),
}
TIER_OF_BLOCK = (1, 0, 1, 2, 1, 2, 0)  # taken modulo the number of tiers
SLOT_OF_BLOCK = (3, 6, -1, 0, 3, 5, 2)  # an empty block; one slot in both tiers


def tier_mix_inputs(name: str, D: int, F: int, codes: str, seed: int, dtype=None):
    """(rows, block_tier, block_slot, tiers, activation) for a TIER_MIXES case at widths D, F."""
    formats, mix_dtype, biased = TIER_MIXES[name]
    rng = np.random.default_rng(seed)
    tiers = []
    for quant in formats:
        gate_up, down = make_pools(rng, quant, D, F, codes)
        tiers.append((gate_up, down, *(bias_pools(rng, gate_up, down) if biased else (None, None))))
    block_tier = jnp.asarray([t % len(formats) for t in TIER_OF_BLOCK], jnp.int32)
    block_slot = jnp.asarray(SLOT_OF_BLOCK, jnp.int32)
    rows = jnp.asarray(rng.normal(size=(len(SLOT_OF_BLOCK), D)), dtype or mix_dtype)
    return rows, block_tier, block_slot, tiers, CLAMPED if biased else SILU


@pytest.mark.parametrize("name", list(TIER_MIXES))
def test_several_tiers_in_one_launch_match_each_tier_alone(name):
    dtype = TIER_MIXES[name][1]
    rows, block_tier, block_slot, tiers, activation = tier_mix_inputs(name, 128, 96, "rtn", 11)  # K=96 pads to 128
    assert supports_tiers(rows, tiers, 1, interpret=True)
    kernel = jax.jit(functools.partial(expert_ffn_pallas_tiers, block_rows=1, interpret=True, activation=activation))
    jaxpr = str(jax.make_jaxpr(kernel)(rows, block_tier, block_slot, tiers))
    assert jaxpr.count("pallas_call") == 2  # one launch per stage, whatever the tiers
    ours = np.asarray(kernel(rows, block_tier, block_slot, tiers), np.float32)
    for t, (gate_up, down, gate_up_bias, down_bias) in enumerate(tiers):
        mine = np.asarray(block_tier) == t
        slots = jnp.where(mine, block_slot, -1)
        ref = np.asarray(expert_ffn_reference(rows, slots, gate_up, down, block_rows=1, gate_up_bias=gate_up_bias,
                                              down_bias=down_bias, activation=activation), np.float32)
        w8a8 = isinstance(gate_up, QArray) and gate_up.fmt.act_bits == 8
        tolerance = W8A8_BF16_TOLERANCE if w8a8 and dtype == jnp.bfloat16 else TOLERANCE[jnp.dtype(dtype).name]
        written = mine & (np.asarray(block_slot) >= 0)
        assert relative_error(ours[written], ref[written]) < tolerance
    assert np.all(ours[np.asarray(block_slot) < 0] == 0)
    # the dispatcher takes the same launch, and the per-tier fallback (XLA) agrees with it
    both = functools.partial(expert_ffn_tiers, block_rows=1, activation=activation)
    np.testing.assert_allclose(np.asarray(both(rows, block_tier, block_slot, tiers, backend="interpret"), np.float32),
                               ours, rtol=1e-6, atol=1e-6)
    xla = np.asarray(both(rows, block_tier, block_slot, tiers, backend="xla"), np.float32)
    any_w8a8 = any(isinstance(t[0], QArray) and t[0].fmt.act_bits == 8 for t in tiers)
    assert relative_error(ours, xla) < TOLERANCE[jnp.dtype(dtype).name] * (2 if any_w8a8 else 1)


def test_several_tiers_lower_as_one_launch_for_cuda():
    tiers = [(*pool_shapes(quant, QWEN3_30B["D"], QWEN3_30B["F"], 8), None, None) for quant in (None, fmt(4, 64, False))]
    rows = jax.ShapeDtypeStruct((8, QWEN3_30B["D"]), jnp.bfloat16)
    blocks = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert supports_tiers(rows, tiers, 1) and not supports_tiers(jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16),
                                                                 tiers, 32)  # prefill: a launch per tier
    lowered = lower_for_cuda(jax.jit(functools.partial(expert_ffn_pallas_tiers, block_rows=1)), rows, blocks, blocks,
                             tiers)
    assert triton_calls(lowered) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TIER_MIXES))
def test_compiled_tiers_in_one_launch_match_the_reference_on_gpu(name):
    widths = GPT_OSS if TIER_MIXES[name][2] else QWEN3_30B  # GPT-OSS's with biases, else Qwen3's
    D, F = widths["D"], widths["F"]
    rows, block_tier, block_slot, tiers, activation = tier_mix_inputs(name, D, F, "random", 12, jnp.bfloat16)
    ours = jax.jit(functools.partial(expert_ffn_pallas_tiers, block_rows=1, activation=activation))(
        rows, block_tier, block_slot, tiers)
    ref = expert_ffn_tiers(rows, block_tier, block_slot, tiers, block_rows=1, backend="xla", activation=activation)
    w8a8 = any(isinstance(t[0], QArray) and t[0].fmt.act_bits == 8 for t in tiers)
    assert relative_error(ours, ref) < (W8A8_BF16_TOLERANCE if w8a8 else TOLERANCE["bfloat16"])


# ----------------------------------------------------------------------------- Mosaic GPU (kernel_backend="mosaic")

# (format, rows dtype, biases and the clamped SwiGLU): scale rows per K step of 64 packed rows are
# 4 (G32), 2 (G64) and a fraction (G128: one group spans two steps); the gate/up stage splits K
MOSAIC_CASES = {
    "int4-g64-asym-f32": (fmt(4, 64, False), jnp.float32, False),
    "int4-g32-bf16": (fmt(4, 32), jnp.bfloat16, False),
    "int4-g128-asym-biased-clamped-f32": (fmt(4, 128, False), jnp.float32, True),
}


@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_mosaic_kernel_matches_reference_in_interpret_mode(name):
    from pallas_kernels.expert_ffn_mosaic import _matmul_partials, expert_ffn_mosaic, supports_mosaic

    quant, dtype, biased = MOSAIC_CASES[name]
    D, F = 256, 128
    rng = np.random.default_rng(13)
    gate_up, down = make_pools(rng, quant, D, F, "random")
    biases = dict(zip(("gate_up_bias", "down_bias"), bias_pools(rng, gate_up, down))) if biased else {}
    activation = CLAMPED if biased else SILU
    block_slot = jnp.asarray(DECODE_SLOTS, jnp.int32)
    rows = jnp.asarray(rng.normal(size=(len(DECODE_SLOTS), D)), dtype)
    assert supports_mosaic(rows, gate_up, down, 1, **biases)
    partials = _matmul_partials(rows, block_slot, gate_up, interpret=True, name="gate_up")
    assert partials.shape[0] > 1  # this shape splits K over programs
    ours = jax.jit(functools.partial(expert_ffn_mosaic, interpret=True, activation=activation))(
        rows, block_slot, gate_up, down, **biases)
    ref = expert_ffn_reference(rows, block_slot, gate_up, down, block_rows=1, activation=activation, **biases)
    assert ours.dtype == rows.dtype and relative_error(ours, ref) < TOLERANCE[jnp.dtype(dtype).name]
    assert np.all(np.asarray(ours, np.float32)[np.asarray(block_slot) < 0] == 0)


def test_mosaic_backend_takes_int4_decode_and_leaves_the_rest_to_triton():
    from pallas_kernels.expert_ffn_mosaic import supports_mosaic

    rng = np.random.default_rng(14)
    rows = jnp.zeros((6, 256), jnp.bfloat16)
    int4 = make_pools(rng, fmt(4, 64, False), 256, 128, "random")
    assert supports_mosaic(rows, *int4, 1)
    assert not supports_mosaic(jnp.zeros((32, 256), jnp.bfloat16), *int4, 16)  # prefill
    assert not supports_mosaic(rows, *make_pools(rng, fmt(8, 128), 256, 128, "random"), 1)
    assert not supports_mosaic(rows, *make_pools(rng, fmt(4, 64, False, smooth=True), 256, 128, "random"), 1)
    assert not supports_mosaic(jnp.zeros((6, 192), jnp.bfloat16), *make_pools(rng, fmt(4, 64), 192, 96, "random"),
                               1)  # widths not a multiple of 128 (GPT-OSS's 2880)
    slots = jnp.asarray(DECODE_SLOTS, jnp.int32)
    traced = lambda pools: str(jax.make_jaxpr(  # noqa: E731
        functools.partial(expert_ffn, block_rows=1, backend="mosaic"))(rows, slots, *pools))
    assert "expert_gate_up_mosaic" in traced(int4) and "expert_down_mosaic" in traced(int4)
    int8 = make_pools(rng, fmt(8, 128), 256, 128, "random")
    assert "expert_gate_up_silu" in traced(int8) and "mosaic" not in traced(int8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, MIXTRAL], ids=["qwen3", "mixtral"])
def test_compiled_mosaic_kernel_matches_the_reference_on_gpu(shape):
    from pallas_kernels.expert_ffn_mosaic import expert_ffn_mosaic

    rng = np.random.default_rng(15)
    gate_up, down = make_pools(rng, fmt(4, 64, False), shape["D"], shape["F"], "random")
    block_slot = jnp.asarray((5, -1, 0, 6, 5, 2, 3, 1), jnp.int32)
    rows = jnp.asarray(rng.normal(size=(block_slot.shape[0], shape["D"])), jnp.bfloat16)
    ours = jax.jit(expert_ffn_mosaic)(rows, block_slot, gate_up, down)
    ref = expert_ffn_reference(rows, block_slot, gate_up, down, block_rows=1)
    assert relative_error(ours, ref) < TOLERANCE["bfloat16"]
    assert np.all(np.asarray(ours, np.float32)[np.asarray(block_slot) < 0] == 0)
