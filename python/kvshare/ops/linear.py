"""Matrix products with weights stored `[out, in]` (GGUF's row-major layout)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op


def linear(x: Any, w: Any, bias: Any | None = None, *, backend: Backend = CPU,
           out: Any | None = None) -> Any:
    """`x @ w.T (+ bias)`. x: float32 `[N, in]`; w: `[out, in]` (f32 on the CPU; f16/bf16 on
    the GPU, accumulated in f32); bias: float32 `[out]` or None. Returns float32 `[N, out]`
    (into `out` when given)."""
    if backend.is_gpu:
        return gpu_op("linear")(x, w, bias, out=out)
    y = np.matmul(x, w.T, out=out)
    if bias is not None:
        y += bias
    return y
