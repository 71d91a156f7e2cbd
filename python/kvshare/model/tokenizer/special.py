"""Special-token splitting, shared by every tokenizer family: llama.cpp's
`tokenizer_st_partition`, which cuts control, unknown and user-defined tokens out of the text
before the family's model sees the raw fragments in between."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable, Sequence

from kvshare.model.tokenizer.vocab import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED


def _trie_regex(texts: Iterable[str]) -> re.Pattern[str]:
    """One regex matching any of `texts`, longest alternative first at every position."""
    trie: dict = {}
    for s in texts:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = None

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items()) if ch != ""]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return "(?:" + body + ")?" if "" in node else body

    return re.compile(build(trie))


class SpecialSplitter:
    """llama.cpp's `tokenizer_st_partition` for one set of special tokens.

    llama.cpp takes the special tokens longest first (ties: unspecified order) and, for each,
    splits every remaining raw fragment at its non-overlapping occurrences, left to right. We
    instead scan once with a leftmost-longest regex. The two agree unless, for a match M of
    token T at [s, e), some other special token U with len(U) >= len(T) starts inside (s, e) and
    ends after e (then llama.cpp may pick U). `danger[T]` lists every continuation Z such that
    T[k:] + Z is such a U; if the text after a match starts with one, the whole text is split
    with the exact longest-first algorithm instead. (Proof sketch in docs/model.md.)
    """

    def __init__(self, specials: Sequence[tuple[str, int]]):
        # llama.cpp order: longer first; among equal lengths we take the lower id first.
        order = sorted(specials, key=lambda t: (-len(t[0]), t[1]))
        self.ids: dict[str, int] = {}
        for text, tid in order:
            self.ids.setdefault(text, tid)
        self.exact_order = [(text, self.ids[text]) for text in self.ids]
        self.rx = _trie_regex(self.ids) if self.ids else None
        self.danger = self._danger_map(list(self.ids))

    @staticmethod
    def _danger_map(texts: list[str]) -> dict[str, tuple[str, ...]]:
        by_prefix: dict[str, list[str]] = defaultdict(list)
        for u in texts:
            for m in range(1, len(u)):
                by_prefix[u[:m]].append(u)
        danger: dict[str, tuple[str, ...]] = {}
        for t in texts:
            zs = set()
            for k in range(1, len(t)):
                s = t[k:]
                for u in by_prefix.get(s, ()):
                    if u != t and len(u) >= len(t):
                        zs.add(u[len(s):])
            if zs:
                kept: list[str] = []
                for z in sorted(zs, key=len):
                    if not any(z.startswith(k) for k in kept):
                        kept.append(z)
                danger[t] = tuple(kept)
        return danger

    def split(self, text: str) -> list[str | int]:
        """`text` as raw-text fragments (str) and special token ids (int), in order."""
        if self.rx is None:
            return [text]
        out: list[str | int] = []
        pos = 0
        ids, danger = self.ids, self.danger
        for m in self.rx.finditer(text):
            s, e = m.span()
            tok = m.group()
            z = danger.get(tok)
            if z is not None and text.startswith(z, e):
                return self.split_exact(text)
            if s > pos:
                out.append(text[pos:s])
            out.append(ids[tok])
            pos = e
        if pos < len(text):
            out.append(text[pos:])
        return out

    def split_exact(self, text: str) -> list[str | int]:
        """llama.cpp's algorithm, literally (slow; only for overlapping special tokens)."""
        buf: list[tuple[int, int] | int] = [(0, len(text))]
        for tok, tid in self.exact_order:
            if tok not in text:
                continue
            n = len(tok)
            new: list[tuple[int, int] | int] = []
            for item in buf:
                if isinstance(item, int):
                    new.append(item)
                    continue
                s, e = item
                while True:
                    m = text.find(tok, s, e)
                    if m < 0:
                        break
                    if m > s:
                        new.append((s, m))
                    new.append(tid)
                    s = m + n
                if s < e:
                    new.append((s, e))
            buf = new
        return [x if isinstance(x, int) else text[x[0]:x[1]] for x in buf]


def splitters(texts: Sequence[str], attrs: Sequence[int]) -> tuple[SpecialSplitter, SpecialSplitter]:
    """The splitters for `parse_special` on (control, unknown and user-defined tokens) and off
    (user-defined tokens only)."""
    special_mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
    specials = [(texts[i], i) for i in range(len(texts)) if attrs[i] & special_mask]
    plain = [(t, i) for t, i in specials if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
    return SpecialSplitter(specials), SpecialSplitter(plain)
