"""The decoder-only MoE transformer (Flax NNX) and the one layer loop every path runs.

`run_layers` is the only loop over decoder layers. What runs each layer's two halves (attention,
then the MLP or sparse block) is a LayerRunner: traced inside the one-jit step (`TracedLayers`),
one jitted piece at a time with the host in between (the layer-wise path,
jmoe/runtime/layerwise.py), or over batches of calibration sequences (convert/calibration.py).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.attention import AttentionMeta, KVCache
from jmoe.layers.decoder_layer import DecoderLayer
from jmoe.layers.experts import ExpertState, wanted_by_importance
from jmoe.layers.fetch import StepFetcher, overlay
from jmoe.layers.modules import make_norm
from jmoe.layers.moe import LayerSignals
from jmoe.layers.linear import Embed, Linear, matmul
from jmoe.layers.refined_head import RefinedHead, RowTable, refine
from kernel_formats.qarray import QuantFormat


class StepSignals(NamedTuple):
    """What one step tells the host, per MoE layer (handle-table row order).

    codes: [3, L_moe, B, T, k] int32: routed expert ids, the tier code the selection wanted and the
    one that ran (packed, so reading them back is one transfer); weights: [L_moe, B, T, k] combine
    weights; missing: [L_moe] assignments of real tokens that ran below their wanted tier;
    importance: [L_moe, B, T] attention each current token received (only when asked for), else None;
    per_expert: [3, L_moe, E] int32 tokens routed to each expert, its wanted and its chosen code;
    gate: [L_moe, E] float32 gate weight each expert received. With experts fetched in the step
    (jmoe/layers/fetch.py): served [L_moe, E] how each was fetched (fetch.SERVED_*, 0: not),
    fetched [L_moe, tiers, 2] and fetch_counts [L_moe, 3] (fetch.LayerReport) and landed
    [tiers, landing] the keys that landed.
    """

    codes: jax.Array
    weights: jax.Array
    missing: jax.Array
    importance: jax.Array | None
    per_expert: jax.Array
    gate: jax.Array
    served: jax.Array | None = None
    fetched: jax.Array | None = None
    fetch_counts: jax.Array | None = None
    landed: jax.Array | None = None

    @property
    def ids(self):
        return self.codes[0]

    @property
    def wanted(self):
        return self.codes[1]

    @property
    def chosen(self):
        return self.codes[2]


class LayerRunner(Protocol):
    num_layers: int

    def is_moe(self, i: int) -> bool: ...

    def attend(self, i: int, x, cache, meta: AttentionMeta, want_importance: bool): ...

    def feed_forward(self, i: int, x, h, meta: AttentionMeta, importance): ...


def run_layers(runner: LayerRunner, x, cache: KVCache | None, meta: AttentionMeta, *, want_importance: bool):
    """Every decoder layer in order: (x, cache, [LayerSignals per MoE layer], [importance [B, T] or None])."""
    caches, signals, importance = [], [], []
    for i in range(runner.num_layers):
        moe = runner.is_moe(i)
        # named scopes: a profile (or the HLO's op metadata) reads "layer_3/moe/experts", not fusion numbers
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                x, h, layer_cache, imp = runner.attend(i, x, None if cache is None else cache.layers[i], meta,
                                                       want_importance and moe)
            with jax.named_scope("moe" if moe else "mlp"):
                x, layer_signals = runner.feed_forward(i, x, h, meta, imp)
        caches.append(layer_cache)
        if moe:
            signals.append(layer_signals)
            importance.append(imp)
    return x, (KVCache(tuple(caches), cache.table) if cache is not None else None), signals, importance


def stack_signals(signals: list[LayerSignals], importance: list, batch: int, tokens: int,
                  fetcher: StepFetcher | None = None) -> StepSignals:
    shape = lambda a: a.reshape(batch, tokens, -1)  # noqa: E731
    codes = jnp.stack([jnp.stack([shape(s.ids), shape(s.wanted), shape(s.chosen)]) for s in signals], axis=1)
    fetched = fetcher.summary_parts() if fetcher is not None else (None,) * 4
    return StepSignals(codes.astype(jnp.int32), jnp.stack([shape(s.weights) for s in signals]),
                       jnp.stack([s.missing for s in signals]), None if importance[0] is None else jnp.stack(importance),
                       jnp.stack([s.per_expert for s in signals], axis=1), jnp.stack([s.gate for s in signals]),
                       *fetched)


class TracedLayers:
    """run_layers inside one trace: every layer of `model`, experts through `experts` (and `pools`,
    which experts fetched in the step are written into, when the state fetches: jmoe/layers/fetch.py)."""

    def __init__(self, model: "Transformer", experts: ExpertState, pools: dict | None = None):
        self.model, self.experts = model, experts
        self.num_layers = len(model.layers)
        self.moe_index = {i: n for n, i in enumerate(model.config.moe_layer_indices)}
        self.pools = experts.pools if pools is None else pools
        self.tables = experts.slots
        self.fetcher = None
        if experts.fetch_spec is not None:
            spec, inputs = experts.fetch_spec, experts.fetch
            plan = spec.unpack(inputs.packed, len(model.config.moe_layer_indices))
            self.fetcher = StepFetcher(spec, inputs, plan, overlay(plan, inputs.previous_keys, spec))
            self.pools = self.fetcher.write_requests(self.pools)

    def is_moe(self, i: int) -> bool:
        return i in self.moe_index

    def attend(self, i, x, cache, meta, want_importance):
        return self.model.layers[i].attend(x, cache, meta, want_importance=want_importance)

    def feed_forward(self, i, x, h, meta, importance):
        B, T, _ = h.shape
        valid = meta.token_valid().reshape(B * T)
        imp = None if importance is None else importance.reshape(B * T)
        if i not in self.moe_index:
            return self.model.layers[i].feed_forward(x, h, valid, imp, None)
        mi = self.moe_index[i]
        experts = self.experts.layer(mi, self.fetcher.tables if self.fetcher else self.tables, self.pools)
        if self.fetcher is None:
            return self.model.layers[i].feed_forward(x, h, valid, imp, experts)

        def serve(routing, wanted, token_valid, experts):
            with jax.named_scope("fetch"):
                served = self.fetcher.serve(mi, routing, wanted, token_valid, experts)
            self.pools = served.pools
            if self.fetcher.spec.predict:  # the next layer's, from this layer's state
                with jax.named_scope("look_ahead"):
                    self._look_ahead(mi, x, valid)
            return served

        return self.model.layers[i].feed_forward(x, h, valid, imp, experts, serve)

    def _look_ahead(self, mi: int, x, valid) -> None:
        """The next MoE layer's norm and router on this layer's state x: what it will probably want."""
        indices = self.model.config.moe_layer_indices
        if mi + 1 >= len(indices):
            return
        layer = self.model.layers[indices[mi + 1]]
        routing = layer.mlp.router(layer.post_attention_layernorm(x.reshape(-1, x.shape[-1])))
        E = layer.mlp.router.num_experts
        one_hot = jax.nn.one_hot(routing.ids, E, dtype=jnp.float32) * valid[:, None, None]
        counts, gate = one_hot.sum((0, 1)), (one_hot * routing.weights[..., None]).sum((0, 1))
        nxt = self.experts.layer(mi + 1, self.fetcher.tables, self.pools)
        wanted = jnp.where(counts > 0, wanted_by_importance(gate, counts > 0, nxt), 0)
        self.fetcher.predict(mi + 1, counts, gate, wanted)


AS_DENSE = "as dense"  # head_quant's default: the embedding table and LM head in the dense tier's format


class Transformer(nnx.Module):
    """The whole model. `quant` is the dense tier's format (None: plain param_dtype weights): the
    attention projections, dense MLPs and shared experts are stored in it, and the LM head and
    embedding table in `head_quant` (default: the same); norms, routers and biases stay float.
    A RefinedHead `head_quant` (jmoe/layers/refined_head.py): the LM head at its coarse format (a
    Linear of its own, tied or not), the embedding table as int8 rows, and an untied head's int8 rows
    in `head_rows` (a tied head refines from the embedding table's)."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype=jnp.bfloat16, rngs: nnx.Rngs,
                 quant: QuantFormat | None = None, head_quant: QuantFormat | RefinedHead | None | str = AS_DENSE):
        self.config = cfg
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        refined = head_quant if isinstance(head_quant, RefinedHead) else None
        head_kw = dict(kw, quant=quant if head_quant is AS_DENSE else refined.coarse if refined else head_quant)
        if refined:
            self.embed_tokens = RowTable(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        else:
            self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, **head_kw)
        self.layers = nnx.List([DecoderLayer(cfg, i, **kw) for i in range(cfg.num_layers)])
        self.norm = make_norm(cfg, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype)
        if cfg.tie_word_embeddings and not refined:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias, **head_kw)
        untied_rows = refined and not cfg.tie_word_embeddings  # a tied head refines from the embedding rows
        self.head_rows = RowTable(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if untied_rows else None
        self.refine_top = refined.top if refined else 0  # static

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, x):
        """Final norm and LM head; float32 logits."""
        x = self.norm(x)
        if self.lm_head is None:
            return matmul(x, self.embed_tokens.head_weight(), int8_dot=self.embed_tokens.int8_dot)
        logits = self.lm_head.project(x)
        if self.refine_top:
            bias = None if self.lm_head.bias is None else self.lm_head.bias[...]
            rows = self.embed_tokens if self.head_rows is None else self.head_rows  # tied: the embedding rows
            logits = refine(logits, x, rows, self.refine_top, bias)
        return logits

    def __call__(self, tokens, cache: KVCache, meta: AttentionMeta, experts: ExpertState, *, want_importance=False,
                 pools: dict | None = None):
        """tokens [B, T] -> (hidden [B, T, D], cache, StepSignals, pools): every layer, experts through
        the handle tables; `pools` (default: the state's) come back with what the step fetched."""
        B, T = tokens.shape
        runner = TracedLayers(self, experts, pools)
        x, cache, signals, importance = run_layers(runner, self.embed(tokens), cache, meta,
                                                   want_importance=want_importance)
        return x, cache, stack_signals(signals, importance, B, T, runner.fetcher), runner.pools


def abstract_model(cfg: ModelConfig, dtype, quant: QuantFormat | None = None,
                   head_quant: QuantFormat | RefinedHead | None | str = AS_DENSE) -> Transformer:
    """The model with shape-only parameters (no memory, no random init); `quant`: the dense tier's
    format, `head_quant`: the LM head's and embedding table's (default: the dense tier's)."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=None, quant=quant, head_quant=head_quant))


__all__ = ["AS_DENSE", "Transformer", "StepSignals", "abstract_model", "run_layers", "TracedLayers"]
