"""Which parts of the grammar become lexemes. Regular nodes become single Lark terminals unless
the fusion check banned them; a banned sequence splits into runs of items (at the conflict
hints, else by peeling nullable ends), a banned literal into pieces, alternatives and
repetitions into their parts."""

from __future__ import annotations

from kvshare.gbnf.charset import lead
from kvshare.gbnf.lark import LarkWriter
from kvshare.gbnf.tree import Alt, Lit, Node, Ref, Rep, Seq, children, seq_nfl, single


class Lexemes:
    """The lexemes of one conversion. `banned`: keys of lexemes the fusion check found in
    conflict; `hints`: where to split them. Each `segment()` recomputes, from those, `fused`
    (ids of the nodes that are lexemes), `segs` (how structural sequences and banned literals
    split), `lex` (key -> [follow mask, node]) and `struct_rules` (the rules that stay Lark
    rules, `root` first)."""

    def __init__(self, rules: dict[str, Node], writer: LarkWriter, fuse: bool):
        self.rules = rules
        self.writer = writer
        self.fuse = fuse  # False: one-character lexemes only (exact and slow)
        self.banned: set[str] = set()
        self.hints: dict[str, set[int]] = {}
        self.runs: dict[tuple[int, int, int], Seq] = {}
        self.pieces: dict[tuple[int, int, int], Lit] = {}
        self.fused: set[int] = set()
        self.segs: dict[int, list[Node]] = {}
        self.lex: dict[str, list] = {}
        self.struct_rules: list[str] = []

    def key(self, node: Node) -> str:
        return self.writer.key(node)

    def run_node(self, seq: Seq, i: int, j: int) -> Seq:
        k = (id(seq), i, j)
        run = self.runs.get(k)
        if run is None:
            run = self.runs[k] = Seq(seq.items[i:j])
            run.nullable, run.first, run.last = seq_nfl(
                [(it.nullable, it.first, it.last) for it in run.items])
            run.follow = seq.items[j - 1].follow
        return run

    def fusable(self, node: Node) -> bool:
        if not node.regular:
            return False
        if not self.fuse:
            return single(node)
        return self.key(node) not in self.banned

    def segment(self) -> None:
        """Given the banned lexemes, which nodes are lexemes (self.fused) and how structural
        sequences split into runs (self.segs); self.lex: key -> [follow mask, node]."""
        self.fused = set()
        self.segs = {}
        self.lex = {}
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
                if isinstance(node, Lit):  # a banned literal: split into pieces
                    segs = []
                    self.split_lit(node, 0, len(node.text), segs, True)
                    self.segs[id(node)] = segs
                elif isinstance(node, Ref):
                    if node.name not in seen:
                        seen.add(node.name)
                        self.struct_rules.append(node.name)
                elif isinstance(node, Seq):
                    items = node.items
                    segs: list[Node] = []
                    if node.regular:  # a banned sequence: split it into runs
                        self.split_run(node, 0, len(items), segs, stack)
                    else:  # items are lexemes (or not) on their own
                        segs.extend(items)
                        stack.extend(items)
                    self.segs[id(node)] = segs
                elif isinstance(node, (Alt, Rep)):
                    stack.extend(children(node))

    def split_run(self, seq: Seq, i: int, j: int, segs: list[Node], stack: list[Node]):
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

    def split_lit(self, lit: Lit, a: int, b: int, segs: list[Node], banned: bool = False):
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

    def piece(self, lit: Lit, a: int, b: int) -> Lit:
        if a == 0 and b == len(lit.text):
            return lit
        k = (id(lit), a, b)
        node = self.pieces.get(k)
        if node is None:
            text = lit.text
            node = self.pieces[k] = Lit(text[a:b])
            node.first, node.last = 1 << lead(ord(text[a])), 1 << lead(ord(text[b - 1]))
            node.follow = 1 << lead(ord(text[b])) if b < len(text) else lit.follow
        return node

    def add_lexeme(self, node: Node) -> None:
        self.fused.add(id(node))
        self.add_key(self.key(node), node, node.follow)

    def add_key(self, key: str, node: Node, follow: int) -> None:
        e = self.lex.get(key)
        if e is None:
            self.lex[key] = [follow, node]
        else:
            e[0] |= follow
