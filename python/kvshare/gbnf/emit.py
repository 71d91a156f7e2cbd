"""The Lark grammar text of a conversion: `start`, the rules that stay rules, the terminals
they use, the definitions split off for depth; and the guard on how deep llguidance's
compile of it recurses (deep chains are compiled bottom-up, deeper ones refused)."""

from __future__ import annotations

import re

from kvshare.gbnf.errors import GBNFError
from kvshare.gbnf.lark import LarkWriter
from kvshare.gbnf.lexemes import Lexemes
from kvshare.gbnf.parse import Parser
from kvshare.gbnf.tree import Alt, Cls, Lit, Node, Ref, Rep, Seq, Tok, walk

# llguidance compiles a Lark grammar depth-first from `start`, recursing into each rule and
# terminal at its first use: ~600 levels overflow a 2 MiB thread stack (a crash, not an error),
# and each parenthesis around a use costs about half a level more. Deeper output is refused.
_MAX_COMPILE_DEPTH = 250
_NEST_NAME = re.compile(r"\bNEST_[0-9]+\b")
_NOTHING = "/[^\\x{0}-\\x{10FFFF}]/"  # a Lark regex matching no character


class Emitter:
    """Writes the grammar once the lexemes are final. Terminals are written as they are
    found needed; a lexeme that is no rule's whole body gets a terminal named after the rule
    it is in (`anon`: text -> name)."""

    def __init__(self, parser: Parser, writer: LarkWriter, lexemes: Lexemes):
        self.parser = parser
        self.rules = parser.rules
        self.writer = writer
        self.lexemes = lexemes
        self.anon: dict[str, str] = {}
        self.terms_needed: list[str] = []
        self.terms_seen: set[str] = set()
        self.cur = "root"  # the rule being written

    def emit(self) -> str:
        w = self.writer
        lines = []
        if w.root_referenced:
            lines.append(f"start: {w.rule_name('root')}")
        for r in self.lexemes.struct_rules:
            self.cur = r
            body = self.struct_text(self.rules[r])
            lines.append(f"{w.rule_name(r)}: {body}")
        i = 0
        term_lines = []
        while i < len(self.terms_needed):
            r = self.terms_needed[i]
            i += 1
            body = self.rules[r]
            text = w.key(body)
            self.need_terms_of(body)
            term_lines.append(f"{w.term_name(r)}: {text}")
        lines += [f"{name}: {text}" for text, name in w.nested_rules.items()]
        lines += term_lines + [f"{name}: {text}" for text, name in self.anon.items()]
        lines += self.nested_terms_used(lines)
        self.bottom_up_if_deep(lines)
        return "\n".join(lines) + "\n"

    def nested_terms_used(self, lines: list[str]) -> list[str]:
        """The definitions of the terminals split off for nesting that `lines` use (they are
        made while lexemes are chosen, some for lexemes later split)."""
        nested = {name: text for text, name in self.writer.nested_terms.items()}
        todo = list(lines)
        used: set[str] = set()
        while todo:
            for name in _NEST_NAME.findall(todo.pop()):
                if name in nested and name not in used:
                    used.add(name)
                    todo.append(nested[name])
        return [f"{name}: {text}" for name, text in nested.items() if name in used]

    def bottom_up_if_deep(self, lines: list[str]) -> None:
        """Makes llguidance compile `lines` bottom-up when its depth-first compile would go too
        deep; raises GBNFError when even that is too deep."""
        depth, deepest, order = _compile_depth(lines)
        if depth > _MAX_COMPILE_DEPTH:
            # compile bottom-up: a first alternative of `start` that never matches (a class of
            # no character) uses every definition, dependencies first (llguidance compiles each
            # once, at its first use)
            name, _, body = lines[0].partition(": ")
            lines[0] = f"{name}: {_NOTHING} {' '.join(order)} | {body}"
            depth, deepest, _ = _compile_depth(lines)
        if depth > _MAX_COMPILE_DEPTH:
            w = self.writer
            gbnf = {v: k for k, v in {**w.term_names, **w.rule_names}.items()}
            raise GBNFError(f"rules used within rules go {depth:.0f} levels deep (rule "
                            f"{gbnf.get(deepest, 'root')!r} is the deepest), more than the "
                            f"{_MAX_COMPILE_DEPTH} llguidance can compile safely",
                            *self.parser.rule_position(gbnf.get(deepest, "root")))

    def need_terms_of(self, node: Node) -> None:
        for n in walk(node):
            if isinstance(n, Ref) and n.name not in self.terms_seen:
                self.terms_seen.add(n.name)
                self.terms_needed.append(n.name)

    def lexeme_text(self, node: Node) -> str:
        w = self.writer
        if isinstance(node, (Lit, Cls)) or (isinstance(node, Seq) and not node.items):
            return w.key(node)
        if isinstance(node, Ref):
            self.need_terms_of(node)
            return w.term_name(node.name)
        text = w.key(node)
        name = self.anon.get(text)
        if name is None:
            base = w.rule_name(self.cur).upper().replace("-", "_")
            name = self.anon[text] = w.fresh(base)
            self.need_terms_of(node)
        return name

    def struct_text(self, node: Node) -> str:
        """`node` in a Lark rule."""
        w = self.writer
        segs = self.lexemes.segs
        if id(node) in self.lexemes.fused:
            return self.lexeme_text(node)
        if isinstance(node, Lit):  # split into pieces
            return " ".join(self.struct_text(p) for p in segs[id(node)])
        if isinstance(node, Cls):
            return w.key(node)
        if isinstance(node, Tok):
            return node.lark
        if isinstance(node, Ref):
            return w.rule_name(node.name)
        if isinstance(node, Seq):
            return w.seq_text([self.struct_text(n) for n in segs.get(id(node), node.items)],
                              False)
        if isinstance(node, Alt):
            return " | ".join(self.struct_text(a) for a in node.alts)
        assert isinstance(node, Rep)
        return w.rep_text(self.struct_text(node.item), node.lo, node.hi, False)


def _compile_depth(lines: list[str]) -> tuple[float, str, list[str]]:
    """How deep llguidance's compile of these Lark definitions (`name: body`) recurses: from
    `start`, into each rule or terminal at its first use (in text order), a level each plus
    half a level per parenthesis around the use; the deepest name; the names in the order
    their compile ends."""
    uses: dict[str, list[tuple[str, int]]] = {}
    for line in lines:
        name, _, body = line.partition(": ")
        out = []
        depth = 0
        i, n = 0, len(body)
        while i < n:
            c = body[i]
            if c == '"' or c == "/":
                i += 1
                while i < n and body[i] != c:
                    i += 2 if body[i] == "\\" else 1
            elif c == "<":
                i = body.index(">", i)
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            elif c.isalpha() or c == "_":
                j = i
                while j < n and (body[j].isalnum() or body[j] in "_-"):
                    j += 1
                out.append((body[i:j], depth))
                i = j - 1
            i += 1
        uses[name] = out
    started = {"start"}
    stack = [("start", 1.0, 0)]
    most, deepest = 1.0, "start"
    order = []
    while stack:
        name, cost, k = stack.pop()
        refs = uses.get(name, [])
        while k < len(refs) and (refs[k][0] in started or refs[k][0] not in uses):
            k += 1
        if k == len(refs):
            if name != "start":
                order.append(name)
            continue
        ref, parens = refs[k]
        stack.append((name, cost, k + 1))
        started.add(ref)
        c = cost + 1 + parens / 2
        if c > most:
            most, deepest = c, ref
        stack.append((ref, c, 0))
    return most, deepest, order
