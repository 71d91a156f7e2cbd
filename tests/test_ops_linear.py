"""`linear`: the BLAS path, the Numba small-batch f32 kernel and `QWeight` (weights kept as
int8 + group scales) for every block-quantized type, against dense float64 products."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare.model.weights import dequantize, split_quantized
from kvshare.ops import linear as L
from kvshare.ops.linear import QWeight, linear

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _blocks(rng, qtype, rows, cols):
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return quants.quantize(x, qtype).reshape(-1)
    except NotImplementedError:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        sc = rng.uniform(-0.05, 0.05, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
        if qtype == Q.Q6_K:  # d at the end
            raw[:, -2:] = sc[:, :2]
        else:  # d, dmin at the start
            raw[:, 0:4] = sc
        return raw.reshape(-1)


def _close(got, ref):
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 7, 16, 32, 33, 40])
def test_qweight_matches_dense(qtype, m):
    rng = np.random.default_rng(int(qtype) * 7 + m)
    rows, cols = 70, 512
    raw = _blocks(rng, qtype, rows, cols)
    dense = dequantize(raw, qtype).reshape(rows, cols)
    qw = QWeight(*split_quantized(raw, qtype, (rows, cols)))
    np.testing.assert_array_equal(qw.dequantize(), dense)  # the split is exact
    np.testing.assert_array_equal(qw.rows(np.array([5, 0, 69])), dense[[5, 0, 69]])
    x = rng.standard_normal((m, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ dense.T.astype(np.float64)
    _close(linear(x, qw), ref)
    qw.dense = dense
    _close(linear(x, qw), ref)


def test_concat_mixed_groups_and_mins():
    rng = np.random.default_rng(3)
    parts, dense = [], []
    for qtype, rows in [(Q.Q5_0, 8), (Q.Q6_K, 4), (Q.Q4_K, 6)]:
        raw = _blocks(rng, qtype, rows, 256)
        dense.append(dequantize(raw, qtype).reshape(rows, 256))
        parts.append(QWeight(*split_quantized(raw, qtype, (rows, 256))))
    qw = QWeight.concat(parts)
    assert qw.group == 16 and qw.mins is not None
    d = np.concatenate(dense)
    np.testing.assert_allclose(qw.dequantize(), d, rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    _close(linear(x, qw), x.astype(np.float64) @ d.T)


def test_q8_0_from_bytes_and_split_agree():
    rng = np.random.default_rng(4)
    raw = _blocks(rng, Q.Q8_0, 10, 64)
    a = QWeight.from_q8_0_bytes(raw, (10, 64))
    b = QWeight(*split_quantized(raw, Q.Q8_0, (10, 64)))
    np.testing.assert_array_equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 33])
def test_f32_linear_every_batch_size(m):
    rng = np.random.default_rng(m)
    w = rng.standard_normal((50, 96)).astype(np.float32)
    b = rng.standard_normal(50).astype(np.float32)
    x = rng.standard_normal((m, 2 * 96)).astype(np.float32)[:, :96]  # a strided view
    _close(linear(x, w, b), x.astype(np.float64) @ w.T + b)


def test_without_numba(monkeypatch):
    monkeypatch.setattr(L, "HAVE_NUMBA", False)
    rng = np.random.default_rng(5)
    raw = _blocks(rng, Q.Q8_0, 40, 64)
    qw = QWeight(*split_quantized(raw, Q.Q8_0, (40, 64)))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    _close(linear(x, qw), x @ qw.dequantize().T)


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 6, 13])
def test_rust_kernel_every_thread_count(threads, m):
    """`_core.qmatmul_t` directly: group 16 with mins and group 32 without, 1-5 threads."""
    from kvshare import _core

    rng = np.random.default_rng(100 * threads + m)
    for qtype, rows, cols in [(Q.Q6_K, 130, 256), (Q.Q4_K, 97, 512), (Q.Q8_0, 300, 64)]:
        raw = _blocks(rng, qtype, rows, cols)
        qw = QWeight(*split_quantized(raw, qtype, (rows, cols)))
        x = rng.standard_normal((m, cols)).astype(np.float32)
        out = np.full((m, rows), np.nan, np.float32)
        _core.qmatmul_t(x, qw.qs, qw.scale, qw.mins, out, qw.group, threads)
        _close(out, x.astype(np.float64) @ qw.dequantize().T.astype(np.float64))


def test_rust_kernel_rejects_bad_arguments():
    from kvshare import _core

    rng = np.random.default_rng(9)
    qw = QWeight(*split_quantized(_blocks(rng, Q.Q8_0, 8, 64), Q.Q8_0, (8, 64)))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    out = np.zeros((2, 8), np.float32)
    with pytest.raises(_core.InvalidArgument, match="dtype"):
        _core.qmatmul_t(x.astype(np.float64), qw.qs, qw.scale, None, out, 32)
    with pytest.raises(_core.InvalidArgument, match="shape"):
        _core.qmatmul_t(x, qw.qs, qw.scale, None, np.zeros((2, 9), np.float32), 32)
    with pytest.raises(_core.InvalidArgument, match="columns"):
        _core.qmatmul_t(x[:, :32].copy(), qw.qs, qw.scale, None, out, 32)
    with pytest.raises(_core.InvalidArgument, match="group"):
        _core.qmatmul_t(x, qw.qs, qw.scale, None, out, 8)
    with pytest.raises(_core.InvalidArgument, match="scale"):
        _core.qmatmul_t(x, qw.qs, qw.scale[:4], None, out, 32)
    with pytest.raises(_core.InvalidArgument, match="C-contiguous"):
        _core.qmatmul_t(np.zeros((2, 128), np.float32)[:, ::2], qw.qs, qw.scale, None, out, 32)
    ro = np.zeros((2, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(_core.InvalidArgument, match="read-only"):
        _core.qmatmul_t(x, qw.qs, qw.scale, None, ro, 32)
    buf = np.zeros(2 * 64 + 8, np.float32)
    with pytest.raises(_core.InvalidArgument, match="overlap"):
        _core.qmatmul_t(buf[:128].reshape(2, 64), qw.qs, qw.scale, None,
                        buf[120:].reshape(2, 8), 32)
    with pytest.raises(TypeError):
        _core.qmatmul_t([[1.0] * 64] * 2, qw.qs, qw.scale, None, out, 32)


def test_kernels_work_in_a_forked_child():
    """The kernels' worker threads do not survive fork(): a child runs every part itself
    rather than waiting on workers that do not exist there."""
    import multiprocessing as mp

    from kvshare import _core

    x = np.ones((1, 64), np.float32)
    qs = np.ones((8192, 64), np.int8)
    scale = np.ones((8192, 2), np.float32)
    out = np.empty((1, 8192), np.float32)
    _core.qmatmul_t(x, qs, scale, None, out, 32, 2)  # start the workers here first
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        res = pool.apply_async(_forked_product, ())
        assert res.get(timeout=60) == 64.0 * 8192


def _forked_product() -> float:
    from kvshare import _core

    x = np.ones((1, 64), np.float32)
    qs = np.ones((8192, 64), np.int8)
    out = np.empty((1, 8192), np.float32)
    _core.qmatmul_t(x, qs, np.ones((8192, 2), np.float32), None, out, 32, 2)
    return float(out.sum())
