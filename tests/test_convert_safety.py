"""Converting never loses user data: --force rules, killed conversions, disk full, partial output."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import jmoe
from convert import convert_checkpoint
from convert.output import PARTIAL_MARKER, REPLACED, clean_stale, protected_reason
from jmoe.cli import main
from jmoe.errors import FormatError, InputError, OutputError
from jmoe.manifest import read_manifest
from tests.conftest import ROOT
from tests.hf_models import make_checkpoint


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("small") / "hf"
    make_checkpoint("qwen3_moe", src)
    return src


def listing(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory` with its content (None for directories)."""
    return {p.relative_to(directory).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


def debris(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ---------------------------------------------------------------- --force never reaches the wrong place


def test_force_refuses_the_source_its_parent_and_the_working_directory(small_source, tmp_path, monkeypatch):
    parent = tmp_path / "models"
    src = parent / "hf"
    parent.mkdir()
    shutil.copytree(small_source, src)
    (parent / "notes.txt").write_text("mine")
    for target, why in ((src, "source checkpoint"), (parent, "source checkpoint or one of its parent")):
        with pytest.raises(InputError, match=f"refusing to replace .*{why}"):
            convert_checkpoint(src, target, overwrite=True, progress=False)
    monkeypatch.chdir(parent)
    with pytest.raises(InputError, match="refusing to replace"):
        convert_checkpoint(src, ".", overwrite=True, progress=False)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    (elsewhere / "data.txt").write_text("keep")
    before = listing(tmp_path)
    monkeypatch.chdir(elsewhere)
    with pytest.raises(InputError, match="current directory"):
        convert_checkpoint(src, ".", overwrite=True, progress=False)
    with pytest.raises(InputError, match="refusing to replace"):
        convert_checkpoint(src, "..", overwrite=True, progress=False)
    assert main(["convert", str(src), "-o", ".", "--force", "--no-progress"]) == 2
    assert listing(tmp_path) == before  # nothing deleted, nothing written


def test_force_refuses_home_root_symlinks_and_foreign_directories(small_source, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "letter.txt").write_text("dear")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(InputError, match="home directory"):
        convert_checkpoint(small_source, home, overwrite=True, progress=False)
    assert protected_reason(Path("/"), small_source) == "it is the file system root"  # judged, never tried
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    with pytest.raises(InputError, match=r"not a jmoe output \(it holds thesis.tex\)"):
        convert_checkpoint(small_source, foreign, overwrite=True, progress=False)
    link = tmp_path / "link"
    link.symlink_to(foreign)
    with pytest.raises(InputError, match="symbolic link"):
        convert_checkpoint(small_source, link, overwrite=True, progress=False)
    a_file = tmp_path / "file.bin"
    a_file.write_bytes(b"data")
    with pytest.raises(InputError, match="not a directory"):
        convert_checkpoint(small_source, a_file, overwrite=True, progress=False)
    assert (foreign / "thesis.tex").read_text() == "years of work" and a_file.read_bytes() == b"data"
    assert (home / "docs" / "letter.txt").read_text() == "dear"


def test_force_replaces_an_earlier_output_or_an_empty_directory_only(small_source, tmp_path):
    out = convert_checkpoint(small_source, tmp_path / "out", progress=False)
    convert_checkpoint(small_source, out, tiers="int4", overwrite=True, progress=False)
    assert list(read_manifest(out)["tiers"]) == ["int4"] and not debris(tmp_path, "out")
    (out / "my-notes.txt").write_text("do not lose")
    with pytest.raises(InputError, match="files jmoe did not write: my-notes.txt"):
        convert_checkpoint(small_source, out, overwrite=True, progress=False)
    assert (out / "my-notes.txt").read_text() == "do not lose"
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_checkpoint(small_source, empty, overwrite=True, progress=False)
    assert read_manifest(empty)["family"] == "qwen3_moe"


# ---------------------------------------------------------------- killed, interrupted, disk full


KILLED_CONVERSION = """
import sys
from convert import convert_checkpoint
convert_checkpoint(sys.argv[1], sys.argv[2], tiers="bf16,int8,int4,int2", progress=False)
"""


def test_sigkill_leaves_a_partial_that_never_loads_and_the_next_conversion_cleans_it(tiny_hf_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CONVERSION, str(tiny_hf_dir), str(out)], cwd=ROOT)
    deadline = time.monotonic() + 120
    partial = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        if found and (found[0] / "experts" / "int2").is_dir():
            partial = found[0]
            break
        time.sleep(0.02)
    assert partial is not None, "the conversion finished or failed before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert partial.is_dir() and not out.exists()
    with pytest.raises(FormatError, match="never loads"):
        jmoe.load(partial)
    (partial / "manifest.json").write_text("{}")  # even with a manifest in it
    with pytest.raises(FormatError, match="never loads"):
        jmoe.load(partial)
    convert_checkpoint(tiny_hf_dir, out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the dead conversion's partial is gone
    assert jmoe.generate(jmoe.load(out), "def f(x):", max_new_tokens=3)


def dead_owner(out: Path) -> dict:
    """The marker of a conversion whose process has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return {"output": str(out), "host": socket.gethostname(), "pid": int(proc.stdout), "start": 1}


def fake_partial(parent: Path, out: Path, owner: dict) -> Path:
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    (partial / PARTIAL_MARKER).write_text(json.dumps(owner))
    (partial / "experts").mkdir()
    return partial


def test_killed_during_the_swap_the_old_output_comes_back(small_source, tmp_path):
    out = convert_checkpoint(small_source, tmp_path / "out", progress=False)
    before = listing(out)
    partial = fake_partial(tmp_path, out, dead_owner(out))
    out.rename(partial / REPLACED)  # killed after parking the old output, before the rename
    clean_stale(out)
    assert listing(out) == before and not debris(tmp_path, "out")
    # killed after the rename, before the marker and the parked output were removed
    (out / PARTIAL_MARKER).write_text(json.dumps(dead_owner(out)))
    (out / REPLACED).mkdir()
    with pytest.raises(FormatError, match="did not finish"):
        jmoe.load(out)
    clean_stale(out)
    assert listing(out) == before and not debris(tmp_path, "out")


def test_live_or_foreign_partials_are_left_alone(small_source, tmp_path):
    out = tmp_path / "out"
    mine = {"output": str(out), "host": socket.gethostname(), "pid": os.getpid(),
            "start": int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])}
    live = fake_partial(tmp_path, out, mine)
    with pytest.raises(InputError, match=f"another conversion \\(pid {os.getpid()}\\) is writing"):
        convert_checkpoint(small_source, out, progress=False)
    live.joinpath(PARTIAL_MARKER).unlink()
    other_host = fake_partial(tmp_path, out, {**mine, "host": "another-machine"})
    unowned = live  # no marker: nothing proves whose it is
    convert_checkpoint(small_source, out, progress=False)
    assert other_host.is_dir() and unowned.is_dir() and read_manifest(out)


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     PermissionError(errno.EACCES, "Permission denied")])
def test_disk_full_or_permission_denied_is_one_clear_error_and_keeps_the_old_output(small_source, tmp_path,
                                                                                   monkeypatch, failure, capsys):
    import convert.pipeline

    out = convert_checkpoint(small_source, tmp_path / "out", progress=False)
    before = listing(out)

    def failing_write(self, tier, version):
        failure.filename = self.files[tier].name
        raise failure

    monkeypatch.setattr(convert.pipeline.LayerFiles, "write", failing_write)
    with pytest.raises(OutputError, match=failure.strerror):
        convert_checkpoint(small_source, out, overwrite=True, progress=False)
    assert listing(out) == before and not debris(tmp_path, "out")
    assert main(["convert", str(small_source), "-o", str(out), "--force", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and failure.strerror in err[0]
    assert listing(out) == before


def test_an_unwritable_output_directory_is_one_clear_error(small_source, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(OutputError, match="Permission denied"):
        convert_checkpoint(small_source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
