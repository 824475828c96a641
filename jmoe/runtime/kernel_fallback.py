"""If the Pallas expert kernels fail to compile (a GPU, driver or Triton version they were never
built for), warn once and run the XLA reference path instead of failing the request."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from jmoe.kernels import default_backend

log = logging.getLogger("jmoe.runtime")
T = TypeVar("T")
KERNEL_MARKERS = ("pallas", "triton", "mosaic", "interpret mode", "ptx", "nvptx")


def runs_kernels(backend: str | None) -> bool:
    return (backend or default_backend()) != "xla"


def is_kernel_failure(error: Exception) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return any(marker in text for marker in KERNEL_MARKERS)


def with_kernel_fallback(residencies, run: Callable[[], T]) -> T:
    """run(); if it fails in the expert kernels, switch `residencies` to the XLA path and run again.
    `run` must read the expert state afresh (residency.expert_state()) on each call."""
    try:
        return run()
    except Exception as error:
        if not any(runs_kernels(r.backend) for r in residencies) or not is_kernel_failure(error):
            raise
        log.warning("the Pallas expert kernels failed to compile (%s); running the XLA reference path instead "
                    "(slower; kernel_backend='xla' avoids this message)", str(error).splitlines()[0][:300])
        for r in residencies:
            r.use_backend("xla")
        return run()
