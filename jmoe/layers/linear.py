"""Dense weights: the one matmul entry point, the linear layer and the embedding table.

A dense weight is stored K-major [K, N] (y = x @ W) either as a plain array (bf16, the dense tier
"bf16") or as a QArray (kernel_formats/qarray.py, dense tiers "int8" / "int4"; "int6" a QPlanes of
two, multiplied plane by plane); model code never branches on which. Every dense projection, the
LM head (tied or not) and the routers multiply through `matmul`:

- on the CPU, `cpu_kernels.matmul` (the native kernel reading the stored bytes, or its XLA
  reference, which is exact float32);
- elsewhere, `jnp.dot` in the compute dtype with float32 accumulation (GPU: bf16 x bf16).

A plain Linear kernel may be stored in the CPU layout (`Linear.tiled`, written by `jmoe convert
--cpu-layout`: columns in tiles of 64, kernel_formats.qarray.tile_plain), which the native kernel
streams tile by tile; every other reader untiles it first (on a GPU, inside the step).

A weight is never promoted whole per step outside that call: the embedding gathers its rows first
and casts (or dequantizes) only those. A quantized embedding table stores E^T [D, V] (each token a
column, groups along D), which is also the tied LM head's K-major weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import cpu_kernels
from jmoe.layers.norms import matmul_precision
from kernel_formats.qarray import (TILE, QArray, QPlanes, QuantFormat, dequantize, is_quantized, prepare_input,
                                   take_columns, template, untile_plain)


def on_cpu() -> bool:
    """Whether this trace computes on the CPU (the model lives on the default device)."""
    return jax.default_backend() == "cpu"


def matmul(x: jax.Array, w, *, int8_dot: bool = False, tiled: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] -> float32 [..., N]; w a plain array or a QArray. int8_dot (CPU only):
    a quantized w multiplies x on its per-group int8 grid (load's cpu_dot="int8"). tiled: a plain w
    stored in the CPU layout."""
    if on_cpu():  # a QPlanes too: both planes in one pass under the int8 dot
        return cpu_kernels.matmul(x, w, int8_dot=int8_dot, tiled=tiled)
    if isinstance(w, QPlanes):  # 6 bits: the low and high planes' products (kernel_formats.qarray)
        return matmul(x, w.low, int8_dot=int8_dot) + matmul(x, w.high, int8_dot=int8_dot)
    if tiled:
        w = untile_plain(w)
    if isinstance(w, QArray):
        x = prepare_input(x, w.act_scale, w.fmt)
        # XLA may fuse this into the dot's operand; compiled for an H100, Mixtral-, GPT-OSS- and
        # DeepSeek-shaped steps hold a dequantized projection in their temporaries (bench/results/gpu_compile)
        w = dequantize(w, x.dtype)
    return jnp.dot(x, w.astype(x.dtype), precision=matmul_precision(x.dtype), preferred_element_type=jnp.float32)


def batched_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, M, K] @ w [B, K, N] -> float32 [B, M, N] for a plain w (bf16 multiplied as stored on the CPU)."""
    if on_cpu():
        return cpu_kernels.batched_matmul(x, w)
    return jnp.einsum("bmk,bkn->bmn", x, w.astype(x.dtype), precision=matmul_precision(x.dtype),
                      preferred_element_type=jnp.float32)


def dense_weight(w, dtype, tiled: bool = False) -> jax.Array:
    """The logical weight [K, N] in `dtype` (for the few small weights used outside a matmul); tiled:
    a plain w stored in the CPU layout."""
    if is_quantized(w):
        return dequantize(w, dtype)
    return (untile_plain(w) if tiled else w).astype(dtype)


def zeros_qarray(fmt: QuantFormat, k: int, n: int) -> QArray | QPlanes:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template(fmt, k, n))


def initial_value(init, rngs: nnx.Rngs | None, shape: tuple, dtype) -> jax.Array:
    """A parameter's initial value: `init` drawn from `rngs`, or zeros when rngs is None (a model built
    only for its shapes, whose weights are loaded: tracing the random initialisers took about 0.17 s
    of the tiny model's 2 s load)."""
    return jnp.zeros(shape, dtype) if rngs is None else init(rngs.params(), shape, dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias) in the compute dtype; kernel [in, out] a plain array or a QArray
    (`quant`), bias float (param_dtype). Parameter names follow nnx.Linear's (kernel, bias)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, param_dtype, rngs,
                 quant: QuantFormat | None = None):
        if quant is None:
            init = nnx.initializers.lecun_normal()
            self.kernel = nnx.Param(initial_value(init, rngs, (in_features, out_features), param_dtype))
        else:
            self.kernel = nnx.Param(zeros_qarray(quant, in_features, out_features))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None
        self.dtype = dtype
        self.int8_dot = False  # static: set by load(cpu_dot="int8")
        self.tiled = False  # static: a plain kernel stored in the CPU layout (set by load, see use_tiled_kernels)
        self.capture = False  # static: record X^T X of the inputs (calibration for GPTQ, capture_inputs)

    def project(self, x):
        """x [..., in] -> float32 [..., out] (bias added in float32)."""
        if self.capture:
            flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
            self.sow(nnx.Intermediate, INPUT_HESSIAN, jnp.dot(flat.T, flat, precision=jax.lax.Precision.HIGHEST),
                     reduce_fn=lambda total, h: total + h, init_fn=lambda: 0.0)
        y = matmul(x.astype(self.dtype), self.kernel.get_value(), int8_dot=self.int8_dot, tiled=self.tiled)
        return self.with_bias(y)

    def with_bias(self, y):
        """The float32 product y with the bias added (in float32), if there is one."""
        return y if self.bias is None else y + self.bias[...].astype(jnp.float32)

    def __call__(self, x):
        return self.project(x).astype(self.dtype)

    def weight(self, dtype) -> jax.Array:
        """The kernel [in, out] in `dtype`."""
        return dense_weight(self.kernel.get_value(), dtype, self.tiled)

    def tileable(self) -> bool:
        """Whether the CPU layout stores this kernel tiled: a plain kernel of whole 64-column tiles."""
        kernel = self.kernel.get_value()
        return not is_quantized(kernel) and kernel.shape[-1] % TILE == 0


def project_together(x, linears: list[Linear]) -> list[jax.Array]:
    """[linear(x) for linear in linears] for Linears that read the same x (a layer's q, k and v; an
    MLP's gate and up): on the CPU one native call for them all (cpu_kernels.matmuls), each result as
    its own call gives it."""
    if not on_cpu() or any(linear.capture for linear in linears):
        return [linear(x) for linear in linears]
    dtype = linears[0].dtype
    ys = cpu_kernels.matmuls(x.astype(dtype), [linear.kernel.get_value() for linear in linears],
                             int8_dot=[linear.int8_dot for linear in linears], tiled=[linear.tiled for linear in linears])
    return [linear.with_bias(y).astype(linear.dtype) for y, linear in zip(ys, linears)]


class Embed(nnx.Module):
    """Token embeddings: rows gathered first, then cast (or dequantized) to the compute dtype.

    Plain: `embedding` [V, D] (nnx.Embed's name and layout). Quantized (`quant`): `embedding` is a
    QArray encoding E^T [D, V], so a lookup gathers columns and the tied LM head multiplies by it
    as it is."""

    def __init__(self, num_embeddings: int, features: int, *, dtype, param_dtype, rngs,
                 quant: QuantFormat | None = None):
        if quant is None:
            init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
            self.embedding = nnx.Param(initial_value(init, rngs, (num_embeddings, features), param_dtype))
        else:
            self.embedding = nnx.Param(zeros_qarray(quant, features, num_embeddings))
        self.features = features
        self.dtype = dtype
        self.int8_dot = False  # static, for the tied LM head: set by load(cpu_dot="int8")

    def __call__(self, ids):
        """ids [...] int -> [..., D] in the compute dtype."""
        table = self.embedding.get_value()
        if not is_quantized(table):
            return jnp.take(table, ids, axis=0).astype(self.dtype)
        cols = take_columns(table, ids.reshape(-1))
        return dequantize(cols, jnp.float32).T.reshape(*ids.shape, self.features).astype(self.dtype)

    def head_weight(self):
        """The tied LM head's weight [D, V]: the QArray as stored, or the plain table transposed
        (folded into the dot by XLA)."""
        table = self.embedding.get_value()
        return table if is_quantized(table) else table.T


def _tileable(model: nnx.Module):
    """(path, Linear) of every Linear whose kernel the CPU layout stores tiled (Linear.tileable)."""
    return [(path, module) for path, module in nnx.iter_graph(model) if isinstance(module, Linear)
            and module.tileable()]


def tiled_kernel_paths(model: nnx.Module) -> list[tuple]:
    """The parameter paths of the plain Linear kernels the CPU layout stores tiled: the attention
    projections, dense MLPs, shared experts and an untied LM head at a plain dense tier.
    Conversion tiles these leaves; load marks their modules (use_tiled_kernels)."""
    return [(*path, "kernel") for path, _ in _tileable(model)]


INPUT_HESSIAN = "input_hessian"  # the nnx.Intermediate a capturing Linear sows


def capture_inputs(module: nnx.Module) -> list[tuple]:
    """Make every Linear with a quantized kernel in `module` record X^T X [K, K] of its inputs as the
    nnx.Intermediate INPUT_HESSIAN (summed over its calls) and return their paths; a static
    attribute, so split the module after this for a graphdef that captures."""
    paths = []
    for path, linear in nnx.iter_graph(module):
        if isinstance(linear, Linear) and is_quantized(linear.kernel.get_value()):
            linear.capture = True
            paths.append(path)
    return paths


def use_tiled_kernels(model: nnx.Module, on: bool) -> nnx.Module:
    """Mark every tileable Linear as holding its kernel in the CPU layout (a static attribute)."""
    for _, module in _tileable(model) if on else []:
        module.tiled = True
    return model
