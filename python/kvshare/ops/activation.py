"""Gated activations of the feed-forward block: GeGLU with tanh-approximated GELU (Gemma) and
SwiGLU (llama family)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvshare import _core
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


# The compiled form (kvshare-kernels' rowops): one pass per row instead of NumPy's 5-7
# whole-array passes over strided halves (~1 ms per 160 x 2048 GeGLU call in a prefill).
_KINDS = {"gelu_tanh": geglu_tanh, "silu": swiglu}


def glu(gu: Any, kind: str, *, backend: Backend = CPU) -> Any:
    """The gated activation of a fused gate|up projection `gu` (`[N, 2 * n_ff]` float32):
    `act(gu[:, :n_ff]) * gu[:, n_ff:]` with `act` "gelu_tanh" (`geglu_tanh`) or "silu"
    (`swiglu`), written over the gate half and returned as that view `[N, n_ff]`."""
    if kind not in _KINDS:
        raise ValueError(f"unknown activation {kind!r}")
    ff = gu.shape[1] // 2
    gate, up = gu[:, :ff], gu[:, ff:]
    if (not backend.is_gpu and hasattr(_core, "glu_in_place") and gu.dtype == np.float32
            and gu.flags.c_contiguous and gu.ndim == 2 and gu.shape[1] % 2 == 0):
        if gu.size:
            _core.glu_in_place(gu, kind)
        return gate
    return _KINDS[kind](gate, up, backend=backend, out=gate)
