"""Tensor loading: vectorised NumPy dequantization of GGUF tensor types, and a loader that
turns a `GGUFFile`'s tensors into backend arrays (f32 on the CPU, f16/bf16 on a GPU) with a
progress bar for large files.

The dequantizers reproduce ggml's reference `dequantize_row_*` (same f32 operations in the
same order) and are several times faster than `gguf.quants.dequantize`, which they fall back
to for types not listed in `FAST_TYPES`. They work in chunks of blocks, so dequantizing the
262K x 640 embedding of Gemma 3 never holds more than a few MB of temporaries.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kvshare.model.gguf_file import GGUFError, GGUFFile

_CHUNK_BLOCKS = 8192  # blocks per chunk (Q8_0: 256K elements; K-quants: 2M elements)


def _f16(col: np.ndarray) -> np.ndarray:
    """A [nb, 2] uint8 column pair as f32 [nb, 1] (little-endian half floats)."""
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


# Each splitter turns a [nb, type_size] array of blocks into integer values q (int8,
# [nb, block]), per-group scales (f32 [nb, block // group]) and per-group mins (or None):
# value = q * scale - min, computed in f32 exactly as ggml's dequantize_row_* does.

def _split_q8_0(b):  # block 32: d f16, qs i8[32]
    return b[:, 2:34].view(np.int8), _f16(b[:, 0:2]), None


def _split_q4_0(b):  # block 32: d f16, qs u8[16]; low nibbles are elements 0..15
    q = np.empty((b.shape[0], 2, 16), np.uint8)
    np.bitwise_and(b[:, 2:18], 0x0F, out=q[:, 0])
    np.right_shift(b[:, 2:18], 4, out=q[:, 1])
    qi = q.reshape(-1, 32).view(np.int8)
    qi -= 8
    return qi, _f16(b[:, 0:2]), None


def _split_q5_0(b):  # block 32: d f16, qh u32 (bit i: 5th bit of element i), qs u8[16]
    hb = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")
    q = np.empty((b.shape[0], 2, 16), np.uint8)
    np.bitwise_and(b[:, 6:22], 0x0F, out=q[:, 0])
    np.right_shift(b[:, 6:22], 4, out=q[:, 1])
    q = q.reshape(-1, 32)
    q |= hb << 4
    qi = q.view(np.int8)
    qi -= 16
    return qi, _f16(b[:, 0:2]), None


def _split_q4_1(b):  # block 32: d f16, m f16, qs u8[16]; value = q * d + m (q unsigned)
    q = np.empty((b.shape[0], 2, 16), np.uint8)
    np.bitwise_and(b[:, 4:20], 0x0F, out=q[:, 0])
    np.right_shift(b[:, 4:20], 4, out=q[:, 1])
    # the split form subtracts its mins: -m (q * d - (-m) is q * d + m exactly)
    return q.reshape(-1, 32).view(np.int8), _f16(b[:, 0:2]), -_f16(b[:, 2:4])


def _split_q5_1(b):  # block 32: d f16, m f16, qh u32, qs u8[16]; value = q * d + m
    hb = np.unpackbits(b[:, 4:8], axis=1, bitorder="little")
    q = np.empty((b.shape[0], 2, 16), np.uint8)
    np.bitwise_and(b[:, 8:24], 0x0F, out=q[:, 0])
    np.right_shift(b[:, 8:24], 4, out=q[:, 1])
    q = q.reshape(-1, 32)
    q |= hb << 4
    return q.view(np.int8), _f16(b[:, 0:2]), -_f16(b[:, 2:4])


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 6-bit scales and mins from 12 bytes."""
    nb = s.shape[0]
    sc = np.empty((nb, 8), np.uint8)
    mn = np.empty((nb, 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _split_q4_k(b):
    # super-block 256: d f16, dmin f16, scales u8[12], qs u8[128]; 8 sub-blocks of 32:
    # sub-block 2j = low nibbles of qs[32j:32j+32], 2j+1 = their high nibbles
    nb = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d1 = _f16(b[:, 0:2]) * sc.astype(np.float32)
    m1 = _f16(b[:, 2:4]) * mn.astype(np.float32)
    qs = b[:, 16:144].reshape(nb, 4, 32)
    q = np.empty((nb, 4, 2, 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    return q.reshape(nb, 256).view(np.int8), d1, m1


def _split_q5_k(b):
    # super-block 256: d, dmin, scales[12], qh u8[32], qs u8[128]; sub-block s takes bit s
    # of qh[l] as the 5th bit of its element l
    nb = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d1 = _f16(b[:, 0:2]) * sc.astype(np.float32)
    m1 = _f16(b[:, 2:4]) * mn.astype(np.float32)
    qs = b[:, 48:176].reshape(nb, 4, 32)
    q = np.empty((nb, 4, 2, 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    q = q.reshape(nb, 8, 32)
    hb = np.unpackbits(b[:, 16:48, None], axis=2, bitorder="little")  # [nb, 32(l), 8(s)]
    q |= hb.transpose(0, 2, 1) << 4
    return q.reshape(nb, 256).view(np.int8), d1, m1


def _split_q6_k(b):
    # super-block 256: ql u8[128], qh u8[64], scales i8[16], d f16; two halves of 128, each
    # 64 low nibbles then 64 high nibbles of ql, 2 high bits from qh; one scale per 16
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    q = np.empty((nb, 2, 2, 64), np.uint8)
    np.bitwise_and(ql, 0x0F, out=q[:, :, 0])
    np.right_shift(ql, 4, out=q[:, :, 1])
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    hb = (qh >> shifts) & 3  # [nb, 2, 4, 32]
    q = q.reshape(nb, 2, 128)
    q |= hb.reshape(nb, 2, 128) << 4
    qi = q.reshape(nb, 256).view(np.int8)
    qi -= 32
    return qi, _f16(b[:, 208:210]) * sc, None


# MXFP4's 16 4-bit codes: the E2M1 values doubled (ggml's kvalues_mxfp4), so that with the
# block's E8M0 exponent taken as half its power of two every value is an integer times d
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as f32 (denormal for e < 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _split_mxfp4(b):  # block 32: e u8 (E8M0), qs u8[16]; low nibbles are elements 0..15
    q = np.empty((b.shape[0], 2, 16), np.uint8)
    np.bitwise_and(b[:, 1:17], 0x0F, out=q[:, 0])
    np.right_shift(b[:, 1:17], 4, out=q[:, 1])
    return _MXFP4_VALUES[q.reshape(-1, 32)], _e8m0_half(b[:, 0:1]), None


_SPLIT: dict[Q, tuple[Callable, int]] = {  # splitter, group size
    Q.Q8_0: (_split_q8_0, 32),
    Q.Q4_0: (_split_q4_0, 32),
    Q.Q5_0: (_split_q5_0, 32),
    Q.Q4_1: (_split_q4_1, 32),
    Q.Q5_1: (_split_q5_1, 32),
    Q.Q4_K: (_split_q4_k, 32),
    Q.Q5_K: (_split_q5_k, 32),
    Q.Q6_K: (_split_q6_k, 16),
    Q.MXFP4: (_split_mxfp4, 32),
}


def _dequant_blocks(qtype: Q):
    split, group = _SPLIT[qtype]

    def fn(b: np.ndarray, out: np.ndarray) -> None:
        q, scale, mins = split(b)
        nb, ng = scale.shape
        o = out.reshape(nb, ng, group)
        np.multiply(q.reshape(nb, ng, group), scale[:, :, None], out=o)
        if mins is not None:
            o -= mins[:, :, None]

    return fn


def split_quantized(raw: np.ndarray, qtype: Q, shape: tuple[int, int]):
    """A 2-D `[rows, cols]` tensor of a block-quantized type as `(q, scale, mins, group)`:
    q int8 `[rows, cols]`, scale f32 `[rows, cols // group]`, mins the same or None, with
    value = q * scale - mins. None for types without an integer split (F32, F16, BF16, ...)."""
    if qtype not in _SPLIT:
        return None
    split, group = _SPLIT[qtype]
    _, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    q, scale, mins = split(np.asarray(raw, np.uint8).reshape(-1, type_size))
    q = np.ascontiguousarray(q).reshape(rows, cols)
    scale = np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, cols // group)
    if mins is not None:
        mins = np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, cols // group)
    return q, scale, mins, group


_FAST: dict[Q, Callable[[np.ndarray, np.ndarray], None]] = {t: _dequant_blocks(t) for t in _SPLIT}
FAST_TYPES = frozenset(_FAST) | {Q.F32, Q.F16, Q.BF16}


def dequantize(raw: np.ndarray, qtype: Q, out: np.ndarray | None = None) -> np.ndarray:
    """The stored bytes `raw` (uint8) of a tensor of type `qtype` as a flat f32 array (written
    into `out`, a contiguous f32 array of the right size, when given)."""
    qtype = Q(qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % type_size:
        raise GGUFError(f"{qtype.name}: {raw.size} bytes is not a whole number of blocks")
    n_blocks = raw.size // type_size
    n = n_blocks * block
    if out is None:
        out = np.empty(n, np.float32)
    flat = out.reshape(-1)
    if flat.size != n or flat.dtype != np.float32:
        raise ValueError(f"out has {flat.size} {flat.dtype} elements, need {n} float32")
    if qtype == Q.F32:
        flat[:] = raw.view(np.float32)
    elif qtype == Q.F16:
        flat[:] = raw.view(np.float16)
    elif qtype == Q.BF16:
        np.left_shift(raw.view(np.uint16), 16, out=flat.view(np.uint32), dtype=np.uint32)
    elif qtype in _FAST:
        fn = _FAST[qtype]
        blocks = raw.reshape(n_blocks, type_size)
        for s in range(0, n_blocks, _CHUNK_BLOCKS):
            e = min(s + _CHUNK_BLOCKS, n_blocks)
            fn(blocks[s:e], flat[s * block : e * block])
    else:
        from gguf import quants  # noqa: PLC0415

        try:
            flat[:] = np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)
        except NotImplementedError as exc:
            raise GGUFError(f"tensor type {qtype.name} is not supported") from exc
    return out


def load_tensor(gf: GGUFFile, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """Tensor `name` of `gf`, dequantized to f32 in its row-major `numpy_shape`."""
    try:
        info = gf.tensors[name]
    except KeyError as exc:
        raise GGUFError(f"{gf.path}: tensor {name!r} missing") from exc
    if out is None:
        out = np.empty(info.numpy_shape, np.float32)
    dequantize(gf.raw(name), info.qtype, out)
    return out.reshape(info.numpy_shape)


CPU_WEIGHT_MODES = ("blocks", "blocks-vnni", "blocks-q8", "int8", "f32")


def cpu_weight_mode(vnni_model: bool = False) -> str:
    """How quantized weights are held on the CPU: $KVSHARE_CPU_WEIGHTS, else `blocks-vnni`
    for a `vnni_model` (see `vnni_eligible`) where the CPU has AVX512-VNNI, else `blocks`
    where this build has the exact block kernels, else `int8` ($KVSHARE_CPU_Q8=0, the older
    switch, means `f32`). ValueError for an unknown value."""
    import os  # noqa: PLC0415

    from kvshare import _core  # noqa: PLC0415

    mode = os.environ.get("KVSHARE_CPU_WEIGHTS", "").strip().lower()
    if not mode:
        if os.environ.get("KVSHARE_CPU_Q8") == "0":
            return "f32"
        if vnni_model and getattr(_core, "block_vnni_available", lambda: False)():
            return "blocks-vnni"
        return "blocks" if hasattr(_core, "block_matmul_t_f32") else "int8"
    if mode not in CPU_WEIGHT_MODES:
        raise ValueError(f"KVSHARE_CPU_WEIGHTS={mode!r}: expected one of "
                         f"{', '.join(CPU_WEIGHT_MODES)}")
    return mode


# a MoE layer's router (`ffn_gate_inp`, [n_expert, n_embd]): llama.cpp's quantizer leaves it
# F32, and an F32 router's product is batch-invariant on its own (`ops.moe.router_logits`)
_ROUTER = "ffn_gate_inp.weight"


def vnni_eligible(gf: GGUFFile, n_recurrent_layers: int) -> bool:
    """Whether a model takes `blocks-vnni` by default: no recurrent layers, and every matrix
    (2-D, or a MoE layer's stacked experts, 3-D) of a type the VNNI kernel takes, except an F32
    MoE router, which `ops.moe.router_logits` multiplies with one summation order per row at
    any batch size. Its products then multiply 8-bit activations at every batch size and its
    attention takes the batch-invariant kernel, so each token's result is the same bits
    however prompts are chunked and batched. A matrix on another path (Q4_1, f16, an f32
    projection on BLAS, ...) or a recurrent layer's scan computes chunks and single steps in
    different float orders (~1e-7), which 8-bit rounding would amplify to ~1% of the logits.
    A shared expert's gate (`ffn_gate_inp_shexp`, a vector multiplied as a 1-row matrix on
    BLAS) is such a product too."""
    from kvshare import _core  # noqa: PLC0415

    if n_recurrent_layers or not hasattr(_core, "block_vnni_supports"):
        return False
    for name, t in gf.tensors.items():
        if ".ffn_gate_inp_shexp." in name:
            return False
        if len(t.shape) < 2 or (name.endswith(_ROUTER) and t.qtype == Q.F32):
            continue
        if not _core.block_vnni_supports(int(t.qtype)):
            return False
    return True


class WeightLoader:
    """Loads tensors of one GGUF file onto a backend, advancing a tqdm bar by stored bytes.

    CPU: f32 NumPy arrays. GPU: `gpu_dtype` (f16 by default) CuPy arrays, converted per tensor
    so host memory holds at most one dequantized tensor at a time.
    """

    def __init__(self, gf: GGUFFile, backend, *, progress: bool | None = None,
                 gpu_dtype: str = "float16", names: Iterable[str] | None = None,
                 vnni_model: bool = False):
        self.gf = gf
        self.backend = backend
        self.vnni_model = vnni_model  # cpu_weight_mode's default for this model
        self.gpu_dtype = gpu_dtype
        names = list(gf.tensors if names is None else names)
        total = sum(gf.tensors[n].n_bytes for n in names if n in gf.tensors)
        if progress is None:  # a bar only for large files on an interactive terminal
            progress = total > (512 << 20) and sys.stderr.isatty()
        self._bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
                             leave=False)

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def host(self, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None
             ) -> np.ndarray:
        arr = load_tensor(self.gf, name)
        if transform is not None:
            arr = transform(arr)
        if self._bar is not None:
            self._bar.update(self.gf.tensors[name].n_bytes)
        return arr

    def get(self, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
            *, keep_f32: bool = False):
        """Tensor `name` on the backend (after an optional host-side `transform`). Vectors
        (norm weights, biases) stay f32 on every backend; so does anything with keep_f32."""
        arr = self.host(name, transform)
        return self.put(arr, keep_f32=keep_f32)

    def cpu_weight(self, names: list[str]):
        """The row-wise stack of tensors `names` in a compact form for the CPU kernels, or
        None where that path does not apply (a GPU backend, $KVSHARE_CPU_WEIGHTS=f32, a
        tensor that is not 2-D or of a type without kernels): the caller then loads f32.

        $KVSHARE_CPU_WEIGHTS picks the form (see `cpu_weight_mode`): `blocks`, a `BlockWeight`
        (the tensors' GGUF blocks as read-only views of the mapped file, so a model costs its
        file size, multiplied with exact f32 activations); `blocks-vnni` (the default for
        `vnni_eligible` models), the same with 8-bit activations and integer products at every
        batch size (AVX512-VNNI); `blocks-q8`,
        8-bit activations in small batches only, as llama.cpp does; `int8`, the older `QWeight` (int8 values + f32 group
        scales). Nothing is dequantized here, so loading never holds a full-size f32 copy."""
        mode = cpu_weight_mode(self.vnni_model)
        if self.backend.is_gpu or mode == "f32":
            return None
        infos = [self.gf.tensors.get(n) for n in names]
        if any(i is None or len(i.shape) != 2 for i in infos):
            return None
        if mode == "int8":
            return self._int8_weight(names, infos)
        from kvshare.ops.blockweight import BLOCK_TYPES, BlockWeight  # noqa: PLC0415

        if all(i.qtype == Q.F32 for i in infos):
            # f32 weights are used as they are (a plain array: BLAS / the small-M kernel),
            # as before blocks existed; wrapping them would only move float rounding
            return None
        parts = []
        for name, info in zip(names, infos):
            k = info.numpy_shape[1]
            block = BLOCK_TYPES.get(int(info.qtype), (0, 0))[0]
            if not block or k % block:
                return None
            parts.append((self.gf.raw(name), int(info.qtype), k))
        for info in infos:
            if self._bar is not None:
                self._bar.update(info.n_bytes)
        activations = {"blocks-q8": "q8", "blocks-vnni": "vnni"}.get(mode, "f32")
        return BlockWeight.concat(parts, activations=activations)

    def gpu_block_weight(self, names: list[str]):
        """With $KVSHARE_GPU_WEIGHTS=blocks: tensors `names` as a `GpuBlockWeight` (their GGUF
        blocks copied to the device unchanged, dequantized inside the kernels), else None (the
        default for now: f16 copies). Opt-in until a lent GPU has run it end to end; the
        kernels are checked by the NVRTC compile test and the CPU emulator
        (tests/test_ops_gpu_blocks.py)."""
        import os  # noqa: PLC0415

        if os.environ.get("KVSHARE_GPU_WEIGHTS", "f16").strip().lower() != "blocks":
            return None
        from kvshare.ops.gpu_blocks import GpuBlockWeight  # noqa: PLC0415

        w = GpuBlockWeight.from_gguf(self.gf, names, self.backend)
        if w is not None and self._bar is not None:
            self._bar.update(sum(self.gf.tensors[n].n_bytes for n in names))
        return w

    def _int8_weight(self, names, infos):
        from kvshare.ops.linear import QWeight  # noqa: PLC0415

        if any(i.qtype not in _SPLIT for i in infos):
            return None
        parts = []
        for name, info in zip(names, infos):
            parts.append(QWeight(*split_quantized(self.gf.raw(name), info.qtype,
                                                  info.numpy_shape)))
            if self._bar is not None:
                self._bar.update(info.n_bytes)
        return parts[0] if len(parts) == 1 else QWeight.concat(parts)

    def matrix(self, names: list[str]):
        """Tensors `names` stacked along the output axis (fused Q/K/V, gate/up) as the
        backend's weight: compact on the CPU (`cpu_weight`), else f32 / the GPU dtype."""
        w = self.cpu_weight(names) if not self.backend.is_gpu else self.gpu_block_weight(names)
        if w is not None:
            return w
        return self.put(np.concatenate([self.host(n) for n in names], axis=0))

    def put(self, arr: np.ndarray, *, keep_f32: bool = False):
        if not self.backend.is_gpu:
            return np.ascontiguousarray(arr, dtype=np.float32)
        dtype = "float32" if (keep_f32 or arr.ndim < 2) else self.gpu_dtype
        return self.backend.asarray(arr, dtype=dtype)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
