"""Gated activations of the feed-forward block: GeGLU with tanh-approximated GELU (Gemma) and
SwiGLU (llama family)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: Any, *, backend: Backend = CPU) -> Any:
    """`0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`, float32, new array."""
    if backend.is_gpu:
        return gpu_op("gelu_tanh")(x)
    return geglu_tanh(x, None)


def geglu_tanh(gate: Any, up: Any | None, *, backend: Backend = CPU, out: Any | None = None
               ) -> Any:
    """`gelu_tanh(gate) * up`, elementwise. gate, up: `[N, n_ff]` float32 (views allowed,
    e.g. the two halves of a fused gate|up projection). Returns float32 `[N, n_ff]` (into
    `out` when given; `out` may alias `gate`). `up=None`: plain GELU.

    Computed as `x * sigmoid(2 z)` with `z = sqrt(2/pi) (x + 0.044715 x^3)`, which equals the
    tanh form exactly in real arithmetic (0.5 (1 + tanh z) = sigmoid(2 z)).
    """
    if backend.is_gpu:
        return gpu_op("geglu_tanh")(gate, up, out=out)
    t = np.square(gate)
    t *= -2.0 * _GELU_C * 0.044715
    t -= 2.0 * _GELU_C
    t *= gate  # t = -2 z
    with np.errstate(over="ignore"):
        np.exp(t, out=t)  # large negative x: inf, and x / inf = -0, the right limit
    t += 1.0
    out = np.divide(gate, t, out=out if out is not None else t)
    if up is not None:
        out *= up
    return out


def swiglu(gate: Any, up: Any, *, backend: Backend = CPU, out: Any | None = None) -> Any:
    """`silu(gate) * up = gate / (1 + exp(-gate)) * up`, elementwise, float32 `[N, n_ff]`
    (into `out` when given; `out` may alias `gate`)."""
    if backend.is_gpu:
        return gpu_op("swiglu")(gate, up, out=out)
    t = np.negative(gate)
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    t += 1.0
    out = np.divide(gate, t, out=out if out is not None else t)
    out *= up
    return out
