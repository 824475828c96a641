"""`optimised_jit`: jax.jit compiled at XLA's full optimisation, whatever XLA_FLAGS asks.

For numeric work that runs long by itself rather than inside a model step: the conversion's
quantizer searches, the packing they feed and the calibration passes run for minutes over a real
model's weights and pay each compile once per shape. A process that lowers XLA's optimisation level
for faster compiles (the test suite does: tests/conftest.py) still runs these at full speed; without
such a flag this changes nothing (the level given is XLA's default).
"""

from __future__ import annotations

import functools

import jax

FULL_OPTIMISATION = {"xla_backend_optimization_level": 2}


def optimised_jit(fun=None, /, **jit_kwargs):
    """jax.jit(fun, **jit_kwargs) at full optimisation; usable as @optimised_jit or
    @functools.partial(optimised_jit, static_argnums=...). Called with traced arguments (inside
    another jit, where jax refuses compile options) it is the plain jit, inlined like any nested one."""
    if fun is None:
        return functools.partial(optimised_jit, **jit_kwargs)
    plain = jax.jit(fun, **jit_kwargs)
    optimised = jax.jit(fun, compiler_options=FULL_OPTIMISATION, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs)))
        return (plain if traced else optimised)(*args, **kwargs)

    return call
