"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the cache holds the compressed latent.

Keys and values are never expanded. Per layer the cache keeps, per token, the normalised key/value
latent [kv_lora_rank] and the shared rotary key [rope_dim]; the up-projection of keys is folded into
the queries (q_nope @ W_uk gives a query in latent space) and the one of values is applied after
the weighted sum of latents, so attention reads kv_lora_rank + rope_dim numbers per cached token
instead of heads * (2 * head widths).

Both up-projections multiply per head, the keys' one transposed (q_nope @ W_uk[h]^T), which the
integer kernels do not do: the step reads kv_b's weight whole. On the CPU, load holds it already as
those products read it (`absorb_up_projections`: W_uk [H, nope, r] and W_uv [H, r, v], kv_b dropped;
a plain kv_b in its stored dtype, a quantized one in the compute dtype), and one native call runs
each up-projection head by head (`per_head`). Dequantized and transposed inside each step instead,
it took 8-11 ms a layer at DeepSeek-V2-Lite's shapes (an int4 dense tier), two thirds of a decode
token's time; held in float32 and multiplied by XLA's batched dot, a bf16 model's two products took
0.19-0.24 ms a layer, the native calls on bf16 0.15 ms (bench/results/kernels/mla_up_projections_zen5_cpu.json).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.layers.attention import (
    AttentionMeta,
    CacheSpec,
    blocked_attention,
    current_importance,
    write_cache,
)
from jmoe.layers.linear import Linear, batched_matmul, project_together
from jmoe.layers.norms import RMSNorm, matmul_precision
from jmoe.layers.rope import apply_rope
from kernel_formats.qarray import is_quantized

LATENT_NORM_EPS = 1e-6  # transformers builds the q/kv latent norms with their default eps


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(q/k head width), times YaRN's mscale(factor, mscale_all_dim)^2 when the RoPE asks for it."""
    scale = cfg.head_dim**-0.5
    params = cfg.rope_param
    if cfg.rope_type != "default" and params.get("mscale_all_dim"):
        factor = params.get("factor", 1.0)
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nnx.Module):
    @staticmethod
    def cache_spec(cfg: ModelConfig, layer_idx: int) -> CacheSpec:
        """The key/value latent [P, 1, page, kv_lora_rank] and the rotary key [P, 1, page, rope_dim]."""
        return ((1, cfg.kv_lora_rank), (1, cfg.rotary_dim))

    @staticmethod
    def head_widths(cfg: ModelConfig) -> tuple[tuple[int, ...], int]:
        """Numbers per query head and token: the absorbed query's score terms (latent and rotary),
        and the output as the loop sums it (a weighted sum of latents, up-projected after)."""
        return (cfg.kv_lora_rank, cfg.rotary_dim), cfg.kv_lora_rank

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, param_dtype, rngs, quant=None):
        H, D, r = cfg.num_heads, cfg.hidden_size, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.rotary_dim, cfg.v_head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        norm_kw = dict(eps=LATENT_NORM_EPS, dtype=dtype, param_dtype=param_dtype)
        q_width = H * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=cfg.qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, **norm_kw)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_width, bias=False, **kw)
        else:
            self.q_proj = Linear(D, q_width, bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(D, r + self.rope, bias=cfg.qkv_bias, **kw)
        self.kv_a_layernorm = RMSNorm(r, **norm_kw)
        self.kv_b_proj = Linear(r, H * (self.nope + self.v_dim), bias=False, **kw)
        self.o_proj = Linear(H * self.v_dim, D, bias=cfg.o_bias, **kw)
        self.num_heads, self.kv_lora_rank = H, r
        self.scale = softmax_scale(cfg)
        self.window = cfg.sliding_windows[layer_idx]
        self.rope_interleaved = cfg.rope_interleaved
        self.cache_layout = self.cache_spec(cfg, layer_idx)
        self.dtype = dtype
        self.w_uk = self.w_uv = None  # kv_b as the absorbed products read it, once absorbed (absorb)

    def absorb(self, dtype) -> None:
        """Hold kv_b's up-projections per head as the products read them: W_uk [H, nope, r] and W_uv
        [H, r, v]; kv_b itself is dropped. A plain kv_b keeps its stored dtype (the transposes round
        nothing, and a bf16 one is read at half float32's bytes), a quantized one is dequantized to `dtype`."""
        kernel = self.kv_b_proj.kernel.get_value()
        w = self._kv_b_weight(dtype if is_quantized(kernel) else kernel.dtype)
        self.w_uk = nnx.data(nnx.Param(jnp.transpose(w[..., : self.nope], (1, 2, 0))))
        self.w_uv = nnx.data(nnx.Param(jnp.transpose(w[..., self.nope :], (1, 0, 2))))
        self.kv_b_proj = None

    def _kv_b_weight(self, dtype):
        """kv_b's weight as [r, H, nope + v] in `dtype`."""
        return self.kv_b_proj.weight(dtype).reshape(self.kv_lora_rank, self.num_heads, self.nope + self.v_dim)

    def _up_project_keys(self, q_nope, prec):
        """The queries in latent space: q_nope [B, T, H, nope] @ W_uk per head -> [B, H, T, r]."""
        if self.kv_b_proj is None:  # absorbed: one product per head, the weight read as held
            return per_head(q_nope.transpose(2, 0, 1, 3), self.w_uk[...]).transpose(1, 0, 2, 3).astype(self.dtype)
        # Absorbed attention needs kv_b's weight itself (r x H * (nope + v): small, unlike the projections).
        w_k = self._kv_b_weight(self.dtype)[..., : self.nope]
        return jnp.einsum("bthn,rhn->bhtr", q_nope, w_k, precision=prec)

    def _up_project_values(self, context, prec):
        """The weighted sums of latents up-projected per head: context [B, H, T, r] -> [B, T, H, v]."""
        if self.kv_b_proj is None:
            return per_head(context.transpose(1, 0, 2, 3), self.w_uv[...]).transpose(1, 2, 0, 3).astype(self.dtype)
        w_v = self._kv_b_weight(self.dtype)[..., self.nope :]
        return jnp.einsum("bhtr,rhv->bthv", context, w_v, precision=prec)

    def _query_and_latent(self, x):
        """The queries and kv_a's output (latent and rotary key), the two projections of x in one call."""
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        q, kv = project_together(x, [first, self.kv_a_proj_with_mqa])
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, kv

    def __call__(self, x, cache, meta: AttentionMeta, *, want_importance: bool = False):
        """x [B, T, D], cache (latent, rotary key) -> (out [B, T, D], cache, importance [B, T] or None)."""
        B, T, _ = x.shape
        H, r, prec = self.num_heads, self.kv_lora_rank, matmul_precision(self.dtype)
        q, kv = self._query_and_latent(x)
        q = q.reshape(B, T, H, self.nope + self.rope)
        q_nope, q_rot = q[..., : self.nope], q[..., self.nope :]
        latent, k_rot = self.kv_a_layernorm(kv[..., :r]), kv[..., r:]
        q_rot = apply_rope(q_rot, meta.cos, meta.sin, interleaved=self.rope_interleaved)
        k_rot = apply_rope(k_rot[:, :, None, :], meta.cos, meta.sin, interleaved=self.rope_interleaved)
        latent_cache, new_latent = write_cache(cache[0], latent[:, None], meta)  # [P, 1, page, r]
        rot_cache, new_rot = write_cache(cache[1], k_rot.transpose(0, 2, 1, 3), meta)  # [P, 1, page, rope]
        with jax.named_scope("up_keys"):  # named for profiles (bench/decode_profile.py)
            q_latent = self._up_project_keys(q_nope, prec)  # keys' up-projection, absorbed
        # one cache head shared by every query head: the latent query head-major [B, 1, H*T, r], the
        # rotary one token-major [B, T, 1, H, rope], as the projection gives it
        queries = (q_latent.reshape(B, 1, H * T, r), q_rot.reshape(B, T, 1, H, self.rope))
        kw = dict(groups=H, scale=self.scale, window=self.window, precision=prec)
        context, softmax = blocked_attention(queries, (latent_cache, rot_cache), latent_cache, meta, **kw)
        context = context.astype(self.dtype).reshape(B, H, T, r)
        with jax.named_scope("up_values"):
            out = self._up_project_values(context, prec).reshape(B, T, H * self.v_dim)
        importance = None
        if want_importance:
            importance = current_importance(queries, (new_latent, new_rot), meta, softmax, **kw)
        return self.o_proj(out), (latent_cache, rot_cache), importance


def per_head(x, w):
    """x [H, B, T, K] @ w [H, K, N], head by head -> float32 [H, B, T, N]."""
    H, B, T, K = x.shape
    return batched_matmul(x.reshape(H, B * T, K), w).reshape(H, B, T, w.shape[-1])


def absorb_up_projections(graphdef, state, dtype):
    """(graphdef, state) with every latent attention's kv_b held as its absorbed products read it
    (LatentAttention.absorb), in `dtype`; the same objects where the model has none. `state` may
    hold arrays or ShapeDtypeStructs (then so does the result: what the prepared weights take)."""
    if not any(getattr(node, "type", None) is LatentAttention for node in graphdef.nodes):
        return graphdef, state
    holder = {}

    def absorbed(state):
        model = nnx.merge(graphdef, state)
        modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, LatentAttention) and m.kv_b_proj is not None]
        for module in modules:
            module.absorb(dtype)
        holder["graphdef"], new_state = nnx.split(model)
        return new_state

    concrete = all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
    new_state = absorbed(state) if concrete else jax.eval_shape(absorbed, state)
    return holder["graphdef"], new_state
