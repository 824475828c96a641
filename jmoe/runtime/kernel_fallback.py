"""If the Pallas expert kernels cannot be built on this machine (a GPU, driver or Triton version they
were never built for), warn once and run the XLA reference path instead of failing the request.

A step that runs Pallas kernels and fails is not taken for a kernel failure by its error's text:
the kernels are compiled alone on the step's pools (jmoe.kernels.compile_error). Only when they fail
there too does the model switch to the XLA path and run the step again; any other failure (a bad
request, memory) is raised as it is, and the kernels stay. A successful check is remembered, so a
failure that is not the kernels' costs its compiles once.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from jmoe.kernels import compile_error, default_backend

log = logging.getLogger("jmoe.runtime")
T = TypeVar("T")
BUILT_PER_MACHINE = ("pallas", "mosaic", "interpret")  # backends whose kernels are built for the machine they run on


def builds_kernels(backend: str | None) -> bool:
    return (backend or default_backend()) in BUILT_PER_MACHINE


def with_kernel_fallback(residencies, run: Callable[[], T]) -> T:
    """run(); if it fails and the expert kernels of `residencies` do not compile on their own, switch
    them to the XLA path and run again. `run` must read the expert state afresh
    (residency.expert_state()) on each call."""
    try:
        return run()
    except Exception:
        failed = None
        for r in residencies:
            if failed is None and builds_kernels(r.backend):
                failed = compile_error(r.backend, r.pool_arrays().values(), r.int8_dot)
        if failed is None:
            raise
        log.warning("the Pallas expert kernels failed to compile (%s); running the XLA reference path instead "
                    "(slower; kernel_backend='xla' avoids this message)", str(failed).splitlines()[0][:300])
        for r in residencies:
            r.use_backend("xla")
        return run()
