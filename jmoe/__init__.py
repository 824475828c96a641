"""jmoe: run Mixture-of-Experts language models whose experts do not fit in accelerator memory."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jmoe.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    FormatError,
    InputError,
    JmoeError,
    OutputError,
)

__version__ = "0.1.0"

# The public names that need jax, each from its module, imported on first use: a process that uses
# none of them (the job launcher, `jmoe --help`, a command refused for a bad option) starts without
# importing jax, flax and the runtime (about 3 s on a 2-core machine).
_LAZY = {"load": "jmoe.api", "generate": "jmoe.api", "forward": "jmoe.api", "perplexity": "jmoe.api",
         "stats": "jmoe.api", "memory_plan": "jmoe.api", "trace_routing": "jmoe.api", "JmoeModel": "jmoe.api",
         "ModelConfig": "jmoe.config"}

__all__ = [
    "load", "generate", "forward", "perplexity", "stats", "memory_plan", "trace_routing", "JmoeModel", "ModelConfig",
    "JmoeError", "ConfigError", "CheckpointError", "FormatError", "InputError", "BudgetError", "OutputError",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jmoe' has no attribute {name!r}")
    from jmoe.runtime.collector import collector_paused

    with collector_paused():  # importing jax and flax allocates much and frees little (jmoe/runtime/collector.py)
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:  # for type checkers and the API docs, which read the names statically
    from jmoe.api import JmoeModel, forward, generate, load, memory_plan, perplexity, stats, trace_routing
    from jmoe.config import ModelConfig
