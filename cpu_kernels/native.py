"""Loading the native library and calling its FFI targets.

The library is the package's extension module `cpu_kernels._native` (built by setup.py). Its
handlers are registered with XLA once, for the CPU platform. Set JMOE_CPU_KERNELS=off to run the
XLA reference instead (for comparisons).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading

import jax
import numpy as np

log = logging.getLogger("jmoe.kernels")
_lock = threading.Lock()
_state: dict = {}

MATMUL = "jmoe_cpu_matmul"
MATMULS = "jmoe_cpu_matmuls"
EXPERT_FFN = "jmoe_cpu_expert_ffn"
ROUTED_FFN = "jmoe_cpu_routed_ffn"
ROUTED_FFN_TIERS = "jmoe_cpu_routed_ffn_tiers"
WRITE_ROWS = "jmoe_cpu_write_rows"
WRITE_SLOTS = "jmoe_cpu_write_slots"
COPY_RECORDS = "jmoe_cpu_copy_records"
FIRST_MAX = "jmoe_cpu_first_max"
ATTENTION = "jmoe_cpu_attention"


def _load():
    """The loaded library, or None (not built, disabled, or failed to register: logged once)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib = None
        if os.environ.get("JMOE_CPU_KERNELS", "on").lower() not in ("off", "0", "false"):
            try:
                from cpu_kernels import _native

                lib = ctypes.cdll.LoadLibrary(_native.__file__)
                for name, symbol in ((MATMUL, lib.JmoeCpuMatmul), (MATMULS, lib.JmoeCpuMatmuls),
                                     (EXPERT_FFN, lib.JmoeCpuExpertFfn),
                                     (ROUTED_FFN, lib.JmoeCpuRoutedFfn),
                                     (ROUTED_FFN_TIERS, lib.JmoeCpuRoutedFfnTiers), (WRITE_ROWS, lib.JmoeCpuWriteRows),
                                     (WRITE_SLOTS, lib.JmoeCpuWriteSlots),
                                     (COPY_RECORDS, lib.JmoeCpuCopyRecords), (FIRST_MAX, lib.JmoeCpuFirstMax),
                                     (ATTENTION, lib.JmoeCpuAttention)):
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
                lib.jmoe_cpu_isa.restype = ctypes.c_char_p
                lib.jmoe_cpu_set_isa.argtypes = [ctypes.c_char_p]
                lib.jmoe_cpu_use_gfni.argtypes = [ctypes.c_int]
            except Exception as e:  # noqa: BLE001 - not built, not loadable, or refused by this jaxlib's XLA
                log.warning("native CPU kernels unavailable (%s); the XLA reference runs instead", e)
                lib = None
        _state["lib"] = lib
        return lib


def loaded() -> bool:
    return _load() is not None


def isa() -> str | None:
    """The instruction set the kernels run with ('avx512-vnni', 'avx512', 'avx2', 'portable'), or None
    when not loaded."""
    lib = _load()
    return None if lib is None else lib.jmoe_cpu_isa().decode()


@contextlib.contextmanager
def using_isa(name: str):
    """Every native kernel on `name` ('avx512', 'avx2' or 'portable') inside the block, then on the
    one before: the paths a narrower CPU runs, in this process (compiled steps read the choice at
    each call). For tests; a user picks a path with JMOE_CPU_ISA before the first call."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not loaded")
    before = isa().removesuffix("-vnni")
    if not lib.jmoe_cpu_set_isa(name.encode()):
        raise ValueError(f"this CPU cannot run the {name!r} kernels (or no such path)")
    try:
        yield
    finally:
        lib.jmoe_cpu_set_isa(before.encode())


def gfni() -> bool:
    """Whether the int8 dot unpacks three-bit weight codes with GFNI (where the CPU has it, unless
    JMOE_CPU_GFNI=off), rather than by shifts and masks (other widths always take the shifts)."""
    lib = _load()
    return lib is not None and bool(lib.jmoe_cpu_gfni())


@contextlib.contextmanager
def using_gfni(on: bool):
    """The int8 dot's three-bit codes unpacked with GFNI (on) or by shifts (off) inside the block, then
    as before: the path of a VNNI CPU without GFNI, in this process. For tests."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not loaded")
    before = gfni()
    if not lib.jmoe_cpu_use_gfni(int(on)):
        raise ValueError("this CPU has no GFNI")
    try:
        yield
    finally:
        lib.jmoe_cpu_use_gfni(int(before))


def call(name: str, result: jax.ShapeDtypeStruct, *args, input_output_aliases=None, **attrs):
    _load()
    return jax.ffi.ffi_call(name, result, vmap_method="sequential",
                            input_output_aliases=input_output_aliases)(*args, **attrs)


def empty(dtype) -> np.ndarray:
    """A zero-size operand standing for an absent one (scales of a plain weight, absent biases)."""
    return np.zeros((0,), dtype)
