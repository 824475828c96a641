"""The project's import graph, read from the source (every import, deferred ones inside functions
included, type-checking-only ones not): no module reaches itself again, and neither kernel package
imports the other or the core (the choice of kernel lives in jmoe/kernels; what both read, the packed
weight format and the activations, in kernel_formats)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jmoe", "kernel_formats", "cpu_kernels", "pallas_kernels", "convert")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict) -> set[str]:
    """The project's modules `name` imports (a package's own __init__ above it left out: importing
    a submodule runs it, but it is not a dependency the module chose)."""

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    tree = ast.parse(path.read_text())
    type_checking = {id(node) for top in ast.walk(tree) if isinstance(top, ast.If)
                     and "TYPE_CHECKING" in ast.unparse(top.test) for node in ast.walk(top)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            module = resolve(target)
            if module is not None and module != name and not name.startswith(module + "."):
                out.add(module)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another in a circle (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle():
    edges = graph()
    assert len(edges) > 100 and "jmoe.runtime.loader" in edges["jmoe.api"]  # the graph was read
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def packages_imported(edges: dict[str, set[str]], package: str) -> set[str]:
    """The project's top-level packages that `package`'s modules import, itself left out."""
    return {t.split(".")[0] for name, targets in edges.items() if name.split(".")[0] == package
            for t in targets} - {package}


def test_neither_kernel_package_imports_the_other_or_the_core():
    edges = graph()
    assert packages_imported(edges, "pallas_kernels") == {"kernel_formats"}
    assert packages_imported(edges, "cpu_kernels") == {"kernel_formats"}
    assert packages_imported(edges, "kernel_formats") == set()
    assert {"pallas_kernels", "cpu_kernels", "kernel_formats"} <= packages_imported(edges, "jmoe")  # read


def test_the_package_and_the_launcher_start_without_jax():
    """`import jmoe` and `python -m jmoe.launch` import no jax (the launcher only starts processes);
    a name of jmoe's that needs it imports it on first use."""
    import subprocess
    import sys

    code = ("import sys, jmoe, jmoe.launch, jmoe.cli\nassert 'jax' not in sys.modules, 'jax imported at start'\n"
            "jmoe.load\nassert 'jax' in sys.modules and callable(jmoe.load) and 'load' in dir(jmoe)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
