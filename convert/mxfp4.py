"""MXFP4 (OCP microscaling FP4) tensors, as GPT-OSS checkpoints store their experts.

A weight W [..., N, K] (linear orientation: N outputs, K inputs) is stored as two uint8 tensors:

  <name>_blocks  [..., N, K / 32, 16]  two e2m1 codes per byte, the low nibble first (even k)
  <name>_scales  [..., N, K / 32]      one e8m0 exponent per block of 32: scale = 2 ** (byte - 127)

An e2m1 code is a sign bit and 3 bits indexing FP4_VALUES, so W[n, 32 b + j] = FP4[code] * scale[n, b].
This is what transformers' MXFP4 integration dequantizes (integrations/mxfp4.py).
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale
BLOCK_BYTES = BLOCK // 2


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                         f"(expected blocks [..., G, {BLOCK_BYTES}] and scales [..., G])")
    values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore"):  # e8m0 255 (NaN) and other huge scales give inf: the caller checks
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)
