"""The layer-wise step: jitted per-layer pieces with the host between them.

After each layer's attention and router the host reads the routing, asks the policy which tier
each routed expert should run at, fetches what is missing (the next layer's predicted experts are
already in flight), or runs cold experts on the CPU, then dispatches the experts. A layer whose
experts do not all fit in the pools at once runs in several passes. Exact: the same layer code as
the one-jit step, every expert at the tier the policy asked for.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.decoding.engine import attention_meta
from jmoe.layers.attention import KVCache
from jmoe.layers.experts import LayerExperts, routed_experts
from jmoe.policies import LayerRouting
from jmoe.runtime.predictor import predict_next, rank_predictions, recall


@partial(jax.jit, static_argnums=0, static_argnames=("want_importance",), donate_argnums=(3, 4))
def _attention_piece(graphdef, state, x, k_cache, v_cache, meta, *, want_importance):
    layer = nnx.merge(graphdef, state)
    x, h, k_cache, v_cache, importance = layer.attention_block(x, k_cache, v_cache, meta, want_importance=want_importance)
    B, T, D = h.shape
    h = h.reshape(B * T, D)
    routing = layer.mlp.route(h) if layer.is_moe else None
    return x, h, k_cache, v_cache, routing, importance


@partial(jax.jit, static_argnums=0, static_argnames=("shared",))
def _experts_piece(graphdef, state, h, routing, valid, experts: LayerExperts, *, shared: bool):
    layer = nnx.merge(graphdef, state)
    out = routed_experts(h, routing, valid, experts)
    extra = layer.mlp.shared_out(h) if shared else None
    return out if extra is None else out + extra


@partial(jax.jit, static_argnums=0)
def _dense_piece(graphdef, state, h):
    return nnx.merge(graphdef, state).mlp(h)


@jax.jit
def _residual(x, out):
    return x + out.reshape(x.shape).astype(x.dtype)


@jax.jit
def _scatter_add(out, rows, weights, y):
    """out [N, D] += weights[:, None] * y at token rows (CPU-run expert contributions)."""
    return out.at[rows].add((weights[:, None] * y.astype(jnp.float32)).astype(out.dtype))


@partial(jax.jit, static_argnums=0)
def _embed_piece(graphdef, dense, tokens):
    return nnx.merge(graphdef, dense).embed(tokens)


@partial(jax.jit, static_argnums=0, static_argnames=("last_only",))
def _head_piece(graphdef, dense, x, *, last_only):
    model = nnx.merge(graphdef, dense)
    return model.logits(x[:, -1:] if last_only else x)


def token_importance(received, write_start: int, num_tokens: int) -> np.ndarray | None:
    """Attention received per cache slot [B, S] -> per current token [B * T] (None if not computed)."""
    if received is None:
        return None
    return np.asarray(received)[:, write_start : write_start + num_tokens].reshape(-1)


class LayerwiseStep:
    def __init__(self, runtime, graphdef, dense):
        self.rt = runtime
        self.graphdef, self.dense = graphdef, dense
        model = nnx.merge(graphdef, dense)
        self.cfg = model.config
        self.layers = [nnx.split(layer) for layer in model.layers]
        self.moe_index = {layer: i for i, layer in enumerate(self.cfg.moe_layer_indices)}
        # What the look-ahead predictor needs of each MoE layer: its router and the norm before it.
        self.router_inputs = [
            (model.layers[i].post_attention_layernorm.weight[...], model.layers[i].mlp.router.kernel[...])
            for i in self.cfg.moe_layer_indices
        ]

    def run(self, tokens, cache: KVCache, write_start: int, key_start, *, last_only: bool, phase: str):
        rt, cfg = self.rt, self.cfg
        B, T = tokens.shape
        meta = attention_meta(cfg, T, write_start, key_start)
        slots = write_start + np.arange(T)
        valid = (slots[None, :] >= np.asarray(key_start)[:, None]).reshape(-1)  # [B*T] real tokens
        valid_dev = jax.device_put(valid, rt.device)
        x = _embed_piece(self.graphdef, self.dense, tokens)
        ks, vs = list(cache.k), list(cache.v)
        predicted: set[int] | None = None  # experts predicted for the MoE layer about to run
        want_importance = phase == "prefill" and rt.policy.wants_importance
        for i, (graphdef, state) in enumerate(self.layers):
            x, h, ks[i], vs[i], routing, importance = _attention_piece(
                graphdef, state, x, ks[i], vs[i], meta, want_importance=want_importance and i in self.moe_index)
            if routing is None:
                x = _residual(x, _dense_piece(graphdef, state, h))
                continue
            mi = self.moe_index[i]
            lookahead = None
            if rt.policy.prefetch and mi + 1 < len(self.router_inputs):
                norm_w, router_k = self.router_inputs[mi + 1]
                lookahead = predict_next(norm_w, router_k, x.reshape(B * T, -1), valid_dev, top_k=cfg.top_k,
                                         eps=cfg.rms_norm_eps)
            r = LayerRouting(rt.step_index, phase, mi, len(self.router_inputs), np.asarray(routing.ids),
                             np.asarray(routing.weights), valid, token_importance(importance, write_start, T))
            if predicted is not None:
                hit, total = recall(predicted, set(int(e) for e in r.experts()))
                rt.stats.predicted += hit
                rt.stats.actual += total
            predicted = None
            if lookahead is not None:
                counts = np.asarray(lookahead)
                predicted = set(int(e) for e in np.flatnonzero(counts))
                next_prefetch = (mi + 1, rank_predictions(counts, rt.prefetch_limit()))
            else:
                next_prefetch = None
            out = self._experts(graphdef, state, h, routing, valid_dev, r, next_prefetch)
            x = _residual(x, out)
        logits = _head_piece(self.graphdef, self.dense, x, last_only=last_only)
        return logits, KVCache(tuple(ks), tuple(vs))

    def _experts(self, graphdef, state, h, routing, valid_dev, r: LayerRouting, next_prefetch):
        """Every routed expert of one layer at its wanted tier: fetched, resident, or on the CPU."""
        rt = self.rt
        device_wanted, cpu_experts = rt.plan_layer(r)
        passes = rt.split_passes(r.layer, device_wanted)
        out = None
        for p, group in enumerate(passes or [{}]):
            keys = rt.fetch_group(r.layer, group)
            if p == 0 and next_prefetch is not None:
                rt.prefetch(*next_prefetch)
            rt.cache.wait(keys)
            tier_row, slot_row = rt.handle_rows(r.layer, group)
            experts = LayerExperts(tier_row, slot_row, rt.pool_arrays(), rt.backend)
            part = _experts_piece(graphdef, state, h, routing, valid_dev, experts, shared=p == 0)
            out = part if out is None else out + part
            rt.finish_group(keys)
        for expert, tier in cpu_experts:
            tokens, position = np.nonzero(r.ids == expert)
            keep = r.valid[tokens]
            tokens, position = tokens[keep], position[keep]
            y = rt.cpu.run(h[tokens], tier, r.layer, expert)
            out = _scatter_add(out, jnp.asarray(tokens), jnp.asarray(r.scores[tokens, position]), y)
        return out
