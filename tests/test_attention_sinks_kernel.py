"""Attention sinks (gpt-oss) on the compiled kernel, `_core.paged_attention(sinks=)`, against
the float64 `attention_reference`: decode rows and prefill chunks in one call, f32, f16 and
q8_0 pools, full and sliding-window (128, gpt-oss's) attention, the fast and the invariant
paths, one and several threads; `ops.attention.paged_attention(sinks=)` takes the kernel and
equals the NumPy tiles; bad sinks are refused."""

import numpy as np
import pytest

import kvshare.ops.attention as attention_mod
from kvshare import _core
from kvshare.ops import kv_q8_0 as q8
from kvshare.ops.attention import (attention_reference, kv_slots, pad_block_tables,
                                   paged_attention, write_kv)

# gpt-oss-20b's grouping (64 query heads on 8 KV heads of 64) scaled down, and tiny-gpt-oss's
SHAPES = [(16, 2, 64), (4, 2, 32)]
LENS, STARTS = [150, 1, 9, 2], [300, 700, 40, 130]  # a chunk, decode rows, a short chunk


def _case(rng, n_head, n_kv, hd, dtype, bs=16):
    """A pool (`dtype`: f32, f16 or q8_0 as uint8) holding random K/V of every sequence's
    positions, shuffled block tables, and the K/V as the pool holds them (the oracle's)."""
    need = [-(-(n + s) // bs) for n, s in zip(LENS, STARTS)]
    n_blocks = sum(need) + 5
    free = rng.permutation(n_blocks)
    tables, keys, vals, used = [], [], [], 0
    for nb, n, s in zip(need, LENS, STARTS):
        tables.append(free[used : used + nb].astype(np.int32))
        used += nb
        keys.append(rng.standard_normal((s + n, n_kv, hd)).astype(np.float32))
        vals.append(rng.standard_normal((s + n, n_kv, hd)).astype(np.float32))
    bt = pad_block_tables(tables)
    if dtype == "q8_0":
        kc = np.zeros((n_blocks, bs, n_kv, hd // 32 * 34), np.uint8)
        held = lambda x: q8.dequantize(q8.quantize(x))  # noqa: E731
    else:
        kc = np.zeros((n_blocks, bs, n_kv, hd), dtype)
        held = lambda x: x.astype(dtype).astype(np.float32)  # noqa: E731
    vc = np.zeros_like(kc)
    q_starts = np.concatenate([[0], np.cumsum([s + n for n, s in zip(LENS, STARTS)])])
    slots = kv_slots(bt, q_starts, np.zeros(len(LENS), np.int64), bs)
    write_kv(kc, vc, slots, np.concatenate(keys), np.concatenate(vals))
    return kc, vc, bt, [held(k) for k in keys], [held(v) for v in vals]


def _reference(q, keys, vals, q_starts, scale, window, sinks):
    out = np.empty(q.shape, np.float64)
    for s, (n, p0) in enumerate(zip(LENS, STARTS)):
        rows = slice(q_starts[s], q_starts[s + 1])
        out[rows] = attention_reference(q[rows], keys[s], vals[s], np.arange(p0, p0 + n),
                                        np.arange(p0 + n), scale=scale, window=window,
                                        sinks=sinks)
    return out


@pytest.mark.parametrize("n_head,n_kv,hd", SHAPES)
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, "q8_0"])
@pytest.mark.parametrize("window", [0, 128])
def test_core_sinks_match_the_reference(n_head, n_kv, hd, kv_dtype, window):
    rng = np.random.default_rng(n_head + hd + window + len(str(kv_dtype)))
    kc, vc, bt, keys, vals = _case(rng, n_head, n_kv, hd, kv_dtype)
    q = rng.standard_normal((sum(LENS), n_head, hd)).astype(np.float32)
    q_starts = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int64)
    starts = np.array(STARTS, np.int64)
    # from far below the scores to far above them (a head that mostly attends to nothing)
    sinks = (rng.standard_normal(n_head) * 3).astype(np.float32)
    sinks[0], sinks[-1] = 40.0, -40.0
    scale = hd ** -0.5
    want = _reference(q, keys, vals, q_starts, scale, window, sinks)
    plain = _reference(q, keys, vals, q_starts, scale, window, None)
    assert np.abs(want - plain).max() > 0.1  # the sinks matter
    for invariant in (False, True):
        for threads in (1, 3):
            out = np.full(q.shape, np.nan, np.float32)
            _core.paged_attention(q, kc, vc, bt, q_starts, starts, scale, window, out, 1 << 62,
                                  threads, invariant, sinks)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"invariant={invariant} threads={threads}")


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, "q8_0"])
def test_ops_sinks_take_the_kernel_and_equal_the_numpy_tiles(monkeypatch, kv_dtype):
    rng = np.random.default_rng(7)
    n_head, n_kv, hd = SHAPES[0]
    kc, vc, bt, keys, vals = _case(rng, n_head, n_kv, hd, kv_dtype)
    q = rng.standard_normal((sum(LENS), n_head, hd)).astype(np.float32)
    q_starts = np.concatenate([[0], np.cumsum(LENS)])
    sinks = (rng.standard_normal(n_head) * 3).astype(np.float32)
    args = (q, kc, vc, bt, q_starts, np.array(STARTS))
    calls = []
    real = _core.paged_attention
    monkeypatch.setattr(_core, "paged_attention", lambda *a: calls.append(a) or real(*a))
    for window in (0, 128):
        fast = paged_attention(*args, scale=0.125, window=window, sinks=sinks)
        assert calls and calls[-1][-1] is not None  # the kernel ran, with the sinks
        with monkeypatch.context() as m:
            m.setattr(attention_mod, "KERNEL_MAX_ROWS", 0)
            slow = paged_attention(*args, scale=0.125, window=window, sinks=sinks)
        np.testing.assert_allclose(fast, slow, rtol=2e-5, atol=2e-6)
        want = _reference(q, keys, vals, q_starts, 0.125, window, sinks)
        np.testing.assert_allclose(fast, want, rtol=1e-5, atol=1e-5)


def test_core_refuses_bad_sinks():
    kc = np.zeros((4, 2, 1, 16), np.float32)
    q = np.zeros((1, 2, 16), np.float32)
    out = np.zeros_like(q)
    bt = np.array([[0, -1]], np.int32)

    def call(sinks):
        _core.paged_attention(q, kc, kc, bt, np.array([0, 1], np.int64),
                              np.array([1], np.int64), 1.0, 0, out, 1, 1, False, sinks)

    call(np.zeros(2, np.float32))
    with pytest.raises(_core.InvalidArgument):
        call(np.zeros(3, np.float32))  # not n_head values
    with pytest.raises(_core.InvalidArgument):
        call(np.zeros(2, np.float64))
    with pytest.raises(_core.InvalidArgument):
        call(out.reshape(-1)[:2])  # overlapping the output
    with pytest.raises(ValueError):
        paged_attention(q, kc, kc, bt, np.array([0, 1]), np.array([1]), scale=1.0,
                        sinks=np.zeros(3, np.float32))
