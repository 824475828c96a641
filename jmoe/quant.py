"""Expert weight formats per tier.

Every expert version is an ExpertWeights pytree in the K-major layout the kernels read. This module
knows each tier's arrays (shapes and dtypes), which fixes the record layout in the expert store and
the slab layout of the device pools.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jmoe.config import ModelConfig
from jmoe.errors import InputError


class ExpertWeights(NamedTuple):
    """One expert's weights: x @ gate_up -> [gate | up], silu(gate) * up @ down.

    gate_up: [..., D, 2F], down: [..., F, D]; a pool adds a leading slots dimension.
    """

    gate_up: Any
    down: Any


def expert_template(cfg: ModelConfig, tier: str) -> ExpertWeights:
    """Shapes and dtypes of one expert version at `tier`."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    if tier == "bf16":
        return ExpertWeights(
            gate_up=jax.ShapeDtypeStruct((D, 2 * F), jnp.bfloat16),
            down=jax.ShapeDtypeStruct((F, D), jnp.bfloat16),
        )
    raise InputError(f"tier {tier!r} has no expert format yet")


def bf16_expert(gate, up, down) -> ExpertWeights:
    """From HF orientation (gate/up [F, D], down [D, F]) to the K-major bf16 layout."""
    gate_up = np.concatenate([np.asarray(gate).T, np.asarray(up).T], axis=1)
    return ExpertWeights(gate_up.astype(ml_dtypes.bfloat16), np.asarray(down).T.astype(ml_dtypes.bfloat16))
