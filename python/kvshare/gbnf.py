"""GBNF, llama.cpp's grammar format (the `grammar` field of llama-server requests), converted to
llguidance's Lark-like syntax (`kvshare.constrain.compile_grammar(vocab, "lark", ...)`).

    gbnf_to_lark(text, token_id=None) -> str      # raises GBNFError, a ValueError

Syntax: all of llama.cpp's (its grammars/README.md; its parser, src/llama-grammar.cpp, is the
reference for the details): rules `name ::= ...` (names of letters, digits and `-`, any case;
`root` is where matching starts), alternatives `|`, groups `( )`, `*` `+` `?` `{m}` `{m,}`
`{m,n}`, string literals and character classes `[a-z]` `[^...]` with the escapes
`\\n \\r \\t \\\\ \\" \\[ \\] \\- \\xHH \\uHHHH \\UHHHHHHHH`, `.` (any character, a
newline too), `#` comments, rules over several lines (inside parentheses, and after a `|`
ending a line), tokens `<[id]>` (that token), `!<[id]>` (any one token but that one),
`<text>` (the token whose text that is) and `!<text>`. A later definition of a rule replaces
an earlier one, and repetition bounds go as in llama.cpp: a count above 2000 is an error, a
maximum above 2000 is no maximum, nested repetitions multiplying past 2000 are an error.

Stricter than llama.cpp (errors, with line and column): an undefined rule even if unused, no
`root`, an empty class `[]` / `[^]` (llama.cpp reads them as nothing at all), a reversed
range `[z-a]` (matches nothing there), a surrogate or out-of-range code point in a literal
(can never match), `{m,n}` with n < m, groups nested deeper than 256. Looser: left recursion
(refused by llama.cpp, fine for llguidance's Earley parser).

Tokens: `<[id]>` and `!<[id]>` become llguidance's `<[id]>` and `<[^id]>`. `<text>` needs
`token_id` (text -> id or None, e.g. `Tokenizer.token_to_id`) to mean any token as in
llama.cpp; without it `<text>` is left to llguidance, which knows special (control) tokens by
name only, and `!<text>` is an error.

Why the output is not a rule-for-rule transcription: GBNF matches character by character with
every alternative alive, while llguidance cuts the text into lexemes (string literals,
regexes, terminals) greedily, over all the lexemes its parser allows at that point, without
backtracking: with `start: NAME "s"` and `NAME: /[a-z]+/`, "cats" is read as NAME = "cats" and
the "s" never comes. One-character lexemes are exact (none can run past another: that form is
what the tests compare with), but the parser then steps once per character, with ~100x
slower token masks on a 262K vocabulary for JSON strings. So the converter makes lexemes as
long as it safely can: regular (non-recursive, token-free) rules become Lark terminals (the
idea comes from llguidance's python/llguidance/gbnf_to_lark.py, MIT licensed; this code is
our own), regular sub-expressions single lexemes; then each lexeme that could continue past
the end of a match of some lexeme with a character that may follow that match in the grammar
is split (checked on automata of the two, at the level of UTF-8 lead bytes, since the lexer
reads bytes; any two lexemes are assumed to be allowed at the same time), again until none
can. A split cuts a sequence where the conflict was, else peels its optional tail (`STRING
ws` -> `STRING`, `ws`); alternatives, repetitions and literals split into their parts. The
check has a budget: past it, lexemes are split without checking (slower masks, same
language). A 25 KB JSON-schema-like grammar takes ~1 s, 130 KB ~8 s, 230 KB ~12 s (budget
spent); without `token_id` the last 32 results are cached. Parentheses nested deeper than
llguidance's parser allows (30) go into rules or terminals of their own. llguidance compiles
rules depth-first, recursing at each first use (a chain of ~600 rules overflows a 2 MiB
stack): deep chains are compiled bottom-up through a first alternative of `start` that
matches nothing and uses every definition in dependency order, and a grammar still too deep
is refused.
"""

from __future__ import annotations

import collections
import functools
import re
import sys
from collections.abc import Callable

__all__ = ["GBNFError", "gbnf_to_lark", "MAX_REPETITION"]

MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
_MAX_NESTING = 256  # groups in groups
_MAX_PARENS = 16  # parentheses nested deeper go into rules / terminals of their own
_MAX_STACKED_REPS = 4  # `x{2,3}{4}...`: repetition operators that could not be merged
_MAX_TERM_DEPTH = 32  # chains of terminals referring to terminals (llguidance recurses on them)
# llguidance compiles a Lark grammar depth-first from `start`, recursing into each rule and
# terminal at its first use: ~600 levels overflow a 2 MiB thread stack (a crash, not an error),
# and each parenthesis around a use costs about half a level more. Deeper output is refused.
_MAX_COMPILE_DEPTH = 250
_MAX_NFA_STATES = 4000  # per lexeme in the fusion check; a bigger lexeme is split
_EXACT_REPS = 24  # counted repetitions checked exactly up to this count (over-approximated above)
_CHECK_BUDGET = 3_000_000  # product-automaton steps over the whole fusion check
_BUILD_BUDGET = 3_000_000  # automaton states built over the whole fusion check

_MAX_CP = 0x10FFFF
_UNIVERSE = ((0, 0xD7FF), (0xE000, _MAX_CP))  # Unicode scalar values
_TOKEN_BIT = 1 << 256  # "a token element comes next" in lead-byte masks

_SPACE_NL = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)*")
_SPACE = re.compile(r"(?:[ \t]+|#[^\r\n]*)*")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_INT = re.compile(r"[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
_LARK_RULE = re.compile(r"[a-z][a-z0-9-]*")
_LARK_SPECIAL = re.compile(r"<[^<>\s]+>")
_NEST_NAME = re.compile(r"\bNEST_[0-9]+\b")
_NOTHING = "/[^\\x{0}-\\x{10FFFF}]/"  # a Lark regex matching no character
_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}


class GBNFError(ValueError):
    """A GBNF grammar that cannot be read or converted; `line` and `column` (1-based, in
    characters) locate the problem."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(f"GBNF grammar, line {line}, column {column}: {message}")
        self.message = message
        self.line = line
        self.column = column


def gbnf_to_lark(text: str, token_id: Callable[[str], int | None] | None = None) -> str:
    """The llguidance Lark grammar matching what the GBNF grammar `text` matches (see the
    module docstring). `token_id` resolves `<text>` tokens to ids (None: unknown token).
    Raises GBNFError (a ValueError). The result has one `start:` rule, on its own line, and
    no name beginning with `kvshare_` / `KVSHARE_`. ~1 s per 25 KB of JSON-schema-like grammar
    (the fusion check has a budget); without `token_id` the last 32 results are cached."""
    if token_id is None:
        return _cached(text)
    return _convert(text, token_id, fuse=True)


@functools.lru_cache(maxsize=32)
def _cached(text: str) -> str:
    return _convert(text, None, fuse=True)


def _convert(text: str, token_id: Callable[[str], int | None] | None, fuse: bool) -> str:
    # `fuse=False`: one-character lexemes only (exact and slow); the tests compare both
    if sys.getrecursionlimit() < 8000:  # the passes below recurse over the nesting
        sys.setrecursionlimit(8000)
    parser = _Parser(text, token_id)
    parser.parse()
    return _Converter(parser, fuse).run()


# ---------------------------------------------------------------------------------------------
# syntax tree


class _Node:
    __slots__ = ("nullable", "first", "last", "follow", "regular", "key")

    def __init__(self):
        self.nullable = False
        self.first = 0  # lead bytes (bit 256: a token element) the node's matches start with
        self.last = 0  # lead bytes of the last characters of its matches
        self.follow = 0  # lead bytes of what may come right after the node
        self.regular = True  # no tokens, no recursion: can be (part of) one lexeme
        self.key: str | None = None  # its text as a Lark terminal expression


class _Lit(_Node):
    __slots__ = ("text",)

    def __init__(self, text: str):
        super().__init__()
        self.text = text  # never empty (an empty literal is an empty _Seq)


class _Cls(_Node):
    __slots__ = ("ranges",)

    def __init__(self, ranges: tuple[tuple[int, int], ...]):
        super().__init__()
        self.ranges = ranges  # sorted, disjoint, non-adjacent scalar-value ranges; not empty


class _Tok(_Node):
    __slots__ = ("lark",)

    def __init__(self, lark: str):
        super().__init__()
        self.lark = lark
        self.regular = False


class _Ref(_Node):
    __slots__ = ("name", "pos")

    def __init__(self, name: str, pos: int):
        super().__init__()
        self.name = name
        self.pos = pos


class _Seq(_Node):
    __slots__ = ("items",)

    def __init__(self, items: list[_Node]):
        super().__init__()
        self.items = items


class _Alt(_Node):
    __slots__ = ("alts",)

    def __init__(self, alts: list[_Node]):
        super().__init__()
        self.alts = alts


class _Rep(_Node):
    __slots__ = ("item", "lo", "hi")

    def __init__(self, item: _Node, lo: int, hi: int | None):
        super().__init__()
        self.item = item
        self.lo = lo
        self.hi = hi  # None: unbounded


def _children(node: _Node) -> list[_Node]:
    if isinstance(node, _Seq):
        return node.items
    if isinstance(node, _Alt):
        return node.alts
    if isinstance(node, _Rep):
        return [node.item]
    return []


def _walk(node: _Node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(_children(n))


# ---------------------------------------------------------------------------------------------
# character sets


def _normalize(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, merged, clipped to scalar values (surrogates and > U+10FFFF dropped)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for ulo, uhi in _UNIVERSE:
            a, b = max(lo, ulo), min(hi, uhi)
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return tuple((a, b) for a, b in out)


def _complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CP:
        out.append((nxt, _MAX_CP))
    return _normalize(out)


def _lead(c: int) -> int:
    """The first byte of c in UTF-8."""
    if c < 0x80:
        return c
    if c < 0x800:
        return 0xC0 | (c >> 6)
    if c < 0x10000:
        return 0xE0 | (c >> 12)
    return 0xF0 | (c >> 18)


_LEAD_CACHE: dict[tuple[tuple[int, int], ...], int] = {}


def _lead_mask(ranges: tuple[tuple[int, int], ...]) -> int:
    m = _LEAD_CACHE.get(ranges)
    if m is None:
        m = 0
        for lo, hi in ranges:
            for slo, shi in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, _MAX_CP)):
                a, b = max(lo, slo), min(hi, shi)
                if a <= b:
                    m |= (1 << (_lead(b) + 1)) - (1 << _lead(a))
        if len(_LEAD_CACHE) < 100_000:
            _LEAD_CACHE[ranges] = m
    return m


def _intersects(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# parser (follows llama.cpp's llama_grammar_parser)


class _Parser:
    def __init__(self, text: str, token_id: Callable[[str], int | None] | None):
        self.s = text
        self.n = len(text)
        self.token_id = token_id
        self.rules: dict[str, _Node] = {}
        self.order: list[str] = []
        self.refs: list[_Ref] = []
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

    def alternates(self, i: int, nested: bool, depth: int) -> tuple[_Node, int]:
        seq, i = self.sequence(i, nested, depth)
        alts = [seq]
        while i < self.n and self.s[i] == "|":
            i = self.space(i + 1, True)
            seq, i = self.sequence(i, nested, depth)
            alts.append(seq)
        return (alts[0] if len(alts) == 1 else _Alt(alts)), i

    def sequence(self, i: int, nested: bool, depth: int) -> tuple[_Node, int]:
        s, n = self.s, self.n
        items: list[_Node] = []
        stacked = 0
        while i < n:
            c = s[i]
            node: _Node
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
                node = _Cls(_UNIVERSE)
                i += 1
            elif c in "*+?{":
                if not items:
                    self.fail(i, f"expected an item before {c!r} to repeat")
                lo, hi, j = self.repetition(i, nested)
                merged = _merge_rep(items[-1], lo, hi)
                if merged is None:
                    stacked += 1
                    if stacked > _MAX_STACKED_REPS:
                        self.fail(i, "too many repetition operators on one item")
                    merged = _Rep(items[-1], lo, hi)
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
                node = _Ref(m.group(), i)
                self.refs.append(node)
                i = m.end()
            items.append(node)
            stacked = 0
            i = self.space(i, nested)
        return (items[0] if len(items) == 1 else _Seq(items)), i

    def weight(self, node: _Node) -> int:
        """The product of the repetition counts around the deepest part of `node` (a bounded
        count: its maximum; an unbounded one: its minimum, at least 1)."""
        w = self.weights.get(id(node))
        if w is None:
            if isinstance(node, _Rep):
                count = node.hi if node.hi is not None else max(node.lo, 1)
                w = max(count, 1) * self.weight(node.item)
            else:
                w = max((self.weight(c) for c in _children(node)), default=1)
            self.weights[id(node)] = w
        return w

    def where(self, i: int) -> str:
        line = self.s.count("\n", 0, i) + 1
        return f"line {line}, column {i - (self.s.rfind(chr(10), 0, i) + 1) + 1}"

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

    def literal(self, i: int) -> tuple[_Node, int]:
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
            if c > _MAX_CP:
                self.fail(start, f"U+{c:X} is beyond the last Unicode character, U+10FFFF")
            out.append(chr(c))
        return (_Lit("".join(out)) if out else _Seq([])), j + 1

    def char_class(self, i: int) -> tuple[_Node, int]:
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
        cls = _normalize(ranges)
        if negated:
            cls = _complement(cls)
        if not cls:
            self.fail(i, f"the character class {s[i:j]} matches no character")
        return _Cls(cls), j

    def token(self, i: int) -> tuple[_Node, int]:
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
            return _Tok(f"<[^{tid}]>" if negated else f"<[{tid}]>"), m.end() + 2
        k = s.find(">", j + 1)
        if k < 0:
            self.fail(j, "unterminated token: expected '>'")
        text = s[j:k + 1]
        if self.token_id is not None:
            tid = self.token_id(text)
            if tid is None:
                self.fail(j, f"{text} is not a token of the model's vocabulary")
            return _Tok(f"<[^{tid}]>" if negated else f"<[{tid}]>"), k + 1
        if negated:
            self.fail(i, f"!{text} needs the model's vocabulary to find the token: write its id, "
                         f"as in !<[id]>")
        if not _LARK_SPECIAL.fullmatch(text):
            self.fail(j, f"the token {text!r} cannot be named in Lark: write its id, as in "
                         f"<[id]>")
        return _Tok(text), k + 1


def _merge_rep(node: _Node, lo: int, hi: int | None) -> _Node | None:
    """`node` repeated lo..hi times as one repetition when that is the same language
    (x** = x*, x+? = x*, (x+){3,} = x{3,}, (x?){0,4} = x{0,4}, x{2}{3} = x{6}); None when
    it is not."""
    if not isinstance(node, _Rep):
        return None
    x, a, b = node.item, node.lo, node.hi
    if hi == 0 or b == 0:
        return _Rep(x, 0, 0)
    if a == b and lo == hi:  # exact counts multiply
        return _Rep(x, a * lo, a * lo) if a * lo <= MAX_REPETITION else None
    if b is None and a == 0:  # x* repeated at least once or not at all: x*
        return _Rep(x, 0, None)
    if b is None and a == 1:  # (x+){lo,hi}: x{lo,}
        return _Rep(x, lo, None)
    if a == 0 and b == 1:  # (x?){lo,hi}: x{0,hi}
        return _Rep(x, 0, hi)
    return None


# ---------------------------------------------------------------------------------------------
# conversion


class _TooBig(Exception):
    pass


class _NFA:
    """Thompson automaton of one lexeme (labels: character-range tuples)."""

    __slots__ = ("eps", "trans", "start", "accept", "_closure", "bound", "item")

    def __init__(self):
        self.eps: list[list[int]] = []
        self.trans: list[list[tuple[int, int]]] = []  # (label id, target)
        self._closure: dict[int, tuple[int, ...]] = {}
        self.bound: dict[int, int] | None = None  # state -> item boundary (a sequence's)
        self.item: list[int] = []  # the item each state belongs to (a sequence's)

    def state(self) -> int:
        if len(self.eps) >= _MAX_NFA_STATES:
            raise _TooBig
        self.eps.append([])
        self.trans.append([])
        return len(self.eps) - 1

    def closure(self, p: int) -> tuple[int, ...]:
        c = self._closure.get(p)
        if c is None:
            seen = {p}
            stack = [p]
            while stack:
                for q in self.eps[stack.pop()]:
                    if q not in seen:
                        seen.add(q)
                        stack.append(q)
            c = self._closure[p] = tuple(seen)
        return c


class _Converter:
    def __init__(self, parser: _Parser, fuse: bool):
        self.parser = parser
        self.rules = parser.rules
        self.order = parser.order
        self.fuse = fuse
        self.used_names: set[str] = set()
        self.rule_names: dict[str, str] = {}
        self.term_names: dict[str, str] = {}
        self.banned: set[str] = set()
        self.runs: dict[tuple[int, int, int], _Seq] = {}
        self.pieces: dict[tuple[int, int, int], _Lit] = {}
        self.nfas: dict[str, _NFA | None] = {}
        self.checked: dict[str, int] = {}  # lexeme -> the follow set it was checked with
        self.seen_ext: set[str] = set()  # lexemes that were candidate extenders already
        self.prefixes: dict[str, str] = {}
        self.summaries: dict[int, tuple[int, frozenset]] = {}
        self.templates: dict[str, _NFA | None] = {}
        self.nested_terms: dict[str, str] = {}  # text -> name, for deep nesting
        self.nested_rules: dict[str, str] = {}
        self.budget = _CHECK_BUDGET
        self.build_budget = _BUILD_BUDGET
        self.hints: dict[str, set[int]] = {}
        self.label_ids: dict[tuple[tuple[int, int], ...], int] = {}
        self.labels: list[tuple[tuple[int, int], ...]] = []
        self.label_leads: list[int] = []
        self.meet_cache: dict[tuple[int, int], bool] = {}

    def where(self, rule: str) -> tuple[int, int]:
        """Line and column of a GBNF rule's definition."""
        p = self.parser
        i = p.defined_at.get(rule, 0)
        return p.s.count("\n", 0, i) + 1, i - (p.s.rfind("\n", 0, i) + 1) + 1

    # --- names -------------------------------------------------------------------------------

    def _fresh(self, base: str) -> str:
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
                name = self._fresh(base)
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
                name = self._fresh(base)
            self.term_names[r] = name
        return name

    # --- analysis ----------------------------------------------------------------------------

    def run(self) -> str:
        rules = self.rules
        live = self.reachable()
        refs = {r: [n.name for n in _walk(rules[r]) if isinstance(n, _Ref)] for r in live}
        self.root_referenced = any("root" in refs[r] for r in live)
        self.regular_rules(live, refs)
        self.nullable_first(live, refs)
        self.follow_sets(live)
        while True:
            self.segment()
            if not self.fuse:
                break
            new = self.conflicts()
            if not new:
                break
            self.banned |= new
        return self.emit()

    def reachable(self) -> list[str]:
        seen = {"root"}
        stack = ["root"]
        while stack:
            for n in _walk(self.rules[stack.pop()]):
                if isinstance(n, _Ref) and n.name not in seen:
                    seen.add(n.name)
                    stack.append(n.name)
        return ["root"] + [r for r in self.order if r in seen and r != "root"]

    def regular_rules(self, live: list[str], refs: dict[str, list[str]]) -> None:
        """Rules that can be Lark terminals: no tokens, no recursion (Tarjan's SCCs), only such
        rules referenced, and not too deep a chain of them."""
        has_tok = {r: any(isinstance(n, _Tok) for n in _walk(self.rules[r])) for r in live}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        on_stack: set[str] = set()
        stack: list[str] = []
        cyclic: set[str] = set()
        finished: list[str] = []  # dependencies first
        counter = 0
        for root in live:
            if root in index:
                continue
            work = [(root, 0)]
            while work:
                v, k = work.pop()
                if k == 0:
                    index[v] = low[v] = counter
                    counter += 1
                    stack.append(v)
                    on_stack.add(v)
                deps = refs[v]
                if k < len(deps):
                    work.append((v, k + 1))
                    w = deps[k]
                    if w not in index:
                        work.append((w, 0))
                    elif w in on_stack:
                        low[v] = min(low[v], index[w])
                    continue
                for w in deps:
                    if w in on_stack:
                        low[v] = min(low[v], low[w])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in deps:
                        cyclic.update(comp)
                    finished.extend(comp)
        self.topo = finished
        self.regular: dict[str, bool] = {}
        depth: dict[str, int] = {}
        for r in finished:
            deps = refs[r]
            ok = not has_tok[r] and r not in cyclic and all(self.regular.get(d) for d in deps)
            depth[r] = 1 + max((depth.get(d, 0) for d in deps), default=0)
            self.regular[r] = ok and depth[r] <= _MAX_TERM_DEPTH

    def node_nf(self, node: _Node) -> tuple[bool, int, int]:
        """nullable, first, last (and regular) of `node` and below (rules: self.rnf)."""
        if isinstance(node, _Lit):
            nl, fi, la = False, 1 << _lead(ord(node.text[0])), 1 << _lead(ord(node.text[-1]))
        elif isinstance(node, _Cls):
            nl, fi = False, _lead_mask(node.ranges)
            la = fi
        elif isinstance(node, _Tok):
            nl, fi, la = False, _TOKEN_BIT, _TOKEN_BIT
        elif isinstance(node, _Ref):
            nl, fi, la = self.rnf[node.name]
            node.regular = self.regular[node.name]
        elif isinstance(node, _Seq):
            vals = [self.node_nf(it) for it in node.items]
            node.regular = all(it.regular for it in node.items)
            nl, fi, la = _seq_nfl(vals)
        elif isinstance(node, _Alt):
            nl, fi, la = False, 0, 0
            for a in node.alts:
                anl, afi, ala = self.node_nf(a)
                nl, fi, la = nl or anl, fi | afi, la | ala
            node.regular = all(a.regular for a in node.alts)
        else:
            assert isinstance(node, _Rep)
            inl, ifi, ila = self.node_nf(node.item)
            node.regular = node.item.regular
            if node.hi == 0:
                nl, fi, la = True, 0, 0
            else:
                nl, fi, la = node.lo == 0 or inl, ifi, ila
        node.nullable, node.first, node.last = nl, fi, la
        return nl, fi, la

    def nullable_first(self, live: list[str], refs: dict[str, list[str]]) -> None:
        self.rnf: dict[str, tuple[bool, int, int]] = {r: (False, 0, 0) for r in live}
        users: dict[str, set[str]] = {r: set() for r in live}
        for r in live:
            for d in refs[r]:
                users[d].add(r)
        queue = collections.deque(self.topo)  # dependencies first: most rules once
        queued = set(queue)
        while queue:
            r = queue.popleft()
            queued.discard(r)
            v = self.node_nf(self.rules[r])
            if v != self.rnf[r]:
                self.rnf[r] = v
                for u in users[r]:
                    if u not in queued:
                        queued.add(u)
                        queue.append(u)
        for r in live:
            self.node_nf(self.rules[r])

    def follow_sets(self, live: list[str]) -> None:
        rfollow = {r: 0 for r in live}
        queue = list(reversed(live))
        queued = set(queue)

        def visit(node: _Node, f: int) -> None:
            node.follow = f
            if isinstance(node, _Seq):
                acc = f
                for it in reversed(node.items):
                    visit(it, acc)
                    acc = it.first | (acc if it.nullable else 0)
            elif isinstance(node, _Alt):
                for a in node.alts:
                    visit(a, f)
            elif isinstance(node, _Rep):
                again = node.hi is None or node.hi > 1
                visit(node.item, f | (node.item.first if again else 0))
            elif isinstance(node, _Ref):
                if f & ~rfollow[node.name]:
                    rfollow[node.name] |= f
                    if node.name not in queued:
                        queued.add(node.name)
                        queue.append(node.name)

        while queue:
            r = queue.pop()
            queued.discard(r)
            visit(self.rules[r], rfollow[r])

    # --- lexemes -----------------------------------------------------------------------------

    def key(self, node: _Node) -> str:
        if node.key is None:
            node.key = self.term_text(node)
        return node.key

    def run_node(self, seq: _Seq, i: int, j: int) -> _Seq:
        k = (id(seq), i, j)
        run = self.runs.get(k)
        if run is None:
            run = self.runs[k] = _Seq(seq.items[i:j])
            run.nullable, run.first, run.last = _seq_nfl(
                [(it.nullable, it.first, it.last) for it in run.items])
            run.follow = seq.items[j - 1].follow
        return run

    def fusable(self, node: _Node) -> bool:
        if not node.regular:
            return False
        if not self.fuse:
            return _single(node)
        return self.key(node) not in self.banned

    def segment(self) -> None:
        """Given the banned lexemes, which nodes are lexemes (self.fused) and how structural
        sequences split into runs (self.segs); self.lex: key -> [follow mask, node]."""
        self.fused: set[int] = set()
        self.segs: dict[int, list[_Node]] = {}
        self.lex: dict[str, list] = {}

        self.struct_rules = ["root"]
        seen = {"root"}
        k = 0
        while k < len(self.struct_rules):
            r = self.struct_rules[k]
            k += 1
            stack = [self.rules[r]]
            while stack:
                node = stack.pop()
                if self.fusable(node):
                    self.add_lexeme(node)
                    continue
                if isinstance(node, _Lit):  # a banned literal: split into pieces
                    segs = []
                    self.split_lit(node, 0, len(node.text), segs, True)
                    self.segs[id(node)] = segs
                elif isinstance(node, _Ref):
                    if node.name not in seen:
                        seen.add(node.name)
                        self.struct_rules.append(node.name)
                elif isinstance(node, _Seq):
                    items = node.items
                    segs: list[_Node] = []
                    if node.regular:  # a banned sequence: split it into runs
                        self.split_run(node, 0, len(items), segs, stack)
                    else:  # items are lexemes (or not) on their own
                        segs.extend(items)
                        stack.extend(items)
                    self.segs[id(node)] = segs
                elif isinstance(node, (_Alt, _Rep)):
                    stack.extend(_children(node))

    def split_run(self, seq: _Seq, i: int, j: int, segs: list[_Node], stack: list[_Node]):
        """Items i..j of `seq` (all regular when more than one): one lexeme if allowed, else
        split in two and each part likewise. Nullable tails are peeled first (`STRING space`
        -> `STRING`, `space`: what follows a match is what lets other lexemes run past its
        end), then nullable heads, then the first item."""
        items = seq.items
        if j - i == 1:
            segs.append(items[i])
            stack.append(items[i])
            return
        if self.fuse:
            run = self.run_node(seq, i, j)
            if self.fusable(run):
                self.add_lexeme(run)
                segs.append(run)
                return
            cuts = sorted(i + h for h in self.hints.get(run.key or "", ()) if 0 < h < j - i)
            if cuts:
                for a, b in zip([i] + cuts, cuts + [j]):
                    self.split_run(seq, a, b, segs, stack)
                return
        m = j
        while m > i + 1 and items[m - 1].nullable:
            m -= 1
        if m == j:
            m = i
            while m < j - 1 and items[m].nullable:
                m += 1
            m = max(m, i + 1)
        self.split_run(seq, i, m, segs, stack)
        self.split_run(seq, m, j, segs, stack)

    def split_lit(self, lit: _Lit, a: int, b: int, segs: list[_Node], banned: bool = False):
        """Characters a..b of a banned literal: one lexeme if allowed, else cut where a
        conflict was found, else in halves (long ones) or characters."""
        piece = self.piece(lit, a, b)
        if not banned and (b - a == 1 or self.fusable(piece)):
            self.add_lexeme(piece)
            segs.append(piece)
            return
        cuts = sorted(a + h for h in self.hints.get(self.key(piece), ()) if 0 < h < b - a)
        if not cuts:
            cuts = [(a + b) // 2] if self.fuse and b - a > 64 else list(range(a + 1, b))
        for x, y in zip([a] + cuts, cuts + [b]):
            self.split_lit(lit, x, y, segs)

    def piece(self, lit: _Lit, a: int, b: int) -> _Lit:
        if a == 0 and b == len(lit.text):
            return lit
        k = (id(lit), a, b)
        node = self.pieces.get(k)
        if node is None:
            text = lit.text
            node = self.pieces[k] = _Lit(text[a:b])
            node.first, node.last = 1 << _lead(ord(text[a])), 1 << _lead(ord(text[b - 1]))
            node.follow = 1 << _lead(ord(text[b])) if b < len(text) else lit.follow
        return node

    def add_lexeme(self, node: _Node) -> None:
        self.fused.add(id(node))
        self.add_key(self.key(node), node, node.follow)

    def add_key(self, key: str, node: _Node, follow: int) -> None:
        e = self.lex.get(key)
        if e is None:
            self.lex[key] = [follow, node]
        else:
            e[0] |= follow

    def summary(self, node: _Node) -> tuple[int, frozenset]:
        """Lead bytes of all characters of the matches of a regular node, and pairs (lead
        bytes of a character, lead bytes of the next one) covering every two consecutive
        characters of its matches (cached)."""
        v = self.summaries.get(id(node))
        if v is not None:
            return v
        if isinstance(node, _Lit):
            leads = [1 << _lead(ord(ch)) for ch in node.text]
            chars = 0
            for b in leads:
                chars |= b
            v = chars, frozenset(zip(leads, leads[1:]))
        elif isinstance(node, _Cls):
            v = node.first, frozenset()
        elif isinstance(node, _Ref):
            v = self.summary(self.rules[node.name])
        elif isinstance(node, _Seq):
            vals = [self.summary(it) for it in node.items]
            chars = 0
            pairs: set = set()
            for ch, ps in vals:
                chars |= ch
                pairs |= ps
            items = node.items
            for i, it in enumerate(items):
                if not it.last:
                    continue
                nxt = 0
                for jt in items[i + 1:]:
                    nxt |= jt.first
                    if not jt.nullable:
                        break
                if nxt:
                    pairs.add((it.last, nxt))
            v = chars, frozenset(pairs)
        elif isinstance(node, _Alt):
            vals = [self.summary(a) for a in node.alts]
            chars = 0
            for ch, _ in vals:
                chars |= ch
            v = chars, frozenset().union(*(ps for _, ps in vals))
        else:
            assert isinstance(node, _Rep)
            if node.hi == 0:
                v = 0, frozenset()
            else:
                chars, pairs = self.summary(node.item)
                if node.hi is None or node.hi > 1:
                    pairs = pairs | {(node.item.last, node.item.first)}
                v = chars, pairs
        self.summaries[id(node)] = v
        return v

    def prefix(self, key: str, node: _Node) -> str:
        """A string every match of the lexeme starts with (cached)."""
        v = self.prefixes.get(key)
        if v is None:
            v = self.prefixes[key] = self.lit_prefix(node, 0)
        return v

    def lit_prefix(self, node: _Node, depth: int) -> str:
        if isinstance(node, _Lit):
            return node.text
        if isinstance(node, _Cls):
            return chr(node.ranges[0][0]) if node.ranges[0][0] == node.ranges[-1][1] else ""
        if isinstance(node, _Ref):
            return self.lit_prefix(self.rules[node.name], depth + 1) if depth < 8 else ""
        if isinstance(node, _Seq):
            out = []
            for it in node.items:
                p = self.lit_prefix(it, depth)
                out.append(p)
                if it.nullable or not _whole_literal(it, p):
                    if it.nullable:
                        out.pop()
                    break
            return "".join(out)
        if isinstance(node, _Rep) and node.lo >= 1:
            return self.lit_prefix(node.item, depth)
        return ""

    def conflicts(self) -> set[str]:
        """Lexemes that can continue a complete match of another lexeme (or of themselves)
        with a character that may follow that match: llguidance would read on greedily where
        GBNF may stop. Any two lexemes are taken as possibly allowed at the same time (working
        out which really can be costs more than it saves). Each pair is checked once (again
        if what may follow the first grew)."""
        banned: set[str] = set()
        ext: dict[str, tuple[int, int, frozenset, str]] = {}
        for k, (_, node) in self.lex.items():
            if _single(node):
                continue
            chars, pairs = self.summary(node)
            if pairs:  # can read two characters: can continue another lexeme
                ext[k] = node.first, chars, pairs, self.prefix(k, node)
        by_lead: dict[int, list[str]] = {}
        fresh: dict[int, list[str]] = {}
        for c, (first, _, _, _) in ext.items():
            new = c not in self.seen_ext
            for b in _bits(first):
                by_lead.setdefault(b, []).append(c)
                if new:
                    fresh.setdefault(b, []).append(c)
        self.seen_ext.update(ext)
        for k, (follow, node) in self.lex.items():
            follow &= ~_TOKEN_BIT
            if k in banned or not follow:
                continue
            same = self.checked.get(k) == follow
            self.checked[k] = follow
            index = fresh if same else by_lead
            first = node.first
            pool = {c for b in _bits(first) for c in index.get(b, ())}
            if not pool:
                continue
            last = node.last
            pre = self.prefix(k, node)
            cands = []
            lit = isinstance(node, _Lit)
            for c in pool:
                _, cchars, cpairs, cpre = ext[c]
                if c == k and lit:
                    continue  # one string: nothing continues a match of it
                if (c not in banned and cchars & follow
                        and (pre.startswith(cpre) or cpre.startswith(pre))
                        and any(i & last and o & follow for i, o in cpairs)):
                    cands.append(c)
            if not cands:
                continue
            if self.budget <= 0 or self.build_budget <= 0:  # out of time: assume the worst
                banned.update(cands)  # (splitting is always safe)
                continue
            nfa = self.nfa(k, node)
            if nfa is None:
                banned.add(k)  # too big to check: split it
                continue
            for c, hints in self.extenders(nfa, cands, [follow] * len(cands)).items():
                banned.add(c)
                self.hints.setdefault(c, set()).update(hints)
        for k in list(banned):  # a rule's terminal and its body are one language
            node = self.lex[k][1]
            if isinstance(node, _Ref):
                body = self.key(self.rules[node.name])
                banned.add(body)
                self.hints.setdefault(body, set()).update(self.hints.get(k, ()))
        return banned

    def label(self, ranges: tuple[tuple[int, int], ...]) -> int:
        lid = self.label_ids.get(ranges)
        if lid is None:
            lid = self.label_ids[ranges] = len(self.labels)
            self.labels.append(ranges)
            self.label_leads.append(_lead_mask(ranges))
        return lid

    def meets(self, la: int, lb: int) -> bool:
        if la == lb:
            return True
        k = (la, lb)
        v = self.meet_cache.get(k)
        if v is None:
            v = self.meet_cache[k] = _intersects(self.labels[la], self.labels[lb])
        return v

    def nfa(self, key: str, node: _Node) -> _NFA | None:
        """The automaton of a lexeme; when it is a sequence (a run, or a rule's body), its
        states know which item they belong to (for split hints)."""
        if key in self.nfas:
            return self.nfas[key]
        top = node
        while isinstance(top, _Ref):
            top = self.rules[top.name]
        a = _NFA()
        try:
            s, t = a.state(), a.state()
            if isinstance(top, _Lit) and len(top.text) > 1:  # every position a boundary
                a.bound = {s: 0}
                cur = s
                for k, ch in enumerate(top.text):
                    nxt = t if k == len(top.text) - 1 else a.state()
                    c = ord(ch)
                    a.trans[cur].append((self.label(((c, c),)), nxt))
                    a.bound[nxt] = k + 1
                    cur = nxt
            elif isinstance(top, _Seq) and len(top.items) > 1:
                items = top.items
                a.bound = {s: 0, t: len(items)}
                spans = []
                cur = s
                for k, it in enumerate(items):
                    nxt = t if k == len(items) - 1 else a.state()
                    a.bound[nxt] = k + 1
                    first = len(a.eps)
                    self.build(a, it, cur, nxt)
                    spans.append((first, len(a.eps), k))
                    cur = nxt
                a.item = [0] * len(a.eps)
                for first, end, k in spans:
                    a.item[first:end] = [k] * (end - first)
            else:
                self.build(a, top, s, t)
        except _TooBig:
            self.nfas[key] = None
            return None
        a.start, a.accept = s, t
        self.nfas[key] = a
        self.build_budget -= len(a.eps)
        return a

    def build(self, a: _NFA, node: _Node, s: int, t: int) -> None:
        if isinstance(node, _Lit):
            cur = s
            for i, ch in enumerate(node.text):
                nxt = t if i == len(node.text) - 1 else a.state()
                c = ord(ch)
                a.trans[cur].append((self.label(((c, c),)), nxt))
                cur = nxt
        elif isinstance(node, _Cls):
            a.trans[s].append((self.label(node.ranges), t))
        elif isinstance(node, _Ref):
            tpl = self.template(node.name)
            off = len(a.eps)
            if off + len(tpl.eps) > _MAX_NFA_STATES:
                raise _TooBig
            a.eps.extend([x + off for x in e] for e in tpl.eps)
            a.trans.extend([(lid, x + off) for lid, x in tr] for tr in tpl.trans)
            a.eps[s].append(tpl.start + off)
            a.eps[tpl.accept + off].append(t)
        elif isinstance(node, _Seq):
            if not node.items:
                a.eps[s].append(t)
                return
            cur = s
            for i, it in enumerate(node.items):
                nxt = t if i == len(node.items) - 1 else a.state()
                self.build(a, it, cur, nxt)
                cur = nxt
        elif isinstance(node, _Alt):
            for alt in node.alts:
                m1, m2 = a.state(), a.state()  # fresh ends keep loops off s and t
                a.eps[s].append(m1)
                self.build(a, alt, m1, m2)
                a.eps[m2].append(t)
        else:
            assert isinstance(node, _Rep)
            lo, hi = node.lo, node.hi
            if hi == 0:
                a.eps[s].append(t)
                return
            # over-approximated above _EXACT_REPS (sound: more conflicts, never fewer)
            if lo > _EXACT_REPS:
                lo = _EXACT_REPS
            if hi is not None and hi > _EXACT_REPS:
                hi = None
            cur = s
            for _ in range(lo):
                nxt = a.state()
                self.build(a, node.item, cur, nxt)
                cur = nxt
            if hi is None:
                m = a.state()
                a.eps[cur].append(m)
                m2 = a.state()
                self.build(a, node.item, m, m2)
                a.eps[m2].append(m)
                a.eps[m].append(t)
            else:
                for _ in range(hi - lo):
                    a.eps[cur].append(t)
                    nxt = a.state()
                    self.build(a, node.item, cur, nxt)
                    cur = nxt
                a.eps[cur].append(t)

    def template(self, rule: str) -> _NFA:
        """The automaton of a regular rule, copied into the automata referring to it."""
        if rule in self.templates:
            tpl = self.templates[rule]
            if tpl is None:
                raise _TooBig
            return tpl
        self.templates[rule] = None
        tpl = _NFA()
        tpl.start, tpl.accept = tpl.state(), tpl.state()
        self.build(tpl, self.rules[rule], tpl.start, tpl.accept)
        self.templates[rule] = tpl
        return tpl

    def extenders(self, o: _NFA, cands: list[str], follows: list[int]) -> dict[str, set[int]]:
        """The candidates c for which some x in L(o), x not empty, and some character y whose
        first UTF-8 byte is in c's `follows` have xy a prefix of a string of L(c): product of the
        automata, pairs of single states (exact for "there is such an x"). For each, where to
        split it (item boundaries of a sequence; empty: no idea)."""
        found: dict[str, set[int]] = {}
        nfas = []
        for c in cands:
            n = self.nfa(c, self.lex[c][1]) if self.build_budget > 0 else None
            if n is None:  # too big to check, or out of time: split it
                found[c] = set()
            nfas.append(n)
        stack = [(o.start, ci, nfas[ci].start, False) for ci in range(len(cands))
                 if cands[ci] not in found]
        seen: set[tuple[int, int, int]] = set()
        oaccept = o.accept
        leads = self.label_leads
        meets = self.meets
        while stack:
            p, ci, q, moved = stack.pop()
            c = cands[ci]
            if c in found:
                continue
            if self.budget <= 0:
                found[c] = set()  # out of time: assume the worst (splitting is always safe)
                continue
            b = nfas[ci]
            P = o.closure(p)
            Q = b.closure(q)
            if moved and oaccept in P:
                follow = follows[ci]
                ext = [q2 for q2 in Q if any(leads[lid] & follow for lid, _ in b.trans[q2])]
                if ext:
                    found[c] = self.hints_at(b, Q, ext)
                    continue
            for p2 in P:
                for la, pt in o.trans[p2]:
                    for q2 in Q:
                        for lb, qt in b.trans[q2]:
                            self.budget -= 1
                            if meets(la, lb):
                                k = (pt, ci, qt)
                                if k not in seen:
                                    seen.add(k)
                                    stack.append((pt, ci, qt, True))
        return found

    @staticmethod
    def hints_at(b: _NFA, Q: tuple[int, ...], ext: list[int]) -> set[int]:
        """Where to split the sequence lexeme `b` so that a match ending in the states Q is
        not continued from the states `ext`: at the last item boundary in Q before the item
        continuing it, else around that item."""
        if b.bound is None:
            return set()
        hints = set()
        bounds = [b.bound[x] for x in Q if x in b.bound]
        for q2 in ext:
            k = b.bound[q2] if q2 in b.bound else b.item[q2]
            before = [j for j in bounds if j <= k]
            if before:
                hints.add(max(before))
            else:
                hints.update((k, k + 1))
        return hints

    # --- output ------------------------------------------------------------------------------

    def emit(self) -> str:
        self.anon: dict[str, str] = {}
        self.terms_needed: list[str] = []
        self.terms_seen: set[str] = set()
        lines = []
        if self.root_referenced:
            lines.append(f"start: {self.rule_name('root')}")
        for r in self.struct_rules:
            self.cur = r
            body = self.struct_text(self.rules[r])
            lines.append(f"{self.rule_name(r)}: {body}")
        i = 0
        term_lines = []
        while i < len(self.terms_needed):
            r = self.terms_needed[i]
            i += 1
            body = self.rules[r]
            text = self.key(body)
            self.need_terms_of(body)
            term_lines.append(f"{self.term_name(r)}: {text}")
        lines += [f"{name}: {text}" for text, name in self.nested_rules.items()]
        lines += term_lines + [f"{name}: {text}" for text, name in self.anon.items()]
        # terminals split off for nesting, made while analysing: only the ones used
        nested = {name: text for text, name in self.nested_terms.items()}
        todo = list(lines)
        used: set[str] = set()
        while todo:
            for name in _NEST_NAME.findall(todo.pop()):
                if name in nested and name not in used:
                    used.add(name)
                    todo.append(nested[name])
        lines += [f"{name}: {text}" for name, text in nested.items() if name in used]
        depth, deepest, order = _compile_depth(lines)
        if depth > _MAX_COMPILE_DEPTH:
            # compile bottom-up: a first alternative of `start` that never matches (a class of
            # no character) uses every definition, dependencies first (llguidance compiles each
            # once, at its first use)
            name, _, body = lines[0].partition(": ")
            lines[0] = f"{name}: {_NOTHING} {' '.join(order)} | {body}"
            depth, deepest, _ = _compile_depth(lines)
        if depth > _MAX_COMPILE_DEPTH:
            gbnf = {v: k for k, v in {**self.term_names, **self.rule_names}.items()}
            raise GBNFError(f"rules used within rules go {depth:.0f} levels deep (rule "
                            f"{gbnf.get(deepest, 'root')!r} is the deepest), more than the "
                            f"{_MAX_COMPILE_DEPTH} llguidance can compile safely",
                            *self.where(gbnf.get(deepest, "root")))
        return "\n".join(lines) + "\n"

    def need_terms_of(self, node: _Node) -> None:
        for n in _walk(node):
            if isinstance(n, _Ref) and n.name not in self.terms_seen:
                self.terms_seen.add(n.name)
                self.terms_needed.append(n.name)

    def lexeme_text(self, node: _Node) -> str:
        if isinstance(node, (_Lit, _Cls)) or (isinstance(node, _Seq) and not node.items):
            return self.key(node)
        if isinstance(node, _Ref):
            self.need_terms_of(node)
            return self.term_name(node.name)
        text = self.key(node)
        name = self.anon.get(text)
        if name is None:
            base = self.rule_name(self.cur).upper().replace("-", "_")
            name = self.anon[text] = self._fresh(base)
            self.need_terms_of(node)
        return name

    def struct_text(self, node: _Node) -> str:
        """`node` in a Lark rule."""
        if id(node) in self.fused:
            return self.lexeme_text(node)
        if isinstance(node, _Lit):  # split into pieces
            return " ".join(self.struct_text(p) for p in self.segs[id(node)])
        if isinstance(node, _Cls):
            return self.key(node)
        if isinstance(node, _Tok):
            return node.lark
        if isinstance(node, _Ref):
            return self.rule_name(node.name)
        if isinstance(node, _Seq):
            return self.seq_text([self.struct_text(n) for n in self.segs.get(id(node), node.items)],
                                 False)
        if isinstance(node, _Alt):
            return " | ".join(self.struct_text(a) for a in node.alts)
        assert isinstance(node, _Rep)
        return self.rep_text(self.struct_text(node.item), node.lo, node.hi, False)

    def term_text(self, node: _Node) -> str:
        """`node` as a Lark terminal expression (one lexeme)."""
        if isinstance(node, _Lit):
            return _lark_string(node.text)
        if isinstance(node, _Cls):
            return _class_text(node.ranges)
        if isinstance(node, _Ref):
            return self.term_name(node.name)
        if isinstance(node, _Seq):
            return self.seq_text([self.term_text(n) for n in node.items], True)
        if isinstance(node, _Alt):
            return " | ".join(self.term_text(a) for a in node.alts)
        assert isinstance(node, _Rep)
        return self.rep_text(self.term_text(node.item), node.lo, node.hi, True)

    def wrap(self, text: str, term: bool) -> str:
        """`(text)`, or the name of a new rule / terminal `text` where parentheses would nest
        too deep for llguidance's Lark parser (at most 30 levels)."""
        if _top_level(text)[2] < _MAX_PARENS:
            return f"({text})"
        nested = self.nested_terms if term else self.nested_rules
        name = nested.get(text)
        if name is None:
            name = nested[text] = self._fresh("NEST" if term else "nest")
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


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _whole_literal(node: _Node, prefix: str) -> bool:
    """Whether `node` matches exactly `prefix` (so what follows it extends the prefix)."""
    return (isinstance(node, _Lit) and node.text == prefix) or (
        isinstance(node, _Cls) and len(prefix) == 1)


def _seq_nfl(vals: list[tuple[bool, int, int]]) -> tuple[bool, int, int]:
    """nullable, first, last of a sequence from its items'."""
    nl, fi = True, 0
    for inl, ifi, _ in vals:
        fi |= ifi
        if not inl:
            nl = False
            break
    la = 0
    for inl, _, ila in reversed(vals):
        la |= ila
        if not inl:
            break
    return nl, fi, la


def _single(node: _Node) -> bool:
    """Matches one character or nothing: can never be continued past a match by a lexeme."""
    return (isinstance(node, _Cls) or (isinstance(node, _Lit) and len(node.text) == 1)
            or (isinstance(node, _Seq) and not node.items)
            or (isinstance(node, _Rep) and node.hi == 0))


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
    if ranges == _UNIVERSE:
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
