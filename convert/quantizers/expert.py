"""Quantizing one MoE layer's experts with RTN, GPTQ or HAQ.

GPTQ and HAQ need, per expert, the inputs of its two matmuls: x (the tokens routed to it) for
gate_up and mid = silu(x @ gate) * (x @ up) for down. Experts that saw few calibration tokens get
their statistics shrunk toward the layer's: their Hessian adds `prior_tokens` worth of the average
over a sample of all the layer's tokens, and their activation ranges come from that sample.

HAQ picks one smoothing exponent per layer, matrix and tier by grid search; the down projection's
smoothing is folded into the up projection's columns (mid / s), gate_up's is kept as an input
scale applied at run time.
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
from pallas_kernels.qarray import QuantFormat

METHODS = ("rtn", "gptq", "haq")
PRIOR_TOKENS = 64  # an expert with fewer routed tokens leans on the layer-wide statistics
SEARCH_ROWS = 256  # activation rows per expert used by HAQ's exponent search
PRIOR_ROWS = 512  # rows of all tokens sampled for the layer-wide statistics


def silu(x):
    return x / (1.0 + np.exp(-x))


def intermediate(x: np.ndarray, gate_up: np.ndarray) -> np.ndarray:
    """Input of the down projection: silu(x @ gate) * (x @ up); x [n, D], gate_up [D, 2F] -> [n, F]."""
    g, u = np.split(x @ gate_up, 2, axis=-1)
    return silu(g) * u


@dataclass
class ExpertInputs:
    """Calibration inputs of one expert's two matmuls (routed rows, or the layer sample as fallback)."""

    x: np.ndarray  # [n, D] rows routed to the expert
    mid: np.ndarray  # [n, F]
    prior_x: np.ndarray  # [m, D] sample of all the layer's tokens
    prior_mid: np.ndarray  # [m, F] this expert's intermediate on that sample

    @property
    def few(self) -> bool:
        return len(self.x) < PRIOR_TOKENS

    def hessian(self, rows: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """X^T X of the routed rows plus PRIOR_TOKENS rows' worth of the layer average (float64)."""
        rows, prior = rows.astype(np.float64), prior.astype(np.float64)
        return rows.T @ rows + (PRIOR_TOKENS / len(prior)) * (prior.T @ prior)

    def search_rows(self, which: str) -> np.ndarray:
        rows = self.prior_x if which == "x" else self.prior_mid
        own = self.x if which == "x" else self.mid
        return rows[:SEARCH_ROWS] if self.few else own[:SEARCH_ROWS]

    def absmax(self, which: str) -> np.ndarray:
        return np.abs(self.search_rows(which)).max(axis=0)


def rtn_expert(gate_up: np.ndarray, down: np.ndarray, fmt: QuantFormat) -> ExpertWeights:
    return ExpertWeights(quantize_rtn(gate_up, fmt), quantize_rtn(down, fmt))


def fold_down_smoothing(gate_up: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Divide the up columns by s, so mid comes out already divided by s (exact)."""
    F = s.shape[0]
    folded = gate_up.copy()
    folded[:, F:] /= s[None, :]
    return folded


class LayerQuantizer:
    """Quantizes every expert of one MoE layer at every integer tier with one method."""

    def __init__(self, method: str, formats: dict[str, QuantFormat | None], experts: list[tuple[np.ndarray, np.ndarray]],
                 inputs: LayerInputs | None, seed: int = 0):
        self.method = method
        self.formats = {t: f for t, f in formats.items() if f is not None}
        self.experts = experts  # (gate_up [D, 2F], down [F, D]) K-major float32
        self.alphas: dict[str, tuple[float, float]] = {}
        self._inputs: list[ExpertInputs] = []
        if method == "rtn":
            return
        rng = np.random.default_rng(seed)
        take = min(PRIOR_ROWS, len(inputs.x))
        prior_x = inputs.x[rng.choice(len(inputs.x), size=take, replace=False)]
        for e, (gate_up, _) in enumerate(experts):
            x = inputs.x[inputs.routed_to(e)]
            self._inputs.append(ExpertInputs(x, intermediate(x, gate_up), prior_x, intermediate(prior_x, gate_up)))
        if method == "haq":
            self.alphas = {tier: self._search(fmt) for tier, fmt in self.formats.items()}

    def _search(self, fmt: QuantFormat) -> tuple[float, float]:
        """HAQ: exponent for down first (its smoothing changes up), then for gate_up."""
        plain = dataclasses.replace(fmt, smooth=False)
        down_cases = [(i.search_rows("mid"), i.absmax("mid"), down) for i, (_, down) in zip(self._inputs, self.experts)]
        alpha_down = search_alpha(down_cases, plain)
        gu_cases = []
        for i, (gate_up, down) in zip(self._inputs, self.experts):
            s = smoothing_scales(i.absmax("mid"), down, alpha_down)
            gu_cases.append((i.search_rows("x"), i.absmax("x"), fold_down_smoothing(gate_up, s)))
        return search_alpha(gu_cases, fmt), alpha_down

    @functools.lru_cache(maxsize=1)  # the pipeline asks for every tier of one expert in a row
    def _hessians(self, expert: int) -> tuple[np.ndarray, np.ndarray]:
        inputs = self._inputs[expert]
        return inputs.hessian(inputs.x, inputs.prior_x), inputs.hessian(inputs.mid, inputs.prior_mid)

    def quantize(self, expert: int, tier: str) -> ExpertWeights:
        fmt = self.formats[tier]
        gate_up, down = self.experts[expert]
        if self.method == "rtn":
            return rtn_expert(gate_up, down, fmt)
        h_x, h_mid = self._hessians(expert)
        if self.method == "gptq":
            return ExpertWeights(gptq_quantize(gate_up, h_x, fmt), gptq_quantize(down, h_mid, fmt))
        inputs = self._inputs[expert]
        alpha_gu, alpha_down = self.alphas[tier]
        s = smoothing_scales(inputs.absmax("mid"), down, alpha_down)
        gate_up = fold_down_smoothing(gate_up, s)
        down_q = gptq_quantize(down * s[:, None], h_mid / np.outer(s, s), dataclasses.replace(fmt, smooth=False))
        # gate_up's rows still see x: folding moved its columns, not its inputs
        return ExpertWeights(haq_quantize(gate_up, h_x, inputs.absmax("x"), alpha_gu, fmt), down_q)
