"""CuPy twins of the model ops: one function per `gpu_op(name)` used in `kvshare.ops.*`, with
the same signature (less `backend`) and the same contract as the NumPy op's docstring.

Kernels are the CUDA sources of `kvshare.kernels` (NVRTC through CuPy); GEMMs are cuBLAS
(`cublasGemmEx`: f16 weights and f16 activations in, float32 accumulation and output). This
module imports nothing GPU-related at import time (CuPy comes from `kvshare.backend` on first
use), so it can be imported, and its kernel table checked, on a machine without CUDA.

Host-side index arrays (block tables, query starts, KV slots, token ids) usually arrive as
NumPy arrays: they are validated on the host exactly as the NumPy ops do (same exceptions) and
uploaded once per distinct content (a small cache keyed by their bytes, so the layers of one
forward call share one upload). Arrays already on the device are used as they are; the kernels
then guard every index (never an out-of-bounds access) instead of raising.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from kvshare.backend import cupy_module
from kvshare.ops import gpu_blocks
from kvshare.ops import gpu_runtime as rt
from kvshare.ops.gpu_blocks import GpuBlockWeight
from kvshare.ops.gpu_runtime import ELEMWISE_THREADS, ROWS_PER_BLOCK

# The kernels this module launches, by kernel module.
_OWN_ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "paged_attention": tuple(f"paged_attn_{dt}_{hd}" for dt in ("f16", "f32")
                             for hd in ("hd64", "hd128", "hd256", "hdx")) + ("paged_attn_combine",),
    "paged_attention_mma": tuple(f"paged_attn_mma_f16_hd{hd}"
                                 for hd in (64, 80, 96, 112, 128, 256)),
    "kv_write": ("kv_write_f16", "kv_write_f32"),
    "rope": ("rope_f32", "rope_cos_sin_f32", "rope_cos_sin_yarn_f32"),
    "qkv_rope": ("qkv_rope_write_f16", "qkv_rope_write_f32"),
    "rms_norm": ("rms_norm_f32",),
    "activation": ("geglu_tanh_f32", "swiglu_f32"),
    "embedding": ("embedding_f16", "embedding_f32", "gather_rows_f32"),
    "linear": ("f32_to_f16_rowscaled", "rowscale_bias_f32"),
}
for _module, _entries in _OWN_ENTRY_POINTS.items():
    rt.declare_entry_points(_module, _entries)
# Every kernel the GPU ops launch, by kernel module: this module's and gpu_blocks.py's (GGUF
# block weights); tests/test_kernels_compile.py checks that each one is an entry point of the
# compiled module.
ENTRY_POINTS: dict[str, tuple[str, ...]] = rt.ENTRY_POINTS

# Launch constants that must match the CUDA sources.
PA_THREADS = 128  # paged_attention.cu: PA_NW * 32
PA_ROWS = 16  # PA_NW * PA_RPW: (token, head) rows per CTA
PA_BN = 32  # keys per tile
PA_MAXD = 512  # largest head_dim of the generic kernels
# Split-KV: the fewest keys of a split (2 key tiles). A split's CTA walks its keys one tile at
# a time, each tile a gather from the cache that waits for the device's memory: a decode
# token over 1,024 keys on 8 KV heads is 32 CTAs of 8 tiles each at 256 keys a split, 128
# CTAs of 2 tiles at 64. The price per split is its partial output (one row per head) and
# one more term in `paged_attn_combine`'s merge.
PA_SPLIT_KEYS = 2 * PA_BN
PA_SPECIALISED_HD = (64, 128, 256)
# paged_attention_mma.cu: the tensor-core kernels for prefill chunks
PM_ROWS = 64  # (token, head) rows per CTA: 4 row groups of 16
PM_HD = (64, 80, 96, 112, 128, 256)  # head sizes it has (f16 caches)
PM_WIDE_HD = 256  # its kernel has two warps a row group (each half of the output dims)


def pm_threads(hd: int) -> int:
    """Threads per CTA of the tensor-core kernel for head size `hd`: a warp per row group up
    to 128, two at 256."""
    return 256 if hd == PM_WIDE_HD else 128

# A launch goes to the tensor-core kernels when some sequence brings at least this many query
# tokens (a prefill chunk; decode rows would fill a 16-row product with one token's heads).
PM_MIN_TOKENS = 16
ATTN_MMA_ENV = "KVSHARE_GPU_ATTN_MMA"  # "0": every launch on the FMA kernels
_DEFAULT_SMEM = 48 * 1024
_LOG2E = 1.4426950408889634

_NULL = np.uint64(0)  # a null pointer kernel argument
_plan_lock = threading.Lock()
_smem_opt_in: dict[tuple[str, int], int] = {}


# --- plumbing ------------------------------------------------------------------------------------

def _kv_tag(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt == np.float16:
        return "f16"
    if dt == np.float32:
        return "f32"
    raise TypeError(f"KV cache dtype {dt} is not supported on the GPU (f16 or f32)")


def _check_cache(k_cache: Any, v_cache: Any) -> None:
    cp = cupy_module()
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, cp.ndarray) or c.ndim != 4:
            raise TypeError(f"{name} must be a 4-D CuPy array [n_blocks, block_size, n_kv, hd]")
        if not c.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (a KVArrays.layer_kv view is)")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache "
                         f"{v_cache.shape} {v_cache.dtype} differ")


# --- KV write ------------------------------------------------------------------------------------

def _check_slots(slots: Any, n: int, n_slots: int) -> None:
    """n KV slots: host slots must lie in [0, n_slots) (IndexError, as the NumPy op); slots
    already on the device are not read back (a CUDA-graph step's padding rows carry -1, which
    the kernels skip)."""
    if not rt.is_device(slots):
        hs = np.asarray(slots).reshape(-1)
        if hs.size != n:
            raise ValueError(f"{hs.size} slots for {n} tokens")
        if hs.size and (hs.min() < 0 or hs.max() >= n_slots):
            raise IndexError(f"KV slot out of range [0, {n_slots})")
    elif int(slots.size) != n:
        raise ValueError(f"{int(slots.size)} slots for {n} tokens")


def write_kv(k_cache: Any, v_cache: Any, slots: Any, k: Any, v: Any) -> None:
    """GPU twin of `kvshare.ops.attention.write_kv`."""
    _check_cache(k_cache, v_cache)
    nb, bs, n_kv, hd = (int(s) for s in k_cache.shape)
    n_slots = nb * bs
    k = rt.f32_lastdim_view(k, 3)
    v = rt.f32_lastdim_view(v, 3)
    n = int(k.shape[0])
    if tuple(k.shape) != (n, n_kv, hd) or tuple(v.shape) != (n, n_kv, hd):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache's "
                         f"[N, {n_kv}, {hd}]")
    _check_slots(slots, n, n_slots)
    if n == 0:
        return None
    d_slots = rt.upload(slots, np.int64).reshape(-1)
    ks, vs = rt.estrides(k), rt.estrides(v)
    fn = rt.kernel("kv_write", f"kv_write_{_kv_tag(k_cache.dtype)}")
    fn(rt.grid(n * n_kv * hd), (ELEMWISE_THREADS, 1, 1),
       (k_cache, v_cache, d_slots, k, np.int64(ks[0]), np.int64(ks[1]), v, np.int64(vs[0]),
        np.int64(vs[1]), np.int32(n), np.int32(n_kv), np.int32(hd), np.int64(n_slots)))
    return None


# --- paged attention -----------------------------------------------------------------------------

def _pa_smem_bytes(hd: int, itemsize: int) -> int:
    """Dynamic shared memory of one paged-attention CTA (paged_attention.cu's layout)."""
    def a16(b: int) -> int:
        return (b + 15) & ~15

    pad = 2 if itemsize == 2 else 1
    return (a16(PA_ROWS * hd * 4) + a16(PA_ROWS * PA_BN * 4) + a16(PA_BN * 8)
            + a16(hd * (PA_BN + pad) * itemsize) + a16(PA_BN * hd * itemsize))


def _check_tables(tables: np.ndarray, q_starts: np.ndarray, start: np.ndarray, bs: int,
                  n_blocks: int, window: int) -> None:
    """The NumPy op's coverage check, vectorised: every block a sequence's queries can read
    (from its first in-window key to its last query) must be a valid block id."""
    lens = np.diff(q_starts)
    act = lens > 0
    if not act.any():
        return
    p0 = start.astype(np.int64)
    hi = p0 + lens
    lo = np.maximum(0, p0 - window + 1) if window else np.zeros_like(p0)
    b0, b1 = lo // bs, -(-hi // bs)
    width = tables.shape[1]
    cols = np.arange(width)[None, :]
    need = (cols >= b0[:, None]) & (cols < b1[:, None]) & act[:, None]
    bad = need & ((tables < 0) | (tables >= n_blocks))
    short = act & (b1 > width)
    if bad.any() or short.any():
        s = int(np.flatnonzero(bad.any(axis=1) | short)[0])
        raise IndexError(f"sequence {s}: block table does not cover positions < {int(hi[s])}")


def pa_tiles(q_starts: np.ndarray, start_positions: np.ndarray, group_chunk: int,
             cta_rows: int = PA_ROWS) -> np.ndarray:
    """Work tiles of one paged-attention launch, int32 `[n_tiles, 4]`: (sequence, first query
    row, rows in the tile, position of the first row). Each sequence's rows are cut into
    runs of at most `cta_rows // group_chunk` tokens (a CTA holds `cta_rows` (token, head)
    rows: PA_ROWS, or PM_ROWS for the tensor-core kernels); sequences without rows get no
    tile."""
    qs = np.asarray(q_starts, np.int64)
    sp = np.asarray(start_positions, np.int64)
    bm = max(1, cta_rows // group_chunk)
    lens = np.diff(qs)
    n_t = -(-lens // bm)
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), n_t)
    first = np.repeat(np.cumsum(n_t) - n_t, n_t)
    t0 = (np.arange(int(n_t.sum()), dtype=np.int64) - first) * bm
    nr = np.minimum(bm, lens[seq] - t0)
    return np.stack([seq, qs[:-1][seq] + t0, nr, sp[seq] + t0], axis=1).astype(np.int32)


def pa_splits(tiles: np.ndarray, window: int, n_kv: int, n_gchunks: int, n_tok: int,
              n_head: int, hd: int, n_sm: int) -> int:
    """Split-KV factor: 1 unless the grid (tiles x KV heads x head chunks) cannot fill the
    GPU's `n_sm` multiprocessors and some tile's key range exceeds 2 * PA_SPLIT_KEYS keys;
    then enough splits for about two CTAs per multiprocessor, each split at least
    PA_SPLIT_KEYS keys long, at most 64, with the partial results under 256 MB."""
    if len(tiles) == 0:
        return 1
    pos0 = tiles[:, 3].astype(np.int64)
    ke = pos0 + tiles[:, 2]
    kb = np.maximum(0, pos0 - window + 1) if window else np.zeros_like(pos0)
    max_span = int((ke - kb).max())
    n_ctas = len(tiles) * n_kv * n_gchunks
    if n_ctas >= n_sm or max_span <= 2 * PA_SPLIT_KEYS:
        return 1
    n_splits = min(-(-2 * n_sm // n_ctas), -(-max_span // PA_SPLIT_KEYS), 64)
    while n_splits > 1 and n_splits * n_tok * n_head * hd * 4 > (256 << 20):
        n_splits //= 2
    return max(1, n_splits)


class _PaPlan:
    __slots__ = ("tiles", "tables", "n_tiles", "n_splits", "gc", "n_gchunks", "width",
                 "splits_dev", "mma")


class StaticAttention:
    """The launch of a step's paged attention whose inputs are device buffers that stay put
    (a CUDA graph's): `tables` int32 `[n_seq, width]`, `tiles` int32 `[n_tiles, 4]`
    (`pa_tiles`' rows of the step's sequences, then padding: one tile per query row at
    most, so `n_tiles` is the launch's query rows; a tile of no rows at position 0 does
    nothing), `splits` a device int32 holding the step's split count (`pa_splits` of its
    real tiles), `max_splits` the grid's z extent (the largest count any step of this graph
    may have), `mma` whether the tiles are the tensor-core kernels' (`PM_ROWS` rows, no
    split). The kernels read the count from `splits`: a step computes what `paged_attention`
    with plain arrays computes, the same bits (kernels/paged_attention.cu)."""

    __slots__ = ("tables", "width", "tiles", "n_tiles", "splits", "max_splits", "mma")

    def __init__(self, tables: Any, tiles: Any, splits: Any, max_splits: int,
                 mma: bool = False):
        self.tables, self.tiles, self.splits = tables, tiles, splits
        self.width = int(tables.shape[1])
        self.n_tiles = int(tiles.shape[0])
        self.max_splits = 1 if mma else int(max_splits)
        self.mma = bool(mma)


def group_chunk(n_head: int, n_kv: int, cta_rows: int = PA_ROWS) -> tuple[int, int]:
    """(query heads per CTA, CTAs per KV head) of a paged-attention launch whose CTAs hold
    `cta_rows` (token, head) rows."""
    G = n_head // n_kv
    gc = min(G, cta_rows)
    return gc, -(-G // gc)


def _static_plan(st: StaticAttention, n_head: int, n_kv: int, n_tok: int) -> _PaPlan:
    if st.n_tiles != n_tok:
        raise ValueError(f"a static attention plan of {st.n_tiles} tiles for {n_tok} "
                         "query rows")
    plan = _PaPlan()
    plan.tiles, plan.tables, plan.width = st.tiles, st.tables, st.width
    plan.n_tiles, plan.n_splits = st.n_tiles, st.max_splits
    # one split at most: the count is always 1, the kernels need not read it
    plan.splits_dev = st.splits if st.max_splits > 1 else None
    plan.gc, plan.n_gchunks = group_chunk(n_head, n_kv, PM_ROWS if st.mma else PA_ROWS)
    plan.mma = st.mma
    return plan


_plan_cache: OrderedDict = OrderedDict()


def _pa_plan(block_tables: Any, q_starts: Any, start_positions: Any, n_head: int, n_kv: int,
             bs: int, n_blocks: int, window: int, hd: int, n_tok: int,
             mma: bool | None = None) -> _PaPlan:
    """Tiles, uploaded block table and split count of one call (cached by content: the layers
    of a forward call with the same window share it). `mma`: whether the call goes to the
    tensor-core kernels (tiles of PM_ROWS rows, no split), or None to decide here: it does
    when some sequence brings PM_MIN_TOKENS query tokens or more (the caller has checked the
    cache and head size, `mma_fits`); the plan says which in `mma`."""
    qs = rt.host(q_starts, np.int64).reshape(-1)
    sp = rt.host(start_positions, np.int64).reshape(-1)
    bt = rt.host(block_tables, np.int32)
    if bt.ndim == 1:
        bt = bt.reshape(1, -1)
    key = (rt.device_id(), qs.tobytes(), sp.tobytes(), bt.shape, bt.tobytes(), n_head, n_kv, bs,
           n_blocks, window, hd, mma)
    with _plan_lock:
        plan = _plan_cache.get(key)
        if plan is not None:
            _plan_cache.move_to_end(key)
            return plan
    n_seq = len(qs) - 1
    if n_seq < 0 or len(sp) < n_seq or bt.shape[0] < n_seq:
        raise ValueError("q_starts, start_positions and block_tables disagree on the number "
                         "of sequences")
    if int(qs[-1]) != n_tok or int(qs[0]) != 0 or (np.diff(qs) < 0).any():
        raise ValueError(f"q_starts {qs.tolist()} do not partition {n_tok} query rows")
    if (sp[:n_seq] < 0).any():
        raise ValueError("start_positions must be >= 0")
    _check_tables(bt[:n_seq], qs, sp[:n_seq], bs, n_blocks, window)
    if mma is None:
        mma = n_seq > 0 and int(np.diff(qs).max()) >= PM_MIN_TOKENS
    cta_rows = PM_ROWS if mma else PA_ROWS
    gc, n_gchunks = group_chunk(n_head, n_kv, cta_rows)
    tiles = pa_tiles(qs, sp[:n_seq], gc, cta_rows)
    plan = _PaPlan()
    plan.mma = mma
    plan.n_tiles = int(tiles.shape[0])
    plan.n_splits = 1 if mma else pa_splits(tiles, window, n_kv, n_gchunks, n_tok, n_head, hd,
                                            rt.device_attr("MultiProcessorCount"))
    plan.tiles = rt.upload(tiles.reshape(-1), np.int32)
    plan.tables = rt.upload(bt, np.int32)
    plan.gc = gc
    plan.n_gchunks = n_gchunks
    plan.width = int(bt.shape[1])
    plan.splits_dev = None
    with _plan_lock:
        _plan_cache[key] = plan
        while len(_plan_cache) > rt.UPLOAD_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return plan


def _pa_kernel(k_cache: Any, v_cache: Any, hd: int) -> tuple[Any, int]:
    """The attention kernel for this cache and head size, and its dynamic shared memory
    (opted in above 48 KB)."""
    tag = _kv_tag(k_cache.dtype)
    if hd in PA_SPECIALISED_HD and k_cache.data.ptr % 16 == 0 and v_cache.data.ptr % 16 == 0:
        entry = f"paged_attn_{tag}_hd{hd}"
    elif hd <= PA_MAXD:
        entry = f"paged_attn_{tag}_hdx"
    else:
        raise NotImplementedError(f"paged attention with head_dim {hd} > {PA_MAXD} on the GPU")
    smem = _pa_smem_bytes(hd, k_cache.dtype.itemsize)
    fn = rt.kernel("paged_attention", entry)
    if smem > _DEFAULT_SMEM:
        limit = rt.device_attr("MaxSharedMemoryPerBlockOptin")
        if smem > limit:
            raise NotImplementedError(f"paged attention needs {smem} bytes of shared memory "
                                      f"per block; this device allows {limit}")
        key = (entry, rt.device_id())
        if _smem_opt_in.get(key, 0) < smem:
            fn.max_dynamic_shared_size_bytes = smem
            _smem_opt_in[key] = smem
    return fn, smem


def mma_fits(k_cache: Any, v_cache: Any, hd: int) -> bool:
    """Whether the tensor-core kernels can take this cache: f16 with a head size of `PM_HD`,
    16-byte aligned, a device of compute capability 7.5 or later (mma.sync on f16), and
    KVSHARE_GPU_ATTN_MMA not "0"."""
    if os.environ.get(ATTN_MMA_ENV, "1") == "0":
        return False
    if k_cache.dtype != np.float16 or hd not in PM_HD:
        return False
    if k_cache.data.ptr % 16 or v_cache.data.ptr % 16:
        return False
    cc = rt.device_attr("ComputeCapabilityMajor") * 10 + rt.device_attr("ComputeCapabilityMinor")
    return cc >= 75


def paged_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, q_starts: Any,
                    start_positions: Any, *, scale: float, window: int = 0,
                    out: Any | None = None, static: StaticAttention | None = None,
                    sinks: Any | None = None) -> Any:
    """GPU twin of `kvshare.ops.attention.paged_attention` (returns float32
    `[N, n_head, head_dim]`, into `out` when given). `static`: a decode step's tiles, block
    tables and split count already in device buffers (`StaticAttention`; `block_tables`,
    `q_starts` and `start_positions` are then not read): what a captured step launches.
    `sinks`: float32 `[n_head]` sink logits (host arrays are uploaded once per content; the
    launch then always goes through `paged_attn_combine`, which adds them) or None.
    A launch with a prefill chunk (`PM_MIN_TOKENS` query tokens or more in one sequence) on
    an f16 cache of a head size in `PM_HD` (64 to 128, multiples of 16, and 256) runs on the
    tensor-core kernels (kernels/paged_attention_mma.cu: q and P rounded to f16 for the
    products); the rest on the FMA kernels (kernels/paged_attention.cu)."""
    cp = cupy_module()
    _check_cache(k_cache, v_cache)
    nb, bs, n_kv, hd = (int(s) for s in k_cache.shape)
    q = rt.f32_lastdim_view(q, 3)
    n_tok, n_head, qhd = (int(s) for s in q.shape)
    if qhd != hd:
        raise ValueError(f"q head size {qhd} != cache head size {hd}")
    if n_kv < 1 or n_head % n_kv:
        raise ValueError(f"{n_head} query heads cannot share {n_kv} KV heads")
    window = int(window or 0)
    if window < 0:
        raise ValueError("window must be >= 0")
    sinks_d = _NULL
    if sinks is not None:
        sinks_d = sinks if isinstance(sinks, cp.ndarray) else rt.upload(sinks, np.float32)
        if sinks_d.dtype != np.float32 or sinks_d.size != n_head or not sinks_d.flags.c_contiguous:
            raise ValueError(f"sinks must be contiguous float32 [{n_head}], got "
                             f"{sinks_d.dtype} {tuple(sinks_d.shape)}")
    fn, smem = _pa_kernel(k_cache, v_cache, hd)
    if static is not None:
        plan = _static_plan(static, n_head, n_kv, n_tok)
    else:
        mma = None if mma_fits(k_cache, v_cache, hd) else False
        plan = _pa_plan(block_tables, q_starts, start_positions, n_head, n_kv, bs, nb, window,
                        hd, n_tok, mma)
    direct = (out is not None and isinstance(out, cp.ndarray) and out.dtype == np.float32
              and tuple(out.shape) == (n_tok, n_head, hd) and out.flags.c_contiguous)
    if out is not None and tuple(out.shape) != (n_tok, n_head, hd):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(n_tok, n_head, hd)}")
    res = out if direct else rt.empty((n_tok, n_head, hd), np.float32)
    if n_tok == 0 or plan.n_tiles == 0:
        return out if out is not None else res
    qs = rt.estrides(q)
    if plan.mma:
        rt.kernel("paged_attention_mma", f"paged_attn_mma_f16_hd{hd}")(
            (plan.n_tiles, n_kv * plan.n_gchunks, 1), (pm_threads(hd), 1, 1),
            (q, np.int64(qs[0]), np.int64(qs[1]), k_cache, v_cache, plan.tables,
             np.int32(plan.width), plan.tiles, res, np.int32(n_head), np.int32(n_kv),
             np.int32(bs), np.int32(nb), np.int32(plan.gc), np.float32(float(scale) * _LOG2E),
             np.int32(window), sinks_d))
    else:
        n_splits = plan.n_splits
        # partials and paged_attn_combine for split-KV, and for sinks at any split count: the
        # combine kernel alone adds them (kernels/paged_attention.cu)
        merged = n_splits > 1 or sinks is not None
        if merged:
            part_o = rt.empty((n_splits, n_tok, n_head, hd), np.float32)
            part_ml = rt.empty((n_splits, n_tok, n_head, 2), np.float32)
        else:
            part_o = part_ml = res  # unused by the kernel
        grid = (plan.n_tiles, n_kv * plan.n_gchunks, n_splits)
        fn(grid, (PA_THREADS, 1, 1),
           (q, np.int64(qs[0]), np.int64(qs[1]), k_cache, v_cache, plan.tables,
            np.int32(plan.width), plan.tiles, _NULL if merged else res, part_o, part_ml,
            np.int32(n_tok), np.int32(n_head), np.int32(n_kv), np.int32(hd), np.int32(bs),
            np.int32(nb), np.int32(plan.gc), np.float32(float(scale) * _LOG2E),
            np.int32(window), np.int32(n_splits),
            _NULL if plan.splits_dev is None else plan.splits_dev),
           shared_mem=smem)
        if merged:
            comb = rt.kernel("paged_attention", "paged_attn_combine")
            comb((n_tok * n_head, 1, 1), (128, 1, 1),
                 (part_o, part_ml, res, np.int32(n_tok * n_head), np.int32(hd),
                  np.int32(n_splits), _NULL if plan.splits_dev is None else plan.splits_dev,
                  np.int32(n_head), sinks_d))
    if out is not None and res is not out:
        out[...] = res
        return out
    return res


# --- rope ----------------------------------------------------------------------------------------

_ROPE_STYLES = {"neox": 0, "norm": 1}


def apply_rope(x: Any, cos: Any, sin: Any, style: str = "neox") -> Any:
    """GPU twin of `kvshare.ops.rope.apply_rope`: rotates `x` in place and returns it."""
    cp = cupy_module()
    if style not in _ROPE_STYLES:
        raise ValueError(f"unknown rope style {style!r}")
    cos = rt.upload(cos, np.float32)
    sin = rt.upload(sin, np.float32)
    half = int(cos.shape[-1])
    if x.ndim != 3 or cos.ndim != 2 or tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"x {tuple(x.shape)} must be [N, heads, head_dim] and cos/sin "
                         f"{tuple(cos.shape)} [N, n_rot/2]")
    n, heads, hd = (int(s) for s in x.shape)
    if int(cos.shape[0]) != n or 2 * half > hd:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    if n == 0 or half == 0 or heads == 0:
        return x
    ok = (isinstance(x, cp.ndarray) and x.dtype == np.float32
          and (hd <= 1 or x.strides[-1] == 4) and all(s % 4 == 0 for s in x.strides))
    if not ok:
        raise TypeError("apply_rope on the GPU needs a float32 CuPy array with unit stride "
                        "along head_dim (it rotates in place)")
    xs = rt.estrides(x)
    rt.kernel("rope", "rope_f32")(
        rt.grid(n * heads * half), (ELEMWISE_THREADS, 1, 1),
        (x, np.int64(xs[0]), np.int64(xs[1]), cos, sin, np.int32(n), np.int32(heads),
         np.int32(half), np.int32(_ROPE_STYLES[style])))
    return x


_inv_freq_cache: dict = {}


def _inv_freq(n_rot: int, base: float, freq_factors: Any) -> Any:
    """`base ** (-2i / n_rot) / freq_factors[i]` in float64 on the device, as the NumPy op
    forms it (computed and uploaded once per model constant)."""
    ff = None if freq_factors is None else rt.host(freq_factors, np.float64).reshape(-1)
    key = (rt.device_id(), int(n_rot), float(base), None if ff is None else ff.tobytes())
    d = _inv_freq_cache.get(key)
    if d is None:
        if rt.is_capturing():
            raise RuntimeError("rope_cos_sin: the model's frequencies were not uploaded "
                               "before the graph capture")
        inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if ff is not None:
            inv = inv / ff
        d = _inv_freq_cache[key] = cupy_module().asarray(np.ascontiguousarray(inv))
    return d


def rope_cos_sin(positions: Any, n_rot: int, base: float, scale: float = 1.0,
                 freq_factors: Any | None = None) -> tuple[Any, Any]:
    """GPU twin of `kvshare.ops.rope.rope_cos_sin`: float32 cos and sin `[N, n_rot // 2]`
    computed on the device from integer positions (a device array is used as it is: a
    captured decode step's positions buffer). Angles in float64 as the NumPy op forms them;
    CUDA's float64 cos / sin may differ from the host's in the last float64 bit, so a value
    may differ by one float32 ulp from the NumPy op's, rarely."""
    pos = rt.upload(positions, np.int64).reshape(-1)
    half = int(n_rot) // 2
    n = int(pos.size)
    inv = _inv_freq(n_rot, base, freq_factors)
    cos = rt.empty((n, half), np.float32)
    sin = rt.empty((n, half), np.float32)
    if n and half:
        rt.kernel("rope", "rope_cos_sin_f32")(
            rt.grid(n * half), (ELEMWISE_THREADS, 1, 1),
            (pos, inv, np.float64(scale), cos, sin, np.int32(n), np.int32(half)))
    return cos, sin


_yarn_cache: dict = {}


def rope_cos_sin_yarn(positions: Any, inv_freq: np.ndarray, keep: np.ndarray, mix: np.ndarray,
                      freq_scale: float, mscale: float) -> tuple[Any, Any]:
    """GPU twin of `kvshare.ops.rope_yarn.yarn_cos_sin` (one `rope_cos_sin_yarn_f32` launch):
    float32 cos and sin `[N, n_rot // 2]` of YaRN-scaled angles, from integer positions (a
    device array as it is: a captured step's positions buffer). The per-pair constants are
    the host op's (`rope_yarn.pair_factors`, float64 `[n_rot // 2]`), uploaded once per
    content; float64 as the host forms them, so a value may differ from the host op's by one
    float32 ulp where CUDA's float64 cos / sin differ in the last bit, rarely."""
    consts = [np.ascontiguousarray(a, np.float64) for a in (inv_freq, keep, mix)]
    key = (rt.device_id(), *(a.tobytes() for a in consts))
    dev = _yarn_cache.get(key)
    if dev is None:
        if rt.is_capturing():
            raise RuntimeError("rope_cos_sin_yarn: the model's frequencies were not uploaded "
                               "before the graph capture")
        cp = cupy_module()
        dev = _yarn_cache[key] = tuple(cp.asarray(a) for a in consts)
    inv, keep_d, mix_d = dev
    pos = rt.upload(positions, np.int64).reshape(-1)
    half = int(inv.size)
    n = int(pos.size)
    cos = rt.empty((n, half), np.float32)
    sin = rt.empty((n, half), np.float32)
    if n and half:
        rt.kernel("rope", "rope_cos_sin_yarn_f32")(
            rt.grid(n * half), (ELEMWISE_THREADS, 1, 1),
            (pos, inv, keep_d, mix_d, np.float64(freq_scale), np.float64(mscale), cos, sin,
             np.int32(n), np.int32(half)))
    return cos, sin


def qkv_rope_write(qkv: Any, q_norm: Any | None, k_norm: Any | None, eps: float, cos: Any,
                   sin: Any, style: str, k_cache: Any, v_cache: Any, slots: Any, n_head: int,
                   n_head_kv: int, head_dim: int) -> Any:
    """GPU twin of `kvshare.ops.rope.qkv_rope_write`, one `qkv_rope_write_<kv dtype>` launch
    (kernels/qkv_rope.cu): q normed and rotated in place in qkv's q columns (returned as the
    `[N, n_head, head_dim]` view), K normed, rotated and stored at `slots`, V stored. Host
    slots are checked as `write_kv` checks them; a device slot outside the pool (a graph's
    padding row: -1) stores nothing."""
    cp = cupy_module()
    if style not in _ROPE_STYLES:
        raise ValueError(f"unknown rope style {style!r}")
    _check_cache(k_cache, v_cache)
    H, K, D = int(n_head), int(n_head_kv), int(head_dim)
    nb, bs, n_kv, hd = (int(s) for s in k_cache.shape)
    if (n_kv, hd) != (K, D):
        raise ValueError(f"the cache holds [{n_kv}, {hd}] per token, the model [{K}, {D}]")
    if not (isinstance(qkv, cp.ndarray) and qkv.ndim == 2 and qkv.dtype == np.float32
            and int(qkv.shape[1]) == (H + 2 * K) * D and qkv.strides[1] == 4
            and qkv.strides[0] % 4 == 0):
        raise TypeError(f"qkv must be a float32 CuPy array [N, {(H + 2 * K) * D}] with unit "
                        "column stride (it is updated in place)")
    n = int(qkv.shape[0])
    cos = rt.upload(cos, np.float32)
    sin = rt.upload(sin, np.float32)
    half = int(cos.shape[-1]) if cos.ndim == 2 else -1
    if (cos.ndim != 2 or tuple(sin.shape) != tuple(cos.shape) or int(cos.shape[0]) != n
            or 2 * half > D):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit {n} rows of head size {D}")
    if not cos.flags.c_contiguous:
        cos = cp.ascontiguousarray(cos)
    if not sin.flags.c_contiguous:
        sin = cp.ascontiguousarray(sin)
    n_slots = nb * bs
    _check_slots(slots, n, n_slots)
    norms = []
    for name, wt in (("q_norm", q_norm), ("k_norm", k_norm)):
        if wt is None:
            norms.append(None)
            continue
        wd = rt.upload(wt, np.float32).reshape(-1)
        if int(wd.size) != D:
            raise ValueError(f"{name} has {int(wd.size)} elements, heads have {D}")
        norms.append(wd)
    q = qkv[:, : H * D].reshape(n, H, D)
    if n == 0:
        return q
    d_slots = rt.upload(slots, np.int64).reshape(-1)
    flags = (1 if norms[0] is not None else 0) | (2 if norms[1] is not None else 0)
    rt.kernel("qkv_rope", f"qkv_rope_write_{_kv_tag(k_cache.dtype)}")(
        rt.grid(n * (H + K), ROWS_PER_BLOCK), (32 * ROWS_PER_BLOCK, 1, 1),
        (qkv, np.int64(rt.estrides(qkv)[0]), cos, sin,
         norms[0] if norms[0] is not None else cos, norms[1] if norms[1] is not None else cos,
         np.int32(flags), np.float32(eps), k_cache, v_cache, d_slots, np.int64(n_slots),
         np.int32(n), np.int32(H), np.int32(K), np.int32(D), np.int32(max(half, 0)),
         np.int32(_ROPE_STYLES[style])))
    return q


# --- RMSNorm -------------------------------------------------------------------------------------

def _row_layout(a: Any) -> tuple[int, int, int, int] | None:
    """(n_rows, inner, stride0, stride1) addressing the rows of a float32 array whose last
    axis has unit stride: 1-D, 2-D, 3-D with any strides, more dims when C-contiguous."""
    if a.dtype != np.float32 or any(s % 4 for s in a.strides):
        return None
    if a.ndim >= 1 and a.shape[-1] > 1 and a.strides[-1] != 4:
        return None
    st = rt.estrides(a)
    if a.ndim == 1:
        return 1, 1, 0, 0
    if a.ndim == 2:
        return int(a.shape[0]), 1, st[0], 0
    if a.ndim == 3:
        return int(a.shape[0] * a.shape[1]), int(a.shape[1]), st[0], st[1]
    if a.flags.c_contiguous:
        d = int(a.shape[-1])
        return int(a.size // max(d, 1)), 1, d, 0
    return None


def rms_norm(x: Any, weight: Any | None, eps: float, *, out: Any | None = None) -> Any:
    """GPU twin of `kvshare.ops.norm.rms_norm`."""
    cp = cupy_module()
    if not isinstance(x, cp.ndarray):
        x = cp.asarray(x)
    if x.ndim == 0:
        raise ValueError("rms_norm needs at least one axis")
    lay = _row_layout(x)
    if lay is None:
        x = cp.ascontiguousarray(x, dtype=np.float32)
        lay = _row_layout(x)
    d = int(x.shape[-1])
    if out is not None and tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    olay = _row_layout(out) if isinstance(out, cp.ndarray) else None
    if olay is not None and olay[:2] != lay[:2]:
        olay = None
    dst = out if olay is not None else rt.empty(x.shape, np.float32)
    if olay is None:
        olay = _row_layout(dst)
    if weight is not None:
        w = rt.upload(weight, np.float32).reshape(-1)
        if int(w.size) != d:
            raise ValueError(f"weight has {int(w.size)} elements, rows have {d}")
    else:
        w = x  # unused (has_weight = 0)
    n_rows, inner, s0, s1 = lay
    if n_rows and d:
        rt.kernel("rms_norm", "rms_norm_f32")(
            rt.grid(n_rows, ROWS_PER_BLOCK), (32 * ROWS_PER_BLOCK, 1, 1),
            (x, np.int64(s0), np.int64(s1), dst, np.int64(olay[2]), np.int64(olay[3]), w,
             np.int32(weight is not None), np.int64(n_rows), np.int32(inner), np.int32(d),
             np.float32(eps)))
    if out is not None and dst is not out:
        out[...] = dst
        return out
    return dst


# --- activations ---------------------------------------------------------------------------------

def _gated(entry: str, gate: Any, up: Any | None, out: Any | None) -> Any:
    cp = cupy_module()
    shape = tuple(gate.shape)
    g = rt.as_rows(gate)
    u = rt.as_rows(up) if up is not None else None
    if u is not None and tuple(u.shape) != tuple(g.shape):
        raise ValueError(f"gate {shape} and up {tuple(up.shape)} differ")
    n_rows, n_cols = (int(s) for s in g.shape)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    direct = (out is not None and isinstance(out, cp.ndarray) and out.ndim == 2
              and out.dtype == np.float32 and (n_cols <= 1 or out.strides[-1] == 4)
              and out.strides[0] % 4 == 0)
    dst = out if direct else rt.empty((n_rows, n_cols), np.float32)
    if n_rows * n_cols:
        gs, ds = rt.estrides(g)[0], rt.estrides(dst)[0]
        if entry == "geglu_tanh_f32":
            args = (g, np.int64(gs), u if u is not None else g,
                    np.int64(rt.estrides(u)[0] if u is not None else 0), np.int32(u is not None),
                    dst, np.int64(ds), np.int64(n_rows), np.int64(n_cols))
        else:
            args = (g, np.int64(gs), u, np.int64(rt.estrides(u)[0]), dst, np.int64(ds),
                    np.int64(n_rows), np.int64(n_cols))
        rt.kernel("activation", entry)(rt.grid(n_rows * n_cols), (ELEMWISE_THREADS, 1, 1), args)
    if out is not None and dst is not out:
        out[...] = dst.reshape(shape)
        return out
    return dst.reshape(shape)


def geglu_tanh(gate: Any, up: Any | None, *, out: Any | None = None) -> Any:
    """GPU twin of `kvshare.ops.activation.geglu_tanh` (`up=None`: plain GELU)."""
    return _gated("geglu_tanh_f32", gate, up, out)


def gelu_tanh(x: Any) -> Any:
    """GPU twin of `kvshare.ops.activation.gelu_tanh` (a new float32 array)."""
    return _gated("geglu_tanh_f32", x, None, None)


def swiglu(gate: Any, up: Any, *, out: Any | None = None) -> Any:
    """GPU twin of `kvshare.ops.activation.swiglu`."""
    if up is None:
        raise ValueError("swiglu needs `up`")
    return _gated("swiglu_f32", gate, up, out)


# --- embedding -----------------------------------------------------------------------------------

def embedding(table: Any, tokens: Any, scale: float = 1.0) -> Any:
    """GPU twin of `kvshare.ops.embedding.embedding`: float32 `[N, d]`. Host token ids are
    range-checked (IndexError, as on the CPU); an out-of-range id already on the device gives
    a NaN row. A `GpuBlockWeight` table (GGUF blocks) goes to `gpu_blocks.embedding`."""
    if isinstance(table, GpuBlockWeight):
        return gpu_blocks.embedding(table, tokens, scale)
    cp = cupy_module()
    if not isinstance(table, cp.ndarray) or table.ndim != 2:
        raise TypeError("the embedding table must be a 2-D CuPy array")
    vocab, d = (int(s) for s in table.shape)
    if not rt.is_device(tokens):
        ht = np.asarray(tokens).reshape(-1)
        if ht.size and (ht.min() < 0 or ht.max() >= vocab):
            raise IndexError(f"token id out of range [0, {vocab})")
    tok = rt.upload(tokens, np.int32).reshape(-1)
    n = int(tok.size)
    tag = _kv_tag(table.dtype)
    if not table.flags.c_contiguous:
        table = cp.ascontiguousarray(table)
    out = rt.empty((n, d), np.float32)
    if n and d:
        rt.kernel("embedding", f"embedding_{tag}")(
            rt.grid(n * d), (ELEMWISE_THREADS, 1, 1),
            (table, tok, out, np.int32(n), np.int32(d), np.int32(vocab), np.float32(scale)))
    return out


def gather_rows(x: Any, idx: Any) -> Any:
    """`x[idx]` of a float32 `[N, ...]` array whose rows are each contiguous (a row-strided
    view such as q inside the fused Q/K/V product is fine), by a device int32 `idx`: a new
    array `[len(idx), ...]` from `rt.empty` (a captured step's workspace). The indices are
    the caller's own (not checked on the device)."""
    if x.dtype != np.float32 or x.ndim < 2:
        raise TypeError(f"gather_rows takes a float32 array of rows, got {x.dtype} {x.shape}")
    inner = tuple(int(s) for s in x.shape[1:])
    d = int(np.prod(inner))
    es = rt.estrides(x)
    # the elements of a row are contiguous: each stride after the first is the product of
    # the sizes after it
    want = d
    for size, stride in zip(inner, es[1:]):
        want //= size
        if size > 1 and stride != want:
            raise ValueError("gather_rows needs each row's elements contiguous")
    n = int(idx.size)
    out = rt.empty((n, *inner), np.float32)
    if n and d:
        rt.kernel("embedding", "gather_rows_f32")(
            rt.grid(n * d), (ELEMWISE_THREADS, 1, 1),
            (x, np.int64(es[0]), idx, out, np.int32(n), np.int32(d)))
    return out


# --- linear --------------------------------------------------------------------------------------

def linear(x: Any, w: Any, bias: Any | None = None, *, out: Any | None = None) -> Any:
    """GPU twin of `kvshare.ops.linear.linear`: `x @ w.T (+ bias)` as float32 `[N, out]`.

    f16 weights: x is converted to f16 with a power-of-two scale per row (no overflow, see
    kernels/linear.cu), multiplied by cuBLAS (cublasGemmEx, f16 x f16 -> float32 with float32
    accumulation), then scaled back and biased in one pass. f32 weights: CuPy's matmul
    (float32 SGEMM). `GpuBlockWeight` (GGUF blocks read in place): `gpu_blocks.linear`."""
    if isinstance(w, GpuBlockWeight):
        return gpu_blocks.linear(x, w, bias, out=out)
    cp = cupy_module()
    if not isinstance(w, cp.ndarray) or w.ndim != 2:
        raise TypeError("linear weights must be a 2-D CuPy array [out, in]")
    n_out, n_in = (int(s) for s in w.shape)
    x = rt.as_rows(x)
    n = int(x.shape[0])
    if int(x.shape[1]) != n_in:
        raise ValueError(f"x has {int(x.shape[1])} features, w expects {n_in}")
    if out is not None and tuple(out.shape) != (n, n_out):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(n, n_out)}")
    direct = (out is not None and isinstance(out, cp.ndarray) and out.dtype == np.float32
              and out.flags.c_contiguous)
    y = out if direct else rt.empty((n, n_out), np.float32)
    b = rt.upload(bias, np.float32).reshape(-1) if bias is not None else None
    if b is not None and int(b.size) != n_out:
        raise ValueError(f"bias has {int(b.size)} elements, expected {n_out}")
    if n and n_out:
        if w.dtype == np.float16:
            if not w.flags.c_contiguous:
                w = cp.ascontiguousarray(w)
            x16 = rt.empty((n, n_in), np.float16)
            inv = rt.empty(n, np.float32)
            if n_in:
                rt.kernel("linear", "f32_to_f16_rowscaled")(
                    rt.grid(n, ROWS_PER_BLOCK), (32 * ROWS_PER_BLOCK, 1, 1),
                    (x, np.int64(rt.estrides(x)[0]), x16, inv, np.int64(n), np.int32(n_in)))
                rt.gemm_f16(x16, w, y)
            else:
                y.fill(0)
                inv.fill(1)
            rt.kernel("linear", "rowscale_bias_f32")(
                rt.grid(n * n_out), (ELEMWISE_THREADS, 1, 1),
                (y, inv, b if b is not None else inv, np.int32(b is not None), np.int64(n),
                 np.int64(n_out)))
        elif w.dtype == np.float32:
            cp.matmul(x, w.T, out=y)
            if b is not None:
                y += b
        else:
            raise TypeError(f"linear weights of dtype {w.dtype} are not supported on the GPU "
                            "(f16 or f32; CuPy has no bfloat16 dtype)")
    if out is not None and y is not out:
        out[...] = y
        return out
    return y


def linear_add(x: Any, w: Any, bias: Any | None, y: Any) -> Any:
    """GPU twin of `kvshare.ops.linear.linear_add`: `y += x @ w.T (+ bias)` in place. On a
    `GpuBlockWeight` with up to 16 rows, the mat-vec adds into y (one launch per part,
    `gpu_blocks.linear_add`; not with KVSHARE_GPU_FUSED=0, `rt.fused_ops`); otherwise
    `linear`, then the add."""
    if isinstance(w, GpuBlockWeight) and rt.fused_ops():
        return gpu_blocks.linear_add(x, w, bias, y)
    y += linear(x, w, bias)
    return y


def linear_glu(x: Any, w: Any, activation: str) -> Any:
    """GPU twin of `kvshare.ops.linear.linear_glu`: `act(x @ gate.T) * (x @ up.T)` float32
    `[N, n_ff]` for w = gate|up stacked `[2 n_ff, in]`. One `bmvglu` launch where
    `gpu_blocks.glu_fuses` (block weights, gate and up of one type, up to 16 rows; not with
    KVSHARE_GPU_FUSED=0, `rt.fused_ops`); otherwise `linear`, then the activation over the
    gate half (the view it returns)."""
    if activation not in gpu_blocks.GLU_ACT:
        raise ValueError(f"unknown activation {activation!r}")
    if (isinstance(w, GpuBlockWeight) and rt.fused_ops()
            and gpu_blocks.glu_fuses(w, int(rt.as_rows(x).shape[0]))):
        return gpu_blocks.linear_glu(x, w, activation)
    gu = linear(x, w)
    ff = int(gu.shape[1]) // 2
    gate, up = gu[:, :ff], gu[:, ff:]
    if activation == "gelu_tanh":
        return geglu_tanh(gate, up, out=gate)
    return swiglu(gate, up, out=gate)


# --- hybrid-model ops (gated delta rule, causal conv with state): kvshare.ops.gpu_hybrid --------
from kvshare.ops.gpu_hybrid import (causal_conv1d, causal_conv1d_step,  # noqa: E402,F401
                                    gated_delta_chunked, gated_delta_step)
