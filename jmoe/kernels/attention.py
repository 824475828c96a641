"""Attention's kernels over the paged KV cache: which one runs the current tokens' attention
(decode, speculative verification, prompt chunks), and where none takes them, the XLA formulation.

The kernels, in the order they are tried: the native CPU kernel (cpu_kernels.attention) for a few
current tokens where the native kernels are in use, then on a GPU the Pallas kernel
(pallas_kernels/decode_attention.py) for any number of them (a prompt chunk in tiles), chosen when
the step is lowered for CUDA (`lax.platform_dependent`; any other platform lowers the XLA
formulation). Each refuses what it cannot take with NotImplementedError before it traces anything;
the caller's `reference` (jmoe/layers/attention.py's online softmax over blocks of keys) takes
everything.
"""

from __future__ import annotations

import os

import jax

import cpu_kernels
import pallas_kernels.decode_attention as pallas_attention

# At most this many current tokens a row go to the native CPU kernel (decode, speculative
# verification: up to 8 per row); longer prompt chunks multiply enough queries per key for XLA's
# batched dots (measured at Qwen3-30B-A3B's heads over 4,096 keys: native 1.7-2.8x faster at 8
# tokens, 0.6-1.1x at 16). On a GPU the Pallas kernel takes prompt chunks too: XLA's loop there
# visits every block of the cache (its trip count known when compiled), the kernel only the blocks
# each tile of tokens reaches.
MAX_KERNEL_TOKENS = 8


def may_lower_for_a_gpu() -> bool:
    """Whether a step traced now may be lowered for a GPU, so that the GPU kernel's branch is traced:
    this process's backend is a GPU, or JMOE_TRACE_GPU_KERNELS=1 (lowering for CUDA from a CPU
    process, as bench/gpu_compile.py does). Elsewhere the branch would be traced for nothing: the
    Pallas kernel's trace added about 0.5 s to each prompt step's compile of the tiny model on a CPU."""
    return os.environ.get("JMOE_TRACE_GPU_KERNELS") == "1" or jax.default_backend() == "gpu"


def decode_attention(queries, keys, values, start, key_start, table, *, num_tokens: int, reference, groups: int,
                     scale: float, window: int | None, sink=None, precision=None):
    """(out, (top, norm)) as cpu_kernels.attention returns them, from the first kernel that takes the
    inputs, else reference() (called with no arguments). queries/keys: per score term (a kernel takes
    one: not MLA's two) a [B, K, G*T, w] query array and its cached keys; values the cached values.
    precision: the dots' on a GPU, as the reference's (the native CPU kernel multiplies in float32)."""
    if len(queries) != 1 or queries[0].ndim != 4:
        return reference()
    args = (queries[0], keys[0], values, start, key_start, table)
    kw = dict(groups=groups, scale=scale, window=window, sink=sink)
    if num_tokens <= MAX_KERNEL_TOKENS:
        try:
            out, top, norm = cpu_kernels.attention(*args, **kw)
            return out, (top, norm)
        except NotImplementedError:
            pass
    if not may_lower_for_a_gpu() or not pallas_attention.supports(*args[:3], groups):
        return reference()

    def on_a_gpu():
        out, top, norm = pallas_attention.decode_attention(*args, precision=precision, **kw)
        return out, (top, norm)

    try:
        return jax.lax.platform_dependent(cuda=on_a_gpu, default=reference)  # chosen when lowered
    except NotImplementedError:
        return reference()
