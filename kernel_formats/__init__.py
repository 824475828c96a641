"""What the core, the converter and both kernel packages share, owned by none of them: the packed
quantized weight (qarray: QArray, its formats, the CPU tile layout and the jnp reference
dequantization), the gated activations (glu) and the full-optimisation jit for long numeric work
(optimised). Imports jax and numpy only, so that neither `pallas_kernels` nor `cpu_kernels` imports the
other, and neither imports `jmoe`."""
