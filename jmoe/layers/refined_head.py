"""The refined LM head: a coarse head for every token's logits, the best candidates computed again finely.

A decode step reads the whole LM head for one row of logits: on a CPU that streams its weights, the
head of a large-vocabulary model is a large share of a token's bytes (half of a Qwen3-30B-A3B 8-layer
slice's at 6 bits). Only the few largest logits decide a greedy or nucleus choice and most of the
softmax's mass, so the refined head multiplies by the head at a low tier (int4, read whole) and then
takes the `top` largest of those logits again from an int8 copy of the head stored row by row (one
row of D per token, so the step gathers `top` rows: top * D bytes, not V * D). The rest keep the
coarse value. It is per-token mixed precision for the head, as DyMoE is for the experts.

The int8 rows (symmetric, float16 scales per ROW_GROUP along D) also hold the embedding table: its
lookups gather rows too. A tied model keeps one copy: the rows are its embedding table and refine its
coarse head, which is stored beside them (the head then is a Linear of its own, as in an untied model).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernel_formats.qarray import QuantFormat

ROW_GROUP = 32  # int8 row codes share a float16 scale along this many of D
ROW_QMAX = 127
# Logits taken again from the int8 rows: 256 of the bundled model's 4096 give its int4 head about the
# int6 head's perplexity, under llama.cpp Q4_0's on every domain in the per-token mixed mode
# (bench/results/quality/quality_vs_llama_cpp_refined_head_gnr_cpu.json). A row is D bytes: 256 of
# Qwen3's 2048-wide rows are 0.5 MB a token beside the 175 MB of its int4 head.
DEFAULT_TOP = 256


@dataclasses.dataclass(frozen=True)
class RefinedHead:
    """The head format of a refined head: `coarse` the LM head's (a QuantFormat), `top` the logits
    computed again from the int8 rows. Passed where a head format goes (jmoe.layers.transformer)."""

    coarse: QuantFormat
    top: int = DEFAULT_TOP

    @property
    def tiled(self) -> bool:  # the loader's check for a CPU-layout conversion on a GPU
        return self.coarse.tiled

    def rows_json(self) -> dict:
        """The manifest's dense.head_rows entry."""
        return {"bits": 8, "group_size": ROW_GROUP, "top": self.top}


class RowTable(nnx.Module):
    """A [V, D] table as int8 rows (`rows` [V, D], `scales` [V, D / ROW_GROUP] float16): the embedding
    lookups of a refined-head model, and the rows its head refines from."""

    def __init__(self, num_rows: int, features: int, *, dtype):
        if features % ROW_GROUP:
            raise ValueError(f"the refined head needs a width divisible by {ROW_GROUP}, not {features}")
        self.rows = nnx.Param(jnp.zeros((num_rows, features), jnp.int8))
        self.scales = nnx.Param(jnp.zeros((num_rows, features // ROW_GROUP), jnp.float16))
        self.features = features
        self.dtype = dtype

    def take(self, ids) -> jax.Array:
        """ids [...] int -> float32 [..., D]."""
        rows = jnp.take(self.rows.get_value(), ids, axis=0).astype(jnp.float32)
        scales = jnp.take(self.scales.get_value(), ids, axis=0).astype(jnp.float32)
        grouped = rows.reshape(*rows.shape[:-1], -1, ROW_GROUP) * scales[..., None]
        return grouped.reshape(rows.shape)

    def __call__(self, ids):
        """ids [...] int -> [..., D] in the compute dtype (an embedding lookup)."""
        return self.take(ids).astype(self.dtype)


def refine(coarse: jax.Array, x: jax.Array, table: RowTable, top: int, bias: jax.Array | None = None) -> jax.Array:
    """coarse logits [..., V] of hidden states x [..., D], their `top` largest replaced by x . row
    (+ the head's bias [V], if any)."""
    _, ids = jax.lax.top_k(coarse, min(top, coarse.shape[-1]))
    fine = jnp.einsum("...d,...kd->...k", x.astype(jnp.float32), table.take(ids))
    if bias is not None:
        fine = fine + jnp.take(bias.astype(jnp.float32), ids)
    return jnp.put_along_axis(coarse, ids, fine, axis=-1, inplace=False)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows w [n, D] float -> (int8 codes [n, D], float16 scales [n, D / ROW_GROUP]): symmetric,
    each group's largest magnitude at ROW_QMAX (the scale rounded to float16 first, so the codes are
    of the scale stored)."""
    n, d = w.shape
    groups = np.asarray(w, np.float32).reshape(n, d // ROW_GROUP, ROW_GROUP)
    scales = (np.abs(groups).max(-1) / ROW_QMAX).astype(np.float16)
    safe = np.where(scales > 0, scales.astype(np.float32), 1.0)[..., None]
    codes = np.clip(np.rint(groups / safe), -ROW_QMAX, ROW_QMAX).astype(np.int8)
    return codes.reshape(n, d), scales
