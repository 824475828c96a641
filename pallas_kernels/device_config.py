"""Per-device launch settings of the GPU kernels: how many programs fill the device.

Decode launches few row blocks, so the kernels split K over programs until about
`target_programs` run (several resident per multiprocessor hide each one's memory latency). The
multiprocessor count comes from the device itself (jax's `core_count`), else from its name; a
device that says neither, and tracing without a GPU (bench/gpu_compile.py compiles for an H100),
get the H100 SXM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class GpuConfig:
    name: str
    multiprocessors: int
    programs_per_multiprocessor: int = 4

    @property
    def target_programs(self) -> int:
        return self.programs_per_multiprocessor * self.multiprocessors


H100_SXM = GpuConfig("H100 SXM", 132)
# by a substring of the device kind, most specific first
BY_NAME = (("H100 PCIe", GpuConfig("H100 PCIe", 114)), ("H100", H100_SXM), ("H200", GpuConfig("H200", 132)),
           ("GH200", GpuConfig("GH200", 132)), ("B200", GpuConfig("B200", 148)), ("A100", GpuConfig("A100", 108)),
           ("L40S", GpuConfig("L40S", 142)), ("L4", GpuConfig("L4", 58)), ("4090", GpuConfig("RTX 4090", 128)))
DEFAULT = H100_SXM


def for_device(device) -> GpuConfig:
    """The settings for one jax device (a non-GPU device: DEFAULT, the compile-only target)."""
    if getattr(device, "platform", None) != "gpu":
        return DEFAULT
    kind = str(getattr(device, "device_kind", ""))
    cores = getattr(device, "core_count", None)
    if isinstance(cores, int) and cores > 0:
        return GpuConfig(kind, cores)
    return next((config for name, config in BY_NAME if name in kind), DEFAULT)


def current() -> GpuConfig:
    """The settings for the device kernels are traced for now (the default backend's first device)."""
    return for_device(jax.devices()[0])
