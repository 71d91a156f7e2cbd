"""Matrix products with weights stored `[out, in]` (GGUF's row-major layout), and the CPU's
small-batch and quantized paths.

CPU paths of `linear(x, w)`:
- `w` a `QWeight` (a block-quantized tensor kept as int8 values + f32 group scales/mins), the
  form of every quantized layer and of the output head: for N = x.shape[0] <= Q_KERNEL_MAX
  rows, `kvshare._core.qmatmul_t` (Rust, explicit AVX2/FMA: reads ~1.1 bytes per weight
  instead of 4, converts each weight once for up to 4 input rows, GIL released); the 262K x
  640 output head of Gemma is 178 MB instead of 671 MB, its layers 110 MB instead of 400 MB.
  Decode is bound by reading those bytes. For larger N, tiles of rows are dequantized on
  the fly + OpenBLAS (no f32 copy is kept: measured on Gemma 3 270M, a 512-token prefill is
  no slower than with one, and the model holds 435 MB instead of ~2 GB). The integer form is
  exact (value = q * scale - min, as ggml dequantizes), so the decode and the prefill paths
  agree to float rounding.
- `w` an f32 ndarray: OpenBLAS `x @ w.T`, except 2 <= N <= 8 where a Numba kernel reads each
  weight row once for all N inputs (OpenBLAS's small-M sgemm packs the weights on every call
  and runs at a fraction of memory bandwidth).
Thread counts follow `backend.CPU_THREADS` (the BLAS pool and the kernels never run at once).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvshare import _core
from kvshare.backend import BLAS_PARALLEL_MIN_TOKENS, CPU, CPU_THREADS, Backend
from kvshare.ops._dispatch import gpu_op
from kvshare.ops.activation import glu

try:  # pragma: no cover - exercised when numba is installed
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

# Numba's workqueue threading layer aborts on concurrent parallel launches from two Python
# threads; kernels are serialised (the cores are shared anyway).
_LOCK = threading.Lock()
SMALL_M_MAX = 8  # f32 weights: Numba kernel for 2 <= N <= SMALL_M_MAX
# QWeight: the Rust kernel for N <= Q_KERNEL_MAX rows (up to here it beats OpenBLAS on the f32
# copy, which reads 4x the bytes): exactly the steps that give their cores to the kernels
Q_KERNEL_MAX = BLAS_PARALLEL_MIN_TOKENS - 1
_TILE = 64

if HAVE_NUMBA:  # pragma: no cover - compiled code is not traced by coverage

    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
    def _mm_f32_small(x, w, out):  # out[m, n] = sum_k x[m, k] w[n, k]
        M, K = x.shape
        N = w.shape[0]
        ntile = (N + _TILE - 1) // _TILE
        for t in prange(ntile):
            for n in range(t * _TILE, min(N, (t + 1) * _TILE)):
                for m in range(M):
                    acc = np.float32(0.0)
                    for k in range(K):
                        acc += x[m, k] * w[n, k]
                    out[m, n] = acc


class QWeight:
    """A `[out, in]` weight kept as integers: `qs` int8 `[out, in]`, `scale` f32
    `[out, in // group]` and optional `mins` (value = qs * scale - mins per group of `group`
    consecutive inputs, group 32 or 16). Q8_0, Q4_0, Q5_0 (group 32), Q4_K, Q5_K (group 32
    with mins) and Q6_K (group 16) all split exactly into this form (`split_quantized`).
    `dense`: an optional f32 copy for large-batch GEMMs (None: tiles are dequantized)."""

    ndim = 2
    dtype = np.dtype(np.float32)  # what it computes in

    def __init__(self, qs: np.ndarray, scale: np.ndarray, mins: np.ndarray | None = None,
                 group: int = 32, dense: np.ndarray | None = None):
        if qs.dtype != np.int8 or qs.ndim != 2 or group not in (16, 32) or qs.shape[1] % group:
            raise ValueError("QWeight needs int8 [out, in], group 16 or 32 dividing in")
        n, k = qs.shape
        self.qs = np.ascontiguousarray(qs)
        self.scale = np.ascontiguousarray(scale, dtype=np.float32).reshape(n, k // group)
        self.mins = None if mins is None else np.ascontiguousarray(
            mins, dtype=np.float32).reshape(n, k // group)
        self.group = group
        self.dense = dense

    @classmethod
    def from_q8_0_bytes(cls, raw: np.ndarray, shape: tuple[int, int]) -> "QWeight":
        """From GGUF Q8_0 blocks (34 bytes: f16 scale, 32 int8) of a `[out, in]` tensor, in
        slices so that no full-size temporary is made (the 262K-row embedding)."""
        blocks = np.asarray(raw, np.uint8).reshape(-1, 34)
        qs = np.empty(shape, np.int8)
        d = np.empty((shape[0], shape[1] // 32), np.float32)
        qf, df = qs.reshape(-1, 32), d.reshape(-1)
        step = 1 << 18
        for s in range(0, len(blocks), step):
            b = blocks[s : s + step]
            qf[s : s + len(b)] = b[:, 2:].view(np.int8)
            df[s : s + len(b)] = np.ascontiguousarray(b[:, :2]).view(np.float16)[:, 0]
        return cls(qs, d, None, 32)

    @classmethod
    def concat(cls, parts: list["QWeight"], dense: np.ndarray | None = None) -> "QWeight":
        """Stack weights along the output axis (fused Q/K/V or gate/up), converting to a
        common group size (a group-32 scale becomes two equal group-16 scales: exact) and
        giving mins of zero to parts without mins."""
        group = min(p.group for p in parts)
        any_min = any(p.mins is not None for p in parts)
        scales, mins = [], []
        for p in parts:
            r = p.group // group
            scales.append(np.repeat(p.scale, r, axis=1) if r > 1 else p.scale)
            if any_min:
                m = p.mins if p.mins is not None else np.zeros_like(p.scale)
                mins.append(np.repeat(m, r, axis=1) if r > 1 else m)
        return cls(np.concatenate([p.qs for p in parts]), np.concatenate(scales),
                   np.concatenate(mins) if any_min else None, group, dense)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape

    @property
    def nbytes(self) -> int:
        n = self.qs.nbytes + self.scale.nbytes + (0 if self.mins is None else self.mins.nbytes)
        return n + (0 if self.dense is None else self.dense.nbytes)

    def dequantize(self, start: int = 0, stop: int | None = None, ids=None) -> np.ndarray:
        """Rows `[start, stop)` (or rows `ids`) as f32, exactly as ggml dequantizes them."""
        sel = ids if ids is not None else slice(start, self.shape[0] if stop is None else stop)
        q = self.qs[sel]
        n, g = q.shape[0], self.group
        out = (q.reshape(n, -1, g) * self.scale[sel][:, :, None])
        if self.mins is not None:
            out -= self.mins[sel][:, :, None]
        return out.reshape(n, -1)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `[len(ids), in]` f32 (the embedding lookup)."""
        return self.dequantize(ids=np.asarray(ids))

    def matmul_t(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`x @ self.T` for x f32 `[M, in]` -> `[M, out]`."""
        M = x.shape[0]
        N = self.shape[0]
        if out is None:
            out = np.empty((M, N), np.float32)
        if M <= Q_KERNEL_MAX:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if not out.flags.c_contiguous:
                res = self.matmul_t(x)
                out[...] = res
                return out
            _core.qmatmul_t(x, self.qs, self.scale, self.mins, out, self.group,
                            CPU_THREADS.kernel_threads)
            return out
        if self.dense is not None:
            return np.matmul(x, self.dense.T, out=out)
        tile = 8192
        for s in range(0, N, tile):
            e = min(N, s + tile)
            np.matmul(x, self.dequantize(s, e).T, out=out[:, s:e])
        return out


Q8Weight = QWeight  # the Q8_0-only name used first


def linear(x: Any, w: Any, bias: Any | None = None, *, backend: Backend = CPU,
           out: Any | None = None) -> Any:
    """`x @ w.T (+ bias)`. x: float32 `[N, in]` (row stride may exceed `in`); w: `[out, in]`
    (f32 ndarray or `Q8Weight` on the CPU; f16/bf16 on the GPU, accumulated in f32); bias:
    float32 `[out]` or None. Returns float32 `[N, out]` (into `out` when given)."""
    if backend.is_gpu:
        return gpu_op("linear")(x, w, bias, out=out)
    if isinstance(w, QWeight) or hasattr(w, "matmul_t"):  # QWeight, BlockWeight
        y = w.matmul_t(x, out=out)
    elif HAVE_NUMBA and 2 <= x.shape[0] <= SMALL_M_MAX and w.dtype == np.float32:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], w.shape[0]), np.float32) if out is None else out
        with _LOCK:
            _mm_f32_small(x, w, y)
    else:
        y = np.matmul(x, w.T, out=out)
    if bias is not None:
        y += bias
    return y


def linear_add(x: Any, w: Any, bias: Any | None, y: Any, *, backend: Backend = CPU) -> Any:
    """`y += x @ w.T (+ bias)` in place (a projection added into the residual stream) and
    return y: `linear`, then the add. y: float32 `[N, out]`, not overlapping x. On the GPU a
    block weight's mat-vec adds into y itself (no second launch, no `[N, out]` temporary)."""
    if backend.is_gpu:
        return gpu_op("linear_add")(x, w, bias, y)
    y += linear(x, w, bias, backend=backend)
    return y


def linear_glu(x: Any, w: Any, activation: str, *, backend: Backend = CPU) -> Any:
    """The gated feed-forward input: `glu(linear(x, w), activation)`, i.e.
    `act(x @ gate.T) * (x @ up.T)` float32 `[N, n_ff]` for w = gate|up stacked
    `[2 n_ff, in]` and `act` as `ops.activation.glu` names it ("silu", "gelu_tanh"). On the
    GPU a block weight's gate and up rows of one type take one fused mat-vec launch."""
    if backend.is_gpu:
        return gpu_op("linear_glu")(x, w, activation)
    return glu(linear(x, w, backend=backend), activation, backend=backend)


def warm_up() -> None:
    """Compile (or load from Numba's cache) the CPU kernels now rather than on first use."""
    if not HAVE_NUMBA:
        return
    x = np.zeros((2, 32), np.float32)
    linear(x, np.zeros((3, 32), np.float32))
