"""Paged attention over a block-table KV cache, for prefill chunks and decode tokens of several
sequences in one call, with causal and sliding-window masks and grouped-query heads.

Cache layout of one layer (views of `KVArrays.kv`): `k_cache`, `v_cache`:
`[n_blocks, block_size, n_kv_heads, head_dim]`. Position p of a sequence lives in block
`block_table[p // block_size]`, row `p % block_size`.

Masks (llama.cpp's, `llama_hparams::is_masked_swa` with LLAMA_SWA_TYPE_STANDARD): a query at
position `qp` sees a key at position `kp` iff `kp <= qp` and, with a window `W > 0`,
`qp - kp < W` (the window counts the query's own token: it sees itself and W-1 earlier ones).
Query head h reads KV head `h // (n_head // n_kv_heads)`.

Sinks (gpt-oss, llama.cpp's `attn_sinks` through `ggml_soft_max_ext`): one learned logit per
query head that joins the softmax's denominator and no value, so a head can attend to
"nothing": `out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m))`, m the max
of the scores and the sink. The compiled kernel, the NumPy tiles and the GPU op
(kernels/paged_attention.cu) all take them.

q8_0 pools (uint8 caches, `kvshare.ops.kv_q8_0`): the last axis is a row's Q8_0 blocks
(`head_dim / 32 * 34` bytes); `write_kv` quantizes, the kernel reads the blocks from the pool
(converting them to f32 a few rows at a time), the NumPy tiles read dequantized copies.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvshare import _core
from kvshare.backend import CPU, CPU_THREADS, Backend
from kvshare.ops import kv_q8_0 as q8
from kvshare.ops._dispatch import gpu_op
from kvshare.ops.parallel import ROWS

# Largest score tile (query rows x heads x keys) held at once, in elements (16 MB of f32).
_TILE_ELEMS = 1 << 22
# Most query rows per tile: a tile computes the scores of the rectangle of keys its queries
# can see, so smaller tiles waste less on masked entries (the upper triangle of causal
# attention; with a window, keys only the tile's first queries see).
_TILE_ROWS = 128
# Sequences with at most this many query rows in a call go to the compiled kernel
# (`_core.paged_attention`, f32 or f16 pools): decode rows in one pass over K and V split over
# threads at long context (at 6K context NumPy's small products spent ~4 ms per global layer on
# them), prefill chunks as flash-attention tiles that read f16 K/V in place (no f32 copies of
# key tiles, no scores of masked keys). Unbounded: the NumPy tile path below stays for other
# pool dtypes and as the tests' oracle (set this to 0 to take it).
KERNEL_MAX_ROWS = 1 << 62
DECODE_ROWS = 4  # the kernel's DECODE_ROWS: more rows per sequence take its tiled path
_KERNEL_KV_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint8))
_Q8 = np.dtype(np.uint8)  # a q8_0 pool's array dtype


def pad_block_tables(tables: Sequence[np.ndarray]) -> np.ndarray:
    """A list of block tables as one int32 `[n_seq, max_blocks]` array padded with -1."""
    width = max((len(t) for t in tables), default=0)
    out = np.full((len(tables), max(width, 1)), -1, np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def kv_slots(block_tables: np.ndarray, q_starts: np.ndarray, start_positions: np.ndarray,
             block_size: int) -> np.ndarray:
    """Flat cache row (`block * block_size + offset`) of every query token, int64 `[N]`:
    where `write_kv` puts each token's K and V."""
    seq, pos = token_positions(q_starts, start_positions)
    return slots_of(block_tables, seq, pos, block_size)


def token_positions(q_starts: np.ndarray, start_positions: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Each query token's sequence (int64 `[N]`, sequence `s` owning rows
    `q_starts[s]..q_starts[s + 1]`) and position (its sequence's start plus its offset)."""
    q_starts = np.asarray(q_starts, dtype=np.int64)
    lens = np.diff(q_starts)
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.asarray(start_positions, dtype=np.int64)[seq] + (
        np.arange(q_starts[-1], dtype=np.int64) - q_starts[:-1][seq])
    return seq, pos


def slots_of(block_tables: np.ndarray, seq: np.ndarray, positions: np.ndarray,
             block_size: int) -> np.ndarray:
    """`kv_slots` from each token's sequence (`seq`, a row of `block_tables`) and position."""
    blocks = np.asarray(block_tables)[seq, positions // block_size].astype(np.int64)
    if (blocks < 0).any():
        raise IndexError("block table does not cover every position of the batch")
    return blocks * block_size + positions % block_size


def write_kv(k_cache: Any, v_cache: Any, slots: Any, k: Any, v: Any, *,
             backend: Backend = CPU) -> None:
    """Store K and V of N tokens: `k_cache.reshape(-1, n_kv, hd)[slots] = k` (same for v).
    k, v: float32 `[N, n_kv_heads, head_dim]` (views allowed); slots: int `[N]` from
    `kv_slots`; converts to the cache dtype (f32 or f16; q8_0 caches: quantized)."""
    if backend.is_gpu:
        return gpu_op("write_kv")(k_cache, v_cache, slots, k, v)
    nb, bs = k_cache.shape[:2]
    if k_cache.dtype == _Q8:
        k_cache.reshape(nb * bs, *k_cache.shape[2:])[slots] = q8.quantize(k)
        v_cache.reshape(nb * bs, *v_cache.shape[2:])[slots] = q8.quantize(v)
        return None
    k_cache.reshape(nb * bs, *k_cache.shape[2:])[slots] = k
    v_cache.reshape(nb * bs, *v_cache.shape[2:])[slots] = v
    return None


# A sequence's blocks are read in place as views of their ascending runs (a shared prefix
# computed in one go is one run, a session's own tail another) up to this many runs; a more
# fragmented table is gathered into one copy. Gathering every table would copy each
# sequence's keys and values at every decode step (12 MB per global layer at 6K context).
_MAX_RUNS = 8


def _block_runs(blocks: np.ndarray) -> list[tuple[int, int]] | None:
    """`[a, e)` index ranges of `blocks` whose ids ascend by one, in order; None when there
    are more than `_MAX_RUNS` of them (the caller gathers a copy instead)."""
    if len(blocks) == 0:
        return []
    breaks = (np.flatnonzero(np.diff(blocks) != 1) + 1).tolist()
    if len(breaks) >= _MAX_RUNS:
        return None
    return list(zip([0, *breaks], [*breaks, len(blocks)]))


def _pieces(cache: np.ndarray, blocks: np.ndarray, runs: list[tuple[int, int]] | None
            ) -> list[tuple[int, np.ndarray]]:
    """The rows of `blocks` as `(first row, rows [len, n_kv, hd])` pieces: a view per run, or
    one gathered copy (`runs` None); a q8_0 cache's rows dequantized (copies)."""
    bs = cache.shape[1]
    tail = cache.shape[2:]
    if runs is None:
        out = [(0, cache[blocks].reshape(len(blocks) * bs, *tail))]
    else:
        out = [(a * bs, cache[blocks[a] : blocks[e - 1] + 1].reshape((e - a) * bs, *tail))
               for a, e in runs]
    if cache.dtype == _Q8:
        out = [(first, q8.dequantize(rows)) for first, rows in out]
    return out


def _key_blocks(block_tables: Any, s: int, p0: int, n: int, window: int, bs: int
                ) -> tuple[np.ndarray, int, int]:
    """The block ids holding the keys that sequence s's rows (positions `p0 .. p0 + n - 1`)
    see, the index of the first of them in its table and the first key position; IndexError
    when the table does not cover them."""
    qp_hi = p0 + n
    k_lo = max(0, p0 - window + 1) if window else 0
    b0, b1 = k_lo // bs, -(-qp_hi // bs)
    blocks = np.asarray(block_tables[s, b0:b1])
    if len(blocks) < b1 - b0 or (blocks < 0).any():
        raise IndexError(f"sequence {s}: block table does not cover positions < {qp_hi}")
    return blocks, b0, k_lo


def _check_sinks(sinks: Any, n_head: int, backend: Backend) -> Any:
    if backend.is_gpu and not isinstance(sinks, np.ndarray):
        if tuple(sinks.shape) != (n_head,):  # a device array: the GPU op checks the rest
            raise ValueError(f"sinks must be [{n_head}], got {tuple(sinks.shape)}")
        return sinks
    sinks = np.ascontiguousarray(np.asarray(sinks, np.float32).reshape(-1))
    if sinks.shape != (n_head,):
        raise ValueError(f"sinks must be [{n_head}], got {sinks.shape}")
    return sinks


def paged_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, q_starts: Any,
                    start_positions: Any, *, scale: float, window: int = 0,
                    backend: Backend = CPU, out: Any | None = None,
                    mask_cache: dict | None = None, parts: int = 1,
                    invariant: bool = False, sinks: Any | None = None) -> Any:
    """Attention of every query token over its own sequence's cached keys and values.

    q: float32 `[N, n_head, head_dim]`, the concatenated queries of n_seq sequences;
    sequence s owns rows `q_starts[s] : q_starts[s+1]` (`q_starts` int `[n_seq + 1]`) at
    positions `start_positions[s] + 0, 1, ...`. The cache must already hold K/V of every
    position up to each query's own (call `write_kv` first). block_tables: int32
    `[n_seq, max_blocks]` (-1 padded; `pad_block_tables`). scale: multiplier of q.k (applied
    before the softmax, which is in float32). window: 0 for full causal attention, else the
    sliding-window size W (see the module docstring). Returns float32 `[N, n_head, head_dim]`
    (into `out` when given). `mask_cache`: an optional dict reused across the layers of one
    forward call to keep the masks (CPU only; the GPU twin may ignore it). `parts` > 1 (CPU):
    spread the query tiles over that many threads (`ops.parallel`; BLAS should be on one
    thread then). `invariant` (CPU kernel pools): every row's result is the same bits in any
    call (decode rows take the prefill tiles, key blocks at absolute positions), at some cost
    to long-context decode; what 8-bit activations (`BlockWeight` "vnni") need. `sinks`:
    float32 `[n_head]` sink logits (module docstring); on a GPU a host or a device array.
    """
    if sinks is not None:
        sinks = _check_sinks(sinks, q.shape[1], backend)
    if backend.is_gpu:
        return gpu_op("paged_attention")(q, k_cache, v_cache, block_tables, q_starts,
                                         start_positions, scale=scale, window=window, out=out,
                                         sinks=sinks)
    n_tok, n_head, hd = q.shape
    bs = k_cache.shape[1]
    if out is None:
        hd_v = hd if v_cache.dtype == _Q8 else v_cache.shape[3]  # q8_0: bytes, and hd_v == hd
        out = np.empty((n_tok, n_head, hd_v), np.float32)
    q_starts = np.asarray(q_starts)
    start_positions = np.asarray(start_positions)
    if mask_cache is None:
        mask_cache = {}
    lens = np.diff(q_starts)
    kernel_rows = 0
    if (k_cache.dtype in _KERNEL_KV_DTYPES and q.dtype == np.float32
            and (lens <= KERNEL_MAX_ROWS).any()):
        kernel_rows = KERNEL_MAX_ROWS
        # a prefill chunk's attention runs while BLAS idles: all cores, even in steps that
        # gave them to BLAS (`CPU_THREADS.for_tokens`); decode rows keep the kernels' share
        threads = (CPU_THREADS.max_threads if (lens > DECODE_ROWS).any()
                   else CPU_THREADS.kernel_threads)
        qc = q if q.flags.c_contiguous else np.ascontiguousarray(q)
        res = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        try:
            _core.paged_attention(qc, k_cache, v_cache,
                                  np.ascontiguousarray(block_tables, dtype=np.int32),
                                  np.ascontiguousarray(q_starts, dtype=np.int64),
                                  np.ascontiguousarray(start_positions, dtype=np.int64),
                                  float(scale), int(window), res, kernel_rows, threads,
                                  invariant, sinks)
        except IndexError:
            # name the first uncovered sequence of the whole batch, as the GPU op does
            for s in range(len(q_starts) - 1):
                _key_blocks(block_tables, s, int(start_positions[s]),
                            int(q_starts[s + 1] - q_starts[s]), window, bs)
            raise
        if res is not out:
            out[...] = res  # only the kernel's rows matter; the rest is written below
    jobs = []  # (sequence's keys/values, query rows, tile), one per query tile
    for s in range(len(q_starts) - 1):
        r0, r1 = int(q_starts[s]), int(q_starts[s + 1])
        n = r1 - r0
        if n <= kernel_rows:
            continue
        p0 = int(start_positions[s])
        qp_hi = p0 + n  # one past the last query position
        blocks, b0, k_lo_all = _key_blocks(block_tables, s, p0, n, window, bs)
        runs = _block_runs(blocks)
        seq = (s, r0, p0, b0 * bs, _pieces(k_cache, blocks, runs), _pieces(v_cache, blocks, runs))
        # query tiles small enough that a tile's score matrix stays ~16 MB
        span = qp_hi - k_lo_all
        tile = max(1, min(n, _TILE_ROWS, _TILE_ELEMS // max(1, n_head * span)))
        jobs += [(seq, t0, min(n, t0 + tile)) for t0 in range(0, n, tile)]

    def run(job) -> None:
        (s, r0, p0, base, K, V), t0, t1 = job
        _attention_tile(q, K, V, out, s, r0, p0, base, t0, t1, scale, window, mask_cache,
                        sinks)

    if parts > 1 and len(jobs) > 1:
        # round-robin: causal tiles grow along the sequence, neighbours cost about the same
        buckets = [jobs[i::parts] for i in range(min(parts, len(jobs)))]
        ROWS.run(lambda bucket: [run(j) for j in bucket], buckets)
    else:
        for job in jobs:
            run(job)
    return out


def _attention_tile(q: np.ndarray, K: list, V: list, out: np.ndarray, s: int,
                    r0: int, p0: int, base: int, t0: int, t1: int, scale: float, window: int,
                    mask_cache: dict, sinks: np.ndarray | None = None) -> None:
    """Query rows `r0 + [t0, t1)` of sequence s (positions `p0 + [t0, t1)`) over the
    sequence's keys/values K, V (`_pieces`; position `base` at row 0)."""
    n_head, hd = q.shape[1], q.shape[2]
    n_kv = K[0][1].shape[1]
    g = n_head // n_kv
    qa, qb = p0 + t0, p0 + t1  # query positions [qa, qb)
    k_lo = max(0, qa - window + 1) if window else 0
    k_hi = qb
    key = (s, t0, t1, window, p0)
    mask = mask_cache.get(key)
    if mask is None:
        qpos = np.arange(qa, qb)[:, None]
        kpos = np.arange(k_lo, k_hi)[None, :]
        bad = kpos > qpos
        if window:
            bad |= (qpos - kpos) >= window
        mask = np.where(bad, np.float32(-np.inf), np.float32(0.0)) if bad.any() else None
        mask_cache[key] = mask  # a dict store is atomic; two threads at worst build it twice
    qt = q[r0 + t0 : r0 + t1]  # [m, n_head, hd]
    m = t1 - t0
    T = k_hi - k_lo
    if n_kv == 1:
        qg = (qt * np.float32(scale)).reshape(1, m * n_head, hd)
    else:
        qg = (qt * np.float32(scale)).reshape(m, n_kv, g, hd).transpose(1, 0, 2, 3)
        qg = qg.reshape(n_kv, m * g, hd)
    lo, hi = k_lo - base, k_hi - base  # the tile's keys, in rows of the sequence's pieces
    pieces = []  # (columns of the score matrix, V rows) per piece the tile reads
    sc = np.empty((n_kv, m * g, T), np.float32)
    for (first, Kp), (_, Vp) in zip(K, V):
        a, b = max(lo, first), min(hi, first + len(Kp))
        if a >= b:
            continue
        cols = slice(a - lo, b - lo)
        np.matmul(qg, Kp[a - first : b - first].transpose(1, 2, 0), out=sc[:, :, cols])
        pieces.append((cols, Vp[a - first : b - first]))
    if mask is not None:
        sc4 = sc.reshape(n_kv, m, g, T)
        sc4 += mask[None, :, None, :]
    mx = sc.max(axis=-1, keepdims=True)
    sk = None
    if sinks is not None:
        # the score rows are (query, head-in-group) pairs of each KV head
        sk = np.broadcast_to(sinks.reshape(n_kv, 1, g), (n_kv, m, g)).reshape(n_kv, m * g, 1)
        np.maximum(mx, sk, out=mx)
    sc -= mx
    np.exp(sc, out=sc)
    den = sc.sum(axis=-1, keepdims=True)
    if sk is not None:
        den += np.exp(sk - mx)
    (cols, Vt), rest = pieces[0], pieces[1:]
    o = np.matmul(sc[:, :, cols], Vt.transpose(1, 0, 2))  # [n_kv, m*g, hd]
    for cols, Vt in rest:
        o += np.matmul(sc[:, :, cols], Vt.transpose(1, 0, 2))
    o /= den
    if n_kv == 1:
        out[r0 + t0 : r0 + t1] = o.reshape(m, n_head, -1)
    else:
        out[r0 + t0 : r0 + t1] = o.reshape(n_kv, m, g, -1).transpose(1, 0, 2, 3).reshape(
            m, n_head, -1)


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                        k_pos: np.ndarray, *, scale: float, window: int = 0,
                        sinks: np.ndarray | None = None) -> np.ndarray:
    """Naive dense attention (float64) for tests: q `[n, H, d]`, k/v `[T, n_kv, d]` with
    positions q_pos `[n]`, k_pos `[T]`; `sinks` `[H]` optional."""
    n, H, d = q.shape
    n_kv = k.shape[1]
    g = H // n_kv
    out = np.zeros((n, H, v.shape[2]))
    for i in range(n):
        for h in range(H):
            kv = h // g
            s = (k[:, kv].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            ok = k_pos <= q_pos[i]
            if window:
                ok &= (q_pos[i] - k_pos) < window
            s = np.where(ok, s, -np.inf)
            mx = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - mx)
            den = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - mx))
            p /= den
            out[i, h] = p @ v[:, kv].astype(np.float64)
    return out
