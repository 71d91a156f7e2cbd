"""q8_0 KV rows: ggml's Q8_0 blocks, the format llama.cpp's `-ctk q8_0 -ctv q8_0` caches hold.

A row of `head_dim` values (one token's K or V of one KV head) is `head_dim / 32` blocks of 34
bytes: an f16 scale `d` (little-endian) then 32 int8 `qs`; value j is `d * qs[j]`. A q8_0 pool
is a uint8 array whose last axis is that row (`row_bytes(head_dim)`), so every block move of
the engine and the tiers is a byte copy.

Writing quantizes as ggml's `quantize_row_q8_0_ref` does: `d = amax / 127`, `q = roundf(x *
(1 / d))` (halves away from zero; 0 when d is 0), `d` stored as the nearest f16 (`quantize`:
the Rust kernel `_core.quantize_q8_0`; `quantize_ref`: the NumPy twin, equal bit for bit).
Reading dequantizes exactly (`d * q` is exact in f32): `dequantize`, the NumPy attention path's
and the tests' reader; the compiled attention kernel reads the blocks from the pool itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare import _core

VALS = 32  # values per block
BYTES = 34  # bytes per block: f16 scale + 32 int8


def row_bytes(head_dim: int) -> int:
    """Bytes of a q8_0 row of `head_dim` values (ValueError unless a multiple of 32)."""
    if head_dim % VALS:
        raise ValueError(f"q8_0 KV needs head_dim to be a multiple of {VALS}, not {head_dim}")
    return head_dim // VALS * BYTES


def head_dim_of(nbytes: int) -> int:
    """Values of a q8_0 row of `nbytes` bytes."""
    if nbytes % BYTES:
        raise ValueError(f"a q8_0 row is a multiple of {BYTES} bytes, not {nbytes}")
    return nbytes // BYTES * VALS


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), exactly: `v - trunc(v)` is exact in floats."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= 0.5, np.sign(v), np.float32(0))


def quantize_ref(x: Any) -> np.ndarray:
    """NumPy `quantize_row_q8_0_ref` of every row of `x` (float32 `[..., head_dim]`): uint8
    `[..., head_dim / 32 * 34]`."""
    x = np.asarray(x, dtype=np.float32)
    rb = row_bytes(x.shape[-1])
    blocks = x.reshape(-1, VALS)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    qs = _roundf(blocks * inv).astype(np.int8)
    out = np.empty((blocks.shape[0], BYTES), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = qs.view(np.uint8)
    return out.reshape(*x.shape[:-1], rb)


def quantize(x: Any, out: np.ndarray | None = None) -> np.ndarray:
    """`quantize_ref` through the Rust kernel (bit for bit the same); into `out` (uint8,
    C-contiguous) when given."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rb = row_bytes(x.shape[-1])
    if out is None:
        out = np.empty((*x.shape[:-1], rb), np.uint8)
    _core.quantize_q8_0(x, out)
    return out


def dequantize(b: Any) -> np.ndarray:
    """q8_0 rows (uint8 `[..., head_dim / 32 * 34]`) as float32 `[..., head_dim]`."""
    b = np.ascontiguousarray(b, dtype=np.uint8)
    hd = head_dim_of(b.shape[-1])
    blocks = b.reshape(-1, BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(*b.shape[:-1], hd)
