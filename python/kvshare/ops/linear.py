"""Matrix products with weights stored `[out, in]` (GGUF's row-major layout), and the CPU's
small-batch and quantized paths.

CPU paths of `linear(x, w)`:
- `w` an f32 ndarray, N = x.shape[0] rows: OpenBLAS `x @ w.T`, except 2 <= N <= 8 where a
  Numba kernel reads each weight row once for all N inputs (OpenBLAS's small-M sgemm packs
  the weights on every call and runs at a fraction of memory bandwidth; this is what makes a
  decode step of 4 sequences cost about as much as one).
- `w` a `Q8Weight` (a Q8_0 tensor kept quantized: int8 values + one f32 scale per 32): a
  Numba kernel for N <= 16 (reads 1.06 bytes per weight instead of 4: the 262K x 640 output
  head of Gemma is 178 MB instead of 671 MB), tiles dequantized to f32 + OpenBLAS otherwise.
  The values are exactly the f32 dequantization, so both paths agree to float rounding.
Numba is optional: without it f32 weights use OpenBLAS for every N and the loader keeps no
`Q8Weight`s.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvshare.backend import CPU, Backend
from kvshare.ops._dispatch import gpu_op

try:  # pragma: no cover - exercised when numba is installed
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

# Numba's workqueue threading layer aborts on concurrent parallel launches from two Python
# threads; kernels are serialised (the cores are shared anyway).
_LOCK = threading.Lock()
SMALL_M_MAX = 8  # f32 weights: Numba kernel for 2 <= N <= SMALL_M_MAX
Q8_KERNEL_MAX = 16  # Q8Weight: Numba kernel for N <= Q8_KERNEL_MAX
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

    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
    def _mm_q8(x, qs, d, out):  # out[m, n] = sum_k x[m, k] qs[n, k] d[n, k // 32]
        # 32 partial sums, one per lane of a block, scaled per block on the x side: this
        # keeps the int8 -> f32 conversion and the FMAs vectorised (a per-block scalar
        # reduction costs a horizontal add per 32 weights and runs ~3x slower)
        M, K = x.shape
        N = qs.shape[0]
        nb = K // 32
        ntile = (N + _TILE - 1) // _TILE
        for t in prange(ntile):
            part = np.empty(32, np.float32)
            for n in range(t * _TILE, min(N, (t + 1) * _TILE)):
                for m in range(M):
                    for j in range(32):
                        part[j] = 0.0
                    for b in range(nb):
                        db = d[n, b]
                        for j in range(32):
                            part[j] += np.float32(qs[n, b * 32 + j]) * (x[m, b * 32 + j] * db)
                    acc = np.float32(0.0)
                    for j in range(32):
                        acc += part[j]
                    out[m, n] = acc


class Q8Weight:
    """A `[out, in]` weight held as Q8_0: `qs` int8 `[out, in]` and `d` f32 `[out, in // 32]`
    (value = qs * d of its 32-block). Used on the CPU for the output head / tied embeddings."""

    ndim = 2
    dtype = np.dtype(np.float32)  # what it computes in

    def __init__(self, qs: np.ndarray, d: np.ndarray):
        if qs.dtype != np.int8 or qs.ndim != 2 or qs.shape[1] % 32:
            raise ValueError("Q8Weight needs int8 [out, in] with in % 32 == 0")
        self.qs = np.ascontiguousarray(qs)
        self.d = np.ascontiguousarray(d, dtype=np.float32).reshape(qs.shape[0], qs.shape[1] // 32)

    @classmethod
    def from_q8_0_bytes(cls, raw: np.ndarray, shape: tuple[int, int]) -> "Q8Weight":
        """From GGUF Q8_0 blocks (34 bytes: f16 scale, 32 int8) of a `[out, in]` tensor."""
        blocks = np.asarray(raw, np.uint8).reshape(-1, 34)
        qs = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(shape)
        d = np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32)
        return cls(qs, d.reshape(shape[0], shape[1] // 32))

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `[len(ids), in]` f32 (the embedding lookup)."""
        q = self.qs[ids].reshape(len(ids), -1, 32)
        return (q * self.d[ids][:, :, None]).reshape(len(ids), -1)

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.shape[0] if stop is None else stop
        q = self.qs[start:stop].reshape(stop - start, -1, 32)
        return (q * self.d[start:stop][:, :, None]).reshape(stop - start, -1)

    def matmul_t(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`x @ self.T` for x f32 `[M, in]` -> `[M, out]`."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        M = x.shape[0]
        N = self.shape[0]
        if out is None:
            out = np.empty((M, N), np.float32)
        if HAVE_NUMBA and M <= Q8_KERNEL_MAX:
            with _LOCK:
                _mm_q8(x, self.qs, self.d, out)
            return out
        tile = 8192
        for s in range(0, N, tile):
            e = min(N, s + tile)
            np.matmul(x, self.dequantize(s, e).T, out=out[:, s:e])
        return out


def linear(x: Any, w: Any, bias: Any | None = None, *, backend: Backend = CPU,
           out: Any | None = None) -> Any:
    """`x @ w.T (+ bias)`. x: float32 `[N, in]` (row stride may exceed `in`); w: `[out, in]`
    (f32 ndarray or `Q8Weight` on the CPU; f16/bf16 on the GPU, accumulated in f32); bias:
    float32 `[out]` or None. Returns float32 `[N, out]` (into `out` when given)."""
    if backend.is_gpu:
        return gpu_op("linear")(x, w, bias, out=out)
    if isinstance(w, Q8Weight):
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


def warm_up() -> None:
    """Compile (or load from Numba's cache) the CPU kernels now rather than on first use."""
    if not HAVE_NUMBA:
        return
    x = np.zeros((2, 32), np.float32)
    linear(x, np.zeros((3, 32), np.float32))
    Q8Weight(np.zeros((3, 32), np.int8), np.zeros((3, 1), np.float32)).matmul_t(x)
