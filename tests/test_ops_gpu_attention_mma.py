"""The tensor-core paged attention for prefill chunks (kernels/paged_attention_mma.cu) against
the NumPy op and the float64 dense oracle: grouped-query heads from 1 to 8 per KV head (and
more heads than a CTA holds), head sizes 64, 80, 112, 128 and 256, block sizes 8 / 16 / 32,
sliding windows, prompts from position 0 and chunks in mid-sequence, key ranges of several 64-key tiles, decode
rows in the same launch, attention sinks, strided q and `out`; and which launches the host
sends to it.
Marked `gpu`: skipped without a CUDA device (conftest); CI runs it on the CPU emulator.

Tolerance: q (scaled) and the probabilities P are rounded to f16 for the products (relative
2^-11 each), so outputs differ from float32 attention by about 1e-3 of their size: the test
holds them to 3e-3 absolute + 3e-3 relative on inputs of magnitude ~1.5 (a fragment or mask
error is of the order of the outputs themselves).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvshare.backend import get_backend
from kvshare.ops.attention import pad_block_tables, paged_attention
from test_ops_gpu import _dense_reference, _sinks  # the float64 oracle; sink logits

pytestmark = pytest.mark.gpu

TOL = dict(rtol=3e-3, atol=3e-3)


@pytest.fixture(scope="module")
def be():
    return get_backend("cuda")


@pytest.fixture(autouse=True)
def mma_on(monkeypatch):
    monkeypatch.delenv("KVSHARE_GPU_ATTN_MMA", raising=False)


def _case(rng, *, n_head, n_kv, hd, bs, chunks):
    """A paged f16 cache with the keys of every chunk's positions (shuffled block ids) and
    float32 queries for each chunk (start, n)."""
    ends = [s + n for s, n in chunks]
    need = [-(-e // bs) for e in ends]
    n_blocks = sum(need) + 3
    ids = rng.permutation(n_blocks)[: sum(need)]
    tables, i = [], 0
    for nd in need:
        tables.append(ids[i : i + nd].astype(np.int32))
        i += nd
    kv = (rng.standard_normal((2, n_blocks, bs, n_kv, hd)) * 1.5).astype(np.float16)
    lens = [n for _, n in chunks]
    qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    q = (rng.standard_normal((int(qs[-1]), n_head, hd)) * 1.5).astype(np.float32)
    sp = np.array([s for s, _ in chunks], np.int64)
    return q, kv, pad_block_tables(tables), qs, sp


def _plan_is_mma(q, kv_d, bt, qs, sp, window):
    from kvshare.ops import gpu  # noqa: PLC0415

    n_tok, n_head, hd = q.shape
    _, nb, bs, n_kv, _ = kv_d.shape
    fits = gpu.mma_fits(kv_d[0], kv_d[1], hd)
    plan = gpu._pa_plan(bt, qs, sp, n_head, n_kv, bs, nb, window, hd, n_tok,
                        None if fits else False)
    return plan.mma


CONFIGS = [
    # n_head, n_kv, hd, bs
    (16, 8, 128, 16),  # Qwen3-1.7B: 2 query heads per KV head
    (4, 4, 64, 8),     # MHA
    (12, 4, 128, 32),  # 3 per KV head: 21 tokens and a padding row per CTA
    (32, 4, 64, 16),   # 8 per KV head
    (8, 1, 64, 16),    # MQA
    (8, 2, 80, 16),    # the other head sizes the kernels have (multiples of 16 up to 128)
    (6, 2, 112, 8),
    (96, 1, 64, 16),   # more query heads than a CTA holds: head chunks
    (4, 1, 256, 16),   # Gemma 3 270M (head size 256: two warps a row group, 32-key tiles)
    (16, 2, 256, 32),  # Qwen3.5's gated attention: 8 per KV head
]


@pytest.mark.parametrize("window", [0, 40, 100])
@pytest.mark.parametrize("n_head,n_kv,hd,bs", CONFIGS)
def test_mma_attention_matches_numpy_and_the_oracle(be, n_head, n_kv, hd, bs, window):
    rng = np.random.default_rng(n_head * 1000 + hd + window + bs)
    # a prompt from 0 over three key tiles, a chunk in mid-sequence, two decode rows (one at a
    # block boundary), an empty chunk, a chunk ending in a partial block
    chunks = [(0, 150), (70, 23), (99, 1), (2 * bs, 1), (7, 0), (3, 2 * bs + 3)]
    q, kv, bt, qs, sp = _case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=bs, chunks=chunks)
    scale = 1.0 / np.sqrt(hd)
    kv_d = be.asarray(kv)
    assert _plan_is_mma(q, kv_d, bt, qs, sp, window)
    got = be.to_host(paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=scale,
                                     window=window, backend=be))
    ref = paged_attention(q, kv[0].astype(np.float32), kv[1].astype(np.float32), bt, qs, sp,
                          scale=scale, window=window)
    np.testing.assert_allclose(got, ref, **TOL)
    np.testing.assert_allclose(
        got, _dense_reference(q, kv, bt, qs, sp, scale=scale, window=window, sinks=None), **TOL)
    # and well inside the tolerance on average: the rounding is f16's, not an error's
    assert np.abs(got - ref).mean() < 3e-4


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("n_head,n_kv,hd,bs",
                         [(8, 2, 64, 16), (16, 8, 128, 16), (8, 2, 256, 16)])
def test_mma_attention_with_sinks(be, n_head, n_kv, hd, bs, window):
    """gpt-oss's sinks: one logit per query head in the softmax's denominator (the oracle's
    and the CPU op's), host and device arrays; a sink far above the scores leaves its head
    almost nothing."""
    rng = np.random.default_rng(n_head + hd + window)
    chunks = [(0, 150), (70, 23), (99, 1)]
    q, kv, bt, qs, sp = _case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=bs, chunks=chunks)
    sinks = _sinks(rng, n_head)
    scale = 1.0 / np.sqrt(hd)
    kv_d = be.asarray(kv)
    assert _plan_is_mma(q, kv_d, bt, qs, sp, window)
    got = be.to_host(paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=scale,
                                     window=window, backend=be, sinks=sinks))
    ref = _dense_reference(q, kv, bt, qs, sp, scale=scale, window=window, sinks=sinks)
    np.testing.assert_allclose(got, ref, **TOL)
    cpu = paged_attention(q, kv[0].astype(np.float32), kv[1].astype(np.float32), bt, qs, sp,
                          scale=scale, window=window, sinks=sinks)
    np.testing.assert_allclose(got, cpu, **TOL)
    assert np.abs(got[:, 0]).max() < 1e-6 * np.abs(got).max() + 1e-9
    got_d = be.to_host(paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=scale,
                                       window=window, backend=be, sinks=be.asarray(sinks)))
    np.testing.assert_array_equal(got_d, got)
    # without the sinks it is another result
    plain = be.to_host(paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp,
                                       scale=scale, window=window, backend=be))
    assert np.abs(plain - got).max() > 0.1


def test_mma_attention_strided_q_and_out(be):
    """q as the model passes it (a view of the fused QKV rows, head stride hd, row stride the
    fused width) and a strided `out` view."""
    rng = np.random.default_rng(3)
    n_head, n_kv, hd, bs = 8, 2, 128, 16
    q, kv, bt, qs, sp = _case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=bs,
                              chunks=[(0, 70), (5, 33)])
    fused = np.zeros((q.shape[0], (n_head + 2 * n_kv) * hd), np.float32)
    fused[:, : n_head * hd] = q.reshape(q.shape[0], -1)
    fused_d = be.asarray(fused)
    q_view = fused_d[:, : n_head * hd].reshape(-1, n_head, hd)
    kv_d = be.asarray(kv)
    big = be.xp.zeros((q.shape[0], n_head, 2 * hd), np.float32)
    out = big[:, :, :hd]
    paged_attention(q_view, kv_d[0], kv_d[1], bt, qs, sp, scale=hd ** -0.5, out=out, backend=be)
    ref = paged_attention(q, kv[0].astype(np.float32), kv[1].astype(np.float32), bt, qs, sp,
                          scale=hd ** -0.5)
    np.testing.assert_allclose(be.to_host(out), ref, **TOL)
    assert not be.to_host(big[:, :, hd:]).any()


def test_which_launches_take_the_tensor_cores(be, monkeypatch):
    from kvshare.ops import gpu  # noqa: PLC0415

    rng = np.random.default_rng(4)
    q, kv, bt, qs, sp = _case(rng, n_head=8, n_kv=2, hd=128, bs=16,
                              chunks=[(0, gpu.PM_MIN_TOKENS), (40, 1)])
    kv_d = be.asarray(kv)
    assert _plan_is_mma(q, kv_d, bt, qs, sp, 0)
    # decode rows alone (fewer than PM_MIN_TOKENS a sequence): the FMA kernels
    dq, dkv, dbt, dqs, dsp = _case(rng, n_head=8, n_kv=2, hd=128, bs=16,
                                   chunks=[(40, 1), (9, gpu.PM_MIN_TOKENS - 1)])
    assert not _plan_is_mma(dq, be.asarray(dkv), dbt, dqs, dsp, 0)
    # f32 caches, other head sizes, the switch: the FMA kernels
    assert not gpu.mma_fits(be.asarray(kv[0].astype(np.float32)),
                             be.asarray(kv[1].astype(np.float32)), 128)
    assert not gpu.mma_fits(kv_d[0][..., :72], kv_d[1][..., :72], 72)
    monkeypatch.setenv("KVSHARE_GPU_ATTN_MMA", "0")
    assert not _plan_is_mma(q, kv_d, bt, qs, sp, 0)
    # either way the same attention, within the tensor cores' rounding
    fma = be.to_host(paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp,
                                     scale=0.1, backend=be))
    monkeypatch.delenv("KVSHARE_GPU_ATTN_MMA")
    mma = be.to_host(paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp,
                                     scale=0.1, backend=be))
    np.testing.assert_allclose(mma, fma, **TOL)
    assert not np.array_equal(mma, fma)  # two kernels, two roundings
