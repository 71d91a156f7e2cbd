"""Decode mat-vec of GGUF block weights on 8-bit activations (kernels/mmvq.cu): llama.cpp's
mmvq design, the alternative to `gpu_blocks`' f32-activation `bmv` for x with m <= 8 rows.

`linear(x, w)` quantizes x on the device to ggml's block_q8_1 (`quantize_q8_1`: per 32
elements an f16 scale d = amax / 127, the f16 sum s of the inputs and 32 int8 values; rows
padded with zeros to a multiple of `ROW_PAD` elements, as llama.cpp pads them), then runs
`mmvq_<type>_m<M>` per part of the `GpuBlockWeight` (M the smallest of `MMVQ_M` >= m): the
weight quants are read as 32-bit words and multiplied with the int8 activations by `__dp4a`,
the block scales applied in float32. Launch as llama.cpp picks it for Ampere and Hopper
(`MMVQ_WARPS`, `MMVQ_ROWS_PER_CTA`).

Numerics: the activations are rounded to 8 bits per 32-element block (relative to the block's
largest magnitude: at most amax / 254 per element, plus the f16 rounding of d), so results
differ from bmv's float32 products by that rounding; the types with an offset or a min
(Q4_0, Q5_0, Q4_1, Q5_1) apply it through s, rounded to f16.

Which design a model's block weights use is `KVSHARE_GPU_MATVEC` (`matvec_design()`): `f32`
(default, `bmv`) or `q8` (this module); `gpu_blocks.linear` asks `linear` here first when it
is `q8` and falls back to `bmv` where this returns None. Allocation goes through
`gpu_runtime.empty`, so a call inside a CUDA-graph capture takes its scratch from the
workspace. Nothing GPU-related is imported before first use.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from kvshare.backend import cupy_module
from kvshare.ops import gpu_runtime as rt

# GGML type id -> kernel name suffix (the types mmvq.cu has a vec_dot for)
MMVQ_TYPES: dict[int, str] = {
    int(Q.Q4_0): "q4_0", int(Q.Q4_1): "q4_1", int(Q.Q5_0): "q5_0", int(Q.Q5_1): "q5_1",
    int(Q.Q8_0): "q8_0", int(Q.Q2_K): "q2_k", int(Q.Q3_K): "q3_k", int(Q.Q4_K): "q4_k",
    int(Q.Q5_K): "q5_k", int(Q.Q6_K): "q6_k", int(Q.IQ4_NL): "iq4_nl", int(Q.IQ4_XS): "iq4_xs",
}
MMVQ_M = (1, 2, 4, 8)  # activation rows of the kernels (llama.cpp's ncols_dst up to 8)
MAX_M = MMVQ_M[-1]
MMVQ_WARPS = {1: 4, 2: 4, 4: 4, 8: 2}  # mmvq.cu's MqLaunch<M>::NW (128- or 64-thread CTAs)
MMVQ_ROWS_PER_CTA = {1: 1, 2: 2, 4: 2, 8: 2}  # MqLaunch<M>::RPB
Q8_1_BLOCK = 32  # activations per block_q8_1
Q8_1_BYTES = 36  # sizeof(block_q8_1): f16 d, f16 s, int8 qs[32]
ROW_PAD = 512  # llama.cpp's MATRIX_ROW_PADDING: q8_1 rows hold a multiple of this many values
QUANTIZE_THREADS = 256  # quantize_q8_1's CTA (llama.cpp's CUDA_QUANTIZE_BLOCK_SIZE)
MAX_GRID_Y = 65535

ENTRY_POINTS: tuple[str, ...] = ("quantize_q8_1", *(
    f"mmvq_{tag}_m{mm}" for tag in MMVQ_TYPES.values() for mm in MMVQ_M))
rt.declare_entry_points("mmvq", ENTRY_POINTS)

MATVEC_ENV = "KVSHARE_GPU_MATVEC"
MATVEC_DESIGNS = ("f32", "q8")


def matvec_design() -> str:
    """The decode mat-vec design of block weights, from `KVSHARE_GPU_MATVEC`: `f32` (the
    default: `bmv` on float32 activations) or `q8` (this module). ValueError otherwise."""
    v = os.environ.get(MATVEC_ENV, "f32").strip().lower() or "f32"
    if v not in MATVEC_DESIGNS:
        raise ValueError(f"{MATVEC_ENV}={v!r}: expected one of {', '.join(MATVEC_DESIGNS)}")
    return v


def supports(part: Any) -> bool:
    """Whether a `gpu_blocks.BlockPart` has an mmvq kernel (its GGML type; every row length
    of a part is whole blocks, which is all the kernels need)."""
    return int(part.qtype) in MMVQ_TYPES


def padded_k(k: int) -> int:
    """Values per q8_1 row for rows of k elements (k rounded up to a multiple of ROW_PAD)."""
    return -(-int(k) // ROW_PAD) * ROW_PAD


def quantize_q8_1(x: Any) -> Any:
    """float32 rows `x` `[m, k]` (device, unit column stride; any row stride) as block_q8_1
    rows: uint8 `[m, padded_k(k) / 32 * 36]`, from `gpu_runtime.empty` (so it works inside a
    CUDA-graph capture)."""
    if x.ndim != 2 or x.dtype != np.float32 or (x.shape[1] > 1 and x.strides[1] != 4):
        raise ValueError("quantize_q8_1 takes float32 rows with unit column stride")
    m, k = int(x.shape[0]), int(x.shape[1])
    if m > MAX_GRID_Y:
        raise ValueError(f"quantize_q8_1 takes at most {MAX_GRID_Y} rows, got {m}")
    kp = padded_k(k)
    xq = rt.empty((m, kp // Q8_1_BLOCK * Q8_1_BYTES), np.uint8)
    if m and k:
        xs = rt.estrides(x)[0] if m > 1 else k
        rt.kernel("mmvq", "quantize_q8_1")(
            (kp // QUANTIZE_THREADS, m, 1), (QUANTIZE_THREADS, 1, 1),
            (x, np.int64(xs), np.int32(k), np.int32(kp), xq, np.int64(xq.shape[1])))
    return xq


def _rows_f32(x: Any) -> Any:
    """x as 2-D float32 rows with unit column stride: x itself when it is one, else a copy
    into `gpu_runtime.empty` (an in-place copy, allowed during a capture)."""
    cp = cupy_module()
    if not isinstance(x, cp.ndarray):
        x = rt.upload(x, np.float32)
    if x.ndim != 2:
        x = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    if x.dtype == np.float32 and (x.shape[1] <= 1 or x.strides[1] == 4) and x.strides[0] % 4 == 0:
        return x
    c = rt.empty(x.shape, np.float32)
    c[...] = x
    return c


def linear(x: Any, w: Any, bias: Any | None = None, *, out: Any | None = None,
           accumulate: bool = False) -> Any | None:
    """`x @ w.T (+ bias)` for a `gpu_blocks.GpuBlockWeight` `w` on 8-bit activations, as
    float32 `[m, n]`; None (nothing launched) when x has more than `MAX_M` rows or a part's
    type has no mmvq kernel (the caller then takes `bmv`).

    `out`: a float32 device array `[m, n]` with unit column stride (any row stride) to write
    into, returned; `accumulate=True` adds into `out` (y += x @ w.T + bias; needs `out`)."""
    n_out, n_in = w.shape
    if not all(supports(p) for p in w.parts):
        return None
    x = _rows_f32(x)
    m = int(x.shape[0])
    if m > MAX_M:
        return None
    if int(x.shape[1]) != n_in:
        raise ValueError(f"x has {int(x.shape[1])} features, w expects {n_in}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out")
    if out is not None:
        if tuple(out.shape) != (m, n_out):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {(m, n_out)}")
        if (not isinstance(out, cupy_module().ndarray) or out.dtype != np.float32
                or (n_out > 1 and out.strides[1] != 4) or out.strides[0] % 4):
            raise ValueError("out must be a float32 device array with unit column stride")
        y = out
    else:
        y = rt.empty((m, n_out), np.float32)
    b = rt.upload(bias, np.float32).reshape(-1) if bias is not None else None
    if b is not None and int(b.size) != n_out:
        raise ValueError(f"bias has {int(b.size)} elements, expected {n_out}")
    if m == 0 or n_out == 0:
        return y
    xq = quantize_q8_1(x)
    mm = next(v for v in MMVQ_M if v >= m)
    ys = rt.estrides(y)[0] if m > 1 else n_out
    flags = (1 if b is not None else 0) | (2 if accumulate else 0)
    rpc = MMVQ_ROWS_PER_CTA[mm]
    for p in w.parts:
        rt.kernel("mmvq", f"mmvq_{MMVQ_TYPES[p.qtype]}_m{mm}")(
            (max(1, min(rt.MAX_GRID, -(-p.n // rpc))), 1, 1), (32 * MMVQ_WARPS[mm], 1, 1),
            (p.data, np.int64(p.row_bytes), np.int32(p.n), np.int32(n_in), xq,
             np.int64(xq.shape[1]), np.int32(m), y, np.int64(ys), np.int64(p.col0),
             b if b is not None else y, np.int32(flags)))
    return y
