"""The GBNF parser (after llama.cpp's llama_grammar_parser): grammar text to a syntax tree per
rule, with llama.cpp's repetition limits and errors located by line and column."""

from __future__ import annotations

import re
from collections.abc import Callable

from kvshare.gbnf.charset import MAX_CP, UNIVERSE, complement, normalize
from kvshare.gbnf.errors import GBNFError
from kvshare.gbnf.tree import Alt, Cls, Lit, Node, Ref, Rep, Seq, Tok, children

MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
_MAX_NESTING = 256  # groups in groups
_MAX_STACKED_REPS = 4  # `x{2,3}{4}...`: repetition operators that could not be merged

_SPACE_NL = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)*")
_SPACE = re.compile(r"(?:[ \t]+|#[^\r\n]*)*")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_INT = re.compile(r"[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
_LARK_SPECIAL = re.compile(r"<[^<>\s]+>")
_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}


class Parser:
    def __init__(self, text: str, token_id: Callable[[str], int | None] | None):
        self.s = text
        self.n = len(text)
        self.token_id = token_id
        self.rules: dict[str, Node] = {}
        self.order: list[str] = []
        self.refs: list[Ref] = []
        self.weights: dict[int, int] = {}
        self.defined_at: dict[str, int] = {}

    def fail(self, i: int, message: str):
        i = min(i, self.n)
        line = self.s.count("\n", 0, i) + 1
        column = i - (self.s.rfind("\n", 0, i) + 1) + 1
        raise GBNFError(message, line, column)

    def found(self, i: int) -> str:
        if i >= self.n:
            return "the end of the grammar"
        c = self.s[i]
        if c in "\r\n":
            return "a newline"
        return repr(c)

    def space(self, i: int, newline_ok: bool) -> int:
        return (_SPACE_NL if newline_ok else _SPACE).match(self.s, i).end()

    def parse(self) -> None:
        i = self.space(0, True)
        while i < self.n:
            i = self.rule(i)
        for ref in self.refs:
            if ref.name not in self.rules:
                self.fail(ref.pos, f"undefined rule {ref.name!r}")
        if "root" not in self.rules:
            self.fail(self.n, "the grammar has no 'root' rule (where matching starts)")

    def rule(self, i: int) -> int:
        m = _NAME.match(self.s, i)
        if m is None:
            hint = ""
            if self.s[i] == "|":
                hint = (" (a rule continues on the next line only after a '|' ending the line, "
                        "or inside parentheses)")
            self.fail(i, f"expected a rule name, found {self.found(i)}{hint}")
        name = m.group()
        j = self.space(m.end(), False)
        if not self.s.startswith("::=", j):
            self.fail(j, f"expected '::=' after the rule name {name!r}, found {self.found(j)}")
        j = self.space(j + 3, True)
        body, j = self.alternates(j, False, 0)
        if j < self.n:
            c = self.s[j]
            if c == "\r":
                j += 2 if self.s.startswith("\r\n", j) else 1
            elif c == "\n":
                j += 1
            elif c == ")":
                self.fail(j, "unmatched ')'")
            else:
                self.fail(j, f"expected an item, '|', or the end of the rule (a newline), "
                             f"found {self.found(j)}")
        if name not in self.rules:
            self.order.append(name)
        self.rules[name] = body
        self.defined_at[name] = i
        return self.space(j, True)

    def alternates(self, i: int, nested: bool, depth: int) -> tuple[Node, int]:
        seq, i = self.sequence(i, nested, depth)
        alts = [seq]
        while i < self.n and self.s[i] == "|":
            i = self.space(i + 1, True)
            seq, i = self.sequence(i, nested, depth)
            alts.append(seq)
        return (alts[0] if len(alts) == 1 else Alt(alts)), i

    def sequence(self, i: int, nested: bool, depth: int) -> tuple[Node, int]:
        s, n = self.s, self.n
        items: list[Node] = []
        stacked = 0
        while i < n:
            c = s[i]
            node: Node
            if c == '"':
                node, i = self.literal(i)
            elif c == "[":
                node, i = self.char_class(i)
            elif c == "<" or c == "!":
                node, i = self.token(i)
            elif c == "(":
                if depth >= _MAX_NESTING:
                    self.fail(i, f"groups nested more than {_MAX_NESTING} deep")
                j = self.space(i + 1, True)
                node, j = self.alternates(j, True, depth + 1)
                if j >= n or s[j] != ")":
                    self.fail(j, f"expected ')' closing the '(' at {self.where(i)}, "
                                 f"found {self.found(j)}")
                i = j + 1
            elif c == ".":
                node = Cls(UNIVERSE)
                i += 1
            elif c in "*+?{":
                if not items:
                    self.fail(i, f"expected an item before {c!r} to repeat")
                lo, hi, j = self.repetition(i, nested)
                merged = merge_rep(items[-1], lo, hi)
                if merged is None:
                    stacked += 1
                    if stacked > _MAX_STACKED_REPS:
                        self.fail(i, "too many repetition operators on one item")
                    merged = Rep(items[-1], lo, hi)
                if self.weight(merged) > MAX_REPETITION:
                    self.fail(i, f"repetitions nested in repetitions multiply to more than "
                                 f"{MAX_REPETITION} (as llama.cpp refuses)")
                items[-1] = merged
                i = self.space(j, nested)
                continue
            else:
                m = _NAME.match(s, i)
                if m is None:
                    break
                node = Ref(m.group(), i)
                self.refs.append(node)
                i = m.end()
            items.append(node)
            stacked = 0
            i = self.space(i, nested)
        return (items[0] if len(items) == 1 else Seq(items)), i

    def weight(self, node: Node) -> int:
        """The product of the repetition counts around the deepest part of `node` (a bounded
        count: its maximum; an unbounded one: its minimum, at least 1)."""
        w = self.weights.get(id(node))
        if w is None:
            if isinstance(node, Rep):
                count = node.hi if node.hi is not None else max(node.lo, 1)
                w = max(count, 1) * self.weight(node.item)
            else:
                w = max((self.weight(c) for c in children(node)), default=1)
            self.weights[id(node)] = w
        return w

    def where(self, i: int) -> str:
        line = self.s.count("\n", 0, i) + 1
        return f"line {line}, column {i - (self.s.rfind(chr(10), 0, i) + 1) + 1}"

    def rule_position(self, rule: str) -> tuple[int, int]:
        """Line and column of a rule's definition."""
        i = self.defined_at.get(rule, 0)
        return self.s.count("\n", 0, i) + 1, i - (self.s.rfind("\n", 0, i) + 1) + 1

    def repetition(self, i: int, nested: bool) -> tuple[int, int | None, int]:
        c = self.s[i]
        if c == "*":
            return 0, None, i + 1
        if c == "+":
            return 1, None, i + 1
        if c == "?":
            return 0, 1, i + 1
        j = self.space(i + 1, nested)
        m = _INT.match(self.s, j)
        if m is None:
            self.fail(j, f"expected a number after '{{', found {self.found(j)}")
        lo = int(m.group())
        j = self.space(m.end(), nested)
        hi: int | None
        if j < self.n and self.s[j] == "}":
            hi = lo
        elif j < self.n and self.s[j] == ",":
            j = self.space(j + 1, nested)
            hi = None
            m = _INT.match(self.s, j)
            if m is not None:
                hi = int(m.group())
                j = self.space(m.end(), nested)
            if j >= self.n or self.s[j] != "}":
                self.fail(j, f"expected '}}' closing the repetition, found {self.found(j)}")
        else:
            self.fail(j, f"expected ',' or '}}' in the repetition, found {self.found(j)}")
        if lo > MAX_REPETITION:
            self.fail(i, f"the repetition count {lo} is more than {MAX_REPETITION}")
        if hi is not None and hi < lo:
            self.fail(i, f"the repetition {{{lo},{hi}}} has its maximum below its minimum")
        if hi is not None and hi > MAX_REPETITION:
            hi = None  # as llama.cpp
        return lo, hi, j + 1

    def char(self, j: int, what: str) -> tuple[int, int]:
        s = self.s
        if s[j] != "\\":
            return ord(s[j]), j + 1
        if j + 1 >= self.n:
            self.fail(j, f"unterminated {what}")
        e = s[j + 1]
        if e in _ESCAPES:
            return _ESCAPES[e], j + 2
        k = _HEX_LEN.get(e)
        if k is None:
            self.fail(j, f"unknown escape '\\{e}' (known: \\n \\r \\t \\\\ \\\" \\[ \\] \\- "
                         f"\\xHH \\uHHHH \\UHHHHHHHH)")
        m = _HEX.match(s, j + 2, j + 2 + k)
        if m is None or m.end() != j + 2 + k:
            self.fail(j, f"expected {k} hexadecimal digits after '\\{e}'")
        return int(m.group(), 16), j + 2 + k

    def literal(self, i: int) -> tuple[Node, int]:
        j = i + 1
        out = []
        while True:
            if j >= self.n:
                self.fail(i, "unterminated string literal")
            if self.s[j] == '"':
                break
            start = j
            c, j = self.char(j, "string literal")
            if 0xD800 <= c <= 0xDFFF:
                self.fail(start, f"U+{c:04X} is a UTF-16 surrogate, not a character: write the "
                                 f"character itself, or \\U and its 8-digit code point")
            if c > MAX_CP:
                self.fail(start, f"U+{c:X} is beyond the last Unicode character, U+10FFFF")
            out.append(chr(c))
        return (Lit("".join(out)) if out else Seq([])), j + 1

    def char_class(self, i: int) -> tuple[Node, int]:
        s, n = self.s, self.n
        j = i + 1
        negated = j < n and s[j] == "^"
        if negated:
            j += 1
        ranges = []
        while True:
            if j >= n:
                self.fail(i, "unterminated character class")
            if s[j] == "]":
                break
            start = j
            lo, j = self.char(j, "character class")
            hi = lo
            if j < n and s[j] == "-":
                if j + 1 >= n:
                    self.fail(i, "unterminated character class")
                if s[j + 1] != "]":
                    hi, j = self.char(j + 1, "character class")
                    if hi < lo:
                        self.fail(start, f"the range {s[start:j]} is reversed (U+{lo:04X} > "
                                         f"U+{hi:04X})")
            ranges.append((lo, hi))
        j += 1
        if not ranges:
            self.fail(i, f"empty character class {s[i:j]}")
        cls = normalize(ranges)
        if negated:
            cls = complement(cls)
        if not cls:
            self.fail(i, f"the character class {s[i:j]} matches no character")
        return Cls(cls), j

    def token(self, i: int) -> tuple[Node, int]:
        s = self.s
        j = i
        negated = s[j] == "!"
        if negated:
            j += 1
        if j >= self.n or s[j] != "<":
            self.fail(j, f"expected '<' (a token) after '!', found {self.found(j)}")
        if s.startswith("<[", j):
            m = _INT.match(s, j + 2)
            if m is None:
                self.fail(j + 2, f"expected a token id after '<[', found {self.found(j + 2)}")
            if not s.startswith("]>", m.end()):
                self.fail(m.end(), f"expected ']>' after the token id, found {self.found(m.end())}")
            tid = int(m.group())
            if tid > 0xFFFFFFFF:
                self.fail(j + 2, f"token id {tid} is too big")
            return Tok(f"<[^{tid}]>" if negated else f"<[{tid}]>"), m.end() + 2
        k = s.find(">", j + 1)
        if k < 0:
            self.fail(j, "unterminated token: expected '>'")
        text = s[j:k + 1]
        if self.token_id is not None:
            tid = self.token_id(text)
            if tid is None:
                self.fail(j, f"{text} is not a token of the model's vocabulary")
            return Tok(f"<[^{tid}]>" if negated else f"<[{tid}]>"), k + 1
        if negated:
            self.fail(i, f"!{text} needs the model's vocabulary to find the token: write its id, "
                         f"as in !<[id]>")
        if not _LARK_SPECIAL.fullmatch(text):
            self.fail(j, f"the token {text!r} cannot be named in Lark: write its id, as in "
                         f"<[id]>")
        return Tok(text), k + 1


def merge_rep(node: Node, lo: int, hi: int | None) -> Node | None:
    """`node` repeated lo..hi times as one repetition when that is the same language
    (x** = x*, x+? = x*, (x+){3,} = x{3,}, (x?){0,4} = x{0,4}, x{2}{3} = x{6}); None when
    it is not."""
    if not isinstance(node, Rep):
        return None
    x, a, b = node.item, node.lo, node.hi
    if hi == 0 or b == 0:
        return Rep(x, 0, 0)
    if a == b and lo == hi:  # exact counts multiply
        return Rep(x, a * lo, a * lo) if a * lo <= MAX_REPETITION else None
    if b is None and a == 0:  # x* repeated at least once or not at all: x*
        return Rep(x, 0, None)
    if b is None and a == 1:  # (x+){lo,hi}: x{lo,}
        return Rep(x, lo, None)
    if a == 0 and b == 1:  # (x?){lo,hi}: x{0,hi}
        return Rep(x, 0, hi)
    return None
