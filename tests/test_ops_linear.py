"""`linear`: the BLAS path, the Numba small-batch f32 kernel and `QWeight` (weights kept as
int8 + group scales) for every block-quantized type, against dense float64 products."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare.model.weights import dequantize, split_quantized
from kvshare.ops import linear as L
from kvshare.ops.linear import QWeight, linear

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


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
@pytest.mark.parametrize("m", [1, 3, 7, 16, 40])
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
