"""How many items llguidance's Earley parser predicts at one position, estimated from the analysed
GBNF trees before the (much slower) lexeme passes, so that a grammar which would overflow a
parser row is refused in milliseconds instead of after seconds of conversion.

At a position where rule R may start, the parser predicts every alternative of R and, through
each alternative's left corner (its first items, past nullable ones), of every parser rule
that can start R's match, transitively. Regular rules and regular sub-expressions become Lark
terminals (analysis.py decides which), so a regular part that starts with a character adds no
prediction; one that starts with a rule reference is counted as a parser rule (the lexeme
passes keep such chains as parser rules when their lexemes conflict, as in the shapes that
overflow). Counted per rule: its top-level alternatives (1 when it has none), plus the
alternatives of groups and a slot per repetition on its left corner (those become rules of
their own in Lark). Against llguidance's own count on the converted grammar: 3 to 5 items more on
chains of left-recursive alternatives (420 rules of 5: 2,101 here, 2,098 there)."""

from __future__ import annotations

from kvshare.gbnf.tree import Alt, Node, Ref, Rep, Seq


def _left_corner(node: Node, refs: list[str]) -> int:
    """Items predicted for `node`'s own groups and repetitions on its left corner; the rules
    there are appended to `refs`."""
    if isinstance(node, Ref):
        refs.append(node.name)
        return 0
    before = len(refs)
    if isinstance(node, Seq):
        n = 0
        for item in node.items:
            n += _left_corner(item, refs)
            if not item.nullable:
                break
    elif isinstance(node, Alt):
        n = len(node.alts) + sum(_left_corner(a, refs) for a in node.alts)
    elif isinstance(node, Rep):
        n = 1 + _left_corner(node.item, refs)
    else:
        return 0
    if node.regular and len(refs) == before:
        return 0  # a lexeme: scanned, not predicted
    return n


def predicted_items(rules: dict[str, Node], limit: int) -> tuple[int, str]:
    """(items, rule): the most items predicted where one rule starts, and that rule; the count
    stops once it passes `limit`. Call after `analysis.analyse` (it sets `regular` and
    `nullable`); only rules reachable from `root` are looked at."""
    own: dict[str, int] = {}
    corner: dict[str, list[str]] = {}
    stack, seen = ["root"], {"root"}
    while stack:  # the parser rules reachable through left corners, from root and every ref
        r = stack.pop()
        node = rules[r]
        refs: list[str] = []
        n = _left_corner(node, refs)
        own[r] = 0 if node.regular and not refs else n + (0 if isinstance(node, Alt) else 1)
        corner[r] = refs
        for name in _all_refs(node):
            if name not in seen:
                seen.add(name)
                stack.append(name)
    worst, where = 0, "root"
    for start in own:
        total, visited, todo = 0, {start}, [start]
        while todo and total <= limit:
            r = todo.pop()
            total += own[r]
            for s in corner[r]:
                if s not in visited:
                    visited.add(s)
                    todo.append(s)
        if total > worst:
            worst, where = total, start
            if worst > limit:
                break
    return worst, where


def _all_refs(node: Node) -> list[str]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Ref):
            out.append(n.name)
        elif isinstance(n, Seq):
            stack.extend(n.items)
        elif isinstance(n, Alt):
            stack.extend(n.alts)
        elif isinstance(n, Rep):
            stack.append(n.item)
    return out
