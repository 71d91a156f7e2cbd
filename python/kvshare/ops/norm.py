"""RMSNorm."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op

from kvshare import _core

try:  # pragma: no cover - exercised when numba is installed
    from numba import njit

    @njit(cache=True, nogil=True, boundscheck=False)
    def _rms_norm_rows(x, w, eps, out):  # x, out: [n, h, d]; w: [d] or empty (no weight)
        n, h, d = x.shape
        for i in range(n):
            for j in range(h):
                acc = 0.0  # float64
                for k in range(d):
                    v = np.float64(x[i, j, k])
                    acc += v * v
                r = np.float32(1.0 / np.sqrt(np.float32(acc / d) + eps))
                if w.shape[0]:
                    for k in range(d):
                        out[i, j, k] = (x[i, j, k] * r) * w[k]
                else:
                    for k in range(d):
                        out[i, j, k] = x[i, j, k] * r

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

# Up to this many rows (decode steps) Numba's loop: the same formula as the Rust kernel (f64
# sum of squares, f32 scale, `(x * s) * w`; the f64 sums differ only in order, which moves
# the f32 result only when a sum falls within ~1e-16 of a rounding boundary) at a lower call
# cost (a decode step of Gemma 3 normalises ~110 times; the Rust call costs ~12 us).
_SMALL_ROWS = 32
_NO_WEIGHT = np.zeros(0, np.float32)


# The compiled row loop (kvshare-kernels' rowops: ggml's formula, squares summed in f64, one
# pass per row) for every batch size: NumPy's seven whole-array passes cost ~100-400 us per
# prefill call, and the earlier split (a compiled loop for <= 32 rows, NumPy above) gave a row
# a different norm in a short chunk than in a long one.
HAVE_KERNEL = hasattr(_core, "rms_norm")


def rms_norm(x: Any, weight: Any | None, eps: float, *, backend: Backend = CPU,
             out: Any | None = None) -> Any:
    """`x / sqrt(mean(x**2, axis=-1) + eps) * weight` over the last axis.

    x: `[..., d]` float32 (any leading shape: `[N, d]` rows, or `[N, heads, head_dim]` for
    per-head q/k norms). weight: `[d]` float32 or None (no scale; Gemma's weights already
    include the +1, they are used as stored). Returns float32 of x's shape, written into
    `out` when given (`out` may be `x` itself: in place). ggml's formula for every batch size:
    the squares summed in f64, the scale `1 / sqrt(mean + eps)` in f32, then `(x * s) * w`.
    """
    if backend.is_gpu:
        return gpu_op("rms_norm")(x, weight, eps, out=out)
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if HAVE_NUMBA and x.ndim in (2, 3) and x.shape[0] <= _SMALL_ROWS and x.dtype == np.float32 \
            and (weight is None or weight.dtype == np.float32):
        if out is None:
            out = np.empty(x.shape, np.float32)
        x3, o3 = (x, out) if x.ndim == 3 else (x[:, None, :], out[:, None, :])
        _rms_norm_rows(x3, _NO_WEIGHT if weight is None else weight, np.float32(eps), o3)
        return out
    if HAVE_KERNEL and x.dtype == np.float32 and x.ndim >= 1 and x.size \
            and (weight is None or weight.dtype == np.float32):
        w = None if weight is None else np.ascontiguousarray(weight)
        if x.flags.c_contiguous and (out is None or out is x or out.flags.c_contiguous):
            if out is None:
                out = np.empty(x.shape, np.float32)
            _core.rms_norm(x, w, float(eps), out)
            return out
        # a strided view (q/k heads inside a fused projection): through a contiguous copy
        xc = np.ascontiguousarray(x)
        _core.rms_norm(xc, w, float(eps), xc)
        if out is None:
            return xc
        out[...] = xc
        return out
    return rms_norm_numpy(x, weight, eps, out=out)


def rms_norm_numpy(x: Any, weight: Any | None, eps: float, *, out: Any | None = None) -> Any:
    """The NumPy form of `rms_norm` (the test oracle; float32 sums)."""
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
