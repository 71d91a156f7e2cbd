"""Rotary position embedding, ggml's NEOX and NORM styles."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op
from kvshare.ops.attention import write_kv
from kvshare.ops.gpu_runtime import fused_ops

NEOX = "neox"
NORM = "norm"


def rope_cos_sin(positions: Any, n_rot: int, base: float, scale: float = 1.0,
                 freq_factors: Any | None = None, *, backend: Backend = CPU) -> tuple[Any, Any]:
    """cos and sin tables, each float32 `[N, n_rot // 2]`, for integer `positions` `[N]`:
    `theta[t, i] = positions[t] * scale * base ** (-2 i / n_rot) / freq_factors[i]`
    (ggml_rope_ext with ext_factor 0 and attn_factor 1; `freq_factors` float32 `[n_rot//2]`
    or None). Angles are formed in float64, then rounded. On the GPU the tables are computed
    there (from device positions too: a captured decode step's)."""
    if backend.is_gpu:
        return gpu_op("rope_cos_sin")(positions, n_rot, base, scale, freq_factors)
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


try:  # pragma: no cover - exercised when numba is installed
    from numba import njit

    from kvshare.ops.norm import _rms_norm_rows

    @njit(cache=True, nogil=True, boundscheck=False)
    def _norm_rope_rows(x, w, eps, cos, sin, neox):  # x: [n, heads, d] in place; w: [d] or []
        if w.shape[0]:
            _rms_norm_rows(x, w, eps, x)  # kvshare.ops.norm's own row loop, in place
        n, h, _ = x.shape
        half = cos.shape[1]
        for i in range(n):
            for j in range(h):
                # apply_rope's arithmetic per pair (a, b): a c - b s and b c + a s, each
                # product rounded (no fused multiply-add), as NumPy computes it
                for t in range(half):
                    if neox:
                        ia, ib = t, t + half
                    else:
                        ia, ib = 2 * t, 2 * t + 1
                    a, b = x[i, j, ia], x[i, j, ib]
                    c, s = cos[i, t], sin[i, t]
                    x[i, j, ia] = a * c - b * s
                    x[i, j, ib] = b * c + a * s

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

# decode steps (a few rows) take the fused loop; prefill chunks the separate whole-array ops
_FUSED_ROWS = 32
_NO_WEIGHT = np.zeros(0, np.float32)


def norm_and_rope(x: Any, weight: Any | None, eps: float, cos: Any, sin: Any,
                  style: str = NEOX, *, backend: Backend = CPU) -> Any:
    """`apply_rope(rms_norm(x, weight, eps), cos, sin, style)` in place (no norm when
    `weight` is None), the same bits as the two calls. A decode step runs it for q and k of
    every layer: in one compiled loop (~3 us) instead of a Numba call and seven NumPy passes
    (~25 us for the 1.9B model's heads)."""
    from kvshare.ops.norm import rms_norm  # noqa: PLC0415

    if (not backend.is_gpu and HAVE_NUMBA and x.ndim == 3 and x.shape[0] <= _FUSED_ROWS
            and x.dtype == np.float32 and cos.dtype == np.float32 and sin.dtype == np.float32
            and (weight is None or (weight.dtype == np.float32
                                    and tuple(weight.shape) == (x.shape[-1],)))
            and style in (NEOX, NORM) and 2 * cos.shape[1] <= x.shape[-1]):
        _norm_rope_rows(x, _NO_WEIGHT if weight is None else weight, np.float32(eps), cos, sin,
                        style == NEOX)
        return x
    if weight is not None:
        rms_norm(x, weight, eps, backend=backend, out=x)
    return apply_rope(x, cos, sin, style, backend=backend)


def qkv_rope_write(qkv: Any, q_norm: Any | None, k_norm: Any | None, eps: float, cos: Any,
                   sin: Any, style: str, k_cache: Any, v_cache: Any, slots: Any, n_head: int,
                   n_head_kv: int, head_dim: int, *, backend: Backend = CPU) -> Any:
    """The tail of an attention layer's fused Q/K/V projection `qkv` (float32
    `[N, (n_head + 2 n_head_kv) * head_dim]`: q heads, k heads, v heads): q and k get their
    per-head RMSNorm (`q_norm` / `k_norm` `[head_dim]`, or None: no norm) and rope
    (`norm_and_rope`), K and V are stored at `slots` of the layer's cache (`write_kv`), and q
    is returned as the `[N, n_head, head_dim]` view of qkv (updated in place; k's columns
    too, on the CPU). On the GPU one kernel does all of it for any N (a device slot < 0, a
    CUDA graph's padding row, stores nothing there), unless KVSHARE_GPU_FUSED=0
    (`gpu_runtime.fused_ops`): then the ops it fuses, as on the CPU."""
    if backend.is_gpu and fused_ops():
        return gpu_op("qkv_rope_write")(qkv, q_norm, k_norm, eps, cos, sin, style, k_cache,
                                        v_cache, slots, n_head, n_head_kv, head_dim)
    return qkv_rope_write_unfused(qkv, q_norm, k_norm, eps, cos, sin, style, k_cache, v_cache,
                                  slots, n_head, n_head_kv, head_dim, backend=backend)


def qkv_rope_write_unfused(qkv: Any, q_norm: Any | None, k_norm: Any | None, eps: float,
                           cos: Any, sin: Any, style: str, k_cache: Any, v_cache: Any,
                           slots: Any, n_head: int, n_head_kv: int, head_dim: int, *,
                           backend: Backend = CPU) -> Any:
    """`qkv_rope_write` as the ops it fuses (`norm_and_rope` of q and of k, `write_kv`): the
    CPU path, and on a GPU what the fused kernel is compared with."""
    H, K, D = n_head, n_head_kv, head_dim
    n = qkv.shape[0]
    q = qkv[:, : H * D].reshape(n, H, D)
    k = qkv[:, H * D : (H + K) * D].reshape(n, K, D)
    v = qkv[:, (H + K) * D :].reshape(n, K, D)
    norm_and_rope(q, q_norm, eps, cos, sin, style, backend=backend)
    norm_and_rope(k, k_norm, eps, cos, sin, style, backend=backend)
    write_kv(k_cache, v_cache, slots, k, v, backend=backend)
    return q
