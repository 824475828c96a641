"""Where the suite's seconds go: an opt-in pytest plugin that records, per test, its wall time and
the seconds JAX spent tracing, lowering and compiling (jax.monitoring's events), and a summary by
module. Most of the suite's time is compiling; this says which modules and how many executables.

    JMOE_COMPILE_PROFILE=/tmp/profile python -m pytest -n 2 --dist loadfile -p tests.compile_profile
    python -m tests.compile_profile /tmp/profile     # the table, slowest module first

Each pytest process (every xdist worker) writes its own JSON file into the directory.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

EVENTS = {"backend_compile_duration": "compile_s", "jaxpr_trace_duration": "trace_s",
          "jaxpr_to_mlir_module_duration": "lower_s"}
_current: dict = {"test": None}
_tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
# per compiled function's name: [compiles, seconds] (which executables the compile time goes to)
_functions: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])


def _listener(event: str, duration: float, fun_name: str | None = None, **_) -> None:
    name = EVENTS.get(event.rsplit("/", 1)[-1])
    if name is not None:
        counts = _tests[_current["test"] or "<outside tests>"]
        counts[name] += duration
        counts["compiles"] += name == "compile_s"
        if name == "compile_s":
            entry = _functions[fun_name or "?"]
            entry[0] += 1
            entry[1] += duration


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    started = time.perf_counter()
    yield
    _tests[item.nodeid]["wall_s"] += time.perf_counter() - started
    _current["test"] = None


def pytest_sessionfinish(session, exitstatus):
    out = Path(os.environ.get("JMOE_COMPILE_PROFILE", "compile-profile"))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.json").write_text(json.dumps(_tests))
    (out / f"{worker}.functions").write_text(json.dumps(_functions))


def summary(directory: Path) -> str:
    modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in directory.glob("*.json"):
        for test, counts in json.loads(path.read_text()).items():
            modules[test.split("::")[0]].update(counts)
            modules[test.split("::")[0]]["tests"] += 1
    columns = ("wall_s", "compile_s", "trace_s", "lower_s", "compiles", "tests")
    lines = [f"{'module':48s}" + "".join(f"{c:>11s}" for c in columns)]
    total = collections.Counter()
    for module, counts in sorted(modules.items(), key=lambda kv: -kv[1]["wall_s"]):
        total.update(counts)
        lines.append(f"{module:48s}" + "".join(f"{counts[c]:11.1f}" for c in columns))
    lines.append(f"{'all':48s}" + "".join(f"{total[c]:11.1f}" for c in columns))
    functions: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for path in directory.glob("*.functions"):
        for name, (n, seconds) in json.loads(path.read_text()).items():
            functions[name][0] += n
            functions[name][1] += seconds
    lines += ["", f"{'compiled function':48s}{'compiles':>11s}{'compile_s':>11s}"]
    for name, (n, seconds) in sorted(functions.items(), key=lambda kv: -kv[1][1])[:40]:
        lines.append(f"{name[:48]:48s}{n:11d}{seconds:11.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "compile-profile")))
