"""The causal depthwise convolution's array code, written once against an array module `xp`:
NumPy for `kvshare.ops.short_conv`, CuPy for its GPU twin in `kvshare.ops.gpu_hybrid`. Both
import it from here, below them, so that the op and its twin need not import each other. The
operation and the state layout are described in `kvshare.ops.short_conv`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["conv_impl", "conv_step_impl"]


def conv_impl(xp: Any, x: Any, weight: Any, state: Any, *, out: Any | None = None) -> Any:
    """`causal_conv1d` against an array module `xp` (NumPy or CuPy)."""
    np = xp  # noqa: N806 - the same code runs on both array modules
    T, C = x.shape
    K = weight.shape[1]
    km1 = K - 1
    if state.shape != (km1, C):
        raise ValueError(f"conv state has shape {state.shape}, expected {(km1, C)}")
    xpad = np.empty((km1 + T, C), np.float32)
    xpad[:km1] = state
    xpad[km1:] = x
    wt = np.ascontiguousarray(weight.T)  # [K, C]
    if out is None:
        out = np.empty((T, C), np.float32)
    np.multiply(xpad[0:T], wt[0], out=out)
    for j in range(1, K):
        out += xpad[j : j + T] * wt[j]
    state[...] = xpad[T:]
    return out


def conv_step_impl(xp: Any, x: Any, weight: Any, states: Any) -> Any:
    """`causal_conv1d_step` against an array module `xp` (NumPy or CuPy)."""
    K = weight.shape[1]
    wt = xp.ascontiguousarray(weight.T)  # [K, C]
    out = states[:, 0] * wt[0]
    for j in range(1, K - 1):
        out += states[:, j] * wt[j]
    out += x * wt[K - 1]
    if K > 2:
        states[:, :-1] = states[:, 1:].copy()
    if K > 1:
        states[:, -1] = x
    return out
