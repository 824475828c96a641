"""Checks for untrusted input: public options (type and range) and JSON files from disk.

Every check raises the given JmoeError subclass (InputError by default) with a message that
names the option or file, says what was expected and shows what was given.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from jmoe.errors import InputError, JmoeError

MAX_JSON_BYTES = 64 << 20  # config and manifest files are small; refuse anything absurd


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            error: type[JmoeError] = InputError) -> int:
    """`value` as a Python int, refusing bools, floats and strings and anything out of range."""
    if not _is_int(value):
        raise error(f"{name} must be an integer, got {_shown(value)} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum}, got {value}")
    return value


def real(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
         above: float | None = None, error: type[JmoeError] = InputError) -> float:
    """`value` as a finite float (ints allowed), within [minimum, maximum] and > above."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a number, got {_shown(value)} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum:g}, got {value:g}")
    if above is not None and value <= above:
        raise error(f"{name} must be > {above:g}, got {value:g}")
    return value


def boolean(name: str, value: Any, *, error: type[JmoeError] = InputError) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be True or False, got {_shown(value)} ({type(value).__name__})")
    return bool(value)


def text(name: str, value: Any, *, error: type[JmoeError] = InputError) -> str:
    if not isinstance(value, str):
        raise error(f"{name} must be a string, got {_shown(value)} ({type(value).__name__})")
    return value


def choice(name: str, value: Any, choices: Iterable[Any], *, error: type[JmoeError] = InputError):
    choices = tuple(choices)
    if isinstance(value, (list, dict, set)) or value not in choices:
        raise error(f"{name} must be one of {', '.join(map(str, choices))}; got {_shown(value)}")
    return value


def path(name: str, value: Any, *, error: type[JmoeError] = InputError) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise error(f"{name} must be a path (a non-empty string or os.PathLike), got {_shown(value)}")
    return Path(value)


def read_json_object(file: Path, *, what: str, error: type[JmoeError]) -> dict[str, Any]:
    """A JSON object from `file`: refuses huge, binary, malformed and absurdly nested files by name."""
    try:
        size = file.stat().st_size
        if size > MAX_JSON_BYTES:
            raise error(f"{file} is {size} bytes; a {what} is at most {MAX_JSON_BYTES} bytes")
        raw = file.read_bytes()
    except OSError as e:
        raise error(f"cannot read {file}: {e.strerror or e}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{file} is not UTF-8 text (a {what} must be JSON)") from None
    except json.JSONDecodeError as e:
        raise error(f"{file} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{file} is nested too deeply to be a {what}") from None
    if not isinstance(data, dict):
        raise error(f"{file} does not hold a JSON object (a {what} must)")
    return data


def token_ids(name: str, value: Any, vocab_size: int) -> list[int]:
    """A 1-D sequence of token ids, each an integer in [0, vocab_size)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise InputError(f"{name} must be a 1-D array of integer token ids, got {value.dtype} of shape {value.shape}")
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise InputError(f"{name} must be a list of token ids, got {type(value).__name__}")
    for i, token in enumerate(value):
        if not _is_int(token):
            raise InputError(f"{name}[{i}] must be an integer token id, got {_shown(token)} ({type(token).__name__})")
    ids = np.asarray(value, np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{name}[{i}] = {int(ids[i])} is not a token id of this model (the vocabulary is 0..{vocab_size - 1})")
    return ids.tolist()
