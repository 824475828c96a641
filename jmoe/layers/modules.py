"""Which attention, router and norm module a config's layers use, and the KV-cache layout that follows.

A family module sets ModelConfig.attention / .router / .norm; the layers look the kind up here, and the
engine, the budget and calibration size caches through `cache_spec` (never from head counts).
"""

from __future__ import annotations

import jax.numpy as jnp

from jmoe.config import ModelConfig
from jmoe.errors import ConfigError
from jmoe.layers.attention import CacheSpec
from jmoe.layers.gqa import GroupedQueryAttention
from jmoe.layers.mla import LatentAttention
from jmoe.layers.norms import LayerNorm, RMSNorm
from jmoe.layers.routers import SigmoidRouter, SoftmaxRouter, SparseMixerRouter, TopKSoftmaxRouter

ATTENTIONS = {"gqa": GroupedQueryAttention, "mla": LatentAttention}
ROUTERS = {"softmax": SoftmaxRouter, "sigmoid": SigmoidRouter, "sparsemixer": SparseMixerRouter,
           "topk_softmax": TopKSoftmaxRouter}
NORMS = {"rms": RMSNorm, "layer": LayerNorm}


def _lookup(table: dict, kind: str, what: str):
    if kind not in table:
        raise ConfigError(f"unknown {what} {kind!r}; jmoe knows {', '.join(sorted(table))}")
    return table[kind]


def attention_class(cfg: ModelConfig):
    return _lookup(ATTENTIONS, cfg.attention, "attention kind")


def router_class(cfg: ModelConfig):
    return _lookup(ROUTERS, cfg.router, "router kind")


def make_norm(cfg: ModelConfig, dim: int, *, dtype, param_dtype):
    """The config's layer norm (decoder layers and the final norm) over the last `dim` features."""
    return _lookup(NORMS, cfg.norm, "norm kind")(dim, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)


def cache_spec(cfg: ModelConfig, layer_idx: int) -> CacheSpec:
    return attention_class(cfg).cache_spec(cfg, layer_idx)


def attention_head_widths(cfg: ModelConfig) -> tuple[tuple[int, ...], int]:
    """Numbers per query head and token as the attention loop holds them: (the query's score terms,
    the output)."""
    return attention_class(cfg).head_widths(cfg)


def cache_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """KV-cache bytes one token of one sequence takes over every layer (an int8 cache: a byte per
    number and a float32 scale per head of each cached array)."""
    width = sum(h * w for i in range(cfg.num_layers) for h, w in cache_spec(cfg, i))
    if jnp.dtype(dtype) == jnp.int8:
        return width + 4 * sum(h for i in range(cfg.num_layers) for h, _ in cache_spec(cfg, i))
    return width * jnp.dtype(dtype).itemsize
