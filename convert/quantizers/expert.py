"""Quantizing one MoE layer's experts with RTN, GPTQ or HAQ.

GPTQ and HAQ need, per expert, the inputs of its two matmuls: x (the tokens routed to it) for
gate_up and mid = act(x @ gate, x @ up) for down (with the expert's biases, if it has them). Experts that saw few calibration tokens get
their statistics shrunk toward the layer's: their Hessian adds `prior_tokens` worth of the average
over a sample of all the layer's tokens, and their activation ranges come from that sample.

A routed token weighs in an expert's statistics by its combine weight squared (the router's
weight scales the expert's output in the layer's), and down is quantized once gate_up is, toward
what the quantized gate_up's intermediate must be mapped to (`compensated_down`).

HAQ picks one smoothing exponent per layer, matrix and tier by grid search; the down projection's
smoothing is folded into the up projection's columns and bias (mid / s), gate_up's is kept as an
input scale applied at run time. Folding is exact only for SwiGLU (mid is linear in up); with
another gated activation (GPT-OSS's clamped SwiGLU) down is not smoothed (HAQ = GPTQ there).

Expert biases are never quantized: every version carries the float32 biases it computes with.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from convert.calibration import LayerInputs
from convert.quantizers.gptq import gptq_quantize
from convert.quantizers.haq import haq_quantize, search_alpha, smoothing_scales
from convert.quantizers.rtn import quantize_rtn
from jmoe.quant import ExpertWeights
from kernel_formats.glu import SILU, GatedActivation
from kernel_formats.qarray import QuantFormat, dequantize

METHODS = ("rtn", "gptq", "haq")
PRIOR_TOKENS = 64  # an expert with fewer routed tokens leans on the layer-wide statistics
SEARCH_ROWS = 256  # activation rows per expert used by HAQ's exponent search
PRIOR_ROWS = 512  # rows of all tokens sampled for the layer-wide statistics


def intermediate(x: np.ndarray, expert: ExpertWeights, activation: GatedActivation = SILU) -> np.ndarray:
    """Input of the down projection: act(x @ gate (+ b), x @ up (+ b)); x [n, D] -> [n, F] float32."""
    gate_up = x @ expert.gate_up
    if expert.gate_up_bias is not None:
        gate_up = gate_up + expert.gate_up_bias
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    return activation.on_host(g, u)


@dataclass
class ExpertInputs:
    """Calibration inputs of one expert's two matmuls (routed rows, or the layer sample as fallback)."""

    x: np.ndarray  # [n, D] rows routed to the expert
    mid: np.ndarray  # [n, F]
    prior_x: np.ndarray  # [m, D] sample of all the layer's tokens
    prior_mid: np.ndarray  # [m, F] this expert's intermediate on that sample
    gate: np.ndarray | None = None  # [n] the expert's combine weight in each routed row

    @property
    def few(self) -> bool:
        return len(self.x) < PRIOR_TOKENS

    def hessian(self, rows: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """X^T X of the routed rows plus PRIOR_TOKENS rows' worth of the layer average (float64):
        R^T R of `weighted_rows`."""
        weighted = self.weighted_rows(rows, prior)
        return weighted.T @ weighted

    def weighted_rows(self, rows: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """[routed rows; prior rows] (float64), each scaled by the square root of what it weighs.

        The prior rows together weigh PRIOR_TOKENS rows. With the routing's combine weights (gate),
        a routed row weighs g^2: the expert's output joins the layer's output times g, so that is
        what a token's output error costs there (a token the router barely sends here matters
        little); the prior then weighs PRIOR_TOKENS rows of the routed rows' mean g^2."""
        rows, prior = rows.astype(np.float64), prior.astype(np.float64)
        prior_weight = PRIOR_TOKENS / len(prior)
        if self.gate is not None and len(rows):
            g = self.gate.astype(np.float64)
            rows = rows * g[:, None]
            prior_weight *= float(np.mean(g * g))
        return np.concatenate([rows, np.sqrt(prior_weight) * prior])

    def search_rows(self, which: str) -> np.ndarray:
        rows = self.prior_x if which == "x" else self.prior_mid
        own = self.x if which == "x" else self.mid
        return rows[:SEARCH_ROWS] if self.few else own[:SEARCH_ROWS]

    def absmax(self, which: str) -> np.ndarray:
        return np.abs(self.search_rows(which)).max(axis=0)


def rtn_expert(expert: ExpertWeights, fmt: QuantFormat) -> ExpertWeights:
    """RTN of both matrices (K-major float32); the biases ride along unquantized."""
    return ExpertWeights(quantize_rtn(expert.gate_up, fmt), quantize_rtn(expert.down, fmt)).with_biases_of(expert)


def fold_down_smoothing(expert: ExpertWeights, s: np.ndarray) -> ExpertWeights:
    """Divide the up columns (and the up bias) by s, so SwiGLU's mid comes out already divided by s (exact)."""
    F = s.shape[0]
    gate_up = expert.gate_up.copy()
    gate_up[:, F:] /= s[None, :]
    bias = expert.gate_up_bias
    if bias is not None:
        bias = bias.copy()
        bias[F:] /= s
    return expert._replace(gate_up=gate_up, gate_up_bias=bias)


def permute_intermediate(expert: ExpertWeights, order: np.ndarray) -> ExpertWeights:
    """The same expert with its intermediate units in `order`: gate and up columns (and biases) and
    down's rows move together, so it computes exactly what it did."""
    F = expert.down.shape[0]
    columns = np.concatenate([order, F + order])
    bias = None if expert.gate_up_bias is None else expert.gate_up_bias[columns]
    return expert._replace(gate_up=expert.gate_up[:, columns], down=expert.down[order], gate_up_bias=bias)


COMPENSATION_DAMP = 0.01  # fraction of mean(diag) added before solving for down's compensated target


def compensated_down(inputs: ExpertInputs, expert: ExpertWeights, gate_up_seen: np.ndarray,
                     activation: GatedActivation):
    """down's GPTQ problem once gate_up is quantized (gate_up_seen: its dequantized [D, 2F]):
    (target [F, D] float32, hessian [F, F]).

    At run time down multiplies the intermediate that the *quantized* gate_up gives (mid_q), not
    the exact one (mid). So down is quantized against mid_q's Hessian, toward the weight that best
    maps mid_q to the exact output mid @ down: target = argmin_W |mid_q W - mid @ down|^2, damped
    toward down. down so takes up part of what rounding gate_up lost. Rows and their weights:
    `weighted_rows`."""
    seen = expert._replace(gate_up=gate_up_seen)

    def rows(weights):
        return inputs.weighted_rows(intermediate(inputs.x, weights, activation),
                                    intermediate(inputs.prior_x, weights, activation))

    mid, mid_q = rows(expert), rows(seen)
    down = expert.down.astype(np.float64)
    h = mid_q.T @ mid_q
    damped = h + COMPENSATION_DAMP * np.mean(np.diagonal(h)) * np.eye(len(h))
    # damped toward down itself, not toward zero: an exact gate_up leaves down as it is
    target = down + np.linalg.solve(damped, mid_q.T @ ((mid - mid_q) @ down))
    return target.astype(np.float32), h


def activation_order(hessian: np.ndarray) -> np.ndarray:
    """GPTQ's act order: inputs by decreasing diag(H), so the ones that matter most are rounded first
    and the later ones absorb their error (and groups gather inputs of like importance)."""
    return np.argsort(-np.diagonal(hessian), kind="stable")


class LayerQuantizer:
    """Quantizes every expert of one MoE layer at every integer tier with one method."""

    def __init__(self, method: str, formats: dict[str, QuantFormat | None], experts: list[ExpertWeights],
                 inputs: LayerInputs | None, activation: GatedActivation = SILU, seed: int = 0):
        self.method = method
        self.formats = {t: f for t, f in formats.items() if f is not None}
        self.experts = experts  # gate_up [D, 2F], down [F, D] K-major float32 (+ float32 biases)
        self.activation = activation
        # HAQ folds down's smoothing into up, exact only where mid is linear in up (SwiGLU)
        self.smooth_down = activation.kind == "silu"
        self.alphas: dict[str, tuple[float, float | None]] = {}
        self._inputs: list[ExpertInputs] = []
        if method == "rtn":
            return
        rng = np.random.default_rng(seed)
        take = min(PRIOR_ROWS, len(inputs.x))
        prior_x = inputs.x[rng.choice(len(inputs.x), size=take, replace=False)]
        for e, expert in enumerate(experts):
            x = inputs.x[inputs.routed_to(e)]
            gate = None if inputs.weights is None else inputs.gate_of(e)
            self._inputs.append(ExpertInputs(x, intermediate(x, expert, activation), prior_x,
                                             intermediate(prior_x, expert, activation), gate))
        if method == "haq":
            self.alphas = {tier: self._search(fmt) for tier, fmt in self.formats.items()}

    def _search(self, fmt: QuantFormat) -> tuple[float, float | None]:
        """HAQ: exponent for down first (its smoothing changes up), then for gate_up (alpha_down None:
        down is not smoothed)."""
        alpha_down = None
        if self.smooth_down:
            plain = dataclasses.replace(fmt, smooth=False)
            down_cases = [(i.search_rows("mid"), i.absmax("mid"), e.down) for i, e in zip(self._inputs, self.experts)]
            alpha_down = search_alpha(down_cases, plain)
        gu_cases = [(i.search_rows("x"), i.absmax("x"), self._folded(i, e, alpha_down).gate_up)
                    for i, e in zip(self._inputs, self.experts)]
        return search_alpha(gu_cases, fmt), alpha_down

    @staticmethod
    def _down_scales(inputs: ExpertInputs, expert: ExpertWeights, alpha_down: float | None) -> np.ndarray:
        if alpha_down is None:
            return np.ones(expert.down.shape[0], np.float32)
        return np.asarray(smoothing_scales(inputs.absmax("mid"), expert.down, alpha_down), np.float32)

    def _folded(self, inputs: ExpertInputs, expert: ExpertWeights, alpha_down: float | None) -> ExpertWeights:
        if alpha_down is None:
            return expert
        return fold_down_smoothing(expert, self._down_scales(inputs, expert, alpha_down))

    @functools.lru_cache(maxsize=1)  # the pipeline asks for every tier of one expert in a row
    def _gate_up_hessian(self, expert: int) -> np.ndarray:
        inputs = self._inputs[expert]
        return inputs.hessian(inputs.x, inputs.prior_x)

    @functools.lru_cache(maxsize=1)
    def _down_order(self, expert: int) -> np.ndarray:
        """GPTQ's act order of down's inputs (the exact intermediate's Hessian)."""
        inputs = self._inputs[expert]
        return activation_order(inputs.hessian(inputs.mid, inputs.prior_mid))

    def quantize(self, expert: int, tier: str) -> ExpertWeights:
        """One expert at one integer tier; the version carries the biases it computes with."""
        fmt = self.formats[tier]
        weights = self.experts[expert]
        if self.method == "rtn":
            return rtn_expert(weights, fmt)
        h_x = self._gate_up_hessian(expert)
        if self.method == "gptq":
            # down's inputs are the expert's own intermediate units: their order is free (gate_up's
            # columns follow), so down is quantized in act order at no cost at run time
            weights = permute_intermediate(weights, self._down_order(expert))
            gate_up_q = gptq_quantize(weights.gate_up, h_x, fmt)
            down, h_down = compensated_down(self._inputs[expert], weights, np.asarray(dequantize(gate_up_q)),
                                            self.activation)
            return ExpertWeights(gate_up_q, gptq_quantize(down, h_down, fmt)).with_biases_of(weights)
        inputs = self._inputs[expert]
        alpha_gu, alpha_down = self.alphas[tier]
        s = self._down_scales(inputs, weights, alpha_down)
        folded = self._folded(inputs, weights, alpha_down)  # up columns and bias / s
        # gate_up's rows still see x: folding moved its columns, not its inputs
        gate_up_q = haq_quantize(folded.gate_up, h_x, inputs.absmax("x"), alpha_gu, fmt)
        # what x multiplies at run time: the smoothed weight after x's own scaling by act_scale
        seen = np.asarray(gate_up_q.act_scale, np.float32)[:, None] * np.asarray(dequantize(gate_up_q))
        # down * s multiplies the folded intermediate (mid / s): the same output
        down, h_down = compensated_down(inputs, folded._replace(down=weights.down * s[:, None]), seen, self.activation)
        down_q = gptq_quantize(down, h_down, dataclasses.replace(fmt, smooth=False))
        return ExpertWeights(gate_up_q, down_q).with_biases_of(folded)
