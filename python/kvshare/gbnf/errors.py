"""The error raised for a GBNF grammar that cannot be read or converted."""

from __future__ import annotations


class GBNFError(ValueError):
    """A GBNF grammar that cannot be read or converted; `line` and `column` (1-based, in
    characters) locate the problem."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(f"GBNF grammar, line {line}, column {column}: {message}")
        self.message = message
        self.line = line
        self.column = column
