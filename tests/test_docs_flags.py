"""docs/configuration.md documents every `kvshare serve` flag: each flag and its env var
appears in it, and its flag tables name no flag the parser lacks. Regenerate the tables with
`python scripts/gen_flag_docs.py --write docs/configuration.md`."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from kvshare.server.cli import build_parser
from kvshare.server.cli.options import env_name

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def serve_flags() -> list[str]:
    parser = build_parser(environ={})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a.option_strings[0] for a in sub.choices["serve"]._actions
            if a.option_strings and a.dest != "help"]


def problems(doc: str, flags: list[str]) -> list[str]:
    """What the doc lacks (a flag, an env var) or names wrongly (a table row of a flag the
    parser does not have)."""
    out = []
    for f in flags:
        if f"`{f}`" not in doc:
            out.append(f"flag {f} is not documented")
        if f"`{env_name(f)}`" not in doc:
            out.append(f"env var {env_name(f)} of {f} is not documented")
    known = set(flags)
    for m in re.finditer(r"^\| `(--[a-z0-9-]+)` \|", doc, re.M):
        if m.group(1) not in known:
            out.append(f"table row for {m.group(1)}, which `kvshare serve` does not have")
    return out


def test_every_serve_flag_is_documented():
    flags = serve_flags()
    assert len(flags) >= 30  # the parser was read, not an empty list
    found = problems(DOC.read_text(encoding="utf-8"), flags)
    assert not found, ("docs/configuration.md is out of date (run `python scripts/"
                       "gen_flag_docs.py --write docs/configuration.md`):\n" + "\n".join(found))


def test_the_check_fails_on_a_missing_or_stale_flag():
    doc = DOC.read_text(encoding="utf-8")
    flags = serve_flags()
    # a flag the parser gains but the doc lacks
    assert problems(doc, flags + ["--brand-new-flag"]) == [
        "flag --brand-new-flag is not documented",
        "env var KVSHARE_BRAND_NEW_FLAG of --brand-new-flag is not documented"]
    # a documented flag whose row is removed
    row = next(line for line in doc.splitlines() if line.startswith("| `--cache-ram` |"))
    stripped = doc.replace(row + "\n", "").replace("`--cache-ram`", "").replace(
        "`KVSHARE_CACHE_RAM`", "")
    assert "flag --cache-ram is not documented" in problems(stripped, flags)
    # a row for a flag the parser no longer has
    assert problems(doc + "\n| `--gone` | `KVSHARE_GONE` | x | y |\n", flags) == [
        "table row for --gone, which `kvshare serve` does not have"]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_flag_docs",
                                                  ROOT / "scripts" / "gen_flag_docs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_generated_tables_cover_every_flag_once():
    gen = _gen()
    text = gen.tables()
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \|", text, re.M)
    assert sorted(rows) == sorted(serve_flags())
    # the doc holds a generated section the script can replace
    doc = DOC.read_text(encoding="utf-8")
    assert gen.BEGIN in doc and gen.END in doc
    assert gen.replace_tables(doc, text).count(gen.BEGIN) == 1


@pytest.mark.parametrize("flag,default", [("--cache-ram", "`8192`"), ("--host", "`127.0.0.1`"),
                                          ("--port", "`8080`"), ("--cache-dir", "off")])
def test_generated_defaults(flag, default):
    rows = {r[0]: r for r in _gen().serve_flags()}
    assert rows[flag][2] == default
