"""jmoe: run Mixture-of-Experts language models whose experts do not fit in accelerator memory."""

from jmoe.runtime.collector import collector_paused

with collector_paused():  # importing jax and flax allocates much and frees little (jmoe/runtime/collector.py)
    from jmoe.api import JmoeModel, forward, generate, load, memory_plan, perplexity, stats, trace_routing
    from jmoe.config import ModelConfig
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

__all__ = [
    "load", "generate", "forward", "perplexity", "stats", "memory_plan", "trace_routing", "JmoeModel", "ModelConfig",
    "JmoeError", "ConfigError", "CheckpointError", "FormatError", "InputError", "BudgetError", "OutputError",
]
