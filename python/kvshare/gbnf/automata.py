"""Thompson automata of lexemes (labels: character ranges), and the product search that finds
which lexemes can run on past a complete match of another: the exact part of the fusion
check, within budgets of states built and steps taken."""

from __future__ import annotations

from kvshare.gbnf.charset import intersects, lead_mask
from kvshare.gbnf.tree import Alt, Cls, Lit, Node, Ref, Rep, Seq

# read at each use, so that tests can lower them
MAX_NFA_STATES = 4000  # per lexeme in the fusion check; a bigger lexeme is split
EXACT_REPS = 24  # counted repetitions checked exactly up to this count (over-approximated above)
CHECK_BUDGET = 3_000_000  # product-automaton steps over the whole fusion check
BUILD_BUDGET = 3_000_000  # automaton states built over the whole fusion check


class TooBig(Exception):
    pass


class NFA:
    """Thompson automaton of one lexeme (labels: character-range tuples)."""

    __slots__ = ("eps", "trans", "start", "accept", "_closure", "bound", "item")

    def __init__(self):
        self.eps: list[list[int]] = []
        self.trans: list[list[tuple[int, int]]] = []  # (label id, target)
        self._closure: dict[int, tuple[int, ...]] = {}
        self.bound: dict[int, int] | None = None  # state -> item boundary (a sequence's)
        self.item: list[int] = []  # the item each state belongs to (a sequence's)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise TooBig
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


class Automata:
    """The automata of one conversion's lexemes (cached by lexeme key), their shared labels,
    and what is left of the budgets (`budget`: search steps; `build_budget`: states)."""

    def __init__(self, rules: dict[str, Node]):
        self.rules = rules
        self.nfas: dict[str, NFA | None] = {}
        self.templates: dict[str, NFA | None] = {}
        self.budget = CHECK_BUDGET
        self.build_budget = BUILD_BUDGET
        self.label_ids: dict[tuple[tuple[int, int], ...], int] = {}
        self.labels: list[tuple[tuple[int, int], ...]] = []
        self.label_leads: list[int] = []
        self.meet_cache: dict[tuple[int, int], bool] = {}

    def label(self, ranges: tuple[tuple[int, int], ...]) -> int:
        lid = self.label_ids.get(ranges)
        if lid is None:
            lid = self.label_ids[ranges] = len(self.labels)
            self.labels.append(ranges)
            self.label_leads.append(lead_mask(ranges))
        return lid

    def meets(self, la: int, lb: int) -> bool:
        if la == lb:
            return True
        k = (la, lb)
        v = self.meet_cache.get(k)
        if v is None:
            v = self.meet_cache[k] = intersects(self.labels[la], self.labels[lb])
        return v

    def nfa(self, key: str, node: Node) -> NFA | None:
        """The automaton of a lexeme; when it is a sequence (a run, or a rule's body), its
        states know which item they belong to (for split hints). None: too big."""
        if key in self.nfas:
            return self.nfas[key]
        top = node
        while isinstance(top, Ref):
            top = self.rules[top.name]
        a = NFA()
        try:
            s, t = a.state(), a.state()
            if isinstance(top, Lit) and len(top.text) > 1:  # every position a boundary
                a.bound = {s: 0}
                cur = s
                for k, ch in enumerate(top.text):
                    nxt = t if k == len(top.text) - 1 else a.state()
                    c = ord(ch)
                    a.trans[cur].append((self.label(((c, c),)), nxt))
                    a.bound[nxt] = k + 1
                    cur = nxt
            elif isinstance(top, Seq) and len(top.items) > 1:
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
        except TooBig:
            self.nfas[key] = None
            return None
        a.start, a.accept = s, t
        self.nfas[key] = a
        self.build_budget -= len(a.eps)
        return a

    def build(self, a: NFA, node: Node, s: int, t: int) -> None:
        """Adds `node` to `a` between the states s and t (the recursion stays in this one
        method for the nodes with children: nesting may be deep)."""
        if isinstance(node, Lit):
            self.build_literal(a, node, s, t)
        elif isinstance(node, Cls):
            a.trans[s].append((self.label(node.ranges), t))
        elif isinstance(node, Ref):
            self.build_ref(a, node, s, t)
        elif isinstance(node, Seq):
            if not node.items:
                a.eps[s].append(t)
                return
            cur = s
            for i, it in enumerate(node.items):
                nxt = t if i == len(node.items) - 1 else a.state()
                self.build(a, it, cur, nxt)
                cur = nxt
        elif isinstance(node, Alt):
            for alt in node.alts:
                m1, m2 = a.state(), a.state()  # fresh ends keep loops off s and t
                a.eps[s].append(m1)
                self.build(a, alt, m1, m2)
                a.eps[m2].append(t)
        else:
            assert isinstance(node, Rep)
            if node.hi == 0:
                a.eps[s].append(t)
                return
            # over-approximated above EXACT_REPS (sound: more conflicts, never fewer)
            lo = min(node.lo, EXACT_REPS)
            hi = node.hi if node.hi is not None and node.hi <= EXACT_REPS else None
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

    def build_literal(self, a: NFA, node: Lit, s: int, t: int) -> None:
        cur = s
        for i, ch in enumerate(node.text):
            nxt = t if i == len(node.text) - 1 else a.state()
            c = ord(ch)
            a.trans[cur].append((self.label(((c, c),)), nxt))
            cur = nxt

    def build_ref(self, a: NFA, node: Ref, s: int, t: int) -> None:
        tpl = self.template(node.name)
        off = len(a.eps)
        if off + len(tpl.eps) > MAX_NFA_STATES:
            raise TooBig
        a.eps.extend([x + off for x in e] for e in tpl.eps)
        a.trans.extend([(lid, x + off) for lid, x in tr] for tr in tpl.trans)
        a.eps[s].append(tpl.start + off)
        a.eps[tpl.accept + off].append(t)

    def template(self, rule: str) -> NFA:
        """The automaton of a regular rule, copied into the automata referring to it."""
        if rule in self.templates:
            tpl = self.templates[rule]
            if tpl is None:
                raise TooBig
            return tpl
        self.templates[rule] = None
        tpl = NFA()
        tpl.start, tpl.accept = tpl.state(), tpl.state()
        self.build(tpl, self.rules[rule], tpl.start, tpl.accept)
        self.templates[rule] = tpl
        return tpl

    def extenders(self, o: NFA, cands: list[tuple[str, Node]], follow: int
                  ) -> dict[str, set[int]]:
        """The candidate lexemes c (key, node) for which some x in L(o), x not empty, and some
        character y whose first UTF-8 byte is in `follow` have xy a prefix of a string of L(c):
        product of the automata, pairs of single states (exact for "there is such an x"). For
        each, where to split it (item boundaries of a sequence; empty: no idea)."""
        found: dict[str, set[int]] = {}
        nfas = []
        for c, node in cands:
            n = self.nfa(c, node) if self.build_budget > 0 else None
            if n is None:  # too big to check, or out of time: split it
                found[c] = set()
            nfas.append(n)
        stack = [(o.start, ci, nfas[ci].start, False) for ci in range(len(cands))
                 if cands[ci][0] not in found]
        seen: set[tuple[int, int, int]] = set()
        oaccept = o.accept
        leads = self.label_leads
        meets = self.meets
        while stack:
            p, ci, q, moved = stack.pop()
            c = cands[ci][0]
            if c in found:
                continue
            if self.budget <= 0:
                found[c] = set()  # out of time: assume the worst (splitting is always safe)
                continue
            b = nfas[ci]
            P = o.closure(p)
            Q = b.closure(q)
            if moved and oaccept in P:
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
    def hints_at(b: NFA, Q: tuple[int, ...], ext: list[int]) -> set[int]:
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
