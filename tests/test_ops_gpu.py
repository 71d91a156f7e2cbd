"""Every GPU op (`kvshare.ops.gpu`, CuPy + kernels/*.cu + cuBLAS) against its NumPy twin on
random inputs: several shapes, strided views as the model passes them, shuffled block tables
with partial last blocks, sliding windows, grouped-query heads, f16 and f32 KV, split-KV decode,
attention sinks (also against the float64 dense oracle `attention_reference`).
Marked `gpu`: skipped without a CUDA device (conftest).

Tolerances (float32 everywhere except where stated):
- exact: KV writes (f16 rounding is round-to-nearest-even on both sides), embedding rows;
- 1e-6 relative: rope (same float32 operations, no fused multiply-add);
- 1e-5: RMSNorm, activations (summation order, expf vs NumPy's exp);
- 1e-4 abs / rel: paged attention (float32 accumulation in another order, exp2 in the log2
  domain);
- linear with f16 weights: activations are rounded to f16 (relative 2^-11 per element), so
  |y - ref| <= 4e-3 * sum|x||w| per output (a bound on that rounding, far above its typical
  size); f32 weights: 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvshare.backend import get_backend
from kvshare.ops import activation as act
from kvshare.ops.attention import (attention_reference, kv_slots, pad_block_tables,
                                   paged_attention, write_kv)
from kvshare.ops.embedding import embedding
from kvshare.ops.linear import linear
from kvshare.ops.norm import rms_norm
from kvshare.ops.rope import apply_rope, rope_cos_sin

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def be():
    return get_backend("cuda")


@pytest.fixture(autouse=True)
def fma_attention(monkeypatch):
    """Every attention launch here runs on the FMA kernels (kernels/paged_attention.cu),
    held to 1e-4: prefill chunks on f16 caches would otherwise go to the tensor-core kernels,
    which round q and P to f16 and have their own tests (tests/test_ops_gpu_attention_mma.py).
    The module's other tests launch no attention."""
    monkeypatch.setenv("KVSHARE_GPU_ATTN_MMA", "0")


def _np(be, a):
    return be.to_host(a)


# --- KV write ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n_kv,hd", [(1, 256), (2, 128), (3, 80)])
def test_write_kv_matches_numpy(be, kv_dtype, n_kv, hd):
    rng = np.random.default_rng(hd + n_kv)
    nb, bs, n = 9, 16, 37
    fused = rng.standard_normal((n, (4 + 2 * n_kv) * hd)).astype(np.float32) * 3
    k = fused[:, 4 * hd : (4 + n_kv) * hd].reshape(n, n_kv, hd)
    v = fused[:, (4 + n_kv) * hd :].reshape(n, n_kv, hd)
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    kc = np.zeros((2, nb, bs, n_kv, hd), kv_dtype)
    kc_d = be.asarray(kc)
    write_kv(kc[0], kc[1], slots, k, v)
    fused_d = be.asarray(fused)
    k_d = fused_d[:, 4 * hd : (4 + n_kv) * hd].reshape(n, n_kv, hd)
    v_d = fused_d[:, (4 + n_kv) * hd :].reshape(n, n_kv, hd)
    write_kv(kc_d[0], kc_d[1], slots, k_d, v_d, backend=be)
    np.testing.assert_array_equal(_np(be, kc_d), kc)
    # device-resident slots work too
    kc_d[...] = 0
    write_kv(kc_d[0], kc_d[1], be.asarray(slots), k_d, v_d, backend=be)
    np.testing.assert_array_equal(_np(be, kc_d), kc)


def test_write_kv_rejects_bad_slots(be):
    kc = be.asarray(np.zeros((2, 4, 16, 1, 64), np.float16))
    k = be.asarray(np.ones((2, 1, 64), np.float32))
    with pytest.raises(IndexError):
        write_kv(kc[0], kc[1], np.array([3, 64]), k, k, backend=be)


# --- paged attention ------------------------------------------------------------------------------

def _attention_case(rng, *, n_head, n_kv, hd, bs, chunks, kv_dtype, n_blocks=None):
    """A cache filled with random K/V for every sequence's positions < end, shuffled block
    ids, and queries for each chunk (start, n). Returns everything paged_attention takes."""
    ends = [s + n for s, n in chunks]
    need = [-(-e // bs) for e in ends]
    total = sum(need)
    n_blocks = n_blocks or total + 3
    ids = rng.permutation(n_blocks)[:total]
    tables, i = [], 0
    for nd in need:
        tables.append(ids[i : i + nd].astype(np.int32))
        i += nd
    kv = np.zeros((2, n_blocks, bs, n_kv, hd), kv_dtype)
    for t, e in zip(tables, ends):
        for p in range(e):
            kv[:, t[p // bs], p % bs] = (rng.standard_normal((2, n_kv, hd)) * 1.5).astype(kv_dtype)
    lens = [n for _, n in chunks]
    q_starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    q = rng.standard_normal((int(q_starts[-1]), n_head, hd)).astype(np.float32) * 1.5
    start = np.array([s for s, _ in chunks], np.int64)
    return q, kv, pad_block_tables(tables), q_starts, start


CONFIGS = [
    # n_head, n_kv, hd, bs
    (4, 1, 256, 16),   # Gemma 3 270M
    (8, 2, 128, 16),   # llama-style GQA
    (4, 4, 64, 8),     # MHA
    (32, 1, 64, 16),   # MQA with more query heads than a CTA holds (head chunks)
    (4, 2, 80, 5),     # generic head size, odd block size
    (2, 1, 32, 16),    # generic, small
]


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("n_head,n_kv,hd,bs", CONFIGS)
def test_paged_attention_mixed_batch(be, n_head, n_kv, hd, bs, window, kv_dtype):
    rng = np.random.default_rng(n_head * 1000 + hd + window)
    # a prefill from 0, a prefill chunk in the middle of a sequence, two decode tokens (one at
    # a block boundary), an empty chunk and a chunk ending in a partial block
    chunks = [(0, 45), (50, 23), (99, 1), (2 * bs, 1), (7, 0), (3, 2 * bs + 3)]
    q, kv, bt, qs, sp = _attention_case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=bs,
                                        chunks=chunks, kv_dtype=kv_dtype)
    scale = 1.0 / np.sqrt(hd)
    ref = paged_attention(q, kv[0], kv[1], bt, qs, sp, scale=scale, window=window)
    kv_d = be.asarray(kv)
    got = paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=scale,
                          window=window, backend=be)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 512])
def test_paged_attention_long_decode_uses_split_kv(be, window, kv_dtype):
    from kvshare.ops import gpu  # noqa: PLC0415

    rng = np.random.default_rng(5)
    chunks = [(3000, 1), (1234, 1), (17, 1)]
    q, kv, bt, qs, sp = _attention_case(rng, n_head=4, n_kv=1, hd=256, bs=16, chunks=chunks,
                                        kv_dtype=kv_dtype)
    tiles = gpu.pa_tiles(qs, sp, 4)
    n_sm = be.xp.cuda.Device(be.device_id).attributes["MultiProcessorCount"]
    if window == 0:
        assert gpu.pa_splits(tiles, 0, 1, 1, 3, 4, 256, n_sm) > 1
    ref = paged_attention(q, kv[0], kv[1], bt, qs, sp, scale=0.0625, window=window)
    kv_d = be.asarray(kv)
    got = paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=0.0625,
                          window=window, backend=be)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-4, atol=1e-4)


def _dense_reference(q, kv, bt, qs, sp, *, scale, window, sinks):
    """`attention_reference` (float64, dense) of every sequence's rows over its keys, gathered
    from the paged cache."""
    bs = kv.shape[2]
    out = np.zeros(q.shape, np.float64)
    for s in range(len(qs) - 1):
        r0, r1 = int(qs[s]), int(qs[s + 1])
        if r1 == r0:
            continue
        p0 = int(sp[s])
        kp = np.arange(p0 + r1 - r0)
        k = kv[0][bt[s][kp // bs], kp % bs].astype(np.float32)
        v = kv[1][bt[s][kp // bs], kp % bs].astype(np.float32)
        out[r0:r1] = attention_reference(q[r0:r1], k, v, np.arange(p0, p0 + r1 - r0), kp,
                                         scale=scale, window=window, sinks=sinks)
    return out


def _sinks(rng, n_head):
    """Sink logits about the size of the scores, one far above them (the head attends to
    almost nothing) and one far below (as if there were none)."""
    s = (rng.standard_normal(n_head) * 2).astype(np.float32)
    s[0] = 30.0
    s[-1] = -30.0
    return s


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("n_head,n_kv,hd,bs", [(8, 2, 64, 16), (4, 2, 80, 5)])
def test_paged_attention_sinks_match_the_oracle(be, n_head, n_kv, hd, bs, with_sinks, window,
                                                kv_dtype):
    """Prefill from 0, a chunk in mid-sequence, decode rows (one split): the GPU op with and
    without sinks against the float64 dense oracle, and the CPU op with the same sinks."""
    rng = np.random.default_rng(n_head * 100 + hd + window)
    chunks = [(0, 45), (50, 23), (99, 1), (2 * bs, 1), (7, 0)]
    q, kv, bt, qs, sp = _attention_case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=bs,
                                        chunks=chunks, kv_dtype=kv_dtype)
    sinks = _sinks(rng, n_head) if with_sinks else None
    scale = 1.0 / np.sqrt(hd)
    ref = _dense_reference(q, kv, bt, qs, sp, scale=scale, window=window, sinks=sinks)
    kv_d = be.asarray(kv)
    got = _np(be, paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=scale,
                                  window=window, backend=be, sinks=sinks))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    cpu = paged_attention(q, kv[0], kv[1], bt, qs, sp, scale=scale, window=window, sinks=sinks)
    np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-4)
    if with_sinks:
        # the sink far above the scores leaves head 0 almost nothing; sinks on the device too
        assert np.abs(got[:, 0]).max() < 1e-6 * np.abs(got).max() + 1e-9
        got_d = paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=scale,
                                window=window, backend=be, sinks=be.asarray(sinks))
        np.testing.assert_array_equal(_np(be, got_d), got)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [0, 128])
def test_paged_attention_sinks_split_kv(be, window, with_sinks):
    """Long decode rows cut into key splits and merged by paged_attn_combine: the sink joins
    the merged denominator once (a sink per split would weigh it n_splits times)."""
    from kvshare.ops import gpu  # noqa: PLC0415

    rng = np.random.default_rng(21)
    n_head, n_kv, hd = 8, 2, 64
    chunks = [(1500, 1), (700, 1), (17, 1)]
    q, kv, bt, qs, sp = _attention_case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=16,
                                        chunks=chunks, kv_dtype=np.float16)
    sinks = _sinks(rng, n_head) if with_sinks else None
    if with_sinks:
        sinks[1:-1] += 4.0  # sinks that weigh about as much as the keys of a row
    gc, n_gchunks = gpu.group_chunk(n_head, n_kv)
    tiles = gpu.pa_tiles(qs, sp, gc)
    n_sm = be.xp.cuda.Device(be.device_id).attributes["MultiProcessorCount"]
    if window == 0:
        assert gpu.pa_splits(tiles, 0, n_kv, n_gchunks, 3, n_head, hd, n_sm) > 1
    ref = _dense_reference(q, kv, bt, qs, sp, scale=0.125, window=window, sinks=sinks)
    kv_d = be.asarray(kv)
    got = paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=0.125,
                          window=window, backend=be, sinks=sinks)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-4, atol=1e-4)


def test_paged_attention_rejects_bad_sinks(be):
    q, kv, bt, qs, sp = _attention_case(np.random.default_rng(2), n_head=4, n_kv=1, hd=64,
                                        bs=16, chunks=[(0, 3)], kv_dtype=np.float16)
    kv_d = be.asarray(kv)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(be.asarray(q), kv_d[0], kv_d[1], bt, qs, sp, scale=1.0, backend=be,
                        sinks=be.asarray(np.zeros(3, np.float32)))


def test_paged_attention_strided_q_out_and_device_tables(be):
    rng = np.random.default_rng(9)
    n_head, n_kv, hd = 8, 2, 128
    chunks = [(0, 20), (40, 3)]
    q, kv, bt, qs, sp = _attention_case(rng, n_head=n_head, n_kv=n_kv, hd=hd, bs=16,
                                        chunks=chunks, kv_dtype=np.float16)
    n = q.shape[0]
    fused = np.concatenate([q.reshape(n, -1), rng.standard_normal((n, 2 * n_kv * hd))],
                           axis=1).astype(np.float32)
    ref = paged_attention(q, kv[0], kv[1], bt, qs, sp, scale=0.1, window=9)
    fused_d = be.asarray(fused)
    q_view = fused_d[:, : n_head * hd].reshape(n, n_head, hd)  # row stride > n_head * hd
    kv_d = be.asarray(kv)
    out = be.xp.full((n, n_head, hd), np.nan, np.float32)
    got = paged_attention(q_view, kv_d[0], kv_d[1], be.asarray(bt), be.asarray(qs),
                          be.asarray(sp), scale=0.1, window=9, backend=be, out=out)
    assert got is out
    np.testing.assert_allclose(_np(be, out), ref, rtol=1e-4, atol=1e-4)
    # a non-contiguous `out` is filled too
    big = be.xp.zeros((n, n_head, 2 * hd), np.float32)
    paged_attention(q_view, kv_d[0], kv_d[1], bt, qs, sp, scale=0.1, window=9, backend=be,
                    out=big[:, :, :hd])
    np.testing.assert_allclose(_np(be, big[:, :, :hd]), ref, rtol=1e-4, atol=1e-4)


def test_paged_attention_rows_of_one_token_sequences(be):
    """The model's last-layer path: each selected row becomes a one-token sequence at its own
    position, sharing its sequence's block table."""
    rng = np.random.default_rng(11)
    q, kv, bt, qs, sp = _attention_case(rng, n_head=4, n_kv=1, hd=256, bs=16,
                                        chunks=[(0, 70)], kv_dtype=np.float16)
    rows = np.array([0, 15, 16, 69])
    ref = paged_attention(q[rows], kv[0], kv[1], bt[[0, 0, 0, 0]], np.arange(5), rows,
                          scale=0.0625, window=8)
    kv_d = be.asarray(kv)
    got = paged_attention(be.asarray(q)[be.asarray(rows)], kv_d[0], kv_d[1], bt[[0, 0, 0, 0]],
                          np.arange(5), rows, scale=0.0625, window=8, backend=be)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-4, atol=1e-4)


def test_paged_attention_rejects_uncovered_positions(be):
    kv = be.asarray(np.zeros((2, 4, 16, 1, 64), np.float16))
    q = be.asarray(np.zeros((3, 4, 64), np.float32))
    bt = np.array([[0, -1]], np.int32)
    with pytest.raises(IndexError, match="sequence 0"):
        paged_attention(q, kv[0], kv[1], bt, np.array([0, 3]), np.array([14]), scale=1.0,
                        backend=be)


def test_write_then_attend_like_the_model(be):
    """kv_slots + write_kv + paged_attention on the device, as one layer of a forward call
    runs them, against the same on the CPU."""
    rng = np.random.default_rng(3)
    n_head, n_kv, hd, bs, nb = 4, 1, 256, 16, 20
    tables = [np.array([7, 2, 11, 4]), np.array([0, 19, 5])]
    chunks = [(10, 30), (33, 1)]
    lens = [n for _, n in chunks]
    qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    sp = np.array([s for s, _ in chunks], np.int64)
    bt = pad_block_tables(tables)
    slots = kv_slots(bt, qs, sp, bs)
    n = int(qs[-1])
    kv = (rng.standard_normal((2, nb, bs, n_kv, hd)) * 1.5).astype(np.float16)
    qkv = rng.standard_normal((n, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    q = qkv[:, : n_head * hd].reshape(n, n_head, hd)
    k = qkv[:, n_head * hd : (n_head + n_kv) * hd].reshape(n, n_kv, hd)
    v = qkv[:, (n_head + n_kv) * hd :].reshape(n, n_kv, hd)
    kv_d, qkv_d = be.asarray(kv), be.asarray(qkv)
    write_kv(kv[0], kv[1], slots, k, v)
    ref = paged_attention(q, kv[0], kv[1], bt, qs, sp, scale=0.0625, window=16)
    write_kv(kv_d[0], kv_d[1], slots, qkv_d[:, n_head * hd : (n_head + n_kv) * hd].reshape(
        n, n_kv, hd), qkv_d[:, (n_head + n_kv) * hd :].reshape(n, n_kv, hd), backend=be)
    got = paged_attention(qkv_d[:, : n_head * hd].reshape(n, n_head, hd), kv_d[0], kv_d[1], bt,
                          qs, sp, scale=0.0625, window=16, backend=be)
    np.testing.assert_array_equal(_np(be, kv_d), kv)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-4, atol=1e-4)


# --- rope ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("hd,n_rot", [(256, 256), (128, 64), (64, 64), (80, 32)])
def test_rope_in_place_on_a_fused_view(be, style, hd, n_rot):
    rng = np.random.default_rng(hd + n_rot)
    n, heads = 29, 3
    fused = rng.standard_normal((n, 5 * hd)).astype(np.float32)
    pos = rng.integers(0, 9000, n)
    factors = rng.uniform(1, 4, n_rot // 2).astype(np.float32)
    cos, sin = rope_cos_sin(pos, n_rot, 1e6, 0.5, factors)
    ref = fused.copy()
    apply_rope(ref[:, hd : 4 * hd].reshape(n, heads, hd), cos, sin, style)
    fused_d = be.asarray(fused)
    cos_d, sin_d = rope_cos_sin(pos, n_rot, 1e6, 0.5, factors, backend=be)
    view = fused_d[:, hd : 4 * hd].reshape(n, heads, hd)
    assert apply_rope(view, cos_d, sin_d, style, backend=be) is view
    np.testing.assert_allclose(_np(be, fused_d), ref, rtol=1e-6, atol=1e-6)


# --- RMSNorm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [640, 256, 33, 4096])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_rows(be, d, with_weight):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((17, d)) * 5).astype(np.float32)
    w = rng.uniform(0.5, 2, d).astype(np.float32) if with_weight else None
    ref = rms_norm(x, w, 1e-6)
    got = rms_norm(be.asarray(x), None if w is None else be.asarray(w), 1e-6, backend=be)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-5, atol=1e-6)


def test_rms_norm_per_head_in_place_on_a_view(be):
    rng = np.random.default_rng(1)
    n, H, D = 11, 4, 256
    fused = rng.standard_normal((n, 6 * D)).astype(np.float32)
    w = rng.uniform(0.5, 2, D).astype(np.float32)
    ref = fused.copy()
    v = ref[:, D : 5 * D].reshape(n, H, D)
    rms_norm(v, w, 1e-6, out=v)
    fused_d = be.asarray(fused)
    vd = fused_d[:, D : 5 * D].reshape(n, H, D)
    assert rms_norm(vd, be.asarray(w), 1e-6, backend=be, out=vd) is vd
    np.testing.assert_allclose(_np(be, fused_d), ref, rtol=1e-5, atol=1e-6)
    # a 4-D input and an `out` of another layout
    x4 = rng.standard_normal((2, 3, 4, 32)).astype(np.float32)
    out = be.xp.zeros((2, 3, 4, 64), np.float32)[..., :32]
    rms_norm(be.asarray(x4), None, 1e-5, backend=be, out=out)
    np.testing.assert_allclose(_np(be, out), rms_norm(x4, None, 1e-5), rtol=1e-5, atol=1e-6)


# --- activations ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["geglu_tanh", "swiglu"])
@pytest.mark.parametrize("n,ff", [(1, 2048), (37, 2048), (5, 77)])
def test_gated_activation_in_place_on_fused_halves(be, fn, n, ff):
    rng = np.random.default_rng(ff + n)
    gu = (rng.standard_normal((n, 2 * ff)) * 4).astype(np.float32)
    gu[0, :4] = [-200.0, 200.0, -1e30, 0.0]  # overflowing exp: the -0 / x limits
    op = getattr(act, fn)
    ref_gu = gu.copy()
    ref = op(ref_gu[:, :ff], ref_gu[:, ff:], out=ref_gu[:, :ff])
    gu_d = be.asarray(gu)
    got = op(gu_d[:, :ff], gu_d[:, ff:], backend=be, out=gu_d[:, :ff])
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(be, gu_d), ref_gu, rtol=1e-5, atol=1e-6)
    # new output array
    got2 = op(be.asarray(gu[:, :ff]), be.asarray(gu[:, ff:]), backend=be)
    np.testing.assert_allclose(_np(be, got2), ref, rtol=1e-5, atol=1e-6)


def test_gelu_and_geglu_without_up(be):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 5, 7)) * 3).astype(np.float32)
    np.testing.assert_allclose(_np(be, act.gelu_tanh(be.asarray(x), backend=be)),
                               act.gelu_tanh(x), rtol=1e-5, atol=1e-6)
    x2 = x.reshape(15, 7)
    np.testing.assert_allclose(_np(be, act.geglu_tanh(be.asarray(x2), None, backend=be)),
                               act.geglu_tanh(x2, None), rtol=1e-5, atol=1e-6)


# --- embedding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_embedding_rows(be, dtype):
    rng = np.random.default_rng(4)
    table = rng.standard_normal((1000, 640)).astype(dtype)
    toks = rng.integers(0, 1000, 57).astype(np.int32)
    ref = embedding(table.astype(np.float32), toks, 25.3)
    got = embedding(be.asarray(table), be.asarray(toks), 25.3, backend=be)
    np.testing.assert_array_equal(_np(be, got), ref)
    got = embedding(be.asarray(table), toks, 25.3, backend=be)  # host ids
    np.testing.assert_array_equal(_np(be, got), ref)
    with pytest.raises(IndexError):
        embedding(be.asarray(table), np.array([0, 1000]), backend=be)


# --- linear --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,m", [(1, 640, 1024), (37, 640, 2048), (300, 2048, 640),
                                   (5, 33, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_f16_weights(be, n, k, m, bias):
    rng = np.random.default_rng(n + k + m)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[0] *= 1e5  # a row far outside the f16 range: the per-row scale keeps it finite
    w16 = (rng.standard_normal((m, k)) * 0.05).astype(np.float16)
    b = rng.standard_normal(m).astype(np.float32) if bias else None
    w32 = w16.astype(np.float32)
    ref = x.astype(np.float64) @ w32.T.astype(np.float64) + (0 if b is None else b)
    bound = 4e-3 * (np.abs(x).astype(np.float64) @ np.abs(w32).T.astype(np.float64)) + 1e-5
    got = _np(be, linear(be.asarray(x), be.asarray(w16),
                         None if b is None else be.asarray(b), backend=be))
    assert got.dtype == np.float32 and got.shape == (n, m)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= bound).all(), float(np.max(np.abs(got - ref) / bound))


def test_linear_f32_weights_views_and_out(be):
    rng = np.random.default_rng(8)
    big = rng.standard_normal((20, 300)).astype(np.float32)
    w = rng.standard_normal((64, 100)).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    ref = linear(big[:, 100:200], w, b)
    big_d = be.asarray(big)
    got = linear(big_d[:, 100:200], be.asarray(w), be.asarray(b), backend=be)
    np.testing.assert_allclose(_np(be, got), ref, rtol=1e-4, atol=1e-4)
    out = be.xp.zeros((20, 64), np.float32)
    w16 = w.astype(np.float16).astype(np.float32)
    assert linear(big_d[:, 100:200], be.asarray(w.astype(np.float16)), backend=be,
                  out=out) is out
    ref16 = big[:, 100:200].astype(np.float64) @ w16.T.astype(np.float64)
    bound = 4e-3 * (np.abs(big[:, 100:200]) @ np.abs(w16).T) + 1e-5
    assert (np.abs(_np(be, out) - ref16) <= bound).all()
