"""What the `kvshare` command prints: startup lines on stdout, the one error line on stderr,
and sizes and counts written for people."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    """A startup line (stdout, like the "serving" line: stderr holds only errors, so a
    startup error stays the one line there)."""
    print(f"kvshare: {msg}", flush=True)


def fail(msg: str, code: int) -> int:
    """Print the error line; `code` is the exit status to return."""
    print(f"kvshare: error: {msg}", file=sys.stderr, flush=True)
    return code


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.{0 if n >= 100 * div else 1}f}{unit}"
    return str(n)
