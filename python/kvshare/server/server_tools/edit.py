"""edit_file's replacement (server-tools.cpp server_tool_edit_file): each old_text must be
found once in the original content, the edits must not overlap, and all apply at once.
An old_text that is not found exactly may still match once trailing whitespace and smart
quotes, dashes and odd spaces are normalized; the lines such an edit does not touch keep
their original bytes."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FUZZY = str.maketrans({
    **{c: "'" for c in "\u2018\u2019\u201a\u201b"},
    **{c: '"' for c in "\u201c\u201d\u201e\u201f"},
    **{chr(c): "-" for c in range(0x2010, 0x2016)}, "\u2212": "-",
    "\u00a0": " ", **{chr(c): " " for c in range(0x2002, 0x200b)},
    "\u202f": " ", "\u205f": " ", "\u3000": " ",
})


class EditError(ValueError):
    """An edit that cannot apply; its text is the tool's error."""


@dataclass
class Match:
    edit_index: int
    start: int
    length: int
    new_text: str


def normalize(content: str) -> str:
    """Per line: trailing spaces/tabs/CR dropped, typographic characters as ASCII (the line
    count stays)."""
    return "\n".join(line.rstrip(" \t\r").translate(_FUZZY) for line in content.split("\n"))


def _apply(content: str, matches: list[Match], offset: int = 0) -> str:
    for m in reversed(matches):
        i = m.start - offset
        content = content[:i] + m.new_text + content[i + m.length:]
    return content


def _line_spans(content: str) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for line in content.splitlines(keepends=True):
        spans.append((pos, pos + len(line)))
        pos += len(line)
    return spans


def _apply_keeping_lines(original: str, base: str, matches: list[Match]) -> str:
    """Apply on the normalized `base`, but every line no edit touches comes from `original`."""
    orig_lines = original.splitlines(keepends=True)
    spans = _line_spans(base)
    groups: list[list] = []  # [start_line, end_line (exclusive), matches]
    for m in matches:
        first = next((i for i, (a, b) in enumerate(spans) if a <= m.start < b), None)
        if first is None:
            continue
        last = first
        while last < len(spans) and spans[last][1] < m.start + m.length:
            last += 1
        last = min(last, len(spans) - 1)
        if groups and first < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], last + 1)
            groups[-1][2].append(m)
        else:
            groups.append([first, last + 1, [m]])
    out, line = [], 0
    for first, end, ms in groups:
        out.extend(orig_lines[line:first])
        a, b = spans[first][0], spans[end - 1][1]
        out.append(_apply(base[a:b], ms, a))
        line = end
    out.extend(orig_lines[line:])
    return "".join(out)


def apply_edits(original: str, edits: list[tuple[str, str]], path: str) -> str:
    """The new content; EditError (llama.cpp's messages) when an edit is not found, not
    unique, overlaps another or changes nothing."""
    fuzzy = False
    norm_original = normalize(original)
    for i, (old, _) in enumerate(edits):
        if old in original:
            continue
        if normalize(old) not in norm_original:
            raise EditError(f"could not find edits[{i}].old_text in {path}, it must match "
                            "the file's current content exactly")
        fuzzy = True
    base = norm_original if fuzzy else original
    matches = []
    for i, (old, new) in enumerate(edits):
        needle = normalize(old) if fuzzy else old
        # uniqueness counts on normalized text: a whitespace-only duplicate still counts
        n = len(re.findall(re.escape(normalize(old)), norm_original))
        if n > 1:
            raise EditError(f"found {n} occurrences of edits[{i}].old_text in {path}, "
                            "it must be unique")
        matches.append(Match(i, base.find(needle), len(needle), new))
    matches.sort(key=lambda m: m.start)
    for a, b in zip(matches, matches[1:]):
        if a.start + a.length > b.start:
            raise EditError(f"edits[{a.edit_index}] and edits[{b.edit_index}] overlap in "
                            f"{path}; merge them into one edit or target disjoint regions")
    new_content = (_apply_keeping_lines(original, base, matches) if fuzzy
                   else _apply(base, matches))
    if new_content == original:
        raise EditError("no changes made: the replacement(s) produced identical content")
    return new_content
