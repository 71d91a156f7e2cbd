"""Token embedding lookup."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op


def embedding(table: Any, tokens: Any, scale: float = 1.0, *, backend: Backend = CPU) -> Any:
    """Rows `table[tokens] * scale` as float32 `[N, d]`. table: `[vocab, d]` (f32 ndarray or
    `Q8Weight` on the CPU; f16/bf16/f32 on the GPU), tokens: int32 `[N]` (every id in
    `[0, vocab)`)."""
    if backend.is_gpu:
        return gpu_op("embedding")(table, tokens, scale)
    tokens = np.asarray(tokens)
    if tokens.size == 1:  # a decode step's token: Python's comparison, not two reductions
        if not 0 <= int(tokens.reshape(-1)[0]) < table.shape[0]:
            raise IndexError(f"token id out of range [0, {table.shape[0]})")
    elif tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise IndexError(f"token id out of range [0, {table.shape[0]})")
    if hasattr(table, "rows"):  # a quantized table (Q8Weight)
        x = table.rows(tokens)
    else:
        x = np.take(table, tokens, axis=0).astype(np.float32, copy=False)
    if scale != 1.0:
        x *= np.float32(scale)
    return x
