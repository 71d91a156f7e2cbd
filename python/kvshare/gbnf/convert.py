"""GBNF text to llguidance Lark, pass by pass: parse, analyse, choose lexemes (alternating with
the fusion check until no lexeme conflicts), emit. `gbnf_to_lark` is the entry point."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from kvshare.gbnf.analysis import analyse
from kvshare.gbnf.automata import Automata
from kvshare.constraint_limits import MAX_GBNF_RULES, MAX_PREDICTED_ITEMS
from kvshare.gbnf.conflicts import ConflictCheck
from kvshare.gbnf.earley import predicted_items
from kvshare.gbnf.emit import Emitter
from kvshare.gbnf.errors import GBNFError
from kvshare.gbnf.lark import LarkWriter
from kvshare.gbnf.lexemes import Lexemes
from kvshare.gbnf.parse import Parser


def gbnf_to_lark(text: str, token_id: Callable[[str], int | None] | None = None) -> str:
    """The llguidance Lark grammar matching what the GBNF grammar `text` matches (see the
    package docstring). `token_id` resolves `<text>` tokens to ids (None: unknown token).
    Raises GBNFError (a ValueError), also for a grammar of more than
    `constraint_limits.MAX_GBNF_RULES` rules or one predicting more than
    `constraint_limits.MAX_PREDICTED_ITEMS` parser items at a position (gbnf/earley.py). The result has one `start:` rule, on its own line, and
    no name beginning with `kvshare_` / `KVSHARE_`. ~1 s per 25 KB of JSON-schema-like grammar
    (the fusion check has a budget); without `token_id` the last 32 results are cached."""
    if token_id is None:
        return _cached(text)
    return convert(text, token_id, fuse=True)


@functools.lru_cache(maxsize=32)
def _cached(text: str) -> str:
    return convert(text, None, fuse=True)


def convert(text: str, token_id: Callable[[str], int | None] | None, fuse: bool) -> str:
    """`gbnf_to_lark` uncached; `fuse=False`: one-character lexemes only (exact and slow; the
    tests compare both)."""
    if sys.getrecursionlimit() < 8000:  # the passes below recurse over the nesting
        sys.setrecursionlimit(8000)
    parser = Parser(text, token_id)
    parser.parse()
    rules = parser.rules
    if len(rules) > MAX_GBNF_RULES:  # before the passes: they take seconds on such grammars
        raise GBNFError(f"the grammar has {len(rules)} rules; at most {MAX_GBNF_RULES} are "
                        "accepted (the limit)", 1, 1)
    root_referenced = analyse(rules, parser.order)
    # before the lexeme passes too: a grammar whose predictions overflow llguidance's Earley
    # row would be refused by the probe only after them
    items, rule = predicted_items(rules, MAX_PREDICTED_ITEMS)
    if items > MAX_PREDICTED_ITEMS:
        raise GBNFError(f"where rule '{rule}' starts, the grammar predicts more than "
                        f"{MAX_PREDICTED_ITEMS} parser items (the alternatives of every rule "
                        f"that can begin it); at most {MAX_PREDICTED_ITEMS} are accepted "
                        "(the limit)", 1, 1)
    writer = LarkWriter(root_referenced)
    lexemes = Lexemes(rules, writer, fuse)
    check = ConflictCheck(rules, lexemes, Automata(rules))
    while True:
        lexemes.segment()
        if not fuse:
            break
        new = check.conflicts()
        if not new:
            break
        lexemes.banned |= new
    return Emitter(parser, writer, lexemes).emit()
