"""Paged attention against a naive dense float64 reference: causal and sliding-window masks,
GQA, several sequences in one call, shuffled block tables, chunked queries; both the compiled
kernel (`_core.paged_attention`: decode rows and prefill tiles, f32 and f16 pools) and the
NumPy tile path (`KERNEL_MAX_ROWS = 0`, the oracle and the path of other pool dtypes)."""

import numpy as np
import pytest

import kvshare.ops.attention as attention_mod
from kvshare.ops.attention import (attention_reference, kv_slots, pad_block_tables,
                                   paged_attention, write_kv)


@pytest.fixture(params=["kernel", "numpy"])
def path(request, monkeypatch):
    """Run a test on the compiled kernel (all rows) and on the NumPy tile path."""
    if request.param == "numpy":
        monkeypatch.setattr(attention_mod, "KERNEL_MAX_ROWS", 0)
    return request.param


@pytest.fixture
def numpy_path(monkeypatch):
    """The NumPy tile path only (tests of its tiling, runs and threads)."""
    monkeypatch.setattr(attention_mod, "KERNEL_MAX_ROWS", 0)


def _setup(rng, lens, starts, n_head, n_kv, hd, bs, n_blocks, shuffle, dtype=np.float32):
    """Fill a paged cache with random K/V for every sequence's positions [0, start + len)."""
    kc = np.zeros((n_blocks, bs, n_kv, hd), dtype)
    vc = np.zeros_like(kc)
    free = rng.permutation(n_blocks) if shuffle else np.arange(n_blocks)
    tables, keys, vals, used = [], [], [], 0
    for n, s in zip(lens, starts):
        total = s + n
        nb = -(-total // bs)
        t = free[used : used + nb].astype(np.int32)
        used += nb
        tables.append(t)
        k = rng.standard_normal((total, n_kv, hd)).astype(np.float32)
        v = rng.standard_normal((total, n_kv, hd)).astype(np.float32)
        keys.append(k)
        vals.append(v)
    bt = pad_block_tables(tables)
    # write through write_kv with the slots of "all positions as one chunk" per sequence
    q_starts = np.concatenate([[0], np.cumsum([s + n for n, s in zip(lens, starts)])])
    slots = kv_slots(bt, q_starts, np.zeros(len(lens), np.int64), bs)
    write_kv(kc, vc, slots, np.concatenate(keys), np.concatenate(vals))
    return kc, vc, bt, keys, vals


@pytest.mark.parametrize("n_head,n_kv", [(4, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize("window", [0, 5, 16])
@pytest.mark.parametrize("shuffle", [False, True])
def test_paged_attention_matches_dense(path, n_head, n_kv, window, shuffle):
    rng = np.random.default_rng(n_head * 100 + n_kv * 10 + window + shuffle)
    hd, bs = 16, 4
    lens, starts = [7, 1, 12], [0, 9, 3]  # a prefill, a decode token, a later chunk
    kc, vc, bt, keys, vals = _setup(rng, lens, starts, n_head, n_kv, hd, bs, 32, shuffle)
    q = rng.standard_normal((sum(lens), n_head, hd)).astype(np.float32)
    q_starts = np.concatenate([[0], np.cumsum(lens)])
    out = paged_attention(q, kc, vc, bt, q_starts, np.array(starts), scale=0.3, window=window)
    for s, (n, p0) in enumerate(zip(lens, starts)):
        ref = attention_reference(q[q_starts[s] : q_starts[s + 1]], keys[s], vals[s],
                                  np.arange(p0, p0 + n), np.arange(p0 + n), scale=0.3,
                                  window=window)
        np.testing.assert_allclose(out[q_starts[s] : q_starts[s + 1]], ref, rtol=1e-5,
                                   atol=1e-5)


def test_query_tiling_matches_untiled(monkeypatch, numpy_path):
    import kvshare.ops.attention as A

    rng = np.random.default_rng(1)
    kc, vc, bt, keys, vals = _setup(rng, [40], [10], 4, 1, 8, 4, 16, True)
    q = rng.standard_normal((40, 4, 8)).astype(np.float32)
    args = (q, kc, vc, bt, np.array([0, 40]), np.array([10]))
    full = paged_attention(*args, scale=0.5, window=7)
    monkeypatch.setattr(A, "_TILE_ELEMS", 100)  # forces tiles of one or two query rows
    tiled = paged_attention(*args, scale=0.5, window=7)
    np.testing.assert_allclose(tiled, full, rtol=1e-6, atol=1e-6)


def test_window_counts_the_query_itself(path):
    """llama.cpp: key kp is visible from query qp iff qp - kp < window."""
    hd, bs = 4, 2
    kc = np.zeros((8, bs, 1, hd), np.float32)
    vc = np.zeros_like(kc)
    k = np.zeros((6, 1, hd), np.float32)
    v = np.arange(6, dtype=np.float32)[:, None, None] * np.ones((6, 1, hd), np.float32)
    bt = pad_block_tables([np.arange(3)])
    write_kv(kc, vc, kv_slots(bt, np.array([0, 6]), np.array([0]), bs), k, v)
    q = np.zeros((1, 1, hd), np.float32)
    # query at position 5 with window 2 sees positions 4 and 5 only: mean value 4.5
    out = paged_attention(q, kc, vc, bt, np.array([0, 1]), np.array([5]), scale=1.0, window=2)
    np.testing.assert_allclose(out[0, 0], 4.5)
    out = paged_attention(q, kc, vc, bt, np.array([0, 1]), np.array([5]), scale=1.0, window=0)
    np.testing.assert_allclose(out[0, 0], 2.5)


def test_uncovered_block_table_raises(path):
    kc = np.zeros((4, 2, 1, 4), np.float32)
    bt = pad_block_tables([np.array([0])])
    with pytest.raises(IndexError):
        paged_attention(np.zeros((1, 1, 4), np.float32), kc, kc, bt, np.array([0, 1]),
                        np.array([5]), scale=1.0)


@pytest.mark.parametrize("parts", [2, 3])
def test_parallel_tiles_equal_serial(numpy_path, parts):
    """`parts` > 1 spreads query tiles over threads: bit-identical to the serial loop."""
    rng = np.random.default_rng(parts)
    nb, bs, n_kv, hd, H = 60, 16, 2, 32, 4
    kc = rng.standard_normal((nb, bs, n_kv, hd)).astype(np.float32)
    vc = rng.standard_normal((nb, bs, n_kv, hd)).astype(np.float32)
    tables = np.stack([rng.permutation(nb)[:30], rng.permutation(nb)[:30]]).astype(np.int32)
    q_starts = np.array([0, 300, 330])
    starts = np.array([100, 7])
    q = rng.standard_normal((330, H, hd)).astype(np.float32)
    for window in (0, 40):
        a = paged_attention(q, kc, vc, tables, q_starts, starts, scale=0.2, window=window)
        b = paged_attention(q, kc, vc, tables, q_starts, starts, scale=0.2, window=window,
                            parts=parts)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("max_runs", [1, 8, 100])
def test_block_runs_read_in_place_or_gathered(monkeypatch, numpy_path, max_runs):
    """A table of a few ascending runs (shared prefix + own tail) is read as views of each run;
    beyond `_MAX_RUNS` runs it is gathered: same result, against the dense reference, with
    query tiles whose key range starts and ends inside different runs."""
    import kvshare.ops.attention as A

    monkeypatch.setattr(A, "_MAX_RUNS", max_runs)
    monkeypatch.setattr(A, "_TILE_ROWS", 8)
    rng = np.random.default_rng(max_runs)
    bs, n_kv, hd, H = 4, 2, 8, 4
    table = np.concatenate([np.arange(10, 20), np.arange(3, 6), np.arange(30, 34)]).astype(np.int32)
    total = len(table) * bs  # 68 positions
    kc = rng.standard_normal((40, bs, n_kv, hd)).astype(np.float32)
    vc = rng.standard_normal((40, bs, n_kv, hd)).astype(np.float32)
    keys = kc[table].reshape(total, n_kv, hd)
    vals = vc[table].reshape(total, n_kv, hd)
    p0, n = 20, 45
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    for window in (0, 13):
        out = paged_attention(q, kc, vc, table[None], np.array([0, n]), np.array([p0]),
                              scale=0.4, window=window, parts=2 if max_runs == 8 else 1)
        ref = attention_reference(q, keys[: p0 + n], vals[: p0 + n], np.arange(p0, p0 + n),
                                  np.arange(p0 + n), scale=0.4, window=window)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_head,n_kv,hd", [(4, 1, 256), (8, 2, 64), (3, 3, 8)])
@pytest.mark.parametrize("window", [0, 512])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_decode_kernel_equals_numpy_path(monkeypatch, n_head, n_kv, hd, window, kv_dtype):
    """Sequences with one query row take the compiled kernel's decode path (split over threads
    at long context), the 5-row chunk in the same call its prefill tiles; the NumPy tiles give
    the same result."""
    import kvshare.ops.attention as attention_mod

    rng = np.random.default_rng(n_head + hd + window)
    bs = 16
    lens, starts = [1, 1, 5, 1], [3000, 40, 700, 1200]  # decode rows and one prefill chunk
    kc, vc, bt, keys, vals = _setup(rng, lens, starts, n_head, n_kv, hd, bs, 400, True)
    kc, vc = kc.astype(kv_dtype), vc.astype(kv_dtype)  # an f16 pool holds rounded values
    keys = [k.astype(kv_dtype).astype(np.float32) for k in keys]
    vals = [v.astype(kv_dtype).astype(np.float32) for v in vals]
    q = rng.standard_normal((sum(lens), n_head, hd)).astype(np.float32)
    q_starts = np.concatenate([[0], np.cumsum(lens)])
    args = (q, kc, vc, bt, q_starts, np.array(starts))
    fast = paged_attention(*args, scale=0.0625, window=window)
    # a strided `out` view goes through a contiguous buffer
    wide = np.zeros((sum(lens), n_head, hd * 2), np.float32)
    paged_attention(*args, scale=0.0625, window=window, out=wide[:, :, :hd])
    monkeypatch.setattr(attention_mod, "KERNEL_MAX_ROWS", 0)
    slow = paged_attention(*args, scale=0.0625, window=window)
    np.testing.assert_allclose(fast, slow, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(wide[:, :, :hd], fast)
    s = 1  # and against the dense reference for one decode row
    ref = attention_reference(q[q_starts[s]:q_starts[s + 1]], keys[s], vals[s],
                              np.arange(starts[s], starts[s] + 1), np.arange(starts[s] + 1),
                              scale=0.0625, window=window)
    np.testing.assert_allclose(fast[q_starts[s]:q_starts[s + 1]], ref, rtol=1e-5, atol=1e-5)


def test_decode_kernel_rejects_bad_input():
    from kvshare import _core

    kc = np.zeros((4, 2, 1, 16), np.float32)
    q = np.zeros((1, 2, 16), np.float32)
    out = np.zeros_like(q)
    bt = np.array([[0, -1]], np.int32)
    ok = dict(q_starts=np.array([0, 1], np.int64), start_positions=np.array([1], np.int64))

    def call(**kw):
        a = {"q": q, "k_cache": kc, "v_cache": kc, "block_tables": bt, **ok, "scale": 1.0,
             "window": 0, "out": out, "max_rows": 1, **kw}
        _core.paged_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"],
                              a["q_starts"], a["start_positions"], a["scale"], a["window"],
                              a["out"], a["max_rows"])

    call()  # positions 0-1 live in block 0
    with pytest.raises(IndexError):
        call(start_positions=np.array([2], np.int64))  # position 2 needs block 1
    with pytest.raises(_core.InvalidArgument):
        call(q=np.zeros((1, 2, 8), np.float32), out=np.zeros((1, 2, 8), np.float32))
    with pytest.raises(_core.InvalidArgument):
        call(k_cache=kc.astype(np.float16))
    with pytest.raises(_core.InvalidArgument):
        call(out=q)  # output overlapping an input
    with pytest.raises(_core.InvalidArgument):
        call(q_starts=np.array([0, 2], np.int64))  # more rows than q has
    with pytest.raises(TypeError):
        call(q=[[0.0]])


def _ragged_case(rng, lens, starts, n_head, n_kv, hd, bs, dtype):
    """`_setup` with spare blocks and -1 padded tables of different widths, the pool holding
    `dtype` values; the keys/values the oracle sees are what the pool holds."""
    kc, vc, bt, keys, vals = _setup(rng, lens, starts, n_head, n_kv, hd, bs,
                                    sum(-(-(n + s) // bs) for n, s in zip(lens, starts)) + 7,
                                    True, dtype)
    bt = np.concatenate([bt, np.full((len(lens), 3), -1, np.int32)], axis=1)  # ragged padding
    keys = [k.astype(dtype).astype(np.float32) for k in keys]
    vals = [v.astype(dtype).astype(np.float32) for v in vals]
    return kc, vc, bt, keys, vals


@pytest.mark.parametrize("n_head,n_kv,hd", [(4, 1, 256), (8, 2, 64), (3, 3, 48), (6, 2, 8)])
@pytest.mark.parametrize("window", [0, 1, 37, 512])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_prefill_kernel_matches_dense_oracle(n_head, n_kv, hd, window, kv_dtype):
    """Prefill chunks on the compiled kernel (tiles of query rows x group heads, online
    softmax) against the float64 oracle: several sequences with different start positions
    and lengths (a fresh prompt, a chunk after a long cached prefix, a decode row, a short
    chunk), windows shorter and longer than the chunk, shuffled and -1 padded block tables,
    f32 and f16 pools; and equal to the NumPy tile path."""
    rng = np.random.default_rng(hd + window + n_head)
    bs = 16
    lens, starts = [300, 150, 1, 9], [0, 700, 64, 31]
    kc, vc, bt, keys, vals = _ragged_case(rng, lens, starts, n_head, n_kv, hd, bs, kv_dtype)
    q = rng.standard_normal((sum(lens), n_head, hd)).astype(np.float32)
    q_starts = np.concatenate([[0], np.cumsum(lens)])
    scale = hd ** -0.5
    args = (q, kc, vc, bt, q_starts, np.array(starts))
    got = paged_attention(*args, scale=scale, window=window)
    for s, (n, p0) in enumerate(zip(lens, starts)):
        ref = attention_reference(q[q_starts[s]:q_starts[s + 1]], keys[s], vals[s],
                                  np.arange(p0, p0 + n), np.arange(p0 + n), scale=scale,
                                  window=window)
        np.testing.assert_allclose(got[q_starts[s]:q_starts[s + 1]], ref, rtol=1e-5, atol=1e-5)
    saved = attention_mod.KERNEL_MAX_ROWS
    attention_mod.KERNEL_MAX_ROWS = 0
    try:
        slow = paged_attention(*args, scale=scale, window=window)
    finally:
        attention_mod.KERNEL_MAX_ROWS = saved
    np.testing.assert_allclose(got, slow, rtol=2e-5, atol=2e-6)


def test_prefill_kernel_takes_every_row_of_f32_and_f16_pools(monkeypatch):
    """A prefill chunk of an f32 or f16 pool never reaches the NumPy tiles."""
    def boom(*a, **k):
        raise AssertionError("NumPy tile path used")

    monkeypatch.setattr(attention_mod, "_attention_tile", boom)
    rng = np.random.default_rng(3)
    for dt in (np.float32, np.float16):
        kc, vc, bt, keys, vals = _ragged_case(rng, [200, 1], [0, 40], 4, 1, 32, 16, dt)
        q = rng.standard_normal((201, 4, 32)).astype(np.float32)
        out = paged_attention(q, kc, vc, bt, np.array([0, 200, 201]), np.array([0, 40]),
                              scale=0.2, window=64)
        ref = attention_reference(q[:200], keys[0], vals[0], np.arange(200), np.arange(200),
                                  scale=0.2, window=64)
        np.testing.assert_allclose(out[:200], ref, rtol=1e-5, atol=1e-5)
