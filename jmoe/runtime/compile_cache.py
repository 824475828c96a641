"""A persistent XLA compilation cache, on by default, so a new process does not compile its steps again.

The cache lives in the user's cache directory ($XDG_CACHE_HOME/jmoe/xla, else ~/.cache/jmoe/xla).
JMOE_COMPILATION_CACHE=<dir> puts it elsewhere and JMOE_COMPILATION_CACHE=off turns it off; a cache
directory the user already gave jax (jax_compilation_cache_dir) is left as it is. A size cap makes
jax's cache take a file lock around every read and write, so processes may share the directory
(entries are evicted least recently used first past the cap). The directory is created private
(0700): jax runs what it finds there, so it must be writable by this user only.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import jax

ENV = "JMOE_COMPILATION_CACHE"
OFF = ("off", "0", "false", "no", "none", "")
MAX_BYTES = 4 << 30  # enough for a few models' steps at every shape generate compiles
MIN_COMPILE_SECONDS = 0.1  # cache what takes noticeable time to compile (jax's default is 1 s)
log = logging.getLogger("jmoe.runtime")
_lock = threading.Lock()
_done = False


def cache_dir(environ=None) -> Path | None:
    """The directory the cache should use, or None when it is turned off."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value.strip()).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path("~").expanduser() / ".cache")
    return Path(base) / "jmoe" / "xla"


def enable() -> Path | None:
    """Turn the persistent cache on for this process (once; before the first compile that should use it).

    Returns the directory in use, or None (turned off, or it could not be created: then a warning)."""
    global _done
    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if _done or current:
            _done = True
            return Path(current) if current else None
        _done = True
        path = cache_dir()
        if path is None:
            return None
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            log.warning("no persistent compilation cache: cannot create %s (%s); set %s to another directory or "
                        "'off'", path, e.strerror or e, ENV)
            return None
        if jax.config.jax_persistent_cache_min_entry_size_bytes == 0:
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # small steps too
        if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # jax's default: the user kept it
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        if jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)  # a cap turns on the file lock
        jax.config.update("jax_compilation_cache_dir", str(path))
        return path
