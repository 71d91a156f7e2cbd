"""The syntax tree of a parsed GBNF grammar: literals, character classes, tokens, rule
references, sequences, alternatives and repetitions, each with the lead-byte sets and the
Lark text the conversion fills in."""

from __future__ import annotations


class Node:
    __slots__ = ("nullable", "first", "last", "follow", "regular", "key")

    def __init__(self):
        self.nullable = False
        self.first = 0  # lead bytes (bit 256: a token element) the node's matches start with
        self.last = 0  # lead bytes of the last characters of its matches
        self.follow = 0  # lead bytes of what may come right after the node
        self.regular = True  # no tokens, no recursion: can be (part of) one lexeme
        self.key: str | None = None  # its text as a Lark terminal expression


class Lit(Node):
    __slots__ = ("text",)

    def __init__(self, text: str):
        super().__init__()
        self.text = text  # never empty (an empty literal is an empty Seq)


class Cls(Node):
    __slots__ = ("ranges",)

    def __init__(self, ranges: tuple[tuple[int, int], ...]):
        super().__init__()
        self.ranges = ranges  # sorted, disjoint, non-adjacent scalar-value ranges; not empty


class Tok(Node):
    __slots__ = ("lark",)

    def __init__(self, lark: str):
        super().__init__()
        self.lark = lark
        self.regular = False


class Ref(Node):
    __slots__ = ("name", "pos")

    def __init__(self, name: str, pos: int):
        super().__init__()
        self.name = name
        self.pos = pos


class Seq(Node):
    __slots__ = ("items",)

    def __init__(self, items: list[Node]):
        super().__init__()
        self.items = items


class Alt(Node):
    __slots__ = ("alts",)

    def __init__(self, alts: list[Node]):
        super().__init__()
        self.alts = alts


class Rep(Node):
    __slots__ = ("item", "lo", "hi")

    def __init__(self, item: Node, lo: int, hi: int | None):
        super().__init__()
        self.item = item
        self.lo = lo
        self.hi = hi  # None: unbounded


def children(node: Node) -> list[Node]:
    if isinstance(node, Seq):
        return node.items
    if isinstance(node, Alt):
        return node.alts
    if isinstance(node, Rep):
        return [node.item]
    return []


def walk(node: Node):
    """`node` and every node below it (not through rule references)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(children(n))


def seq_nfl(vals: list[tuple[bool, int, int]]) -> tuple[bool, int, int]:
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


def single(node: Node) -> bool:
    """Matches one character or nothing: can never be continued past a match by a lexeme."""
    return (isinstance(node, Cls) or (isinstance(node, Lit) and len(node.text) == 1)
            or (isinstance(node, Seq) and not node.items)
            or (isinstance(node, Rep) and node.hi == 0))
