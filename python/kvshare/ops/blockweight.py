"""`BlockWeight`: a `[out, in]` weight kept in its GGUF block format (the file's bytes, e.g. a
read-only view into the mmapped GGUF), with the interface of `ops.linear.QWeight`.

A quantized layer then costs its file size in memory (Q4_K: 0.56 bytes per weight, against
~1.1-1.25 for QWeight's int8 + f32 scales), and a decode product reads that many bytes. For
x.shape[0] <= BLOCK_KERNEL_MAX rows a Rust kernel (AVX2) computes on the blocks directly:
- activations "f32" (the default): `_core.block_matmul_t_f32` unpacks each block in registers
  and multiplies it with the f32 activations, exact up to float summation order;
- activations "q8": `_core.block_matmul_t` quantizes the activations to 8 bits per 32 values
  and takes integer dot products, as ggml-cpu's `vec_dot` does (~0.5% of sum |w x| per
  product, llama.cpp's approximation). Results then depend on how a prompt was chunked.
Larger batches (prefill) with f32 activations run `_core.block_gemm_f32` where AVX-512 is
present (panels of weight rows dequantized into a cache-sized buffer, an f32 micro-kernel);
otherwise they dequantize tiles of rows into a reusable f32 buffer (`_core.block_dequantize`,
exact as ggml) and multiply them with OpenBLAS.

Fused weights (Q/K/V, gate/up) are `BlockWeight.concat` of parts whose types may differ; each
part keeps its own bytes and fills its own columns of the output.
"""
from __future__ import annotations

import os
import threading
from typing import Iterable

import numpy as np

from kvshare import _core
from kvshare.backend import CPU_THREADS
from kvshare.ops.parallel import ROWS

# Most rows of x for the block kernel (it quantizes the activations once and reads each weight
# block once per 8 rows); larger products dequantize tiles + BLAS.
BLOCK_KERNEL_MAX = 16
# f32 values per dequantized tile of the large-batch path (8 MB)
_TILE_VALUES = 1 << 21

# GGML type id -> (elements per block, bytes per block), the types the kernels take
BLOCK_TYPES: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    20: (32, 18),  # IQ4_NL
    23: (256, 136),  # IQ4_XS
    30: (1, 2),  # BF16
    39: (32, 17),  # MXFP4
}

# How the small-batch kernel treats activations: "f32" exact (`_core.block_matmul_t_f32`: a
# row's result does not depend on the batch it is computed in, so sharing a prefix changes no
# output), or "q8" quantized to 8 bits per 32 values as llama.cpp does (`block_matmul_t`:
# integer dot products; larger batches then multiply the values those 8-bit activations stand
# for, `block_act_round_trip`, but summation order still moves 8-bit rounding boundaries, so
# logits depend on chunking by ~1-3%).
#
# "vnni": 8-bit activations times the blocks in integers for every batch size, prefill
# included (`_core.block_matmul_t_vnni`, AVX512-VNNI): as fast per product as llama.cpp's
# `vec_dot` form, and a row's result is the same bits in a batch of any size or a prefill
# chunk of any shape, so sharing a prefix still changes no output. Types without a VNNI
# kernel (`_core.block_vnni_supports`) take the "f32" path.
ACTIVATIONS = ("f32", "q8", "vnni")
HAVE_F32_KERNEL = hasattr(_core, "block_matmul_t_f32")
HAVE_VNNI = hasattr(_core, "block_vnni_available") and _core.block_vnni_available()
HAVE_PARTS_KERNEL = hasattr(_core, "block_matmul_t_f32_parts")
# The prefill GEMM on the blocks (`_core.block_gemm_f32`, AVX-512): panels of weight rows are
# dequantized into an L1/L2-sized buffer and multiplied by a register-tiled f32 micro-kernel,
# each output summing its k products in order from zero (so a row's result does not depend on
# the chunk's size). Elsewhere, or with KVSHARE_BLOCK_GEMM=0, tiles are dequantized for BLAS.
USE_GEMM = (hasattr(_core, "block_gemm_available") and _core.block_gemm_available()
            and os.environ.get("KVSHARE_BLOCK_GEMM", "1") != "0")

# float weights: the kernels multiply them with f32 activations (no 8-bit quantization)
FLOAT_TYPES = frozenset({0, 1, 30})

_local = threading.local()


def _tile_buffer(n_values: int) -> np.ndarray:
    """A flat f32 scratch buffer of at least `n_values`, one per thread, shared by every
    BlockWeight (one per weight would cost 8 MB x hundreds of layers)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n_values:
        buf = np.empty(n_values, np.float32)
        _local.buf = buf
    return buf[:n_values]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of `k` values of GGML type `qtype` (ValueError if unsupported or `k`
    is not a whole number of blocks)."""
    if int(qtype) not in BLOCK_TYPES:
        raise ValueError(f"GGML type {qtype} has no block kernels")
    block, size = BLOCK_TYPES[int(qtype)]
    if k <= 0 or k % block:
        raise ValueError(f"k = {k} is not a positive multiple of the block size {block}")
    return k // block * size


class _Part:
    """Rows `[start, start + rows)` of the weight: `raw` uint8 `[rows, row_bytes]`."""

    __slots__ = ("raw", "qtype", "start", "rows")

    def __init__(self, raw: np.ndarray, qtype: int, start: int):
        self.raw = raw
        self.qtype = qtype
        self.start = start
        self.rows = raw.shape[0]


class BlockWeight:
    """`[out, in]` weight rows in GGUF block formats: `BlockWeight(raw, qtype, k)` for one
    tensor (`raw`: its bytes, uint8, any shape holding whole rows, read-only allowed, kept
    without a copy when C-contiguous), `BlockWeight.concat([...])` for fused ones."""

    ndim = 2
    dtype = np.dtype(np.float32)  # what it computes in

    def __init__(self, raw: np.ndarray, qtype: int, k: int, activations: str = "f32"):
        self._init([(raw, qtype, k)], activations)

    def _init(self, parts: list[tuple[np.ndarray, int, int]], activations: str = "f32") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        if activations == "f32" and not HAVE_F32_KERNEL:
            raise ValueError("this build has no f32-activation block kernel "
                             "(_core.block_matmul_t_f32)")
        if activations == "vnni" and not HAVE_VNNI:
            raise ValueError("activations 'vnni' need AVX512-VNNI and a build with "
                             "_core.block_matmul_t_vnni")
        self.activations = activations
        if not parts:
            raise ValueError("a BlockWeight needs at least one part")
        ks = {int(p[2]) for p in parts}
        if len(ks) != 1:
            raise ValueError(f"parts have different input sizes {sorted(ks)}")
        self.k = ks.pop()
        self.parts: list[_Part] = []
        start = 0
        for raw, qtype, k in parts:
            qtype = int(qtype)
            rb = row_bytes(qtype, k)
            if isinstance(raw, (bytes, bytearray, memoryview)):
                raw = np.frombuffer(raw, np.uint8)
            raw = np.asarray(raw)
            if raw.dtype != np.uint8:
                raise ValueError(f"raw must be uint8, got {raw.dtype}")
            if raw.size % rb:
                raise ValueError(f"{raw.size} bytes are not whole rows of {rb} bytes")
            # a copy only for strided input: views of the mapped file stay views
            raw = np.ascontiguousarray(raw).reshape(raw.size // rb, rb)
            self.parts.append(_Part(raw, qtype, start))
            start += raw.shape[0]
        self.n = start
        # with "vnni": every part has a VNNI kernel, so one call multiplies them all (the
        # fused decode layer takes only such weights); parts of a type without one take the
        # exact f32 path alone
        self.vnni_all = activations == "vnni" and all(
            _core.block_vnni_supports(p.qtype) for p in self.parts)
        self._fallback: dict[int, BlockWeight] = {}
        if activations == "vnni" and not self.vnni_all:
            for i, p in enumerate(self.parts):
                if not _core.block_vnni_supports(p.qtype):
                    self._fallback[i] = BlockWeight(p.raw, p.qtype, self.k)

    @classmethod
    def concat(cls, parts: Iterable["BlockWeight | tuple[np.ndarray, int, int]"],
               activations: str = "f32") -> "BlockWeight":
        """Stack weights along the output axis (fused Q/K/V or gate/up): each item a
        BlockWeight or a `(raw, qtype, k)` tuple; types may differ, `k` may not."""
        flat: list[tuple[np.ndarray, int, int]] = []
        for p in parts:
            if isinstance(p, BlockWeight):
                flat.extend((q.raw, q.qtype, p.k) for q in p.parts)
            else:
                raw, qtype, k = p
                flat.append((raw, qtype, k))
        w = cls.__new__(cls)
        w._init(flat, activations)  # noqa: SLF001 - the class initialising its own new instance
        return w

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what a product reads; mapped pages count once resident)."""
        return sum(p.raw.nbytes for p in self.parts)

    @property
    def qtypes(self) -> list[int]:
        return [p.qtype for p in self.parts]

    def __repr__(self) -> str:
        return f"BlockWeight(shape={self.shape}, qtypes={self.qtypes})"

    def _dequantize_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows `[start, stop)` into `out` (C-contiguous f32 `[stop - start, k]`)."""
        threads = CPU_THREADS.kernel_threads
        for p in self.parts:
            a, b = max(start, p.start), min(stop, p.start + p.rows)
            if a < b:
                _core.block_dequantize(p.raw[a - p.start : b - p.start], p.qtype, self.k,
                                       out[a - start : b - start], threads)

    def dequantize(self, start: int = 0, stop: int | None = None, ids=None) -> np.ndarray:
        """Rows `[start, stop)` (or rows `ids`) as f32 `[rows, in]`, exactly as ggml
        dequantizes them."""
        if ids is not None:
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < -self.n or ids.max() >= self.n):
                raise IndexError(f"row ids out of range for {self.n} rows")
            ids = np.where(ids < 0, ids + self.n, ids)
            out = np.empty((ids.size, self.k), np.float32)
            threads = CPU_THREADS.kernel_threads
            for p in self.parts:
                sel = np.nonzero((ids >= p.start) & (ids < p.start + p.rows))[0]
                if sel.size:
                    rows = np.ascontiguousarray(p.raw[ids[sel] - p.start])
                    tmp = np.empty((sel.size, self.k), np.float32)
                    _core.block_dequantize(rows, p.qtype, self.k, tmp, threads)
                    out[sel] = tmp
            return out
        start, stop, _ = slice(start, stop).indices(self.n)
        out = np.empty((max(0, stop - start), self.k), np.float32)
        self._dequantize_into(start, stop, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `[len(ids), in]` f32 (the embedding lookup)."""
        if len(self.parts) == 1 and len(ids) == 1 and 0 <= int(ids[0]) < self.n:
            # a decode step's token: `dequantize(ids=...)`'s checks and selection are most of
            # its cost
            p = self.parts[0]
            out = np.empty((1, self.k), np.float32)
            _core.block_dequantize(p.raw[ids], p.qtype, self.k, out, 1)
            return out
        return self.dequantize(ids=ids)

    def _kernel(self, x, raw, qtype, out, threads) -> None:
        if self.activations == "f32":
            _core.block_matmul_t_f32(x, raw, qtype, out, threads)
        else:
            _core.block_matmul_t(x, raw, qtype, out, threads)

    def matmul_t(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`x @ self.T` for x f32 `[M, in]` -> `[M, out]` (into `out` when given)."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be [M, {self.k}], got shape {x.shape}")
        M, N = x.shape[0], self.n
        if out is None:
            out = np.empty((M, N), np.float32)
        elif out.shape != (M, N):
            raise ValueError(f"out must be ({M}, {N}), got {out.shape}")
        if M == 0:
            return out
        if self.activations == "vnni":
            return self._matmul_vnni(x, out)
        if M <= BLOCK_KERNEL_MAX:
            return self._matmul_blocks(x, out)
        # with "q8" the block kernel multiplies 8-bit activations: here BLAS multiplies the
        # values they stand for, so both paths compute the same products
        xq = x
        if self.activations == "q8" and any(p.qtype not in FLOAT_TYPES for p in self.parts):
            xq = np.array(x, dtype=np.float32, order="C", copy=True)
            _core.block_act_round_trip(xq)
        if USE_GEMM and self.activations == "f32":
            return self._matmul_gemm(x, out)
        return self._matmul_tiles(x, xq, out)

    def _matmul_blocks(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`matmul_t` of a few rows (at most BLOCK_KERNEL_MAX): the block kernels."""
        M = x.shape[0]
        x = np.ascontiguousarray(x, dtype=np.float32)
        threads = CPU_THREADS.kernel_threads
        direct = out.flags.c_contiguous and out.dtype == np.float32
        if len(self.parts) == 1 and direct:
            p = self.parts[0]
            self._kernel(x, p.raw, p.qtype, out, threads)
            return out
        if direct and self.activations == "f32" and HAVE_PARTS_KERNEL:
            # fused Q/K/V, gate/up: all parts in one call (one hand-off to the kernel
            # threads, rows split by bytes across parts, no per-part copies)
            _core.block_matmul_t_f32_parts(x, [p.raw for p in self.parts],
                                           [p.qtype for p in self.parts], out, threads)
            return out
        for p in self.parts:
            tmp = np.empty((M, p.rows), np.float32)
            self._kernel(x, p.raw, p.qtype, tmp, threads)
            out[:, p.start : p.start + p.rows] = tmp
        return out

    def _matmul_gemm(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`matmul_t` of many rows with f32 activations: the blocked GEMM kernel per part
        (float parts: NumPy's matmul of the dequantized rows)."""
        M, N = x.shape[0], self.n
        # inside a row-parallel part the other parts hold the other cores
        threads = 1 if ROWS.inside() else CPU_THREADS.kernel_threads
        x = np.ascontiguousarray(x, dtype=np.float32)
        direct = out.flags.c_contiguous and out.dtype == np.float32
        dst = out if direct else np.empty((M, N), np.float32)
        for p in self.parts:
            if p.qtype in FLOAT_TYPES:
                np.matmul(x, self.dequantize(p.start, p.start + p.rows).T,
                          out=dst[:, p.start : p.start + p.rows])
            else:
                _core.block_gemm_f32(x, p.raw, p.qtype, dst, p.start, threads)
        if not direct:
            out[...] = dst
        return out

    def _matmul_tiles(self, x: np.ndarray, xq: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`matmul_t` of many rows through BLAS: tiles of dequantized rows times `x` (times
        `xq`, the activations as the block kernel rounds them, for quantized parts)."""
        N = self.n
        tile = max(32, min(N, _TILE_VALUES // self.k))
        buf = _tile_buffer(min(tile, N) * self.k)
        for p in self.parts:
            xs = x if p.qtype in FLOAT_TYPES else xq
            for s in range(p.start, p.start + p.rows, tile):
                e = min(p.start + p.rows, s + tile)
                w = buf[: (e - s) * self.k].reshape(e - s, self.k)
                self._dequantize_into(s, e, w)
                np.matmul(xs, w.T, out=out[:, s:e])
        return out

    def _matmul_vnni(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`matmul_t` with activations "vnni" (any number of rows)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        M = x.shape[0]
        # inside a row-parallel part (prefill) the other parts hold the other cores
        threads = (1 if M > BLOCK_KERNEL_MAX and ROWS.inside()
                   else CPU_THREADS.kernel_threads)
        direct = out.flags.c_contiguous and out.dtype == np.float32
        if self.vnni_all and direct:
            _core.block_matmul_t_vnni(x, [p.raw for p in self.parts],
                                      [p.qtype for p in self.parts], out, threads)
            return out
        for i, p in enumerate(self.parts):
            fb = self._fallback.get(i)
            if fb is not None:
                tmp = fb.matmul_t(x)
            else:
                tmp = np.empty((M, p.rows), np.float32)
                _core.block_matmul_t_vnni(x, [p.raw], [p.qtype], tmp, threads)
            out[:, p.start : p.start + p.rows] = tmp
        return out
