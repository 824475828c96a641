"""Where a conversion writes: a temporary directory beside the output, renamed into place at the end.

Nothing outside the output is ever deleted or overwritten:
- an existing output is replaced only when asked (overwrite / --force), and only if it is an
  earlier jmoe output (its manifest says so and it holds nothing else) or an empty directory;
- never the source, an ancestor of it, the working directory or one of its ancestors, the home
  directory or /;
- the temporary directory `.NAME.XXXXXXXX.partial` holds a marker naming its owner (host, pid and
  process start time). The next conversion to the same output removes the partials whose owner is
  provably dead, refuses to start while one is alive, and leaves any other alone;
- the swap first moves the old output into the partial, then renames the partial into place, so a
  conversion killed at any moment leaves the old or the new output, plus at most a partial that
  the next conversion cleans up (putting the old output back if the new one never landed).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from jmoe import validate
from jmoe.errors import FormatError, InputError, OutputError
from jmoe.format import DENSE_DIR, EXPERTS_DIR, TOKENIZER_DIR
from jmoe.manifest import MANIFEST, PARTIAL_MARKER, PARTIAL_SUFFIX, is_jmoe_output

log = logging.getLogger("jmoe.convert")
REPLACED = ".jmoe-replaced"  # the previous output, parked inside the partial during the swap
JMOE_ENTRIES = {MANIFEST, DENSE_DIR, EXPERTS_DIR, TOKENIZER_DIR, PARTIAL_MARKER, REPLACED}


def absolute(path: Path) -> Path:
    """An absolute, lexically normalised path (symlinks are judged separately)."""
    return Path(os.path.abspath(path))


def _within(path: Path, other: Path) -> bool:
    """path is `other` or one of its ancestors (so deleting path would delete other)."""
    return other == path or other.is_relative_to(path)


def protected_reason(out: Path, source: Path) -> str | None:
    """Why `out` may never be replaced, or None."""
    real = out.resolve()
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):
        home = None
    if real == Path(real.anchor):
        return "it is the file system root"
    if _within(real, source.resolve()):
        return "it is the source checkpoint or one of its parent directories"
    if _within(real, Path.cwd().resolve()):
        return "it is the current directory or one of its parents"
    if home is not None and _within(real, home):
        return "it is the home directory or one of its parents"
    return None


def replace_reason(out: Path, source: Path) -> str | None:
    """Why an existing `out` cannot be replaced even with --force, or None if it can."""
    if out.is_symlink():
        return "it is a symbolic link"
    if not out.is_dir():
        return "it is not a directory"
    reason = protected_reason(out, source)
    if reason:
        return reason
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return None
    if not is_jmoe_output(out):
        shown = ", ".join(entries[:3]) + (" ..." if len(entries) > 3 else "")
        return f"it is not a jmoe output (it holds {shown})"
    foreign = [name for name in entries if name not in JMOE_ENTRIES]
    if foreign:
        return f"it holds files jmoe did not write: {', '.join(foreign[:3])}"
    return None


def check_output(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse, before any work, an output that exists (without overwrite) or may not be replaced."""
    if not out.name:
        raise InputError(f"output {out} names no directory")
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise InputError(f"{out} already exists (pass overwrite=True / --force to replace it)")
    reason = replace_reason(out, source)
    if reason:
        raise InputError(f"refusing to replace {out}: {reason}")


# ---------------------------------------------------------------- owners of partial directories


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (tells a reused pid apart), if known."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def this_process() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid)}


def owner_alive(owner: dict) -> bool | None:
    """True / False when the owner is known alive / dead; None when it cannot be told (another host)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return None
    pid = owner["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    start = _start_ticks(pid)
    return start is None or owner.get("start") is None or start == owner["start"]


def read_owner(directory: Path) -> dict | None:
    try:
        return validate.read_json_object(directory / PARTIAL_MARKER, what="conversion marker", error=FormatError)
    except FormatError:
        return None


def clean_stale(out: Path) -> None:
    """Remove what dead conversions to `out` left behind; refuse while one is still running."""
    siblings = out.parent.iterdir() if out.parent.is_dir() else []
    candidates = [p for p in siblings if p.name.startswith(f".{out.name}.") and p.name.endswith(PARTIAL_SUFFIX)
                  and p.is_dir() and not p.is_symlink()]
    if (out / PARTIAL_MARKER).is_file() and not out.is_symlink():
        candidates.append(out)  # killed after its final rename, before removing its marker
    for directory in candidates:
        owner = read_owner(directory)
        if owner is None or owner.get("output") != str(out):
            continue  # not provably a conversion to this output
        alive = owner_alive(owner)
        if alive:
            raise InputError(f"another conversion (pid {owner['pid']}) is writing {out}; wait for it or stop it")
        if alive is None:
            log.warning("leaving %s alone: it was written on %s", directory, owner.get("host"))
            continue
        parked = directory / REPLACED
        if directory == out:  # the new output landed: finish its clean-up
            shutil.rmtree(parked, ignore_errors=True)
            (out / PARTIAL_MARKER).unlink()
            continue
        if parked.is_dir() and not (out.exists() or out.is_symlink()):
            os.rename(parked, out)  # the new output never landed: put the old one back
            log.warning("restored %s, which an interrupted conversion was replacing", out)
        log.warning("removing %s, left by an interrupted conversion (pid %s)", directory, owner["pid"])
        shutil.rmtree(directory)


class Partial:
    """The temporary directory a conversion writes into; commit() renames it into place."""

    def __init__(self, out: Path):
        self.out = out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PARTIAL_SUFFIX, dir=out.parent))
            owner = {"output": str(out), **this_process(), "created": time.time()}
            (self.path / PARTIAL_MARKER).write_text(json.dumps(owner))
        except OSError as e:
            raise output_error(e) from None

    def commit(self, source: Path, overwrite: bool) -> None:
        """Replace `out` (checked again: it may have changed meanwhile) with the finished partial."""
        out, parked = self.out, self.path / REPLACED
        if out.exists() or out.is_symlink():
            check_output(out, source, overwrite)
            os.rename(out, parked)
        try:
            os.rename(self.path, out)
        except OSError:
            if parked.exists():
                os.rename(parked, out)
            raise
        shutil.rmtree(out / REPLACED, ignore_errors=True)
        (out / PARTIAL_MARKER).unlink()

    def discard(self) -> None:
        parked = self.path / REPLACED
        if parked.exists() and not (self.out.exists() or self.out.is_symlink()):
            os.rename(parked, self.out)
        shutil.rmtree(self.path, ignore_errors=True)


def output_error(e: OSError) -> OutputError:
    where = f": {e.filename}" if e.filename else ""
    return OutputError(f"cannot write the output ({e.strerror or e}){where}")
