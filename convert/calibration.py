"""Calibration for GPTQ/HAQ: run calibration text through the model one layer at a time.

The converter holds only the dense weights and one layer's experts: hidden states of the
calibration sequences advance layer by layer (the full-precision model), and each MoE layer
exposes its inputs and routing so every expert can be quantized against the tokens routed to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.layers.attention import AttentionMeta
from jmoe.layers.experts import ExpertState, Selection
from jmoe.layers.linear import INPUT_HESSIAN, capture_inputs, use_tiled_kernels
from jmoe.layers.rope import rope_tables
from jmoe.layers.transformer import AS_DENSE, abstract_model, run_layers
from jmoe.quant import ExpertWeights
from kernel_formats.optimised import optimised_jit
from kernel_formats.qarray import QArray, QuantFormat


def calibration_tokens(tokenizer, files: Sequence[str | Path], num_sequences: int, seq_len: int,
                       seed: int = 0) -> np.ndarray:
    """[num_sequences, seq_len] token windows drawn evenly from the calibration text files.

    Each window tokenizes only a random span of text, so large calibration files cost little.
    """
    if tokenizer is None:
        raise InputError("calibration needs the checkpoint's tokenizer to read the calibration text")
    rng = np.random.default_rng(seed)
    per_file = [num_sequences // len(files) + (i < num_sequences % len(files)) for i in range(len(files))]
    windows = []
    for path, count in zip(files, per_file):
        path = Path(path)
        if not path.is_file():
            raise InputError(f"calibration file {path} does not exist")
        text = path.read_text(errors="replace")
        for _ in range(count):
            windows.append(_window(tokenizer, text, seq_len, rng, path))
    return np.stack(windows)


def _window(tokenizer, text: str, seq_len: int, rng, path: Path) -> np.ndarray:
    span = 8 * seq_len  # characters; doubled until the span holds seq_len tokens
    while True:
        start = int(rng.integers(0, max(1, len(text) - span)))
        ids = tokenizer.encode(text[start : start + span])
        if len(ids) >= seq_len:
            return np.asarray(ids[:seq_len], np.int32)
        if span >= len(text):
            raise InputError(f"calibration file {path} has fewer than {seq_len} tokens")
        span *= 2


@dataclass
class LayerInputs:
    """What one MoE layer saw during calibration: its input rows and their routing."""

    x: np.ndarray  # [n_tokens, D] float32, the normed input of the MoE block
    ids: np.ndarray  # [n_tokens, k] routed experts
    weights: np.ndarray | None = None  # [n_tokens, k] their combine weights

    def routed_to(self, expert: int) -> np.ndarray:
        """Token indices routed to `expert`."""
        return np.flatnonzero((self.ids == expert).any(axis=1))

    def gate_of(self, expert: int) -> np.ndarray:
        """[n] the combine weight of `expert` in each token routed to it (routed_to's order)."""
        rows = self.routed_to(expert)
        return (np.where(self.ids[rows] == expert, self.weights[rows], 0.0)).sum(axis=1)


class LayerwiseCalibration:
    """Runs the calibration sequences through the model with run_layers, one decoder layer at a
    time over every sequence (hidden states stay on the host between layers). At each MoE layer
    `on_moe_layer(moe_index, inputs)` gets the layer's inputs and routing and returns the layer's
    full-precision experts, which then compute the layer's output; it is where the converter
    quantizes and writes that layer, so only one layer's experts are ever held.

    With `quantize_dense(path, stored, hessian) -> QArray`, each layer's quantized Linears (attention
    projections, dense MLP, shared expert) are quantized again before the layer computes its
    output: a first pass records X^T X of each one's inputs (as the layers before, already done, and
    this layer's round-to-nearest weights give them), `quantize_dense` returns the weight for the
    dense tree's leaf at `path` (stored there as `stored`), and the layer then runs on it
    (convert/dense_gptq.py)."""

    def __init__(self, cfg: ModelConfig, dense: dict, tokens: np.ndarray, batch: int = 16, *,
                 quant: QuantFormat | None = None, head_quant: QuantFormat | None | str = AS_DENSE,
                 progress: bool = False, tiled_kernels: bool = False,
                 quantize_dense: Callable[[tuple, QArray, np.ndarray], QArray] | None = None):
        """dense: the stored dense tree (at the dense tier `quant` and head tier `head_quant`, as the
        converter wrote it; tiled_kernels: its plain projections in the CPU layout); with
        quantize_dense, its layers' quantized leaves are replaced as calibration reaches them."""
        self.cfg = cfg
        self.batch = batch
        self.progress = progress
        self.dense = dense
        self.quantize_dense = quantize_dense
        model = use_tiled_kernels(abstract_model(cfg, jnp.float32, quant, head_quant), tiled_kernels)
        self.layers = []
        for i, layer in enumerate(model.layers):
            graphdef, state = nnx.split(layer)
            nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dense["layers"][i]))
            self.layers.append((graphdef, state))
        graphdef, state = nnx.split(model.embed_tokens)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dense["embed_tokens"]))
        self.hidden = np.array(nnx.merge(graphdef, state)(jnp.asarray(tokens)))  # [n_seq, L, D], writable
        graphdef, state = nnx.split(model.norm)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dense["norm"]))
        self._final_norm = nnx.merge(graphdef, state)
        L = tokens.shape[1]
        self._rope = rope_tables(jnp.arange(L, dtype=jnp.int32)[None], cfg)

    def run(self, on_moe_layer: Callable[[int, LayerInputs], Sequence[ExpertWeights]]) -> None:
        runner = _CalibrationRunner(self, on_moe_layer)
        with tqdm(total=len(self.layers), desc="calibration", unit="layer", disable=not self.progress) as bar:
            runner.done = bar.update
            self.hidden, *_ = run_layers(runner, self.hidden, None, None, want_importance=False)

    def head_inputs(self) -> np.ndarray:
        """After run(): what the LM head multiplies, the final norm of the last layer's outputs [n, D] float32."""
        x = self.hidden.reshape(-1, self.hidden.shape[-1])
        step = 8192
        return np.concatenate([np.asarray(self._final_norm(jnp.asarray(x[i : i + step])), np.float32)
                               for i in range(0, len(x), step)])

    def requantize(self, i: int, part: str, capture_pass) -> None:
        """Layer i's quantized Linears under `part` ("self_attn" or "mlp") quantized again from the
        X^T X their inputs gave in `capture_pass(graphdef, state)` (a jitted layer piece returning the
        captured intermediates), written into the dense tree and the layer's state."""
        if self.quantize_dense is None:
            return
        graphdef, state = self.layers[i]
        layer = nnx.merge(graphdef, state)
        paths = capture_inputs(getattr(layer, part))
        if not paths:
            return
        capturing, _ = nnx.split(layer)
        hessians = {}
        for captured in capture_pass(capturing, state):
            for path in paths:
                node = captured.get(part, {})
                for key in path:
                    node = node.get(key, {})
                if INPUT_HESSIAN in node:  # a weight read outside a product (MLA's absorbed kv_b) records nothing
                    hessians[path] = hessians.get(path, 0.0) + np.asarray(node[INPUT_HESSIAN], np.float64)
        for path, hessian in hessians.items():
            linear = self.dense["layers"][i][part]
            for key in path:
                linear = linear[key]
            linear["kernel"] = self.quantize_dense(("layers", i, part, *path, "kernel"), linear["kernel"], hessian)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, self.dense["layers"][i]))

    def meta(self, batch: int) -> AttentionMeta:
        cos, sin = self._rope
        zeros = jnp.zeros((batch,), jnp.int32)
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]  # a page of the sequence's length per row
        return AttentionMeta(zeros, zeros, jnp.broadcast_to(cos, (batch, *cos.shape[1:])),
                             jnp.broadcast_to(sin, (batch, *sin.shape[1:])), rows)

    def batches(self):
        for start in range(0, self.hidden.shape[0], self.batch):
            yield slice(start, start + self.batch)


class _CalibrationRunner:
    """run_layers' runner over host-resident calibration hidden states, in batches of sequences."""

    def __init__(self, calib: LayerwiseCalibration, on_moe_layer):
        self.calib, self.on_moe_layer = calib, on_moe_layer
        self.done = lambda n: None
        self.num_layers = len(calib.layers)
        self.moe_index = {i: n for n, i in enumerate(calib.cfg.moe_layer_indices)}

    def is_moe(self, i: int) -> bool:
        return i in self.moe_index

    def attend(self, i, x, cache, meta, want_importance):
        calib = self.calib
        calib.requantize(i, "self_attn", lambda graphdef, state: (
            _layer_fn("attention_inputs", graphdef)(state, jnp.asarray(x[sl]), calib.meta(x[sl].shape[0]))
            for sl in calib.batches()))
        graphdef, state = self.calib.layers[i]
        normed = np.empty_like(x)
        for sl in self.calib.batches():
            out, h = _layer_fn("attention", graphdef)(state, jnp.asarray(x[sl]), self.calib.meta(x[sl].shape[0]))
            x[sl], normed[sl] = np.asarray(out), np.asarray(h)
        return x, normed, None, None

    def feed_forward(self, i, x, h, meta, importance):
        self.calib.requantize(i, "mlp", lambda graphdef, state: (
            _layer_fn("mlp_inputs", graphdef)(state, jnp.asarray(h[sl])) for sl in self.calib.batches()))
        graphdef, state = self.calib.layers[i]
        experts = None
        if self.is_moe(i):
            flat = h.reshape(-1, h.shape[-1])
            route = _layer_fn("route", graphdef)
            routed = [route(state, jnp.asarray(flat[j : j + 8192])) for j in range(0, len(flat), 8192)]
            ids = np.concatenate([np.asarray(r[0]) for r in routed])
            gates = np.concatenate([np.asarray(r[1], np.float32) for r in routed])
            weights = self.on_moe_layer(self.moe_index[i], LayerInputs(flat, ids, gates))
            # The bf16 tier's pool (half a float32 copy of the layer): what that tier runs; biases stay float32.
            stack = lambda ws, dtype: jnp.asarray(np.stack([np.asarray(w, dtype) for w in ws]))  # noqa: E731
            pool = ExpertWeights(*(None if ws[0] is None else stack(ws, jnp.bfloat16 if n < 2 else np.float32)
                                   for n, ws in enumerate(zip(*weights))))
            E = len(weights)
            experts = ExpertState({"bf16": jnp.arange(E, dtype=jnp.int32)[None]}, {"bf16": pool},
                                  Selection.uniform(1, E, "bf16"))
        for sl in self.calib.batches():
            x[sl] = np.asarray(_layer_fn("mlp", graphdef)(state, jnp.asarray(x[sl]), jnp.asarray(h[sl]), experts))
        self.done(1)
        return x, None


_JITTED: dict = {}


def clear_compiled() -> None:
    """Forget the compiled layer pieces (see jmoe.decoding.engine.clear_compiled)."""
    _JITTED.clear()


def _layer_fn(kind: str, graphdef):
    """Jitted pieces of a decoder layer, compiled once per layer structure (identical layers share them)."""
    key = (kind, graphdef)
    if key in _JITTED:
        return _JITTED[key]

    def attention(state, x, meta):
        layer = nnx.merge(graphdef, state)
        B, L, _ = x.shape
        cache = tuple(jnp.zeros((B, heads, L, width), x.dtype) for heads, width in layer.self_attn.cache_layout)
        x, h, *_ = layer.attend(x, cache, meta)
        return x, h

    def captured(layer):
        return nnx.to_pure_dict(nnx.state(layer, nnx.Intermediate))

    def attention_inputs(state, x, meta):
        """What the capturing Linears of the attention saw (requantize)."""
        layer = nnx.merge(graphdef, state)
        B, L, _ = x.shape
        cache = tuple(jnp.zeros((B, heads, L, width), x.dtype) for heads, width in layer.self_attn.cache_layout)
        layer.attend(x, cache, meta)
        return captured(layer)

    def mlp_inputs(state, h):
        """What the capturing Linears of the dense MLP or the shared expert saw (requantize)."""
        layer = nnx.merge(graphdef, state)
        flat = h.reshape(-1, h.shape[-1])
        layer.mlp.shared_out(flat) if layer.is_moe else layer.mlp(flat)
        return captured(layer)

    def route(state, h):
        routing = nnx.merge(graphdef, state).mlp.route(h)
        return routing.ids, routing.weights

    def mlp(state, x, h, experts):
        layer = nnx.merge(graphdef, state)
        valid = jnp.ones((h.shape[0] * h.shape[1],), bool)
        return layer.feed_forward(x, h, valid, None, None if experts is None else experts.layer(0))[0]

    _JITTED[key] = optimised_jit({"attention": attention, "route": route, "mlp": mlp,
                                  "attention_inputs": attention_inputs, "mlp_inputs": mlp_inputs}[kind])
    return _JITTED[key]
