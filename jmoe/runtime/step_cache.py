"""Compiled steps kept on disk, so a new process runs its first step without tracing it again.

jax's persistent compilation cache (compile_cache.py) saves the XLA compile, but finding an entry
needs the lowered HLO: every process still traces and lowers each step (about two seconds for the
tiny model's prefill and decode steps, most of a warm `jmoe generate`). This cache sits one level
up: a step's compiled executable, serialized (jax.experimental.serialize_executable), under a key
made of everything a trace depends on:

- the code: the sources of jmoe, pallas_kernels and cpu_kernels (and the native library), jax,
  jaxlib and flax versions, XLA_FLAGS, jax's trace-affecting settings, the backend and its devices;
- the step: its function, the model's graphdef (every static attribute: the config, formats,
  dtypes) and the static arguments;
- the call: the pytree structure of the arguments (custom nodes' static fields included) and each
  leaf's shape, dtype, weak type and sharding (memory kind included).

A call first tries the executable last used with the same static arguments: a compiled executable
checks the types and structure of what it is given and refuses a mismatch (TypeError) before it
runs anything, so the hot path costs no key. Only a refused call (a new shape bucket, say) builds
the key, and only a key seen for the first time in the process reads the disk or compiles.

Entries live in <compilation cache dir>/steps, written whole (a temporary file renamed) and read
only by this user (the directory is private: a serialized executable is code). A step that cannot
be serialized (constants closed over, say) is compiled as usual and not stored.
JMOE_STEP_CACHE=off turns the cache off (steps are then plain jax.jit); JMOE_STEP_CACHE=<dir> puts
it elsewhere. GPU backends do not use it yet. The key sees the source files, not the running
objects: a process that replaces a function at run time (a comparison of two variants in one
process, a test's monkeypatch inside a traced step) must turn the cache off, or it runs the
executable of whichever variant was stored first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import re
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np
from jax._src import config as jax_config

from jmoe.runtime.compile_cache import OFF
from jmoe.runtime.host_memory import release_free_heap

ENV = "JMOE_STEP_CACHE"
MAX_BYTES = 1 << 30  # past this, the least recently used entries go
PLAIN = ".plain"  # an entry's marker: this step cannot be stored
_SOURCES = ("jmoe", "pallas_kernels", "cpu_kernels")
log = logging.getLogger("jmoe.runtime")
_lock = threading.Lock()
_compile_lock = threading.Lock()
_fingerprint: str | None = None


def _setting() -> str:
    return os.environ.get(ENV, "").strip()


def _turned_off() -> bool:
    """JMOE_STEP_CACHE names an off value (compile_cache's); unset means on."""
    return bool(_setting()) and _setting().lower() in OFF


def enabled() -> bool:
    """On unless turned off; the CPU backend in one process only (executables with GPU kernels, and
    those spanning processes, are not checked here)."""
    return not _turned_off() and jax.default_backend() == "cpu" and jax.process_count() == 1


def directory() -> Path | None:
    """Where entries go: JMOE_STEP_CACHE=<dir>, else beside jax's persistent cache (None: off)."""
    if not enabled():
        return None
    if _setting() and _setting().lower() not in ("on", "1", "true", "yes"):
        return Path(_setting()).expanduser()
    base = jax.config.jax_compilation_cache_dir
    return Path(base) / "steps" if base else None


def code_fingerprint() -> str:
    """A digest of everything outside the call that shapes a trace (computed once per process)."""
    global _fingerprint
    with _lock:
        if _fingerprint is None:
            import flax
            import jaxlib

            from cpu_kernels import native

            h = hashlib.sha256()
            root = Path(__file__).resolve().parents[2]
            for package in _SOURCES:
                for path in sorted((root / package).rglob("*")):
                    if path.suffix in (".py", ".so") and path.is_file():
                        h.update(str(path.relative_to(root)).encode())
                        h.update(path.read_bytes())
            backend = jax.devices()[0].client
            # whether the native kernels run (a trace calls them or the XLA reference); loading them
            # also registers their FFI targets, which a deserialized executable needs
            h.update(repr((native.loaded(), jax.__version__, jaxlib.__version__, flax.__version__,
                           os.environ.get("XLA_FLAGS", ""),
                           backend.platform, backend.platform_version,
                           [(d.id, d.device_kind) for d in jax.devices()],
                           # the axis environment's repr carries its address (empty outside a trace)
                           re.sub(r" at 0x[0-9a-f]+", "", repr(jax_config.trace_context())))).encode())
            _fingerprint = h.hexdigest()
        return _fingerprint


def _leaf_signature(leaf) -> tuple:
    """What jit keys a leaf on: its abstract value and placement, never its contents (a numpy array
    or Python scalar becomes an argument of its shape and dtype)."""
    if isinstance(leaf, jax.Array):
        aval = jax.typeof(leaf)
        return (aval.shape, str(aval.dtype), aval.weak_type, repr(leaf.sharding))
    if isinstance(leaf, (np.ndarray, np.generic)):
        return (leaf.shape, str(leaf.dtype), False, "host")
    if isinstance(leaf, (bool, int, float, complex)):
        return ((), type(leaf).__name__, True, "host")
    raise TypeError(f"no step cache key for a {type(leaf).__name__} argument")


class CachedStep:
    """jax.jit(fn, **jit_kwargs) (static arguments by name only), its executables kept on disk (see
    the module docstring). `name` names fn's code, `identity` everything bound into it (a graphdef's repr)."""

    def __init__(self, fn, name: str, identity: str, **jit_kwargs):
        self.jitted = jax.jit(fn, **jit_kwargs)
        self.static_argnames = tuple(jit_kwargs.get("static_argnames", ()))
        self.name, self.identity = name, identity
        self._last: dict = {}  # static arguments -> the executable last called with them
        self._known: dict = {}  # (static arguments, call signature) -> executable

    def __call__(self, *args, **kwargs):
        statics = tuple((n, kwargs.pop(n)) for n in self.static_argnames if n in kwargs)
        compiled = self._last.get(statics)
        if compiled is not None:
            try:
                return compiled(*args, **kwargs)
            except TypeError as e:  # refused before running anything: another signature
                if not _refused(e):
                    raise
        compiled = self._executable(statics, args, kwargs)
        if compiled is None:
            return self.jitted(*args, **dict(statics), **kwargs)
        self._last[statics] = compiled
        return compiled(*args, **kwargs)

    def executables(self) -> list:
        """Every executable this step has run with (compiled or loaded), one per call signature."""
        return list(self._known.values())

    def lower(self, *args, **kwargs):
        """As jax.jit's (for HLO checks and ahead-of-time compiles: nothing is stored)."""
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)

    def _executable(self, statics, args, kwargs):
        """The executable for this call's signature (None: an argument no key describes)."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        try:
            signature = (statics, str(tree), tuple(_leaf_signature(x) for x in leaves))
        except TypeError:
            return None
        compiled = self._known.get(signature)
        if compiled is None:
            compiled = self._load_or_compile(statics, signature, tree, args, kwargs)
            self._known[signature] = compiled
            release_free_heap()  # what the compile or load freed (a new step is rare: this costs nothing per token)
        return compiled

    def _compile(self, statics, args, kwargs):
        return self.jitted.lower(*args, **dict(statics), **kwargs).compile()

    def _load_or_compile(self, statics, signature, tree, args, kwargs):
        folder = directory()
        if folder is None:
            return self._compile(statics, args, kwargs)
        key = hashlib.sha256(repr((code_fingerprint(), self.name, self.identity, signature)).encode()).hexdigest()
        if (folder / (key + PLAIN)).exists():  # not storable: jax's own cache serves it
            return self._compile(statics, args, kwargs)
        compiled = _read(folder / key, tree)
        if compiled is None:
            with _fresh_compiles():
                compiled = self._compile(statics, args, kwargs)
            _write(folder, key, compiled)
        return compiled


def _refused(error: TypeError) -> bool:
    """Whether a compiled executable refused its arguments (their types or structure)."""
    text = str(error)
    return "Argument types differ" in text or "input pytree does not match" in text


@contextlib.contextmanager
def _fresh_compiles():
    """jax's persistent cache off while a step compiles: an executable XLA:CPU loaded from a serialized
    one serializes again without its kernels (NOT_FOUND when run), so only a fresh compile is stored.
    jax decides once per process whether its cache is used (reset_cache() asks again)."""
    from jax._src import compilation_cache

    with _compile_lock:
        was = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", was)
            compilation_cache.reset_cache()


def _read(path: Path, tree):
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        from jax.experimental.serialize_executable import deserialize_and_load

        payload, in_tree, out_tree, device_ids = pickle.loads(blob)
        if in_tree != tree:
            return None
        by_id = {d.id: d for d in jax.devices()}
        compiled = deserialize_and_load(payload, in_tree, out_tree,
                                        execution_devices=[by_id[i] for i in device_ids])
    except Exception as e:  # a damaged or foreign entry: compile instead, and replace it
        log.warning("step cache entry %s unreadable (%s: %s); compiling instead", path.name, type(e).__name__, e)
        return None
    os.utime(path)  # recently used
    return compiled


def _write(folder: Path, key: str, compiled) -> None:
    from jax.experimental.serialize_executable import serialize

    try:
        payload, in_tree, out_tree = serialize(compiled)
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]  # its devices, in order
        blob = pickle.dumps((payload, in_tree, out_tree, device_ids))
    except Exception as e:  # e.g. constants closed over: jax's persistent cache keeps it instead
        log.debug("step not stored (%s: %s)", type(e).__name__, e)
        blob, key = b"", key + PLAIN
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tmp-", delete=False) as f:
            f.write(blob)
        os.replace(f.name, folder / key)
        _evict(folder)
    except OSError as e:
        log.warning("step cache: cannot write %s (%s)", folder, e.strerror or e)


def _evict(folder: Path) -> None:
    stats = [(p.stat(), p) for p in folder.iterdir() if not p.name.startswith(".")]
    entries = sorted((st.st_mtime, st.st_size, p) for st, p in stats)
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
        if total <= MAX_BYTES:
            break
        path.unlink(missing_ok=True)
        total -= size
