"""One decoder layer: pre-norm attention, then the dense MLP or the sparse block."""

from __future__ import annotations

from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.attention import Attention, AttentionMeta
from jmoe.layers.mlp import DenseMLP
from jmoe.layers.moe import MoEBlock
from jmoe.layers.norms import RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, layer_idx, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.is_moe = cfg.moe_layers[layer_idx]
        if self.is_moe:
            self.mlp = MoEBlock(cfg, rngs=rngs, **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, rngs=rngs, **kw)

    def attention_block(self, x, k_cache, v_cache, meta: AttentionMeta, *, want_importance=False):
        """Pre-norm attention with residual: returns (x, h = normed input of the MLP, caches, importance)."""
        attn, k_cache, v_cache, importance = self.self_attn(
            self.input_layernorm(x), k_cache, v_cache, meta, want_importance=want_importance
        )
        x = x + attn
        return x, self.post_attention_layernorm(x), k_cache, v_cache, importance
