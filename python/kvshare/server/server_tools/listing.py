"""Directory listings and globs as llama.cpp's tools make them (server-tools.cpp
tools_io_basic::list_entries, path_glob_match; common.cpp glob_match): files come from
`git ls-files --cached --others --exclude-standard` when the directory is in a git work
tree (so .gitignore applies), else from a walker that lists but never enters junk
directories (.git, node_modules, build, ...) nor follows links; one listing has a 15 s
budget, after which what was found is returned marked truncated."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .runner import run_bounded

GIT_LS_FILES_MAX_OUTPUT = 8 * 1024 * 1024
LIST_TIMEOUT_S = 15
JUNK_DIR_NAMES = frozenset({".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv",
                            "venv", "dist", "build", "target", ".cache", ".idea", ".vscode"})
FILES, DIRS, ALL = "file", "dir", "all"


@dataclass
class Entry:
    rel: str  # '/'-separated, relative to the listed directory
    is_dir: bool = False


@dataclass
class Listing:
    entries: list[Entry] = field(default_factory=list)
    err: str = ""
    truncated: bool = False


def _class_match(c: str, body: str) -> bool:
    negated = body[:1] in ("!", "^")
    if negated:
        body = body[1:]
    i, matched = 0, False
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":
            matched = matched or body[i] <= c <= body[i + 2]
            i += 3
        else:
            matched = matched or body[i] == c
            i += 1
    return matched != negated


def glob_match(pattern: str, s: str) -> bool:
    """llama.cpp's glob: `*` any run without '/', `**` anything, `?` one non-'/' character,
    `[...]` a class (`!`/`^` negates)."""
    if not pattern:
        return not s
    if pattern.startswith("**"):
        rest = pattern[2:]
        return any(glob_match(rest, s[i:]) for i in range(len(s) + 1))
    if pattern[0] == "*":
        rest = pattern[1:]
        i = 0
        while True:
            if glob_match(rest, s[i:]):
                return True
            if i >= len(s) or s[i] == "/":
                return False
            i += 1
    if pattern[0] == "?":
        return bool(s) and s[0] != "/" and glob_match(pattern[1:], s[1:])
    if pattern[0] == "[":
        end = 2 if pattern[1:2] in ("]", "-") else 1
        end = pattern.find("]", end)
        if end >= 0:
            return bool(s) and _class_match(s[0], pattern[1:end]) and glob_match(
                pattern[end + 1:], s[1:])
        return s[:1] == "[" and glob_match(pattern[1:], s[1:])
    return bool(s) and pattern[0] == s[0] and glob_match(pattern[1:], s[1:])


def path_glob_match(pattern: str, rel: str) -> bool:
    """No '/' in the pattern: it matches the base name at any depth; else the whole
    relative path, anchored with `**/` unless it starts with `**` or '/'."""
    if "/" not in pattern:
        return glob_match(pattern, rel.rsplit("/", 1)[-1])
    if pattern == "**" or pattern.startswith("**/") or pattern.startswith("/"):
        return glob_match(pattern, rel)
    return glob_match("**/" + pattern, rel)


def _walk(base: str, max_depth: int, kind: str, deadline: float) -> tuple[list[Entry], bool]:
    out: list[Entry] = []
    truncated = False
    stack = [(base, "", 0)]
    while stack:
        if time.monotonic() >= deadline:
            return out, True
        d, rel_dir, depth = stack.pop()
        try:
            items = list(os.scandir(d))
        except OSError:
            truncated = True  # a subtree the caller never sees
            continue
        for it in items:
            rel = f"{rel_dir}/{it.name}" if rel_dir else it.name
            try:
                is_dir = it.is_dir()
                is_link = it.is_symlink()
            except OSError:
                continue
            if is_dir:
                if kind in (DIRS, ALL):
                    out.append(Entry(rel, True))
                # junk directories stay selectable but are never walked: they can be enormous
                if it.name in JUNK_DIR_NAMES or is_link:
                    continue
                if max_depth == 0 or depth + 1 < max_depth:
                    stack.append((it.path, rel, depth + 1))
            elif kind in (FILES, ALL) and it.is_file():
                out.append(Entry(rel, False))
    return out, truncated


def list_entries(base: str, max_depth: int, kind: str) -> Listing:
    """Entries under the absolute directory `base` (max_depth 0: any depth; 1: its
    children)."""
    if not os.path.isdir(base):
        return Listing(err="path does not exist or is not a directory")
    deadline = time.monotonic() + LIST_TIMEOUT_S
    if kind == FILES:  # git ls-files cannot list directories
        res = run_bounded(["git", "-C", base, "ls-files", "--cached", "--others",
                           "--exclude-standard"], GIT_LS_FILES_MAX_OUTPUT, LIST_TIMEOUT_S)
        if res.exit_code == 0 and not res.timed_out:
            out = Listing()
            for line in res.output.splitlines():
                line = line.rstrip("\r").replace("\\", "/")
                if not line or (max_depth > 0 and line.count("/") + 1 > max_depth):
                    continue
                if os.path.isfile(os.path.join(base, line)):
                    out.entries.append(Entry(line))
            return out
    entries, truncated = _walk(base, max_depth, kind, deadline)
    return Listing(entries, "", truncated)
