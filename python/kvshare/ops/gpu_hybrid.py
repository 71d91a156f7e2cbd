"""CuPy twins of the hybrid-model ops (`kvshare.ops.gated_delta`, `kvshare.ops.short_conv`),
re-exported by `kvshare.ops.gpu` so that `gpu_op(name)` finds them.

They run the very same array code as the NumPy ops (`chunked_impl`, `step_impl` of
`gated_delta_xp`, `conv_impl`, `conv_step_impl` of `short_conv_xp`, written against an array
module) with CuPy as the module: cuBLAS batched GEMMs for the chunkwise delta rule (the
triangular systems of every chunk and head in one batch of forward-substitution steps; one
small loop over chunks for the state), CuPy element-wise kernels elsewhere. Same signatures as the NumPy ops less `backend`, same
contracts (states updated in place). Nothing GPU-related is imported before first use.
"""

from __future__ import annotations

from typing import Any

from kvshare.backend import cupy_module
from kvshare.ops.gated_delta_xp import CHUNK, chunked_impl, step_impl
from kvshare.ops.short_conv_xp import conv_impl, conv_step_impl

__all__ = ["causal_conv1d", "causal_conv1d_step", "gated_delta_chunked", "gated_delta_step"]


def _f32(cp: Any, a: Any) -> Any:
    return a if (isinstance(a, cp.ndarray) and a.dtype == cp.float32) else cp.asarray(
        a, dtype=cp.float32)


def causal_conv1d(x: Any, weight: Any, state: Any, *, out: Any | None = None) -> Any:
    cp = cupy_module()
    return conv_impl(cp, _f32(cp, x), _f32(cp, weight), state, out=out)


def causal_conv1d_step(x: Any, weight: Any, states: Any) -> Any:
    cp = cupy_module()
    return conv_step_impl(cp, _f32(cp, x), _f32(cp, weight), states)


def gated_delta_chunked(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *, scale: float,
                        chunk_size: int = CHUNK) -> Any:
    cp = cupy_module()
    return chunked_impl(cp, *(_f32(cp, a) for a in (q, k, v, g, beta)), state, scale=scale,
                        chunk_size=chunk_size)


def gated_delta_step(q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, *,
                     scale: float) -> Any:
    cp = cupy_module()
    return step_impl(cp, *(_f32(cp, a) for a in (q, k, v, g, beta)), states, scale=scale)
