"""Entry points of the CPU kernels, with the XLA reference as the fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.expert_ffn import expert_ffn_reference
from pallas_kernels.qarray import QArray, dequantize, prepare_input


def available() -> bool:
    """Whether the native library is loaded (it is not yet: every call runs the XLA reference)."""
    return False


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ w [K, N] -> float32 [..., N]; w a plain array or a QArray (smoothing and W8A8 applied)."""
    if isinstance(w, QArray):
        x = prepare_input(x, w.act_scale, w.fmt)
        w = dequantize(w, jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)


expert_ffn = expert_ffn_reference
