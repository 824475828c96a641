"""Run the runnable code blocks of README.md and docs/tutorial.md, in order, against a fresh conversion.

A block is runnable when the line just before its fence is `<!-- runnable -->`:

    <!-- runnable -->
    ```bash
    jmoe info out/tiny-qwen3-moe
    ```

In a temporary directory holding a copy of `examples/`, this converts the bundled model as `make
demo` does (`out/tiny-qwen3-moe`, bf16 only), then runs each runnable block from that directory:
```bash blocks with `bash -euo pipefail`, ```python blocks with this interpreter, the `jmoe` and
`python` beside this interpreter first on PATH (as after `source .venv/bin/activate`). Port 8000
in a block becomes a free port, so a server a block starts does not collide with another one. The
blocks share an XLA compilation cache of their own in the temporary directory, empty at the start.
Any non-zero exit, or a block past its time limit, fails the check (exit status 1).

    python docs/check_readme.py            # README.md, then docs/tutorial.md
    python docs/check_readme.py --list     # print the blocks it would run
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", ROOT / "docs" / "tutorial.md"]
BLOCK = re.compile(r"^<!-- runnable -->\n```(?P<lang>bash|python)\n(?P<code>.*?)^```$", re.M | re.S)
BLOCK_TIMEOUT_S = 300


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, code, line number) of each runnable block of a markdown file."""
    text = path.read_text()
    return [(m["lang"], m["code"], text.count("\n", 0, m.start()) + 3) for m in BLOCK.finditer(text)]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(lang: str, code: str, cwd: Path, env: dict) -> int:
    code = code.replace("8000", str(free_port()))
    if lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    # Its own process group, so that a server a block left running is stopped with it.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"check_readme: block still running after {BLOCK_TIMEOUT_S} s", file=sys.stderr)
        return 124
    finally:
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the runnable blocks and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)

    todo = [(path, *b) for path in FILES for b in blocks(path)]
    if args.list:
        for path, lang, code, line in todo:
            print(f"--- {rel(path)}:{line} ({lang})\n{code}")
        return 0
    if not todo:
        print("check_readme: no runnable block found", file=sys.stderr)
        return 1

    bin_dir = str(Path(sys.executable).parent)
    work = Path(tempfile.mkdtemp(prefix="jmoe-readme-check-"))
    # The blocks share a compilation cache of their own, empty at the start, as on a new user's
    # machine: the user's cache would make the check's time (and what it compiles) depend on
    # whatever ran on this machine before.
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1",
               JMOE_COMPILATION_CACHE=str(work / "xla-cache"))
    start = time.monotonic()
    failed = []
    try:
        shutil.copytree(ROOT / "examples", work / "examples")
        # What `make demo` converts (bf16 only).
        setup = "jmoe convert examples/tiny-qwen3-moe -o out/tiny-qwen3-moe --force --no-progress"
        print(f"$ {setup}", flush=True)
        if run("bash", setup, work, env) != 0:
            print("check_readme: the demo conversion failed", file=sys.stderr)
            return 1
        for path, lang, code, line in todo:
            where = f"{rel(path)}:{line}"
            print(f"--- {where} ({lang})", flush=True)
            t = time.monotonic()
            rc = run(lang, code, work, env)
            print(f"--- {where}: exit {rc} in {time.monotonic() - t:.1f} s", flush=True)
            if rc != 0:
                failed.append(where)
                break  # later blocks may need what this one made
    finally:
        if args.keep:
            print(f"check_readme: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - start
    if failed:
        print(f"check_readme: FAILED at {failed[0]} ({total:.0f} s)", file=sys.stderr)
        return 1
    print(f"check_readme: {len(todo)} blocks ran, all passed ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
