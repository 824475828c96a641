"""Calibration for GPTQ/HAQ: run calibration text through the model one layer at a time.

The converter holds only the dense weights and one layer's experts: hidden states of the
calibration sequences advance layer by layer (the full-precision model), and each MoE layer
exposes its inputs and routing so every expert can be quantized against the tokens routed to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.layers.attention import AttentionMeta
from jmoe.layers.experts import ExpertState
from jmoe.layers.rope import rope_tables
from jmoe.layers.transformer import abstract_model
from jmoe.quant import ExpertWeights
from jmoe.tiers import TIER_CODES


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

    def routed_to(self, expert: int) -> np.ndarray:
        """Token indices routed to `expert`."""
        return np.flatnonzero((self.ids == expert).any(axis=1))


class LayerwiseCalibration:
    """Advances calibration hidden states through the model one decoder layer at a time."""

    def __init__(self, cfg: ModelConfig, dense: dict, tokens: np.ndarray, batch: int = 16):
        self.cfg = cfg
        self.batch = batch
        model = abstract_model(cfg, jnp.float32)
        self._layers = []
        for i, layer in enumerate(model.layers):
            graphdef, state = nnx.split(layer)
            nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dense["layers"][i]))
            self._layers.append((graphdef, state))
        table = np.asarray(dense["embed_tokens"]["embedding"], np.float32)
        self.hidden = table[tokens]  # [n_seq, L, D]
        L = tokens.shape[1]
        cos, sin = rope_tables(jnp.arange(L, dtype=jnp.int32)[None], cfg.head_dim, cfg.rope_theta)
        self._rope = (cos, sin)
        self._normed = None  # MoE/MLP input of the layer entered last, [n_seq, L, D]

    def _meta(self, batch: int) -> AttentionMeta:
        cos, sin = self._rope
        B = batch
        return AttentionMeta(jnp.int32(0), jnp.zeros((B,), jnp.int32), jnp.broadcast_to(cos, (B, *cos.shape[1:])),
                             jnp.broadcast_to(sin, (B, *sin.shape[1:])))

    def _batches(self):
        for start in range(0, self.hidden.shape[0], self.batch):
            yield slice(start, start + self.batch)

    def enter(self, layer: int) -> LayerInputs | None:
        """Run attention of `layer`; for a MoE layer return its inputs and routing."""
        graphdef, state = self._layers[layer]
        normed = np.empty_like(self.hidden)
        for sl in self._batches():
            x, h = _layer_fn("attention", graphdef)(state, jnp.asarray(self.hidden[sl]), self._meta(self.hidden[sl].shape[0]))
            self.hidden[sl], normed[sl] = np.asarray(x), np.asarray(h)
        self._normed = normed
        if not self.cfg.moe_layers[layer]:
            return None
        flat = normed.reshape(-1, normed.shape[-1])
        route = _layer_fn("route", graphdef)
        ids = np.concatenate([np.asarray(route(state, jnp.asarray(flat[i : i + 8192])))
                              for i in range(0, len(flat), 8192)])
        return LayerInputs(flat, ids)

    def leave(self, layer: int, experts: Sequence[ExpertWeights] | None = None) -> None:
        """Add `layer`'s MLP output (full-precision experts for a MoE layer) to the hidden states."""
        graphdef, state = self._layers[layer]
        expert_state = None
        if experts is not None:
            pool = ExpertWeights(*(jnp.asarray(np.stack(w), jnp.float32) for w in zip(*experts)))
            E = len(experts)
            expert_state = ExpertState(
                tier=jnp.full((1, E), TIER_CODES["bf16"], jnp.int32),
                slot=jnp.arange(E, dtype=jnp.int32)[None],
                pools={"bf16": pool},
            )
        for sl in self._batches():
            h = jnp.asarray(self._normed[sl])
            out = _layer_fn("mlp", graphdef)(state, h, expert_state)
            self.hidden[sl] = self.hidden[sl] + np.asarray(out)
        self._normed = None


_JITTED: dict = {}


def _layer_fn(kind: str, graphdef):
    """Jitted per-layer pieces, compiled once per layer structure (identical layers share them)."""
    key = (kind, graphdef)
    if key in _JITTED:
        return _JITTED[key]

    def attention(state, x, meta):
        layer = nnx.merge(graphdef, state)
        B, L, _ = x.shape
        shape = (B, layer.self_attn.num_kv_heads, L, layer.self_attn.head_dim)
        x, h, *_ = layer.attention_block(x, jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype), meta)
        return x, h

    def route(state, h):
        return nnx.merge(graphdef, state).mlp.route(h).ids

    def mlp(state, h, experts):
        layer = nnx.merge(graphdef, state)
        B, L, D = h.shape
        flat = h.reshape(B * L, D)
        if experts is None:
            return layer.mlp(flat).reshape(B, L, D)
        routing = layer.mlp.route(flat)
        return layer.mlp.combine(flat, routing, jnp.ones((B * L,), bool), experts.layer(0)).reshape(B, L, D)

    _JITTED[key] = jax.jit({"attention": attention, "route": route, "mlp": mlp}[kind])
    return _JITTED[key]
