"""Rotary position embedding, ggml's NEOX and NORM styles."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op

NEOX = "neox"
NORM = "norm"


def rope_cos_sin(positions: Any, n_rot: int, base: float, scale: float = 1.0,
                 freq_factors: Any | None = None, *, backend: Backend = CPU) -> tuple[Any, Any]:
    """cos and sin tables, each float32 `[N, n_rot // 2]`, for integer `positions` `[N]`:
    `theta[t, i] = positions[t] * scale * base ** (-2 i / n_rot) / freq_factors[i]`
    (ggml_rope_ext with ext_factor 0 and attn_factor 1; `freq_factors` float32 `[n_rot//2]`
    or None). Angles are formed in float64, then rounded."""
    pos = np.asarray(backend.to_host(positions), dtype=np.float64)
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(backend.to_host(freq_factors), dtype=np.float64)
    theta = (pos * scale)[:, None] * inv[None, :]
    cos = np.cos(theta).astype(np.float32)
    sin = np.sin(theta).astype(np.float32)
    if backend.is_gpu:
        return backend.asarray(cos), backend.asarray(sin)
    return cos, sin


def apply_rope(x: Any, cos: Any, sin: Any, style: str = NEOX, *, backend: Backend = CPU) -> Any:
    """Rotate `x` in place and return it. x: float32 `[N, heads, head_dim]` (may be a
    non-contiguous view, e.g. a slice of a fused QKV projection); cos/sin: float32
    `[N, n_rot // 2]` from `rope_cos_sin`; the first `n_rot = 2 * cos.shape[1]` dims of each
    head rotate, the rest pass through.

    NEOX: pairs `(i, i + n_rot/2)`; NORM: pairs `(2i, 2i + 1)`. For a pair `(a, b)` and
    angle t: `a' = a cos t - b sin t`, `b' = b cos t + a sin t`.
    """
    if backend.is_gpu:
        return gpu_op("apply_rope")(x, cos, sin, style)
    half = cos.shape[-1]
    n_rot = 2 * half
    if style == NEOX:
        a = x[..., :half]
        b = x[..., half:n_rot]
    elif style == NORM:
        a = x[..., 0:n_rot:2]
        b = x[..., 1:n_rot:2]
    else:
        raise ValueError(f"unknown rope style {style!r}")
    c = cos[:, None, :]
    s = sin[:, None, :]
    a_s = a * s
    tmp = a * c
    tmp -= b * s  # a' = a c - b s
    b *= c
    b += a_s  # b' = b c + a s
    a[...] = tmp
    return x
