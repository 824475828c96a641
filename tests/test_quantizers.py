"""GPTQ and HAQ at the matrix level: agreement with a plain reference, and error against RTN."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from convert.quantizers import grid
from convert.quantizers.gptq import gptq_quantize
from convert.quantizers.haq import (
    S_MAX,
    S_MIN,
    haq_quantize,
    search_alpha,
    smoothing_scales,
)
from convert.quantizers.rtn import rtn_dequantized
from kernel_formats.qarray import QuantFormat, dequantize, prepare_input, unpack_codes

W8A8 = QuantFormat(8, 128, True, act_bits=8, smooth=True)


def correlated_inputs(rng, n, k, *, rank=8, noise=0.3, outliers=(1, 5), outlier_scale=20.0):
    """X [n, K]: low-rank structure plus noise, a few channels of large magnitude (as in LLM activations)."""
    x = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, k)) + noise * rng.standard_normal((n, k))
    x[:, list(outliers)] *= outlier_scale
    return x.astype(np.float32)


def weights(rng, k, n):
    return (0.05 * rng.standard_normal((k, n))).astype(np.float32)


def output_error(x, w, w_hat, x_hat=None):
    """|| X W - X_hat W_hat || (X_hat: what the runtime multiplies the weight by, default X)."""
    x_hat = x if x_hat is None else x_hat
    return float(np.linalg.norm(x.astype(np.float64) @ w - np.asarray(x_hat, np.float64) @ np.asarray(w_hat)))


def reference_gptq(w, hessian, fmt, damp=0.01):
    """Unblocked GPTQ, one row at a time, straight from the paper.

    Returns codes [Kp, N] and the dequantized weight [K, N] it decided on.
    """
    k, n = w.shape
    g = fmt.group_size
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0
    h[np.diag_indices(k)] = np.where(dead, 1.0, np.diag(h))
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: u.T @ u = inv(h)

    kp = fmt.padded_k(k)
    w_work = np.zeros((kp, n), np.float32)  # padding rows are dead inputs with zero weight
    w_work[:k] = np.where(dead[:, None], 0.0, w)
    u_padded = np.eye(kp, dtype=np.float32)
    u_padded[:k, :k] = u
    codes = np.zeros((kp, n), np.int64)
    w_hat = np.zeros((kp, n), np.float32)
    for row in range(kp):
        if row % g == 0:  # group grid from the weights as they are now, after earlier errors
            scale, offset = (np.asarray(p)[0] for p in grid.group_params(w_work[row : row + g], fmt))
        codes[row] = np.asarray(grid.encode(w_work[row], scale, offset, fmt))
        w_hat[row] = np.asarray(grid.decode(codes[row], scale, offset, fmt))
        err = (w_work[row] - w_hat[row]) / u_padded[row, row]
        w_work[row + 1 :] -= np.outer(u_padded[row, row + 1 :], err)
    return codes, w_hat[:k]


# ---------------------------------------------------------------- GPTQ


# Shapes and formats shared with the tests below, so the compiled GPTQ is reused.
@pytest.mark.parametrize(
    "k, fmt, block_size",
    [
        (256, QuantFormat(4, 32, True), 128),  # two blocks, groups starting inside a block
        (96, QuantFormat(2, 64, True), 32),  # K not a multiple of G; block rounded up to G
    ],
)
def test_gptq_matches_reference_and_round_trips(k, fmt, block_size):
    rng = np.random.default_rng(0)
    x = correlated_inputs(rng, 512, k)
    w = weights(rng, k, 64)
    hessian = x.T @ x

    q = gptq_quantize(w, hessian, fmt, block_size=block_size)
    ref_codes, ref_w_hat = reference_gptq(w, hessian, fmt)

    codes = np.asarray(unpack_codes(q.values, fmt))
    assert codes.shape == ref_codes.shape
    assert np.mean(codes == ref_codes) > 0.995
    # Round trip: the packed array dequantizes to the weights GPTQ decided on.
    w_hat = np.asarray(dequantize(q))
    assert w_hat.shape == (k, 64)
    assert np.mean(np.isclose(w_hat, ref_w_hat, rtol=0, atol=1e-6)) > 0.995
    err, ref_err = output_error(x, w, w_hat), output_error(x, w, ref_w_hat)
    assert abs(err - ref_err) < 0.01 * ref_err


# Every (bits, symmetric) pair twice, every group size with both bit widths and both grids.
@pytest.mark.parametrize(
    "bits, symmetric, k, group_size",
    [
        (4, True, 256, 32),
        (4, False, 256, 64),
        (4, True, 256, 128),
        (4, False, 96, 64),
        (2, False, 256, 32),
        (2, True, 256, 64),
        (2, False, 256, 128),
        (2, True, 96, 64),
    ],
)
def test_gptq_beats_rtn_on_correlated_inputs(bits, symmetric, k, group_size):
    rng = np.random.default_rng(1)
    x = correlated_inputs(rng, 1024, k, rank=16)
    w = weights(rng, k, 64)
    fmt = QuantFormat(bits, group_size, symmetric)

    q = gptq_quantize(w, x.T @ x, fmt)
    gptq_err = output_error(x, w, dequantize(q))
    rtn_err = output_error(x, w, rtn_dequantized(w, fmt))
    assert gptq_err < 0.6 * rtn_err


@pytest.mark.parametrize("fmt", [QuantFormat(4, 32, True), QuantFormat(4, 64, False)])
def test_gptq_dead_inputs(fmt):
    rng = np.random.default_rng(2)
    k = 256
    x = correlated_inputs(rng, 256, k)
    dead = np.r_[3, 40, 100, 128:192]  # scattered channels and whole groups
    x[:, dead] = 0.0
    w = weights(rng, k, 64)  # non-zero weights on dead rows: must not leak into live rows

    q = gptq_quantize(w, x.T @ x, fmt)
    w_hat = np.asarray(dequantize(q))
    assert np.all(np.isfinite(w_hat))
    assert np.all(w_hat[128:192] == 0.0)  # a group with no live input quantizes to exact zeros
    scales = np.repeat(np.asarray(q.scales, np.float32), fmt.group_size, axis=0)[:k]
    # Dead rows hold zero before rounding: exact on a symmetric grid, within half a step otherwise.
    assert np.all(np.abs(w_hat[dead]) <= 0.5 * scales[dead] + 1e-7)
    if fmt.symmetric:
        assert np.all(w_hat[dead] == 0.0)
    assert output_error(x, w, w_hat) < output_error(x, w, rtn_dequantized(w, fmt))


def test_gptq_rejects_bad_input():
    w = np.zeros((64, 8), np.float32)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, np.eye(32), QuantFormat(4, 64, True))
    with pytest.raises(ValueError, match="act_scale"):
        gptq_quantize(w, np.eye(64), W8A8)


# ---------------------------------------------------------------- HAQ


def outlier_case(rng, n, k, n_out, *, outlier_scale=50.0):
    """(X [n, K], act_absmax [K], W [K, N]) with a few activation channels far above the rest."""
    x = correlated_inputs(rng, n, k, rank=16, outliers=(2, 17, 60), outlier_scale=outlier_scale)
    return x, np.max(np.abs(x), axis=0), weights(rng, k, n_out)


def smoothed_rtn_error(cases, fmt, alpha):
    """The search's objective written out: sum of || X W - prepare(X) RTN(diag(s) W) ||^2."""
    total = 0.0
    for x, act_absmax, w in cases:
        s = np.asarray(smoothing_scales(act_absmax, w, alpha))
        x_hat = prepare_input(x, 1.0 / s, fmt)
        total += output_error(x, w, rtn_dequantized(s[:, None] * w, fmt), x_hat) ** 2
    return total


def test_smoothing_is_exact_and_safe():
    rng = np.random.default_rng(3)
    x, act_absmax, w = outlier_case(rng, 64, 128, 32)
    act_absmax[7] = 0.0  # dead channel
    w[9] = 0.0  # dead weight row
    act_absmax[11] = 1e12  # extreme outlier: clamped
    for alpha in (0.0, 0.5, 0.85, 1.0):
        s = np.asarray(smoothing_scales(act_absmax, w, alpha))
        assert s.shape == (128,) and np.all(np.isfinite(s))
        assert np.all((s >= S_MIN * (1 - 1e-3)) & (s <= S_MAX * (1 + 1e-3)))
        assert s[7] == 1.0 and s[9] == 1.0
        act_scale = (1.0 / s).astype(np.float16).astype(np.float32)  # what the QArray stores
        np.testing.assert_allclose(act_scale, 1.0 / s, rtol=1e-6)
        smoothed = (x / s) @ (s[:, None] * w)
        np.testing.assert_allclose(smoothed, x @ w, rtol=1e-4, atol=1e-4 * np.abs(x @ w).max())


@pytest.mark.parametrize("fmt", [W8A8, QuantFormat(4, 64, False, smooth=True)])
def test_search_alpha(fmt):
    rng = np.random.default_rng(4)
    cases = [outlier_case(rng, n, 128, 48) for n in (3, 12, 60)]  # experts see few tokens

    alpha = search_alpha(cases, fmt)
    assert 0.0 <= alpha <= 1.0
    best, at_zero = smoothed_rtn_error(cases, fmt, alpha), smoothed_rtn_error(cases, fmt, 0.0)
    assert best <= at_zero * (1 + 1e-5)
    if fmt.act_bits == 8:  # outlier channels wreck per-token int8 unless smoothed away
        assert alpha > 0.0 and best < 0.5 * at_zero


def test_search_alpha_ties_go_to_smaller_alpha():
    rng = np.random.default_rng(5)
    x, act_absmax, w = outlier_case(rng, 16, 64, 8)
    # All-zero inputs: every alpha gives zero error.
    assert search_alpha([(np.zeros_like(x), act_absmax, w)], W8A8, alphas=(0.7, 0.3, 0.5)) == pytest.approx(0.3)
    assert search_alpha([(x[:0], act_absmax, w)], W8A8) == 0.0


@pytest.mark.parametrize(
    "fmt, rtn_fmt",
    [
        (W8A8, QuantFormat(8, 128, True, act_bits=8)),
        (QuantFormat(4, 64, False, smooth=True), QuantFormat(4, 64, False)),
    ],
)
def test_haq_beats_rtn_on_outlier_data(fmt, rtn_fmt):
    rng = np.random.default_rng(6)
    x, _, w = outlier_case(rng, 512, 128, 64)
    x_cal, x_test = x[:256], x[256:]  # held-out rows from the same distribution
    act_absmax = np.max(np.abs(x_cal), axis=0)
    alpha = search_alpha([(x_cal, act_absmax, w), outlier_case(rng, 256, 128, 64)], fmt)

    q = haq_quantize(w, x_cal.T @ x_cal, act_absmax, alpha, fmt)
    assert q.act_scale is not None and q.act_scale.shape == (128,) and q.act_scale.dtype == np.float16
    haq_err = output_error(x_test, w, dequantize(q), prepare_input(x_test, q.act_scale, fmt))
    rtn_err = output_error(x_test, w, rtn_dequantized(w, rtn_fmt), prepare_input(x_test, None, rtn_fmt))
    assert haq_err < 0.7 * rtn_err


def test_haq_needs_smooth_format():
    with pytest.raises(ValueError, match="smooth"):
        haq_quantize(np.ones((64, 8)), np.eye(64), np.ones(64), 0.5, QuantFormat(8, 64, True))


# ---------------------------------------------------------------- the int2 grid: search and refit

INT2 = QuantFormat(2, 64, False)


def weighted_error(w, scale, offset, fmt, importance):
    deq = grid.decode(grid.encode(w, scale, offset, fmt), scale, offset, fmt)
    return np.sum(np.asarray(importance) * (np.asarray(w) - np.asarray(deq)) ** 2, axis=0)


def test_searched_grid_is_never_worse_than_min_max_and_beats_it_with_an_outlier():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    w[5, :16] *= 8.0  # one large weight in half of the columns stretches min/max's four levels
    importance = rng.uniform(0.1, 2.0, (64, 1)).astype(np.float32)
    plain = weighted_error(w, *grid.group_params(w, INT2), INT2, importance)
    searched = weighted_error(w, *grid.searched_group_params(w, INT2, importance), INT2, importance)
    assert np.all(searched <= plain * (1 + 1e-5))
    assert np.mean(searched[16:] / plain[16:]) < 0.9 and np.mean(searched[:16] / plain[:16]) < 0.9
    # formats above SEARCH_MAX_BITS keep min/max
    int4 = QuantFormat(4, 64, False)
    assert all(np.array_equal(a, b) for a, b in zip(grid.fitted_group_params(w, int4), grid.group_params(w, int4)))


def test_refit_is_the_least_squares_grid_of_the_codes():
    from convert.quantizers.gptq import refit_groups

    rng = np.random.default_rng(4)
    fmt = QuantFormat(2, 32, False)
    k, n, groups = 80, 6, 3  # K not a multiple of G: the padded rows carry no weight
    x = correlated_inputs(rng, 400, k)
    h = (x.T @ x).astype(np.float64)
    w = weights(rng, k, n)
    codes = rng.integers(0, 4, (groups * 32, n))
    scales, offsets = np.full((groups, n), 0.02, np.float32), np.zeros((groups, n), np.float32)
    dead = np.zeros(k, bool)
    new_scales, new_offsets = refit_groups(w, h, codes, scales, offsets, fmt, dead)

    def loss(s, o):
        deq = codes[:k] * np.repeat(s, 32, axis=0)[:k] + np.repeat(o, 32, axis=0)[:k]
        r = w - deq
        return np.einsum("ic,ij,jc->c", r, h, r)

    for c in range(n):  # the normal equations written out with the explicit basis
        basis = np.zeros((k, 2 * groups))
        basis[np.arange(k), np.arange(k) // 32] = codes[:k, c]
        basis[np.arange(k), groups + np.arange(k) // 32] = 1.0
        theta = np.linalg.solve(basis.T @ h @ basis, basis.T @ h @ w[:, c])
        np.testing.assert_allclose(new_scales[:, c], theta[:groups], rtol=2e-3, atol=2e-4)
        np.testing.assert_allclose(new_offsets[:, c], theta[groups:], rtol=2e-3, atol=2e-4)
    assert np.all(loss(new_scales, new_offsets) < loss(scales, offsets))


def test_gptq_int2_refit_lowers_the_output_error(monkeypatch):
    from convert.quantizers import gptq

    rng = np.random.default_rng(5)
    x = correlated_inputs(rng, 1024, 256, rank=16)
    w = weights(rng, 256, 64)
    refit = output_error(x, w, dequantize(gptq_quantize(w, x.T @ x, INT2)))
    monkeypatch.setattr(gptq, "REFIT_ROUNDS", 0)
    one_pass = output_error(x, w, dequantize(gptq_quantize(w, x.T @ x, INT2)))
    assert refit < 0.95 * one_pass


def test_an_expert_with_its_intermediate_units_reordered_computes_the_same():
    from convert.quantizers.expert import activation_order, intermediate, permute_intermediate
    from jmoe.quant import ExpertWeights

    rng = np.random.default_rng(6)
    D, F = 16, 12
    expert = ExpertWeights(rng.standard_normal((D, 2 * F)).astype(np.float32),
                           rng.standard_normal((F, D)).astype(np.float32))._replace(
        gate_up_bias=rng.standard_normal(2 * F).astype(np.float32))
    x = rng.standard_normal((5, D)).astype(np.float32)
    mid = intermediate(x, expert)
    order = activation_order(mid.T @ mid)
    assert np.all(np.diff(np.diagonal((mid.T @ mid))[order]) <= 0)
    moved = permute_intermediate(expert, order)
    np.testing.assert_allclose(intermediate(x, moved) @ moved.down, mid @ expert.down, rtol=1e-5, atol=1e-5)


def test_searched_grids_tile_by_tile_are_the_whole_matrix_grids():
    """rtn's int2 grid search runs in tiles of 512 columns (a padded last tile included): the grids
    are the whole matrix's, up to the last float16 bit where a sum's order differs."""
    from convert.quantizers.rtn import TILE_COLUMNS, group_grid

    fmt = QuantFormat(2, 64, False)
    w = np.random.default_rng(3).normal(size=(256, 2 * TILE_COLUMNS + 76)).astype(np.float32) * 0.02
    groups = grid.pad_k(w, fmt).reshape(-1, 64, w.shape[1])
    tiled = jax.jit(group_grid, static_argnums=1)(groups, fmt)
    whole = jax.jit(grid.fitted_group_params, static_argnums=1)(groups, fmt)
    for a, b in zip(tiled, whole):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape == (4, 1, w.shape[1])
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)
        assert np.mean(a != b) < 1e-3


def test_an_experts_gate_weights_its_tokens_in_its_hessian():
    """Each routed token counts with its combine weight squared; the prior keeps its share at the
    rows' mean g^2 (so an expert's Hessian has the same balance of own and layer-wide rows)."""
    from convert.calibration import LayerInputs
    from convert.quantizers.expert import PRIOR_TOKENS, ExpertInputs

    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 4))
    ids = np.array([[0, 1], [1, 2], [2, 0], [1, 0], [2, 1], [0, 2]])
    weights = rng.uniform(0.1, 0.9, ids.shape)
    inputs = LayerInputs(x, ids, weights)
    rows = inputs.routed_to(0)
    np.testing.assert_array_equal(rows, [0, 2, 3, 5])
    gate = inputs.gate_of(0)
    np.testing.assert_allclose(gate, [weights[0, 0], weights[2, 1], weights[3, 1], weights[5, 0]])
    prior = rng.standard_normal((10, 4))
    expert = ExpertInputs(x[rows], x[rows], prior, prior, gate)
    expected = sum(g * g * np.outer(r, r) for g, r in zip(gate, x[rows]))
    expected += PRIOR_TOKENS / 10 * np.mean(gate ** 2) * prior.T @ prior
    np.testing.assert_allclose(expert.hessian(x[rows], prior), expected, rtol=1e-9, atol=1e-12)
    unweighted = ExpertInputs(x[rows], x[rows], prior, prior)
    np.testing.assert_allclose(unweighted.hessian(x[rows], prior),
                               x[rows].T @ x[rows] + PRIOR_TOKENS / 10 * prior.T @ prior, rtol=1e-9, atol=1e-12)


def test_down_compensated_for_the_quantized_gate_up_lowers_the_experts_output_error():
    """GPTQ's down at int2 toward what the quantized gate_up's intermediate must map to: the whole
    expert's output error on its calibration tokens is lower than with down quantized alone, and
    an exact gate_up leaves down's target as down (the damping pulls toward down, not toward 0)."""
    from convert.quantizers.expert import ExpertInputs, compensated_down, intermediate
    from jmoe.quant import ExpertWeights
    from kernel_formats.glu import SILU as SILU_ACT

    rng = np.random.default_rng(9)
    D, F, n = 128, 32, 512
    x = correlated_inputs(rng, n, D, rank=12, outliers=())
    expert = ExpertWeights(weights(rng, D, 2 * F), weights(rng, F, D))
    mid = intermediate(x, expert)
    inputs = ExpertInputs(x, mid, x[:256], mid[:256])
    target, h = compensated_down(inputs, expert, expert.gate_up, SILU_ACT)
    np.testing.assert_allclose(target, expert.down, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h, inputs.hessian(inputs.mid, inputs.prior_mid), rtol=1e-4, atol=1e-4)

    gate_up_q = np.asarray(dequantize(gptq_quantize(expert.gate_up, inputs.hessian(inputs.x, inputs.prior_x), INT2)))
    mid_q = intermediate(x, expert._replace(gate_up=gate_up_q))
    exact = mid @ expert.down

    def error(down_q):
        return float(np.sum((mid_q @ np.asarray(dequantize(down_q)) - exact) ** 2))

    alone = gptq_quantize(expert.down, inputs.hessian(inputs.mid, inputs.prior_mid), INT2)
    target, h = compensated_down(inputs, expert, gate_up_q, SILU_ACT)
    assert error(gptq_quantize(target, h, INT2)) < 0.98 * error(alone)


def test_8bit_scales_code_each_column_against_its_own_range_and_keep_flat_groups_exact():
    """coded_scales: each group's scale and offset within half a code step of its column's base
    (independently of the other columns), a group whose codes are all equal exactly its value, and
    dequantize reading the codes as the float16 grid they came from."""
    rng = np.random.default_rng(3)
    K, N = 256, 96
    w = rng.standard_normal((K, N)).astype(np.float32) * np.geomspace(1e-3, 10, N, dtype=np.float32)  # columns apart
    w[32:64, 5] = 0.25  # a flat group: one value, whatever its scale
    fmt16 = QuantFormat(2, 32, False)
    fmt8 = QuantFormat(2, 32, False, scale_bits=8)
    codes = grid.encode(*_grid_of(w, fmt16), fmt16)
    scale, offset = (np.asarray(a)[:, 0] for a in grid.fitted_group_params(w.reshape(-1, 32, N), fmt16))
    q16 = grid.to_qarray(np.asarray(codes).reshape(K, N), scale, offset, fmt16, K)
    q8 = grid.to_qarray(np.asarray(codes).reshape(K, N), scale, offset, fmt8, K)
    assert q8.scales.dtype == np.uint8 and q8.offsets.dtype == np.uint8 and q8.bases.shape == (2, N)
    assert q8.scales.nbytes + q8.offsets.nbytes == (q16.scales.nbytes + q16.offsets.nbytes) // 2
    s8 = q8.scales * q8.bases[0]
    o8 = (q8.offsets.astype(np.float32) - 128) * q8.bases[1]
    flat = np.zeros_like(s8, bool)
    flat[1, 5] = True
    assert s8[1, 5] == 0 and o8[1, 5] == pytest.approx(0.25, rel=1e-2)
    half_step = 0.5 * (1 + 1e-6) * q8.bases[:, None, :]  # [2, 1, N]: each column's own
    assert np.all((np.abs(s8 - q16.scales) <= half_step[0]) | flat)
    assert np.all((np.abs(o8 - q16.offsets) <= half_step[1]) | flat)
    assert np.all((q8.scales >= 1) | flat)
    w16, w8 = np.asarray(dequantize(q16)), np.asarray(dequantize(q8))
    column_range = np.abs(w16).max(axis=0)
    assert np.all(np.abs(w8 - w16) <= 0.02 * column_range)  # each column within its own range's codes
    assert np.all(w8[32:64, 5] == pytest.approx(0.25, rel=1e-2))


def _grid_of(w, fmt):
    scale, offset = grid.fitted_group_params(w.reshape(-1, fmt.group_size, w.shape[1]), fmt)
    return w.reshape(-1, fmt.group_size, w.shape[1]), scale, offset


def test_8bit_scales_are_for_asymmetric_weight_only_formats_and_written_to_the_manifest_only_when_set():
    with pytest.raises(ValueError, match="8-bit scales"):
        QuantFormat(2, 32, True, scale_bits=8)
    with pytest.raises(ValueError, match="scale_bits"):
        QuantFormat(2, 32, False, scale_bits=4)
    assert "scale_bits" not in QuantFormat(4, 64, False).to_json()
    coded = QuantFormat(2, 32, False, scale_bits=8)
    assert QuantFormat.from_json(coded.to_json()) == coded


def test_dense_gptq_runs_column_blocks_and_beats_rtn_on_its_inputs(monkeypatch):
    """convert/dense_gptq.py: GPTQ quantizes a weight's columns independently, so blocks of columns
    give the whole matrix's codes; against its inputs the error is below RTN's; a tiled spec gets the
    same codes in column tiles."""
    import dataclasses

    from convert import dense_gptq
    from convert.dense import dense_format
    from kernel_formats.qarray import template, untile

    rng = np.random.default_rng(3)
    k, vocab = 64, 320
    x = correlated_inputs(rng, 2048, k)
    w = weights(rng, k, vocab)  # [K, vocab]
    fmt = dense_format("int4")
    spec = template(fmt, k, vocab)
    rows = lambda cols: w.T[cols]  # noqa: E731 - the source's [vocab, K] rows
    whole = dense_gptq.gptq_columns(rows, dense_gptq.hessian_of(x), spec)
    monkeypatch.setattr(dense_gptq, "COLUMNS", 128)  # three blocks, the last of 64 columns
    blocks = dense_gptq.gptq_columns(rows, dense_gptq.hessian_of(x), spec)
    for a, b in ((whole.values, blocks.values), (whole.scales, blocks.scales), (whole.offsets, blocks.offsets)):
        np.testing.assert_array_equal(a, b)
    assert output_error(x, w, dequantize(whole)) < 0.8 * output_error(x, w, rtn_dequantized(w, fmt))
    tiled_fmt = dataclasses.replace(fmt, tiled=True)
    tiled = dense_gptq.gptq_columns(rows, dense_gptq.hessian_of(x), template(tiled_fmt, k, vocab))
    assert tiled.fmt == tiled_fmt
    np.testing.assert_array_equal(np.asarray(untile(tiled).values), whole.values)


def test_optimised_jit_runs_alone_and_nested_in_another_jit():
    """Compile options are refused on a nested jit: inside another jit it is the plain one."""
    import functools

    import jax.numpy as jnp

    from kernel_formats.optimised import optimised_jit

    @functools.partial(optimised_jit, static_argnums=1)
    def scaled_sum(x, factor: int):
        return jnp.sum(x * factor, axis=0)

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = (x * 3).sum(axis=0)
    np.testing.assert_array_equal(scaled_sum(x, 3), expected)
    np.testing.assert_array_equal(jax.jit(lambda x: scaled_sum(x, 3) + 1)(x), expected + 1)
    np.testing.assert_array_equal(jax.vmap(lambda row: scaled_sum(row[None], 3))(x), x * 3)
