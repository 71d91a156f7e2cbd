"""Lark text: llguidance names for GBNF rules (as rules and as terminals), and nodes written as
Lark terminal expressions or rule pieces, with parentheses kept shallow enough for
llguidance's Lark parser (deeper groups become definitions of their own)."""

from __future__ import annotations

import re

from kvshare.gbnf.charset import UNIVERSE
from kvshare.gbnf.tree import Alt, Cls, Lit, Node, Ref, Rep, Seq

_MAX_PARENS = 16  # parentheses nested deeper go into rules / terminals of their own
_LARK_RULE = re.compile(r"[a-z][a-z0-9-]*")


class LarkWriter:
    """Names and Lark text shared by every pass of one conversion: a name, once given, is
    never given again. `nested_terms` / `nested_rules`: text -> name of the definitions split
    off for depth."""

    def __init__(self, root_referenced: bool):
        self.root_referenced = root_referenced  # then `root` is a rule of its own, not `start`
        self.used_names: set[str] = set()
        self.rule_names: dict[str, str] = {}
        self.term_names: dict[str, str] = {}
        self.nested_terms: dict[str, str] = {}  # text -> name, for deep nesting
        self.nested_rules: dict[str, str] = {}

    def fresh(self, base: str) -> str:
        """`base_1`, `base_2`, ...: the first not given yet."""
        k = 1
        while f"{base}_{k}" in self.used_names:
            k += 1
        name = f"{base}_{k}"
        self.used_names.add(name)
        return name

    def rule_name(self, r: str) -> str:
        name = self.rule_names.get(r)
        if name is None:
            if r == "root" and not self.root_referenced:
                name = "start"
            elif _LARK_RULE.fullmatch(r) and r != "start" and not r.startswith("kvshare"):
                name = r  # GBNF names have no '_': these never meet the generated ones
            else:
                base = r.lower().replace("-", "_")
                if not base[:1].isalpha() or base.startswith("kvshare") or base == "start":
                    base = "r" + base
                name = self.fresh(base)
            self.rule_names[r] = name
        return name

    def term_name(self, r: str) -> str:
        name = self.term_names.get(r)
        if name is None:
            if _LARK_RULE.fullmatch(r) and not r.startswith("kvshare"):
                name = r.upper()
            else:
                base = r.upper().replace("-", "_")
                if not base[:1].isalpha() or base.startswith("KVSHARE"):
                    base = "T" + base
                name = self.fresh(base)
            self.term_names[r] = name
        return name

    def key(self, node: Node) -> str:
        """`node` as a Lark terminal expression, cached on it: what identifies a lexeme."""
        if node.key is None:
            node.key = self.term_text(node)
        return node.key

    def term_text(self, node: Node) -> str:
        """`node` as a Lark terminal expression (one lexeme)."""
        if isinstance(node, Lit):
            return _lark_string(node.text)
        if isinstance(node, Cls):
            return _class_text(node.ranges)
        if isinstance(node, Ref):
            return self.term_name(node.name)
        if isinstance(node, Seq):
            return self.seq_text([self.term_text(n) for n in node.items], True)
        if isinstance(node, Alt):
            return " | ".join(self.term_text(a) for a in node.alts)
        assert isinstance(node, Rep)
        return self.rep_text(self.term_text(node.item), node.lo, node.hi, True)

    def wrap(self, text: str, term: bool) -> str:
        """`(text)`, or the name of a new rule / terminal `text` where parentheses would nest
        too deep for llguidance's Lark parser (at most 30 levels)."""
        if _top_level(text)[2] < _MAX_PARENS:
            return f"({text})"
        nested = self.nested_terms if term else self.nested_rules
        name = nested.get(text)
        if name is None:
            name = nested[text] = self.fresh("NEST" if term else "nest")
        return name

    def seq_text(self, parts: list[str], term: bool) -> str:
        parts = [p for p in parts if p != '""'] if len(parts) > 1 else parts
        if not parts:
            return '""'
        return " ".join(self.wrap(p, term) if _top_level(p)[1] else p for p in parts)

    def rep_text(self, inner: str, lo: int, hi: int | None, term: bool) -> str:
        if hi == 0 or inner == '""':
            return '""'
        if lo == 1 and hi == 1:
            return inner
        space, bar, _ = _top_level(inner)
        if inner[-1] in "*+?}" or space or bar:  # not one atom
            inner = self.wrap(inner, term)
        if hi is None:
            op = "*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"
        elif lo == 0 and hi == 1:
            op = "?"
        elif lo == hi:
            op = f"{{{lo}}}"
        else:
            op = f"{{{lo},{hi}}}"
        return inner + op


def _top_level(text: str) -> tuple[bool, bool, int]:
    """Whether Lark text has a space / a '|' outside parentheses, strings, regexes and
    special tokens; how deep its parentheses nest."""
    space = bar = False
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "/":
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif c == "<":
            i = text.index(">", i)
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif depth == 0 and c == " ":
            space = True
        elif depth == 0 and c == "|":
            bar = True
        i += 1
    return space, bar, deepest


def _lark_string(text: str) -> str:
    out = ['"']
    for ch in text:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _class_char(c: int) -> str:
    ch = chr(c)
    if ch.isascii() and ch.isalnum():
        return ch
    if c >= 0xA0 and ch.isprintable() and not ch.isspace():
        return ch
    return f"\\x{{{c:X}}}"


def _class_text(ranges: tuple[tuple[int, int], ...]) -> str:
    if ranges == UNIVERSE:
        return "/(?s:.)/"
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _lark_string(chr(ranges[0][0]))
    parts = []
    for lo, hi in ranges:
        if lo == hi:
            parts.append(_class_char(lo))
        elif hi == lo + 1:
            parts.append(_class_char(lo) + _class_char(hi))
        else:
            parts.append(f"{_class_char(lo)}-{_class_char(hi)}")
    return "/[" + "".join(parts) + "]/"
