"""GGUF block-quantized weights on the GPU, read in place (kernels/blocks.cu): a device holds
each weight at its file size, and the kernels dequantize blocks in registers.

`GpuBlockWeight` is a `[n, k]` weight made of one or more parts stacked along the output axis
(a fused Q/K/V or gate/up projection whose parts may have different GGUF types), each part the
file's raw bytes `[n_i, row_bytes_i]` copied to the device unchanged. `kvshare.ops.gpu.linear`
and `kvshare.ops.gpu.embedding` dispatch on it to `linear` and `embedding` here:

- linear, x with m <= 16 rows (decode, small batches): per part, `bmv_<type>_m<M>` (M the
  smallest of 1, 4, 16 >= m) writes the part's columns of y directly (bias added there):
  one warp per 2 (M = 1) or 4 output rows, each weight block read once for all m rows,
  float32 accumulation. `linear_add` (y += x @ w.T + bias: a projection added into the
  residual stream) is the same launch with the accumulate flag; `linear_glu` (a gate|up
  weight of two parts of one type) is one `bmvglu_<type>_m<M>` launch that writes
  act(gate) * up, the [m, 2 n_ff] products never stored.
- linear, m > 16 (prefill): x is converted to row-scaled f16 as for f16 weights
  (`f32_to_f16_rowscaled`), then each part is dequantized tile by tile (`bdq_<type>`, at most
  `DEQUANT_TILE_ELEMS` weights per tile, 64 MB of f16 scratch) and multiplied by cuBLAS
  (`cublasGemmEx`, f16 x f16 -> float32) straight into its column slice of y; one
  `rowscale_bias_f32` pass at the end. Same numerics as an f16 weight (the dequantized value
  rounded to f16), without keeping the f16 copy.
- embedding (one part): `bemb_<type>` dequantizes the selected rows to float32, exactly the
  values of ggml's dequantize_row_* (gguf.quants.dequantize), times `scale`.

Types (GGML type ids): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS, and the plain F32, F16, BF16 (so a fused weight may mix them, and bf16 works on the
GPU this way). Nothing GPU-related is imported before first use.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np
from gguf import GGMLQuantizationType as Q

from kvshare.backend import cupy_module
from kvshare.ops import gpu_mmvq
from kvshare.ops import gpu_runtime as rt
from kvshare.ops.gpu_runtime import ELEMWISE_THREADS, ROWS_PER_BLOCK

# GGML type id -> (kernel name suffix, elements per block, bytes per block)
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    int(Q.Q4_0): ("q4_0", 32, 18),
    int(Q.Q4_1): ("q4_1", 32, 20),
    int(Q.Q5_0): ("q5_0", 32, 22),
    int(Q.Q5_1): ("q5_1", 32, 24),
    int(Q.Q8_0): ("q8_0", 32, 34),
    int(Q.Q2_K): ("q2_k", 256, 84),
    int(Q.Q3_K): ("q3_k", 256, 110),
    int(Q.Q4_K): ("q4_k", 256, 144),
    int(Q.Q5_K): ("q5_k", 256, 176),
    int(Q.Q6_K): ("q6_k", 256, 210),
    int(Q.IQ4_NL): ("iq4_nl", 32, 18),
    int(Q.IQ4_XS): ("iq4_xs", 256, 136),
    int(Q.F32): ("f32", 8, 32),
    int(Q.F16): ("f16", 8, 16),
    int(Q.BF16): ("bf16", 8, 16),
}
BMV_M = (1, 4, 16)  # row counts of the mat-vec kernels (bmv_<type>_m<M>)
BMV_MAX_M = BMV_M[-1]  # rows of one mat-vec launch
# Rows up to which `linear` takes the mat-vec kernels (in launches of at most BMV_MAX_M rows,
# each reading the weight once) rather than dequantized f16 tiles + cuBLAS (which writes and
# reads an f16 copy of every tile): $KVSHARE_GPU_MATVEC_MAX_ROWS, default BMV_MAX_M. Which
# side of, e.g., a 32-sequence decode step is faster is a device measurement
# (bench/gpu_bench.py --matvec-max-rows).
MATVEC_ROWS_ENV = "KVSHARE_GPU_MATVEC_MAX_ROWS"
BMV_WARPS = 4  # blocks.cu's BK_MV_WARPS: bmv's 128-thread CTAs, the warps splitting each row
BMV_ROWS_PER_CTA = {1: 2, 4: 4, 16: 4}  # blocks.cu's BkRows<M, 1>::R (output rows per CTA)
BMVGLU_ROWS_PER_CTA = 2  # BkRows<M, 2>::R: gate rows per CTA of bmvglu (and as many up rows)
BMV_BIAS, BMV_ACCUMULATE = 1, 2  # bmv's flags word (blocks.cu)
# ops.activation.glu's names -> blocks.cu's bk_act codes
GLU_ACT = {"silu": 0, "gelu_tanh": 1}
DEQUANT_TILE_ELEMS = 1 << 25  # weights per dequantized f16 tile (64 MB of scratch)

# Every kernel of blocks.cu that this module launches (kvshare.ops.gpu.ENTRY_POINTS["blocks"]).
ENTRY_POINTS: tuple[str, ...] = tuple(
    e for tag, _, _ in BLOCK_TYPES.values()
    for e in (*(f"bmv_{tag}_m{m}" for m in BMV_M), *(f"bmvglu_{tag}_m{m}" for m in BMV_M),
              f"bdq_{tag}", f"bemb_{tag}"))
rt.declare_entry_points("blocks", ENTRY_POINTS)
# large batches convert x and scale y back as an f16 weight's linear does (kernels/linear.cu)
rt.declare_entry_points("linear", ("f32_to_f16_rowscaled", "rowscale_bias_f32"))


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of `k` elements of GGML type `qtype` (ValueError if unsupported or
    if k is not a whole number of blocks)."""
    try:
        _, qk, size = BLOCK_TYPES[int(qtype)]
    except KeyError:
        raise ValueError(f"GGML type {qtype} is not supported by the GPU block kernels "
                         f"(have {sorted(BLOCK_TYPES)})") from None
    if k <= 0 or k % qk:
        raise ValueError(f"row length {k} is not a positive multiple of the block size {qk} "
                         f"of GGML type {qtype}")
    return k // qk * size


def supports(qtype: int, k: int) -> bool:
    """Whether rows of `k` elements of GGML type `qtype` can be a `GpuBlockWeight` part."""
    t = BLOCK_TYPES.get(int(qtype))
    return t is not None and k > 0 and k % t[1] == 0


class BlockPart:
    """One part of a `GpuBlockWeight`: `data` (device uint8 `[n, row_bytes]`, the file's
    bytes), `qtype` (GGML type id), `n` rows of `k` elements, `col0` its first output row in
    the stacked weight."""

    __slots__ = ("data", "qtype", "n", "k", "row_bytes", "col0", "tag")

    def __init__(self, data: Any, qtype: int, n: int, k: int, col0: int):
        self.data, self.qtype, self.n, self.k, self.col0 = data, int(qtype), n, k, col0
        self.row_bytes = row_bytes(qtype, k)
        self.tag = BLOCK_TYPES[self.qtype][0]

    def __repr__(self) -> str:
        return f"BlockPart({self.tag}, n={self.n}, k={self.k}, col0={self.col0})"


class GpuBlockWeight:
    """A `[n, k]` weight on the GPU kept as GGUF blocks: parts stacked along the output axis
    (rows), each with its own GGML type. Quacks like a 2-D float32 weight where the model
    needs it: `shape`, `ndim` (2), `dtype` (float32: what it computes in), `nbytes` (device
    bytes held). Built with `from_parts`."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, parts: list[BlockPart]):
        if not parts:
            raise ValueError("a GpuBlockWeight needs at least one part")
        k = parts[0].k
        col0 = 0
        for p in parts:
            if p.k != k:
                raise ValueError(f"parts have different row lengths ({p.k} != {k})")
            if p.col0 != col0:
                raise ValueError("parts must be stacked in order")
            col0 += p.n
        self.parts: tuple[BlockPart, ...] = tuple(parts)
        self._shape = (col0, k)

    @classmethod
    def from_parts(cls, parts: Iterable[tuple[Any, int, int]], backend: Any = None
                   ) -> "GpuBlockWeight":
        """Stack `parts`, each `(raw, ggml_type_id, k)`: `raw` the tensor's bytes as stored in
        the GGUF file (a uint8 `[n, row_bytes]` array, or any array whose bytes are the rows:
        flat uint8, float16 `[n, k]`, ...), copied to the device unchanged. `backend`: the
        CUDA `Backend` (its device; None: CuPy's current device)."""
        cp = cupy_module()
        built, col0 = [], 0
        for raw, qtype, k in parts:
            k = int(k)
            rb = row_bytes(qtype, k)
            if isinstance(raw, cp.ndarray):
                b = cp.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            else:
                b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            if b.size == 0 or b.size % rb:
                raise ValueError(f"{b.size} bytes are not whole rows of {rb} bytes "
                                 f"(GGML type {qtype}, k={k})")
            if getattr(raw, "ndim", 1) == 2 and raw.dtype == np.uint8 and raw.shape[1] != rb:
                raise ValueError(f"raw rows of {raw.shape[1]} bytes, GGML type {qtype} with "
                                 f"k={k} has {rb}")
            n = b.size // rb
            b = b.reshape(n, rb)
            if isinstance(b, cp.ndarray):
                # the kernels' 16/32-bit loads assume the rows start on a 16-byte boundary
                d = b if b.data.ptr % 16 == 0 else cp.array(b)
            elif backend is not None and getattr(backend, "is_gpu", False):
                d = backend.asarray(b)
            else:
                d = cp.asarray(b)
            built.append(BlockPart(d, qtype, n, k, col0))
            col0 += n
        return cls(built)

    @classmethod
    def from_gguf(cls, gf: Any, names: list[str], backend: Any = None
                  ) -> "GpuBlockWeight | None":
        """Tensors `names` of a `GGUFFile` (2-D, stacked along the output axis in this order)
        straight from the file's bytes (`gf.raw(name)`), or None when one is missing, not 2-D
        or of a type / row length the kernels do not take (the caller then loads it another
        way). Consecutive tensors of one type become one part (their rows are whole blocks of
        the same format, so the stacked bytes are a valid part): a decode step then launches
        one mat-vec for them (Q and K of a Q4_K_M file, gate and up) instead of one each."""
        parts: list[tuple[Any, int, int]] = []
        for name in names:
            info = gf.tensors.get(name)
            if info is None or len(info.shape) != 2:
                return None
            k = int(info.shape[0])  # GGUF order: the row length first
            qtype = int(info.qtype)
            if not supports(qtype, k):
                return None
            raw = gf.raw(name)
            if parts and parts[-1][1:] == (qtype, k):
                parts[-1] = (np.concatenate([parts[-1][0], raw]), qtype, k)
            else:
                parts.append((raw, qtype, k))
        return cls.from_parts(parts, backend) if parts else None

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def nbytes(self) -> int:
        return sum(int(p.data.nbytes) for p in self.parts)

    @property
    def qtypes(self) -> tuple[int, ...]:
        return tuple(p.qtype for p in self.parts)

    def __repr__(self) -> str:
        return f"GpuBlockWeight(shape={self.shape}, parts={list(self.parts)})"

    def kernel_parts(self) -> set[tuple[str, str]]:
        """The kernel units (`kvshare.kernels.parts`) its products launch: blocks.cu's part of
        each part's type and, with `KVSHARE_GPU_MATVEC=q8`, mmvq.cu's (and its quantizer's)."""
        units = {("blocks", p.tag) for p in self.parts}
        if gpu_mmvq.matvec_design() == "q8":
            units |= {("mmvq", gpu_mmvq.MMVQ_TYPES[p.qtype]) for p in self.parts
                      if gpu_mmvq.supports(p)}
            units.add(("mmvq", ""))
        return units

    def dequantize_f16(self, r0: int = 0, r1: int | None = None) -> Any:
        """Rows `[r0, r1)` as a new f16 CuPy array `[r1 - r0, k]` (the values bdq_ gives
        the large-batch GEMM)."""
        cp = cupy_module()
        r1 = self.shape[0] if r1 is None else int(r1)
        r0 = int(r0)
        if not 0 <= r0 <= r1 <= self.shape[0]:
            raise IndexError(f"rows [{r0}, {r1}) of a weight with {self.shape[0]} rows")
        out = cp.empty((r1 - r0, self.shape[1]), np.float16)
        for p in self.parts:
            a, b = max(r0, p.col0), min(r1, p.col0 + p.n)
            if a < b:
                _dequant_rows(p, a - p.col0, b - a, out[a - r0 : b - r0])
        return out


def _dequant_rows(p: BlockPart, r0: int, n: int, out: Any) -> None:
    """f16 rows [r0, r0 + n) of part p into `out` (C-contiguous f16 [n, k])."""
    rt.kernel("blocks", f"bdq_{p.tag}")(
        rt.grid(n * (p.k // 8)), (ELEMWISE_THREADS, 1, 1),
        (p.data, np.int64(p.row_bytes), np.int64(r0), np.int64(n), np.int32(p.k), out))


def _aligned_rows(x: Any) -> Any:
    """x (float32 rows, unit column stride) itself when its rows can be read as float4 (base
    16-byte aligned, row stride a multiple of 4 floats), else an aligned contiguous copy."""
    cp = cupy_module()
    if (x.data.ptr % 16 == 0 and (x.shape[0] <= 1 or x.strides[0] % 16 == 0)
            and (x.shape[1] <= 1 or x.strides[1] == 4)):
        return x
    return cp.array(x, dtype=np.float32)


def matvec_max_rows() -> int:
    """$KVSHARE_GPU_MATVEC_MAX_ROWS (a positive multiple of BMV_MAX_M, or BMV_MAX_M)."""
    v = os.environ.get(MATVEC_ROWS_ENV, "").strip()
    if not v:
        return BMV_MAX_M
    if not v.isdigit() or int(v) < BMV_MAX_M or int(v) % BMV_MAX_M:
        raise ValueError(f"{MATVEC_ROWS_ENV}={v!r}: expected a multiple of {BMV_MAX_M}")
    return int(v)


def _row_chunks(n: int) -> list[tuple[int, int]]:
    """[r0, r1) row ranges of at most BMV_MAX_M rows covering n rows (one launch each)."""
    return [(r0, min(n, r0 + BMV_MAX_M)) for r0 in range(0, n, BMV_MAX_M)]


def _bmv_rows(x: Any) -> tuple[Any, int, int]:
    """(x as rows the mat-vec kernels can read, its row stride in elements, M: the smallest
    kernel row count >= its rows)."""
    xa = _aligned_rows(x)
    n = int(xa.shape[0])
    return xa, (rt.estrides(xa)[0] if n > 1 else int(xa.shape[1])), next(v for v in BMV_M if v >= n)


def _bmv(xa: Any, xs: int, mm: int, w: GpuBlockWeight, b: Any | None, y: Any, y_stride: int,
         flags: int) -> None:
    """One `bmv_<type>_m<mm>` launch per part of w: y's columns of the part (=, or += with
    BMV_ACCUMULATE) x @ part.T (+ bias). With `KVSHARE_GPU_MATVEC=q8` the 8-bit-activation
    kernels (`gpu_mmvq`) take the product instead where they cover its rows and types."""
    n, n_in = int(xa.shape[0]), int(xa.shape[1])
    if (n <= gpu_mmvq.MAX_M and gpu_mmvq.matvec_design() == "q8"
            and gpu_mmvq.linear(xa, w, b, out=y, accumulate=bool(flags & BMV_ACCUMULATE))
            is not None):
        return
    for p in w.parts:
        rt.kernel("blocks", f"bmv_{p.tag}_m{mm}")(
            (max(1, min(rt.MAX_GRID, -(-p.n // BMV_ROWS_PER_CTA[mm]))), 1, 1),
            (32 * BMV_WARPS, 1, 1),
            (p.data, np.int64(p.row_bytes), np.int32(p.n), np.int32(n_in), xa, np.int64(xs),
             np.int32(n), y, np.int64(y_stride), np.int64(p.col0), b if b is not None else y,
             np.int32(flags | (BMV_BIAS if b is not None else 0))))


def _check_linear(x: Any, w: GpuBlockWeight, bias: Any | None) -> tuple[Any, Any | None]:
    """x as rows and the bias on the device, checked against w's shape."""
    n_out, n_in = w.shape
    x = rt.as_rows(x)
    if int(x.shape[1]) != n_in:
        raise ValueError(f"x has {int(x.shape[1])} features, w expects {n_in}")
    b = rt.upload(bias, np.float32).reshape(-1) if bias is not None else None
    if b is not None and int(b.size) != n_out:
        raise ValueError(f"bias has {int(b.size)} elements, expected {n_out}")
    return x, b


def linear(x: Any, w: GpuBlockWeight, bias: Any | None = None, *, out: Any | None = None) -> Any:
    """`x @ w.T (+ bias)` as float32 `[N, n]` for a `GpuBlockWeight` (see the module doc);
    the contract of `kvshare.ops.gpu.linear`."""
    cp = cupy_module()
    n_out, n_in = w.shape
    x, b = _check_linear(x, w, bias)
    n = int(x.shape[0])
    if out is not None and tuple(out.shape) != (n, n_out):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(n, n_out)}")
    direct = (out is not None and isinstance(out, cp.ndarray) and out.dtype == np.float32
              and out.flags.c_contiguous)
    y = out if direct else rt.empty((n, n_out), np.float32)
    if n and n_out:
        if n <= matvec_max_rows():
            for r0, r1 in _row_chunks(n):
                xa, xs, mm = _bmv_rows(x[r0:r1])
                _bmv(xa, xs, mm, w, b, y[r0:r1], n_out, 0)
        else:
            x16 = rt.empty((n, n_in), np.float16)
            inv = rt.empty(n, np.float32)
            rt.kernel("linear", "f32_to_f16_rowscaled")(
                rt.grid(n, ROWS_PER_BLOCK), (32 * ROWS_PER_BLOCK, 1, 1),
                (x, np.int64(rt.estrides(x)[0]), x16, inv, np.int64(n), np.int32(n_in)))
            tile = max(1, min(max(p.n for p in w.parts), DEQUANT_TILE_ELEMS // n_in))
            scratch = rt.empty((tile, n_in), np.float16)
            for p in w.parts:
                for r0 in range(0, p.n, tile):
                    t = min(tile, p.n - r0)
                    w16 = scratch[:t]
                    _dequant_rows(p, r0, t, w16)
                    rt.gemm_f16(x16, w16, y, p.col0 + r0)
            rt.kernel("linear", "rowscale_bias_f32")(
                rt.grid(n * n_out), (ELEMWISE_THREADS, 1, 1),
                (y, inv, b if b is not None else inv, np.int32(b is not None), np.int64(n),
                 np.int64(n_out)))
    if out is not None and y is not out:
        out[...] = y
        return out
    return y


def linear_add(x: Any, w: GpuBlockWeight, bias: Any | None, y: Any) -> Any:
    """`y += x @ w.T (+ bias)` in place for a `GpuBlockWeight`: the contract of
    `kvshare.ops.gpu.linear_add`. Up to `matvec_max_rows()` rows of a float32 y with unit
    column stride, one `bmv` launch per part (and BMV_MAX_M rows) that adds into y (the
    residual add fused into the mat-vec); otherwise `linear`, then the add."""
    cp = cupy_module()
    n_out = w.shape[0]
    x, b = _check_linear(x, w, bias)
    n = int(x.shape[0])
    if tuple(y.shape) != (n, n_out):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {(n, n_out)}")
    if not n or not n_out:
        return y
    if (n <= matvec_max_rows() and isinstance(y, cp.ndarray) and y.dtype == np.float32
            and (n_out <= 1 or y.strides[1] == 4) and y.strides[0] % 4 == 0):
        ys = rt.estrides(y)[0] if n > 1 else n_out
        for r0, r1 in _row_chunks(n):
            xa, xs, mm = _bmv_rows(x[r0:r1])
            _bmv(xa, xs, mm, w, b, y[r0:r1], ys if r1 - r0 > 1 else n_out, BMV_ACCUMULATE)
        return y
    y += linear(x, w, b)
    return y


def glu_fuses(w: GpuBlockWeight, n: int) -> bool:
    """Whether `linear_glu` of n rows on w is `bmvglu` launches (one per BMV_MAX_M rows):
    n <= `matvec_max_rows()` and w is
    two parts (gate, up) of the same type and row count, or one part of an even row count
    (gate and up of one type stacked into one part by `from_gguf`: its halves)."""
    p = w.parts
    return 0 < n <= matvec_max_rows() and (len(p) == 2 and p[0].qtype == p[1].qtype
                                   and p[0].n == p[1].n
                                   or len(p) == 1 and p[0].n % 2 == 0)


def _gate_up(w: GpuBlockWeight) -> tuple[Any, Any, BlockPart]:
    """The device bytes of the gate rows and of the up rows of a gate|up weight that
    `glu_fuses`, and the part that describes either (type, rows, row bytes)."""
    if len(w.parts) == 2:
        g, u = w.parts
        return g.data, u.data, g
    p = w.parts[0]
    half = p.n // 2
    return p.data[:half], p.data[half:], BlockPart(p.data[:half], p.qtype, half, p.k, 0)


def linear_glu(x: Any, w: GpuBlockWeight, activation: str) -> Any:
    """`act(x @ gate.T) * (x @ up.T)` as float32 `[N, n_ff]` with w = gate|up stacked: one
    `bmvglu_<type>_m<M>` launch where `glu_fuses` (the contract of
    `kvshare.ops.gpu.linear_glu`, which composes the other cases)."""
    if activation not in GLU_ACT:
        raise ValueError(f"unknown activation {activation!r}")
    x, _ = _check_linear(x, w, None)
    n = int(x.shape[0])
    if not glu_fuses(w, n):
        raise ValueError(f"linear_glu on {n} rows of {w!r} is not one bmvglu launch")
    gate, up, g = _gate_up(w)
    out = rt.empty((n, g.n), np.float32)
    for r0, r1 in _row_chunks(n):
        xa, xs, mm = _bmv_rows(x[r0:r1])
        rt.kernel("blocks", f"bmvglu_{g.tag}_m{mm}")(
            (max(1, min(rt.MAX_GRID, -(-g.n // BMVGLU_ROWS_PER_CTA))), 1, 1),
            (32 * BMV_WARPS, 1, 1),
            (gate, up, np.int64(g.row_bytes), np.int32(g.n), np.int32(g.k), xa, np.int64(xs),
             np.int32(r1 - r0), out[r0:r1], np.int64(g.n), np.int32(GLU_ACT[activation])))
    return out


def embedding(table: GpuBlockWeight, tokens: Any, scale: float = 1.0) -> Any:
    """Rows `table[tokens] * scale` as float32 `[N, k]` for a one-part `GpuBlockWeight`: the
    contract of `kvshare.ops.gpu.embedding` (host ids range-checked with IndexError; a bad id
    already on the device gives a NaN row)."""
    if len(table.parts) != 1:
        raise ValueError("an embedding table must be a one-part GpuBlockWeight")
    p = table.parts[0]
    vocab, d = table.shape
    if not rt.is_device(tokens):
        ht = np.asarray(tokens).reshape(-1)
        if ht.size and (ht.min() < 0 or ht.max() >= vocab):
            raise IndexError(f"token id out of range [0, {vocab})")
    tok = rt.upload(tokens, np.int32).reshape(-1)
    n = int(tok.size)
    out = rt.empty((n, d), np.float32)
    if n:
        rt.kernel("blocks", f"bemb_{p.tag}")(
            rt.grid(n * (d // 8)), (ELEMWISE_THREADS, 1, 1),
            (p.data, np.int64(p.row_bytes), np.int32(vocab), np.int32(d), tok, np.int32(n),
             np.float32(scale), out))
    return out
