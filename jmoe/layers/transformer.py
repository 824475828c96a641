"""The decoder-only MoE transformer (Flax NNX), built from a ModelConfig.

The full step runs every layer in one jitted call; the same per-layer methods serve the
layer-wise path, which stops between attention/routing and the experts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.attention import AttentionMeta, KVCache
from jmoe.layers.decoder_layer import DecoderLayer
from jmoe.layers.experts import ExpertState
from jmoe.layers.moe import Routing
from jmoe.layers.norms import RMSNorm, linear, matmul_precision


class StepSignals(NamedTuple):
    """What one step tells the host about routing (per MoE layer, in handle-table row order).

    ids/weights: [L_moe, B, T, k]; importance: [L_moe, B, S] mean attention each cached token
    received (only when asked for), else None.
    """

    ids: jax.Array
    weights: jax.Array
    importance: jax.Array | None


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, x):
        """Final norm and LM head; float32 logits."""
        x = self.norm(x)
        if self.lm_head is None:
            table = self.embed_tokens.embedding[...].astype(self.dtype)
            out = jnp.dot(x, table.T, precision=matmul_precision(self.dtype), preferred_element_type=jnp.float32)
        else:
            out = self.lm_head(x)
        return out.astype(jnp.float32)

    def __call__(self, tokens, cache: KVCache, meta: AttentionMeta, experts: ExpertState, *, want_importance=False):
        """tokens [B, T] -> (hidden [B, T, D], cache, StepSignals). Every layer, experts via the handle table."""
        B, T = tokens.shape
        x = self.embed(tokens)
        valid = meta.token_valid().reshape(B * T)
        ks, vs, ids, weights, importance = [], [], [], [], []
        moe_index = 0
        for i, layer in enumerate(self.layers):
            x, h, k_i, v_i, imp = layer.attention_block(
                x, cache.k[i], cache.v[i], meta, want_importance=want_importance and layer.is_moe
            )
            ks.append(k_i)
            vs.append(v_i)
            h = h.reshape(B * T, -1)
            if layer.is_moe:
                routing = layer.mlp.route(h)
                out = layer.mlp.combine(h, routing, valid, experts.layer(moe_index))
                ids.append(routing.ids.reshape(B, T, -1))
                weights.append(routing.weights.reshape(B, T, -1))
                if imp is not None:
                    importance.append(imp)
                moe_index += 1
            else:
                out = layer.mlp(h)
            x = x + out.reshape(B, T, -1)
        signals = StepSignals(
            jnp.stack(ids), jnp.stack(weights), jnp.stack(importance) if importance else None
        )
        return x, KVCache(tuple(ks), tuple(vs)), signals


def abstract_model(cfg: ModelConfig, dtype) -> Transformer:
    """The model with shape-only parameters (no memory, no random init)."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


__all__ = ["Transformer", "StepSignals", "abstract_model", "Routing"]
