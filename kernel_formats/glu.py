"""How an expert combines its gate and up projections: the gated activation, a static kernel parameter.

Every expert computes gate_up = x @ W_gate_up (+ bias), splits it into [gate | up] halves, and feeds
act(gate, up) to the down projection. Two activations exist:

  "silu"            silu(gate) * up                                     (SwiGLU: Qwen, Mixtral, OLMoE, ...)
  "clamped_swiglu"  g = min(gate, limit), u = clip(up, -limit, limit),  (GPT-OSS)
                    (u + 1) * g * sigmoid(alpha * g)

The same formula runs in the XLA reference and inside the Pallas kernels (written with exp only, so
it lowers to Triton), so both paths agree within rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class GatedActivation:
    kind: str = "silu"
    alpha: float = 1.702  # clamped_swiglu only: the sigmoid's gain
    limit: float = 7.0  # clamped_swiglu only: gate clamped above, up on both sides

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown gated activation {self.kind!r}; choose from {KINDS}")
        if self.kind == "silu":  # one canonical value per kind: jit caches and kernel plans key on it
            object.__setattr__(self, "alpha", 1.702)
            object.__setattr__(self, "limit", 7.0)

    def __call__(self, gate, up):
        """The XLA reference: gate, up [..., F] (any float dtype) -> [..., F] in that dtype."""
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        g = jnp.minimum(gate, self.limit)
        u = jnp.clip(up, -self.limit, self.limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * self.alpha))

    def on_host(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """The same in numpy (the converter's calibration): no jax op, so no compile per row count."""
        gate, up = np.asarray(gate, np.float32), np.asarray(up, np.float32)
        with np.errstate(over="ignore"):  # exp(-gate) = inf for very negative gates: the product is then 0
            if self.kind == "silu":
                return gate / (1.0 + np.exp(-gate)) * up
            g = np.minimum(gate, self.limit)
            u = np.clip(up, -self.limit, self.limit)
            return (u + 1.0) * (g / (1.0 + np.exp(-self.alpha * g)))

    def in_kernel(self, gate, up):
        """The same inside a Pallas kernel (float32 accumulators): only exp, min/max and arithmetic."""
        if self.kind == "silu":
            return gate / (1.0 + jnp.exp(-gate)) * up
        g = jnp.minimum(gate, self.limit)
        u = jnp.maximum(jnp.minimum(up, self.limit), -self.limit)
        return (u + 1.0) * (g / (1.0 + jnp.exp(-self.alpha * g)))


SILU = GatedActivation()
