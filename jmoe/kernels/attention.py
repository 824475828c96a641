"""Attention's kernels over the paged KV cache: which one runs the current tokens' attention
(decode, speculative verification, prompt chunks), and where none takes them, the XLA formulation.

The kernels, in the order they are tried: the native CPU kernel (cpu_kernels.attention) for a few
current tokens (native_tokens) where the native kernels are in use, then on a GPU the Pallas kernel
(pallas_kernels/decode_attention.py) for any number of them (a prompt chunk in tiles), chosen when
the step is lowered for CUDA (`lax.platform_dependent`; any other platform lowers the XLA
formulation). Each refuses what it cannot take with NotImplementedError before it traces anything;
the caller's `reference` (jmoe/layers/attention.py's online softmax over blocks of keys) takes
everything.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import cpu_kernels
import pallas_kernels.decode_attention as pallas_attention

# Current tokens a row that go to the native CPU kernel: at least MAX_KERNEL_TOKENS (decode,
# speculative verification: up to 8 per row), and more while the multiply-adds per cached key and
# cache head (query heads per cache head x tokens x width) stay within NATIVE_KEY_WORK; longer
# prompt chunks multiply enough queries per key for XLA's batched dots. Over 4,096 keys (one layer,
# bench.cpu_attention, bench/results/kernels/cpu_attention_*_heads_chunks_zen4_cpu.json) the
# native kernel against XLA's formulation, float32 and int8 caches:
# - Qwen3-30B-A3B's heads (8 query heads a cache head, width 128): 1.8-1.9x at 8 tokens (8,192 a
#   key), 1.05-1.1x at 16 (an earlier measurement of this kernel: 0.6-1.1x);
# - GPT-OSS-20B's (8, width 64): 2.1x at 8, 1.3-1.4x at 16 (8,192), 1.0-1.1x at 32;
# - Mixtral-8x7B's (4, width 128): 2.5x at 8, 1.8-2.0x at 16 (8,192), 1.0-1.5x at 32;
# - the tiny model's (2, width 32): 1.0-1.2x at 64 and 128 (8,192) tokens.
# On a GPU the Pallas kernel takes prompt chunks too: XLA's loop there visits every block of the
# cache (its trip count known when compiled), the kernel only the blocks each tile of tokens reaches.
MAX_KERNEL_TOKENS = 8
NATIVE_KEY_WORK = 8 * 8 * 128


def native_tokens(groups: int, width: int) -> int:
    """Most current tokens a row for which the native CPU kernel runs attention (groups query heads
    a cache head, keys `width` wide)."""
    return max(MAX_KERNEL_TOKENS, NATIVE_KEY_WORK // (groups * width))


def head_major(q: jax.Array) -> jax.Array:
    """A query term as [B, K, G*T, w] (query heads of each cache head, then tokens), from that or from
    token-major [B, T, K, G, w]."""
    if q.ndim == 4:
        return q
    B, T, K, G, w = q.shape
    return q.transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, w)


def may_lower_for_a_gpu() -> bool:
    """Whether a step traced now may be lowered for a GPU, so that the GPU kernel's branch is traced:
    this process's backend is a GPU, or JMOE_TRACE_GPU_KERNELS=1 (lowering for CUDA from a CPU
    process, as bench/gpu_compile.py does). Elsewhere the branch would be traced for nothing: the
    Pallas kernel's trace added about 0.5 s to each prompt step's compile of the tiny model on a CPU."""
    return os.environ.get("JMOE_TRACE_GPU_KERNELS") == "1" or jax.default_backend() == "gpu"


def decode_attention(queries, keys, values, start, key_start, table, *, num_tokens: int, reference, groups: int,
                     scale: float, window: int | None, sink=None, precision=None):
    """(out, (top, norm)) as cpu_kernels.attention returns them, from the first kernel that takes the
    inputs, else reference() (called with no arguments). queries/keys: per score term a query array,
    [B, K, G*T, w] or [B, T, K, G, w], and its cached keys (the native CPU kernel takes one or two
    terms, latent attention's latent and rotary ones; the Pallas kernel one, head-major); values the
    cached values. precision: the dots' on a GPU, as the reference's (the native CPU kernel multiplies
    in float32)."""
    if len(queries) > 2:
        return reference()
    kw = dict(groups=groups, scale=scale, window=window, sink=sink)
    width = sum(q.shape[-1] for q in queries)
    if num_tokens <= native_tokens(groups, width):
        try:
            parts = [head_major(q) for q in queries]
            q = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
            out, top, norm = cpu_kernels.attention(q, keys[0], values, start, key_start, table,
                                                   keys2=keys[1] if len(keys) == 2 else None, **kw)
            return out, (top, norm)
        except NotImplementedError:
            pass
    if len(queries) != 1 or queries[0].ndim != 4:
        return reference()
    args = (queries[0], keys[0], values, start, key_start, table)
    if not may_lower_for_a_gpu() or not pallas_attention.supports(*args[:3], groups):
        return reference()

    def on_a_gpu():
        out, top, norm = pallas_attention.decode_attention(*args, precision=precision, **kw)
        return out, (top, norm)

    try:
        return jax.lax.platform_dependent(cuda=on_a_gpu, default=reference)  # chosen when lowered
    except NotImplementedError:
        return reference()
