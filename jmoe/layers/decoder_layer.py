"""One decoder layer: pre-norm attention, then the dense MLP or the sparse block."""

from __future__ import annotations

from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.attention import AttentionMeta
from jmoe.layers.experts import LayerExperts
from jmoe.layers.mlp import DenseMLP
from jmoe.layers.modules import attention_class, make_norm
from jmoe.layers.moe import MoEBlock


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs, quant=None):
        """quant: the dense tier's format for the layer's projections (None: plain param_dtype)."""
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, **kw)
        self.self_attn = attention_class(cfg)(cfg, layer_idx, rngs=rngs, quant=quant, **kw)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, **kw)
        self.is_moe = cfg.moe_layers[layer_idx]
        if self.is_moe:
            self.mlp = MoEBlock(cfg, rngs=rngs, quant=quant, **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, rngs=rngs, quant=quant, **kw)

    def attend(self, x, cache, meta: AttentionMeta, *, want_importance=False):
        """Pre-norm attention with residual: (x, h = normed input of the MLP, this layer's cache,
        importance [B, T]: attention each current token received, or None)."""
        attn, cache, importance = self.self_attn(self.input_layernorm(x), cache, meta, want_importance=want_importance)
        x = x + attn
        return x, self.post_attention_layernorm(x), cache, importance

    def feed_forward(self, x, h, token_valid, token_importance=None, experts: LayerExperts | None = None, serve=None):
        """The MLP (dense) or the sparse block with its residual: x, h [B, T, D] -> (x, LayerSignals or None).

        token_valid [B*T], token_importance [B*T] or None, serve: the in-step fetch (used by the sparse block only)."""
        B, T, D = h.shape
        flat = h.reshape(B * T, D)
        if not self.is_moe:
            return x + self.mlp(flat).reshape(B, T, D), None
        out, signals = self.mlp(flat, token_valid, token_importance, experts, serve)
        return x + out.reshape(B, T, D), signals
