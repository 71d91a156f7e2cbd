"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention; ggml's `gated_delta_net`).

Per value head h, with a state matrix `S [Dk, Dv]`, and per token t a query q, key k (both
L2-normalised by the caller), value v, log-decay g <= 0 and write strength beta in (0, 1):

    S  = exp(g) * S                         # decay
    u  = beta * (v - S^T k)                 # delta: what S still mispredicts for k
    S  = S + k u^T                          # rank-1 write
    o  = S^T (scale * q)                    # read-out after the write

Value head h reads query/key head `h % H_k` when there are fewer key heads than value heads
(ggml broadcasts the key heads by repetition: `ggml_repeat_4d` in llama.cpp's graph, the same
indexing in its fused op).

Prefill uses the chunkwise ("WY") form, exact in real arithmetic: within a chunk of C tokens
with in-chunk cumulative log-decays `G_i = g_1 + ... + g_i` and the chunk's initial state S0,

    (I + A) U = beta * V - beta * exp(G) * K S0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i)
    O   = exp(G) * Q S0 + (Q K^T o D) U,           D_ij = exp(G_i - G_j)  (j <= i, else 0)
    S1  = exp(G_C) S0 + (exp(G_C - G) * K)^T U

The triangular systems do not depend on the state, so they are solved for every chunk and
head at once (one batched LAPACK solve); only the three small state products per chunk run in
a Python loop (T / 64 iterations, all heads batched). No exponent is ever positive, so
nothing overflows however long the chunk. Decode (`gated_delta_step`) applies the recurrence
directly to a batch of sequences' states.

State layout: `[H_v, Dk, Dv]` per sequence (float32), `S[h, i, j]` = key dim i, value dim j.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op
from kvshare.ops.gated_delta_xp import CHUNK, chunked_impl, heads, step_impl

__all__ = ["CHUNK", "gated_delta_chunked", "gated_delta_step", "gated_delta_reference"]


def gated_delta_chunked(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *,
                        scale: float, chunk_size: int = CHUNK, backend: Backend = CPU) -> Any:
    """Run T tokens of one sequence through the rule, starting from `state` (updated in place).

    q, k: float32 `[T, H_k, Dk]` (L2-normalised); v: float32 `[T, H_v, Dv]`; g (log-decay,
    <= 0), beta: float32 `[T, H_v]`; state: float32 `[H_v, Dk, Dv]`. Returns the outputs
    float32 `[T, H_v, Dv]`.
    """
    if backend.is_gpu:
        return gpu_op("gated_delta_chunked")(q, k, v, g, beta, state, scale=scale,
                                             chunk_size=chunk_size)
    return chunked_impl(np, q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)


def gated_delta_step(q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, *, scale: float,
                     backend: Backend = CPU) -> Any:
    """One token for each of B sequences (decode): q, k `[B, H_k, Dk]`, v `[B, H_v, Dv]`,
    g, beta `[B, H_v]`, states `[B, H_v, Dk, Dv]` (updated in place). Returns `[B, H_v, Dv]`."""
    if backend.is_gpu:
        return gpu_op("gated_delta_step")(q, k, v, g, beta, states, scale=scale)
    return step_impl(np, q, k, v, g, beta, states, scale=scale)


def gated_delta_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                          beta: np.ndarray, state: np.ndarray, *, scale: float
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token float64 recurrence for tests: `(o [T, H_v, Dv], new_state)`."""
    H = v.shape[1]
    qh = heads(q, H).astype(np.float64)
    kh = heads(k, H).astype(np.float64)
    S = state.astype(np.float64).copy()
    outs = []
    for t in range(v.shape[0]):
        S *= np.exp(g[t].astype(np.float64))[:, None, None]
        kv = np.einsum("hij,hi->hj", S, kh[t])
        u = (v[t] - kv) * beta[t][:, None]
        S += kh[t][:, :, None] * u[:, None, :]
        outs.append(np.einsum("hij,hi->hj", S, qh[t]) * scale)
    return np.stack(outs), S
