"""Grammar analysis ahead of choosing lexemes: the rules reachable from `root`, which of them
can be Lark terminals (regular: no tokens, no recursion), and each node's nullable flag and
first / last / follow lead-byte sets."""

from __future__ import annotations

import collections

from kvshare.gbnf.charset import TOKEN_BIT, lead, lead_mask
from kvshare.gbnf.tree import Alt, Cls, Lit, Node, Ref, Rep, Seq, Tok, seq_nfl, walk

_MAX_TERM_DEPTH = 32  # chains of terminals referring to terminals (llguidance recurses on them)


def analyse(rules: dict[str, Node], order: list[str]) -> bool:
    """Fills in `regular`, `nullable`, `first`, `last` and `follow` of the nodes of the rules
    reachable from `root` (`order`: the rules in definition order). Whether a rule refers to
    `root` (then `root` cannot simply be Lark's `start`)."""
    return _Analysis(rules, order).run()


def _components(live: list[str], refs: dict[str, list[str]]) -> tuple[list[str], set[str]]:
    """Tarjan's strongly connected components: the rules, dependencies first, and the rules
    on a cycle."""
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
    return finished, cyclic


class _Analysis:
    def __init__(self, rules: dict[str, Node], order: list[str]):
        self.rules = rules
        self.order = order
        self.topo: list[str] = []
        self.regular: dict[str, bool] = {}
        self.rnf: dict[str, tuple[bool, int, int]] = {}

    def run(self) -> bool:
        rules = self.rules
        live = self.reachable()
        refs = {r: [n.name for n in walk(rules[r]) if isinstance(n, Ref)] for r in live}
        root_referenced = any("root" in refs[r] for r in live)
        self.regular_rules(live, refs)
        self.nullable_first(live, refs)
        self.follow_sets(live)
        return root_referenced

    def reachable(self) -> list[str]:
        seen = {"root"}
        stack = ["root"]
        while stack:
            for n in walk(self.rules[stack.pop()]):
                if isinstance(n, Ref) and n.name not in seen:
                    seen.add(n.name)
                    stack.append(n.name)
        return ["root"] + [r for r in self.order if r in seen and r != "root"]

    def regular_rules(self, live: list[str], refs: dict[str, list[str]]) -> None:
        """Rules that can be Lark terminals: no tokens, no recursion, only such rules
        referenced, and not too deep a chain of them."""
        has_tok = {r: any(isinstance(n, Tok) for n in walk(self.rules[r])) for r in live}
        finished, cyclic = _components(live, refs)
        self.topo = finished
        depth: dict[str, int] = {}
        for r in finished:
            deps = refs[r]
            ok = not has_tok[r] and r not in cyclic and all(self.regular.get(d) for d in deps)
            depth[r] = 1 + max((depth.get(d, 0) for d in deps), default=0)
            self.regular[r] = ok and depth[r] <= _MAX_TERM_DEPTH

    def node_nf(self, node: Node) -> tuple[bool, int, int]:
        """nullable, first, last (and regular) of `node` and below (rules: self.rnf)."""
        if isinstance(node, Lit):
            nl, fi, la = False, 1 << lead(ord(node.text[0])), 1 << lead(ord(node.text[-1]))
        elif isinstance(node, Cls):
            nl, fi = False, lead_mask(node.ranges)
            la = fi
        elif isinstance(node, Tok):
            nl, fi, la = False, TOKEN_BIT, TOKEN_BIT
        elif isinstance(node, Ref):
            nl, fi, la = self.rnf[node.name]
            node.regular = self.regular[node.name]
        elif isinstance(node, Seq):
            vals = [self.node_nf(it) for it in node.items]
            node.regular = all(it.regular for it in node.items)
            nl, fi, la = seq_nfl(vals)
        elif isinstance(node, Alt):
            nl, fi, la = False, 0, 0
            for a in node.alts:
                anl, afi, ala = self.node_nf(a)
                nl, fi, la = nl or anl, fi | afi, la | ala
            node.regular = all(a.regular for a in node.alts)
        else:
            assert isinstance(node, Rep)
            inl, ifi, ila = self.node_nf(node.item)
            node.regular = node.item.regular
            if node.hi == 0:
                nl, fi, la = True, 0, 0
            else:
                nl, fi, la = node.lo == 0 or inl, ifi, ila
        node.nullable, node.first, node.last = nl, fi, la
        return nl, fi, la

    def nullable_first(self, live: list[str], refs: dict[str, list[str]]) -> None:
        self.rnf = {r: (False, 0, 0) for r in live}
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

        def visit(node: Node, f: int) -> None:
            node.follow = f
            if isinstance(node, Seq):
                acc = f
                for it in reversed(node.items):
                    visit(it, acc)
                    acc = it.first | (acc if it.nullable else 0)
            elif isinstance(node, Alt):
                for a in node.alts:
                    visit(a, f)
            elif isinstance(node, Rep):
                again = node.hi is None or node.hi > 1
                visit(node.item, f | (node.item.first if again else 0))
            elif isinstance(node, Ref) and f & ~rfollow[node.name]:
                rfollow[node.name] |= f
                if node.name not in queued:
                    queued.add(node.name)
                    queue.append(node.name)

        while queue:
            r = queue.pop()
            queued.discard(r)
            visit(self.rules[r], rfollow[r])
