"""RMSNorm."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op


def rms_norm(x: Any, weight: Any | None, eps: float, *, backend: Backend = CPU,
             out: Any | None = None) -> Any:
    """`x / sqrt(mean(x**2, axis=-1) + eps) * weight` over the last axis.

    x: `[..., d]` float32 (any leading shape: `[N, d]` rows, or `[N, heads, head_dim]` for
    per-head q/k norms). weight: `[d]` float32 or None (no scale; Gemma's weights already
    include the +1, they are used as stored). Returns float32 of x's shape, written into
    `out` when given (`out` may be `x` itself: in place). The mean of squares accumulates in
    float32 or wider.
    """
    if backend.is_gpu:
        return gpu_op("rms_norm")(x, weight, eps, out=out)
    d = x.shape[-1]
    ms = np.einsum("...i,...i->...", x, x)
    ms *= 1.0 / d
    ms += eps
    np.sqrt(ms, out=ms)
    np.reciprocal(ms, out=ms)
    out = np.multiply(x, ms[..., None], out=out)
    if weight is not None:
        out *= weight
    return out
