"""Causal depthwise 1-D convolution with a carried state (ggml's `ssm_conv` plus the
concat/state-update of llama.cpp's recurrent layers): the short convolution of LFM2 and the
qkv convolution of Qwen3.5's gated delta net layers.

For a channel c with kernel `w[c, 0..K-1]` and a sequence whose last K-1 inputs before this
call are the state rows `state[0..K-2, c]` (oldest first):

    xp = concat(state, x)                       # [K-1+T, C]
    y[t, c] = sum_{j=0}^{K-1} w[c, j] * xp[t + j, c]     (j ascending, f32, as ggml sums)
    new state = xp[-(K-1):]                     # the last K-1 inputs

A fresh sequence starts from a zero state (the zero padding of a causal convolution).
State layout: time-major `[K-1, C]` per sequence (a batch of them: `[B, K-1, C]`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op
from kvshare.ops.short_conv_xp import conv_impl, conv_step_impl

__all__ = ["causal_conv1d", "causal_conv1d_step", "causal_conv1d_reference"]


def causal_conv1d(x: Any, weight: Any, state: Any, *, backend: Backend = CPU,
                  out: Any | None = None) -> Any:
    """Convolve one sequence's chunk and advance its state in place.

    x: float32 `[T, C]` (T >= 1; may be a column slice of a projection); weight: float32
    `[C, K]`; state: float32 `[K-1, C]`, read and then overwritten with the last K-1 inputs.
    Returns float32 `[T, C]` (into `out` when given; `out` must not alias x).
    """
    if backend.is_gpu:
        return gpu_op("causal_conv1d")(x, weight, state, out=out)
    return conv_impl(np, x, weight, state, out=out)


def causal_conv1d_step(x: Any, weight: Any, states: Any, *, backend: Backend = CPU) -> Any:
    """One new token for each of B sequences (the decode step), states advanced in place.

    x: float32 `[B, C]`; weight `[C, K]`; states: float32 `[B, K-1, C]` (a gathered copy or
    a view; written in place). Returns float32 `[B, C]`.
    """
    if backend.is_gpu:
        return gpu_op("causal_conv1d_step")(x, weight, states)
    return conv_step_impl(np, x, weight, states)


def causal_conv1d_reference(x: np.ndarray, weight: np.ndarray, state: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token float64 reference for tests: `(y [T, C], new_state [K-1, C])`."""
    K = weight.shape[1]
    hist = [r.astype(np.float64) for r in state]
    ys = []
    for t in range(x.shape[0]):
        window = np.stack(hist[len(hist) - (K - 1):] + [x[t].astype(np.float64)]) if K > 1 \
            else x[t : t + 1].astype(np.float64)
        ys.append((window * weight.T.astype(np.float64)).sum(0))
        hist.append(x[t].astype(np.float64))
    new_state = np.stack(hist[len(hist) - (K - 1):]) if K > 1 else np.zeros((0, x.shape[1]))
    return np.stack(ys), new_state
