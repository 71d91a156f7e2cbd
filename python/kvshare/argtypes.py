"""Number checks for command-line flags (argparse `type=` callables), shared by every kvshare
subcommand so that `kvshare serve` and `kvshare route` refuse a bad value in the same words.

Each raises ValueError on a bad value; argparse then reports "invalid <__name__> value".
"""

from __future__ import annotations

__all__ = ["positive_int", "non_negative_int", "port", "positive_float", "non_negative_float"]


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise ValueError(s)
    return v


def port(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 65535:
        raise ValueError(s)
    return v


def non_negative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise ValueError(s)
    return v


def positive_float(s: str) -> float:
    v = float(s)
    if not v > 0 or v == float("inf"):
        raise ValueError(s)
    return v


def non_negative_float(s: str) -> float:
    v = float(s)
    if not 0 <= v < float("inf"):  # also refuses nan
        raise ValueError(s)
    return v


# the names argparse shows in its error messages
positive_int.__name__ = "positive integer"
non_negative_int.__name__ = "non-negative integer"
port.__name__ = "port"
positive_float.__name__ = "positive number"
non_negative_float.__name__ = "non-negative number"
