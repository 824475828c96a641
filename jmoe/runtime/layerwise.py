"""The layer-wise path: run_layers one jitted piece at a time, with the host between the pieces.

Each layer's attention runs, then its router and tier selection; the host reads the routing (one
sync per MoE layer), fetches what is missing at the wanted tiers (the next layer's predicted
experts are already in flight), or runs cold experts on the CPU, then the experts run. A layer
whose experts do not all fit the pools at once runs in several passes. The pieces are the decoder
layer's own methods, so the result is the one-jit step's with every expert at its wanted tier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.decoding.engine import jit_for
from jmoe.layers.experts import LayerExperts, Routing
from jmoe.layers.transformer import run_layers
from jmoe.policies.base import LayerRouting
from jmoe.runtime.kernel_fallback import with_kernel_fallback
from jmoe.runtime.predictor import predict_next, recall


def _attend(graphdef, state, x, cache, meta, *, want_importance):
    return nnx.merge(graphdef, state).attend(x, cache, meta, want_importance=want_importance)


def _dense(graphdef, state, x, h):
    return nnx.merge(graphdef, state).feed_forward(x, h, None)[0]


def _route(graphdef, state, h, valid, importance, experts: LayerExperts):
    """Routing and wanted tiers of a MoE layer's tokens (h [B, T, D])."""
    block = nnx.merge(graphdef, state).mlp
    return block.select(block.route(h.reshape(-1, h.shape[-1])), valid, importance, experts)


def _experts(graphdef, state, x, h, ids, weights, wanted, valid, experts: LayerExperts, shared):
    """x + the routed experts visible in `experts` (at their wanted tiers) and, if `shared` (a traced
    bool: a layer split into passes adds it once, and a static flag would compile a second piece on
    the request path), the shared expert."""
    block = nnx.merge(graphdef, state).mlp
    flat = h.reshape(-1, h.shape[-1])
    signals = block.resolve(Routing(ids, weights), wanted, valid, experts)
    out = block.experts_out(flat, signals, valid, experts, shared=False)
    extra = block.shared_out(flat)
    if extra is not None:
        out = out + jnp.where(shared, extra, jnp.zeros_like(extra))
    return x + out.reshape(x.shape)


@jax.jit
def _scatter_add(x, rows, weights, y):
    """x [B, T, D] += weights[:, None] * y at flat token rows (CPU-run expert contributions)."""
    flat = x.reshape(-1, x.shape[-1])
    flat = flat.at[rows].add((weights[:, None] * y.astype(jnp.float32)).astype(x.dtype))
    return flat.reshape(x.shape)


def _predict(graphdef, state, x, valid):
    """The look-ahead: this (next) MoE layer's norm and router on the previous layer's state x."""
    return predict_next(nnx.merge(graphdef, state), x, valid)


def _embed(graphdef, dense, tokens):
    return nnx.merge(graphdef, dense).embed(tokens)


def _head(graphdef, dense, x, *, last_only):
    model = nnx.merge(graphdef, dense)
    return model.logits(x[:, -1:] if last_only else x)


class LayerPieces:
    """A model's decoder layers as per-layer jitted pieces, and what the look-ahead predictor needs."""

    def __init__(self, graphdef, dense):
        self.graphdef, self.dense = graphdef, dense
        model = nnx.merge(graphdef, dense)
        self.cfg = model.config
        self.layers = [nnx.split(layer) for layer in model.layers]
        self.moe_index = {layer: i for i, layer in enumerate(self.cfg.moe_layer_indices)}
        self.embed = jit_for(_embed, graphdef)
        self.head = jit_for(_head, graphdef, static_argnames=("last_only",))
        self.attend = [jit_for(_attend, g, static_argnames=("want_importance",), donate_argnums=(2,))
                       for g, _ in self.layers]
        self.dense_mlp = [jit_for(_dense, g) for g, _ in self.layers]
        self.route = [jit_for(_route, g) for g, _ in self.layers]
        self.experts = [jit_for(_experts, g) for g, _ in self.layers]
        # the look-ahead predictor applies a MoE layer's norm and router to the previous layer's state
        self.predict = [jit_for(_predict, g) for g, _ in self.layers]


class LayerwiseRunner:
    """run_layers' runner for the layer-wise path (see the module docstring)."""

    def __init__(self, pieces: LayerPieces, res, valid: np.ndarray, phase: str):
        self.pieces, self.res, self.valid, self.phase = pieces, res, valid, phase
        self.valid_dev = jax.device_put(valid, res.device)
        res.stats.count_io(transfers=1, nbytes=valid.nbytes)
        self.num_layers = len(pieces.layers)
        self.routings: list[LayerRouting] = []
        self.predicted: set[int] | None = None  # experts predicted for the MoE layer about to run

    def is_moe(self, i: int) -> bool:
        return i in self.pieces.moe_index

    def attend(self, i, x, cache, meta, want_importance):
        state = self.pieces.layers[i][1]
        self.res.stats.count_io(executions=1)
        return self.pieces.attend[i](state, x, cache, meta, want_importance=want_importance)

    def feed_forward(self, i, x, h, meta, importance):
        state = self.pieces.layers[i][1]
        count = self.res.stats.count_io
        if not self.is_moe(i):
            count(executions=1)
            return self.pieces.dense_mlp[i](state, x, h), None
        res, cfg, mi = self.res, self.pieces.cfg, self.pieces.moe_index[i]
        flat_importance = None if importance is None else importance.reshape(-1)
        experts = res.layer_experts(mi, self.phase)
        if flat_importance is not None:
            count(executions=1)  # the reshape above
        signals = self.pieces.route[i](state, h, self.valid_dev, flat_importance, experts)
        count(executions=1)
        lookahead = None
        if res.policy.prefetch and mi + 1 < cfg.num_moe_layers:
            nxt = cfg.moe_layer_indices[mi + 1]
            lookahead = self.pieces.predict[nxt](self.pieces.layers[nxt][1], x, self.valid_dev)
            count(executions=1)
        ids, weights, wanted, imp = jax.device_get((signals.ids, signals.weights, signals.wanted, flat_importance))
        res.synced(3 if flat_importance is None else 4)
        r = LayerRouting(res.step_index, self.phase, mi, cfg.num_moe_layers, ids, weights, self.valid, imp,
                         wanted, wanted)
        self.routings.append(r)
        if self.predicted is not None:
            hit, total = recall(self.predicted, set(int(e) for e in r.experts()))
            res.stats.predicted += hit
            res.stats.actual += total
        self.predicted = None
        if lookahead is not None:
            counts, gate = (np.asarray(a) for a in lookahead)
            res.synced(2)
            self.predicted = set(int(e) for e in np.flatnonzero(counts))
            rank_by = counts if self.phase == "prefill" else gate
        device_wanted, cpu_experts = res.plan_layer(r)
        passes = res.split_passes(mi, device_wanted) or [{}]
        for p, group in enumerate(passes):
            keys = res.fetch_pass(mi, group)
            if p == 0 and lookahead is not None:
                res.prefetch_predicted(mi + 1, rank_by)
            res.cache.wait(keys)

            def run(group=group, p=p, x=x):
                # one pass and nothing on the CPU: the whole layer's tables (no other routed expert is
                # resident to run twice); otherwise only this pass's experts are visible
                visible = res.layer_experts(mi, self.phase, None if len(passes) == 1 and not cpu_experts else group)
                return self.pieces.experts[i](state, x, h, signals.ids, signals.weights, signals.wanted,
                                              self.valid_dev, visible, np.bool_(p == 0))

            x = with_kernel_fallback([res], run)
            count(executions=1)
            res.finish_pass(keys)
        flat_h = h.reshape(-1, h.shape[-1])
        count(executions=1)
        for expert, tier in cpu_experts:
            tokens, position = np.nonzero(r.ids == expert)
            keep = r.valid[tokens]
            tokens, position = tokens[keep], position[keep]
            y = res.cpu.run(flat_h[tokens], tier, mi, expert)
            x = _scatter_add(x, jnp.asarray(tokens), jnp.asarray(r.scores[tokens, position]), y)
            count(executions=5, reads=1, transfers=4)  # gather, the CPU's call, its rows both ways, the scatter
        return x, None


def run_layerwise(pieces: LayerPieces, res, tokens, cache, meta, valid: np.ndarray, *, last_only: bool, phase: str):
    """One step through the layer-wise path: (logits, cache)."""
    runner = LayerwiseRunner(pieces, res, valid, phase)
    want_importance = phase == "prefill" and res.policy.wants_importance
    x, cache, _, _ = run_layers(runner, pieces.embed(pieces.dense, tokens), cache, meta,
                                want_importance=want_importance)
    res.finish_layerwise(runner.routings)
    res.stats.count_io(executions=2)  # the embedding and the head
    return pieces.head(pieces.dense, x, last_only=last_only), cache
