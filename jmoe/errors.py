"""Errors jmoe raises for bad input; each message names the problem and what to do."""


class JmoeError(Exception):
    """Base class for every error jmoe raises on purpose."""


class ConfigError(JmoeError):
    """A model config is missing, malformed, or describes an unsupported model."""


class CheckpointError(JmoeError):
    """A Hugging Face checkpoint is missing a tensor, has a wrong shape, or is corrupt."""


class FormatError(JmoeError):
    """A converted jmoe directory is missing, incomplete, or from another format version."""


class InputError(JmoeError):
    """A prompt or generation argument cannot be used (empty, too long, out of range)."""


class BudgetError(JmoeError):
    """The device-memory budget cannot hold what the requested configuration needs."""


class OutputError(JmoeError):
    """An output cannot be written: the disk is full, permission is denied, the file system is read-only."""
