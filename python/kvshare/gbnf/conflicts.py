"""The fusion check: which lexemes can continue a complete match of another lexeme with a
character that may follow that match (llguidance's lexer reads on greedily where GBNF may
stop). Lead-byte summaries and literal prefixes rule out most pairs cheaply; the automata
decide the rest."""

from __future__ import annotations

from kvshare.gbnf.automata import Automata
from kvshare.gbnf.charset import TOKEN_BIT, bits, lead
from kvshare.gbnf.lexemes import Lexemes
from kvshare.gbnf.tree import Alt, Cls, Lit, Node, Ref, Rep, Seq, single

# per possible extender: its first lead bytes, the lead bytes of all its characters, its
# pairs of consecutive lead bytes, the prefix all its matches share
_Extender = tuple[int, int, frozenset, str]


class ConflictCheck:
    """The check over the passes of one conversion: pairs already checked are not checked
    again unless what may follow the first lexeme grew."""

    def __init__(self, rules: dict[str, Node], lexemes: Lexemes, automata: Automata):
        self.rules = rules
        self.lexemes = lexemes
        self.automata = automata
        self.checked: dict[str, int] = {}  # lexeme -> the follow set it was checked with
        self.seen_ext: set[str] = set()  # lexemes that were candidate extenders already
        self.prefixes: dict[str, str] = {}
        self.summaries: dict[int, tuple[int, frozenset]] = {}

    def conflicts(self) -> set[str]:
        """Lexemes that can continue a complete match of another lexeme (or of themselves)
        with a character that may follow that match: llguidance would read on greedily where
        GBNF may stop. Any two lexemes are taken as possibly allowed at the same time (working
        out which really can be costs more than it saves). Each pair is checked once (again
        if what may follow the first grew). Adds where to split them to the lexemes' hints."""
        banned: set[str] = set()
        ext, by_lead, fresh = self.extender_index()
        for k, (follow, node) in self.lexemes.lex.items():
            follow &= ~TOKEN_BIT
            if k in banned or not follow:
                continue
            same = self.checked.get(k) == follow
            self.checked[k] = follow
            cands = self.candidates(k, node, follow, ext, fresh if same else by_lead, banned)
            if cands:
                self.check(k, node, follow, cands, banned)
        self.ban_rule_bodies(banned)
        return banned

    def extender_index(self) -> tuple[dict[str, _Extender], dict[int, list[str]],
                                      dict[int, list[str]]]:
        """The lexemes that can continue another (they read two characters at least), and
        them by first lead byte: all, and those new since the last pass."""
        ext: dict[str, _Extender] = {}
        for k, (_, node) in self.lexemes.lex.items():
            if single(node):
                continue
            chars, pairs = self.summary(node)
            if pairs:  # can read two characters: can continue another lexeme
                ext[k] = node.first, chars, pairs, self.prefix(k, node)
        by_lead: dict[int, list[str]] = {}
        fresh: dict[int, list[str]] = {}
        for c, (first, _, _, _) in ext.items():
            new = c not in self.seen_ext
            for b in bits(first):
                by_lead.setdefault(b, []).append(c)
                if new:
                    fresh.setdefault(b, []).append(c)
        self.seen_ext.update(ext)
        return ext, by_lead, fresh

    def candidates(self, k: str, node: Node, follow: int, ext: dict[str, _Extender],
                   index: dict[int, list[str]], banned: set[str]) -> list[str]:
        """The extenders that may continue a match of the lexeme `k` by the summaries: they
        start like it, read a character of `follow`, after one like its last."""
        first = node.first
        pool = {c for b in bits(first) for c in index.get(b, ())}
        if not pool:
            return []
        last = node.last
        pre = self.prefix(k, node)
        cands = []
        lit = isinstance(node, Lit)
        for c in pool:
            _, cchars, cpairs, cpre = ext[c]
            if c == k and lit:
                continue  # one string: nothing continues a match of it
            if (c not in banned and cchars & follow
                    and (pre.startswith(cpre) or cpre.startswith(pre))
                    and any(i & last and o & follow for i, o in cpairs)):
                cands.append(c)
        return cands

    def check(self, k: str, node: Node, follow: int, cands: list[str], banned: set[str]):
        """Bans the candidates the automata find continuing the lexeme `k`, all of them when
        out of budget, and `k` itself when it is too big to check (splitting is always safe)."""
        automata = self.automata
        if automata.budget <= 0 or automata.build_budget <= 0:  # out of time: the worst
            banned.update(cands)
            return
        nfa = automata.nfa(k, node)
        if nfa is None:
            banned.add(k)  # too big to check: split it
            return
        lex = self.lexemes.lex
        hints = self.lexemes.hints
        for c, where in automata.extenders(nfa, [(c, lex[c][1]) for c in cands], follow).items():
            banned.add(c)
            hints.setdefault(c, set()).update(where)

    def ban_rule_bodies(self, banned: set[str]) -> None:
        """A rule's terminal and its body are one language: banning one bans the other."""
        hints = self.lexemes.hints
        for k in list(banned):
            node = self.lexemes.lex[k][1]
            if isinstance(node, Ref):
                body = self.lexemes.key(self.rules[node.name])
                banned.add(body)
                hints.setdefault(body, set()).update(hints.get(k, ()))

    def summary(self, node: Node) -> tuple[int, frozenset]:
        """Lead bytes of all characters of the matches of a regular node, and pairs (lead
        bytes of a character, lead bytes of the next one) covering every two consecutive
        characters of its matches (cached)."""
        v = self.summaries.get(id(node))
        if v is not None:
            return v
        if isinstance(node, Lit):
            v = _literal_summary(node)
        elif isinstance(node, Cls):
            v = node.first, frozenset()
        elif isinstance(node, Ref):
            v = self.summary(self.rules[node.name])
        elif isinstance(node, Seq):
            v = _seq_summary(node, [self.summary(it) for it in node.items])
        elif isinstance(node, Alt):
            vals = [self.summary(a) for a in node.alts]
            chars = 0
            for ch, _ in vals:
                chars |= ch
            v = chars, frozenset().union(*(ps for _, ps in vals))
        else:
            assert isinstance(node, Rep)
            if node.hi == 0:
                v = 0, frozenset()
            else:
                chars, pairs = self.summary(node.item)
                if node.hi is None or node.hi > 1:
                    pairs = pairs | {(node.item.last, node.item.first)}
                v = chars, pairs
        self.summaries[id(node)] = v
        return v

    def prefix(self, key: str, node: Node) -> str:
        """A string every match of the lexeme starts with (cached)."""
        v = self.prefixes.get(key)
        if v is None:
            v = self.prefixes[key] = self.lit_prefix(node, 0)
        return v

    def lit_prefix(self, node: Node, depth: int) -> str:
        if isinstance(node, Lit):
            return node.text
        if isinstance(node, Cls):
            return chr(node.ranges[0][0]) if node.ranges[0][0] == node.ranges[-1][1] else ""
        if isinstance(node, Ref):
            return self.lit_prefix(self.rules[node.name], depth + 1) if depth < 8 else ""
        if isinstance(node, Seq):
            out = []
            for it in node.items:
                p = self.lit_prefix(it, depth)
                out.append(p)
                if it.nullable or not _whole_literal(it, p):
                    if it.nullable:
                        out.pop()
                    break
            return "".join(out)
        if isinstance(node, Rep) and node.lo >= 1:
            return self.lit_prefix(node.item, depth)
        return ""


def _literal_summary(node: Lit) -> tuple[int, frozenset]:
    leads = [1 << lead(ord(ch)) for ch in node.text]
    chars = 0
    for b in leads:
        chars |= b
    return chars, frozenset(zip(leads, leads[1:]))


def _seq_summary(node: Seq, vals: list[tuple[int, frozenset]]) -> tuple[int, frozenset]:
    """A sequence's summary from its items': theirs, and each item's last lead bytes paired
    with the first of what may come next within the sequence."""
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
    return chars, frozenset(pairs)


def _whole_literal(node: Node, prefix: str) -> bool:
    """Whether `node` matches exactly `prefix` (so what follows it extends the prefix)."""
    return (isinstance(node, Lit) and node.text == prefix) or (
        isinstance(node, Cls) and len(prefix) == 1)
