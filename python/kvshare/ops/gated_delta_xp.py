"""The gated delta rule's array code, written once against an array module `xp`: NumPy for
`kvshare.ops.gated_delta`, CuPy for its GPU twin in `kvshare.ops.gpu_hybrid`. Both import it
from here, below them, so that the op and its twin need not import each other. The rule, the
chunkwise form and the layouts are described in `kvshare.ops.gated_delta`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CHUNK", "heads", "chunked_impl", "step_impl"]

CHUNK = 64
# chunks processed per group in the vectorised part: bounds the [H, n, C, C] temporaries
_GROUP_ELEMS = 1 << 18  # ~1 MB per temporary: stays in cache (4x faster than 16 MB)


def heads(x: Any, n_v: int, xp: Any = np) -> Any:
    """`[..., H_k, d]` key/query heads broadcast to `n_v` value heads (head h <- h % H_k)."""
    n_k = x.shape[-2]
    if n_k == n_v:
        return x
    if n_v % n_k:
        raise ValueError(f"{n_v} value heads are not a multiple of {n_k} key heads")
    return x[..., xp.arange(n_v) % n_k, :]


def _unit_lower_solve(xp: Any, A: Any, X: Any) -> None:
    """`X <- (I + A)^-1 X` in place for strictly lower-triangular A `[..., C, C]` and X
    `[..., C, m]`: forward substitution, one row of every matrix of the batch at a time
    (faster than a batched LAPACK solve at C = 64, and no pivoting is involved)."""
    C = A.shape[-1]
    for i in range(1, C):
        X[..., i, :] -= xp.matmul(A[..., i : i + 1, :i], X[..., :i, :])[..., 0, :]


def _solve_chunks(xp: Any, K: Any, V: Any, B: Any, D: Any, eG: Any, strict_f: Any) -> Any:
    """The triangular systems of a group of chunks, `(I + A) X = [beta V, beta exp(G) K]`
    with `A = (K K^T o D o strict lower) * beta` (rows scaled): X `[H, n, C, Dv + Dk]`,
    the state-free parts U0 (first Dv columns) and W (the rest) of the new values."""
    np = xp  # noqa: N806 - the same code runs on both array modules
    C = K.shape[-2]
    A = np.matmul(K, K.swapaxes(-1, -2))
    A *= D
    A *= strict_f
    A *= B[..., :, None]
    X = np.concatenate([V * B[..., None], K * (B * eG)[..., None]], axis=-1)
    if X.shape[-1] > C:  # wide right-hand sides: substitute on I (C columns), then one GEMM
        Tinv = np.broadcast_to(np.eye(C, dtype=np.float32), A.shape).copy()
        _unit_lower_solve(xp, A, Tinv)
        return np.matmul(Tinv, X)
    _unit_lower_solve(xp, A, X)  # X <- (I + A)^-1 X
    return X


def chunked_impl(xp: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *,
                 scale: float, chunk_size: int = CHUNK) -> Any:
    """`gated_delta_chunked` written against an array module `xp` (NumPy, or CuPy for the GPU
    twin in `kvshare.ops.gpu_hybrid`)."""
    np = xp  # noqa: N806 - the same code runs on both array modules
    T, H, Dv = v.shape
    Dk = k.shape[-1]
    if state.shape != (H, Dk, Dv):
        raise ValueError(f"state has shape {state.shape}, expected {(H, Dk, Dv)}")
    C = min(int(chunk_size), T)
    n_c = -(-T // C)
    Tp = n_c * C
    f32 = np.float32

    def heads_first(x: np.ndarray, width: int | None) -> np.ndarray:
        """[T, H, d] -> [H, n_c, C, d] (zero padded); [T, H] -> [H, n_c, C]."""
        if width is None:
            out = np.zeros((H, Tp), f32)
            out[:, :T] = x.T
            return out.reshape(H, n_c, C)
        out = np.zeros((H, Tp, width), f32)
        out[:, :T] = x.transpose(1, 0, 2)
        return out.reshape(H, n_c, C, width)

    Q = heads_first(heads(np.asarray(q, f32), H, xp), Dk)
    Q *= f32(scale)
    K = heads_first(heads(np.asarray(k, f32), H, xp), Dk)
    V = heads_first(np.asarray(v, f32), Dv)
    Gc = np.cumsum(heads_first(np.asarray(g, f32), None), axis=-1, dtype=f32)  # [H, n_c, C]
    B = heads_first(np.asarray(beta, f32), None)
    out = np.empty((H, Tp, Dv), f32)
    out4 = out.reshape(H, n_c, C, Dv)

    tril = np.tri(C, dtype=bool)  # j <= i
    strict_f = np.tri(C, k=-1, dtype=f32)  # j < i
    S = state.astype(f32, copy=True)
    # chunks per group: the largest per-chunk temporaries are C x C (decay mask, A, QK),
    # C x (Dk + Dv) (the solved right-hand sides) and Dk x Dv (each chunk's initial state)
    group = max(1, _GROUP_ELEMS // (H * max(C * C, C * (Dk + Dv), Dk * Dv)))
    for c0 in range(0, n_c, group):
        c1 = min(n_c, c0 + group)
        Qg, Kg, Vg = Q[:, c0:c1], K[:, c0:c1], V[:, c0:c1]
        G, Bg = Gc[:, c0:c1], B[:, c0:c1]
        diff = G[..., :, None] - G[..., None, :]  # [H, n, C, C]: G_i - G_j
        D = np.exp(np.where(tril, diff, f32(-np.inf)))  # 0 above the diagonal
        eG = np.exp(G)  # [H, n, C]
        X = _solve_chunks(xp, Kg, Vg, Bg, D, eG, strict_f)
        U0, W = X[..., :Dv], X[..., Dv:]
        gl = G[..., -1]  # [H, n]
        Kd = Kg * np.exp(gl[..., None] - G)[..., None]  # [H, n, C, Dk]
        KdT = np.ascontiguousarray(Kd.swapaxes(-1, -2))  # [H, n, Dk, C]
        egl = np.exp(gl)
        # the sequential part: each chunk's initial state S_c and new values U_c
        Ss = np.empty((H, c1 - c0, Dk, Dv), f32)
        for i in range(c1 - c0):
            Ss[:, i] = S
            U = U0[:, i]
            U -= np.matmul(W[:, i], S)  # [H, C, Dv], in place in X
            S *= egl[:, i, None, None]
            S += np.matmul(KdT[:, i], U)
        # outputs of the whole group at once: exp(G) Q S_c + (Q K^T o D) U_c
        QK = np.matmul(Qg, Kg.swapaxes(-1, -2))
        QK *= D
        o = np.matmul(Qg * eG[..., None], Ss)
        o += np.matmul(QK, U0)
        out4[:, c0:c1] = o
    state[...] = S
    return np.ascontiguousarray(out[:, :T].transpose(1, 0, 2))


def step_impl(xp: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any, *,
              scale: float) -> Any:
    """`gated_delta_step` against an array module `xp` (NumPy or CuPy)."""
    H = v.shape[1]
    qh = heads(q, H, xp)
    kh = heads(k, H, xp)
    states *= xp.exp(g)[..., None, None]
    kv = xp.matmul(kh[..., None, :], states)[..., 0, :]  # S^T k: [B, H, Dv]
    delta = v - kv
    delta *= beta[..., None]
    states += kh[..., :, None] * delta[..., None, :]
    o = xp.matmul(qh[..., None, :], states)[..., 0, :]
    o *= xp.float32(scale)
    return o
