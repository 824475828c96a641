"""GPTQ for the dense weights: the attention projections, dense MLPs, shared experts and LM head.

Round-to-nearest at int4 costs the bundled model about half a percent of perplexity in the
attention and MLP weights and about 1% in the LM head, which every token's choice reads. When a
conversion calibrates (gptq, haq) and the dense tier or the head is an integer tier, each such
weight is quantized again by GPTQ against what it multiplies during calibration
(convert/calibration.py): layer by layer, each projection's inputs as the layers before it (done
already) and its own layer's round-to-nearest weights give them (captured as X^T X,
jmoe.layers.linear.capture_inputs), and for the head the final norm of the calibration sequences'
last hidden states. For a tied model the head is the
embedding table (stored E^T, one column per token), so the lookups read the same codes. GPTQ
quantizes each column on its own, so a weight is read and quantized in blocks of columns.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tqdm.auto import tqdm

from convert.dense import quantize_columns
from convert.hf_source import TensorSource
from convert.quantizers.gptq import gptq_quantize
from jmoe.config import ModelConfig
from jmoe.models.checkpoint import dense_tensor
from kernel_formats.qarray import QArray

COLUMNS = 8192  # output columns quantized at once (bounds GPTQ's float32 working copies)


def head_path(dense: dict) -> tuple[str, str]:
    """Where the head lives in the dense tree: the LM head, or a tied model's embedding table (a
    refined head is a Linear of its own, tied or not)."""
    return ("lm_head", "kernel") if "lm_head" in dense else ("embed_tokens", "embedding")


def hessian_of(inputs: np.ndarray) -> np.ndarray:
    """X^T X [K, K] in float64 of a weight's inputs X [n, K]."""
    x = np.asarray(inputs, np.float64)
    return x.T @ x


def gptq_columns(read_rows, hessian: np.ndarray, spec: QArray, progress: bool = False, desc: str = "GPTQ") -> QArray:
    """A weight [K, N] in spec's format by GPTQ, COLUMNS columns at a time (convert.dense.quantize_columns).

    read_rows(rows: slice) -> the source's rows [rows, K] (its output units, float32)."""
    def quantize(w, fmt):
        # float scales: quantize_columns codes 8-bit ones on their columns' bases, as the experts' GPTQ does
        q = gptq_quantize(w, hessian, dataclasses.replace(fmt, scale_bits=16))
        return q.values, q.scales, q.offsets

    n = spec.n
    blocks = [slice(start, min(n, start + COLUMNS)) for start in range(0, n, COLUMNS)]
    with tqdm(total=n, desc=desc, unit="col", unit_scale=True, disable=not progress) as bar:
        def read(rows):
            bar.update(rows.stop - rows.start)
            return read_rows(rows)

        return quantize_columns(read, spec, quantize, blocks)


def calibrated_weight(source: TensorSource, cfg: ModelConfig, path: tuple, spec: QArray, hessian: np.ndarray,
                      progress: bool = False) -> QArray:
    """The quantized dense leaf at `path` (a kernel, or a quantized embedding table: E^T), shaped
    like `spec`, quantized by GPTQ from the checkpoint's float weight against `hessian` [K, K]."""
    tensor = dense_tensor(cfg, path)
    name = next((n for n in tensor.hf_names if n in source), tensor.hf_names[0])
    shape = (spec.n, spec.k)  # the source's [out, in]
    return gptq_columns(lambda rows: source.get(name, shape, rows), hessian, spec, progress,
                        desc=f"{'.'.join(map(str, path[:-1]))} (GPTQ)")


def calibrated_head(source: TensorSource, cfg: ModelConfig, dense: dict, inputs: np.ndarray,
                    progress: bool = False) -> None:
    """Replace the quantized head in `dense` by GPTQ's against `inputs` [n, D], the final-norm
    outputs of the calibration tokens (LayerwiseCalibration.head_inputs)."""
    module, leaf = head_path(dense)
    dense[module][leaf] = calibrated_weight(source, cfg, (module, leaf), dense[module][leaf], hessian_of(inputs),
                                            progress)
