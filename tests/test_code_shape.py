"""The server's shape stays as docs/architecture.md draws it: `app.py` a route table, every
module of `server/` and `apis/` one concept of at most 600 lines, no function over 80 lines, and
the server reaching the engine and its settings through their typed fields, never `getattr`.
(Complexity, private names across modules and the import graph are checked by ruff's C90 /
PLR0912 / SLF001 and tests/test_imports.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "python" / "kvshare"
SEAM = [PKG / "server", PKG / "apis"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_APP_LINES = 300


def _modules() -> list[Path]:
    return sorted(p for d in SEAM for p in d.rglob("*.py"))


def test_app_is_a_route_table():
    n = len((PKG / "server" / "app.py").read_text().splitlines())
    assert n <= MAX_APP_LINES, f"server/app.py has {n} lines"


def test_modules_are_small():
    big = {str(p.relative_to(PKG)): n for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_functions_are_short():
    long = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(PKG)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _names_engine_or_settings(node: ast.expr) -> bool:
    text = ast.unparse(node)
    return "engine" in text or "settings" in text or text in ("self.info", "info")


def test_no_getattr_on_the_engine_or_the_settings():
    found = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and _names_engine_or_settings(node.args[0])):
                found.append(f"{p.relative_to(PKG)}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"duck typing on the engine or the settings: {found}"


def test_the_checks_can_fail(tmp_path):
    """The walkers see what they look for (a check that finds nothing must be able to)."""
    src = ("def f(engine):\n    return getattr(engine, 'x', None)\n"
           "def g():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES + 1))
    tree = ast.parse(src)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and _names_engine_or_settings(n.args[0])]
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert len(calls) == 1 and [f.name for f in funcs] == ["g"]
