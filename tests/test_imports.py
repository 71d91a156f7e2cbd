"""The kvshare modules import one another without a cycle.

Every .py file under python/kvshare is parsed (not imported) and each of its imports of a
kvshare module becomes an edge: absolute and relative imports, at module level and inside
functions, and under `if TYPE_CHECKING:` too (a type-only cycle is still two modules that
each need the other). `from pkg import name` is an edge to the submodule `pkg.name` when
that is a module, else to `pkg` itself (its `__init__`).

A node is a module file; a package is the node of its `__init__.py`. Importing `pkg.sub`
makes Python run `pkg/__init__` first, but that implicit step is not an edge: a package's
`__init__` importing its own submodules is the usual layout. An edge `pkg.sub -> pkg`
exists only when `pkg.sub` names `pkg` itself (`from pkg import Thing`, `from . import
Thing`), and then `pkg -> pkg.sub -> pkg` is reported: a real cycle, in which `pkg.sub`
reads a half-initialised `pkg` when it is imported first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "python"
PACKAGE = "kvshare"

# Cycles inside python/kvshare/server/ that are being removed by the server rewrite. Each
# entry is the set of modules of one strongly connected component; a component found in the
# graph is tolerated when it lies within one entry (so a cycle that shrinks or goes away
# passes, and one that grows or is new fails).
SERVER_CYCLES_PENDING: list[frozenset[str]] = []


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every .py file of the package (a package is its __init__)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _base_of_import_from(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The module a `from X import ...` names as X, made absolute."""
    if node.level == 0:
        return node.module
    # a relative import counts from the importing module's package
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    drop = node.level - 1
    if drop > len(package_parts):
        return None
    base_parts = package_parts[: len(package_parts) - drop]
    if node.module:
        base_parts = [*base_parts, *node.module.split(".")]
    return ".".join(base_parts)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name` if it is a kvshare module file, else its longest prefix that is one."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The kvshare modules that `module` (the file `path`) imports, anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    target = _known(alias.name, modules)
                    if target:
                        yield target
        elif isinstance(node, ast.ImportFrom):
            base = _base_of_import_from(node, module, _is_package(path))
            if not base or base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _known(base, modules)
                if target:
                    yield target


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the kvshare modules it imports (self-imports left out)."""
    modules = module_files(root, package)
    return {
        name: {t for t in imports_of(name, path, modules) if t != name}
        for name, path in modules.items()
    }


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One shortest cycle through the component's first module, as a closed path."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in component {sorted(component)}")


def _tolerated(component: set[str]) -> bool:
    return any(component <= pending for pending in SERVER_CYCLES_PENDING)


def test_graph_sees_the_package():
    graph = import_graph()
    assert f"{PACKAGE}.engine.engine" in graph
    assert f"{PACKAGE}.ops" in graph
    # a relative import and an import inside a function both give edges
    assert any(graph.values())


def test_no_import_cycles():
    graph = import_graph()
    found = [c for c in strongly_connected(graph) if not _tolerated(c)]
    report = [" -> ".join(a_cycle(graph, c)) + f"   (component: {sorted(c)})" for c in found]
    assert not found, "import cycles:\n" + "\n".join(report)


def test_pending_server_cycles_stay_in_server():
    for pending in SERVER_CYCLES_PENDING:
        assert all(m.startswith(f"{PACKAGE}.server.") for m in pending), sorted(pending)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_resolution_rules(tmp_path):
    _write(tmp_path, {
        "kvshare/__init__.py": "",
        "kvshare/pkg/__init__.py": "from .sub import Thing\nfrom kvshare.pkg import other\n",
        "kvshare/pkg/sub.py": "def f():\n    from ..pkg import other\n",
        "kvshare/pkg/other.py": "import kvshare.low\nfrom kvshare import low\n",
        "kvshare/pkg/user.py": "from . import Thing\n",
        "kvshare/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from kvshare.pkg.user import X\n",
    })
    graph = import_graph(tmp_path)
    assert graph["kvshare.pkg"] == {"kvshare.pkg.sub", "kvshare.pkg.other"}
    assert graph["kvshare.pkg.sub"] == {"kvshare.pkg.other"}
    assert graph["kvshare.pkg.other"] == {"kvshare.low"}
    assert graph["kvshare.pkg.user"] == {"kvshare.pkg"}
    assert graph["kvshare.low"] == {"kvshare.pkg.user"}
    # user -> pkg -> other -> low -> user is a cycle (and sub, on pkg -> sub -> other, in it)
    components = strongly_connected(graph)
    assert components == [{"kvshare.pkg", "kvshare.pkg.sub", "kvshare.pkg.other",
                           "kvshare.low", "kvshare.pkg.user"}]
    cycle = a_cycle(graph, components[0])
    assert cycle[0] == cycle[-1] == "kvshare.low"
    assert len(cycle) == 5
    # without low's type-only import, the package importing its submodules is no cycle
    _write(tmp_path, {"kvshare/low.py": ""})
    assert strongly_connected(import_graph(tmp_path)) == []
