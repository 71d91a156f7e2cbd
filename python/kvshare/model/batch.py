"""`SeqChunk`: one sequence's share of a forward call (a prefill chunk or a decode token),
and `split_logits`, which hands each chunk its rows of the call's logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

LogitsMode = Literal["none", "last", "all"]


@dataclass
class SeqChunk:
    """Tokens of one sequence at positions `start_pos .. start_pos + len(tokens) - 1`.

    `block_table[i]` is the cache block holding positions `[i*block_size, (i+1)*block_size)`;
    it must cover every position up to `start_pos + len(tokens) - 1` (earlier positions hold
    the KV already computed, the chunk's own positions are written by the forward call).
    `logits`: "none" (prefill chunk whose logits nobody reads), "last" (one row, the logits
    after the chunk's last token) or "all" (one row per token). `state_slot`: the sequence's
    recurrent-state slot in the cache (hybrid models only; None for attention-only models).
    `win_block_table`: the sliding-window layers' table in a split cache (`KVArrays.split`;
    same indexing, entries before the window may be any valid block: they are never read).
    """

    tokens: np.ndarray
    start_pos: int
    block_table: np.ndarray
    logits: LogitsMode = "last"
    state_slot: int | None = None
    win_block_table: np.ndarray | None = None
    n: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32).reshape(-1)
        self.block_table = np.ascontiguousarray(self.block_table, dtype=np.int32).reshape(-1)
        if self.win_block_table is not None:
            self.win_block_table = np.ascontiguousarray(self.win_block_table,
                                                        dtype=np.int32).reshape(-1)
        self.start_pos = int(self.start_pos)
        self.n = int(self.tokens.size)
        if self.n == 0:
            raise ValueError("a SeqChunk needs at least one token")
        if self.start_pos < 0:
            raise ValueError("start_pos must be >= 0")
        if self.logits not in ("none", "last", "all"):
            raise ValueError(f"logits must be 'none', 'last' or 'all', not {self.logits!r}")

    @property
    def end_pos(self) -> int:
        """One past the last position of the chunk (the sequence length after it)."""
        return self.start_pos + self.n

    @property
    def n_logits(self) -> int:
        return {"none": 0, "last": 1, "all": self.n}[self.logits]


def split_logits(logits: Any, chunks: Sequence[SeqChunk]) -> list[Any]:
    """Each chunk's rows of a step's logits (`n_logits` rows each, in chunk order), None
    where a chunk wants none; views, not copies."""
    out: list[Any] = []
    i = 0
    for c in chunks:
        k = c.n_logits
        out.append(logits[i : i + k] if k else None)
        i += k
    return out
