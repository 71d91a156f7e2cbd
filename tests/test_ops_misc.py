"""RMSNorm, the gated activations and the embedding lookup against naive formulas."""

import math

import numpy as np
import pytest

from kvshare import _core
from kvshare.ops.activation import geglu_tanh, gelu_tanh, glu, swiglu
from kvshare.ops.embedding import embedding
from kvshare.ops.norm import rms_norm, rms_norm_numpy


def test_rms_norm_rows_heads_and_in_place():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32) * 10
    w = rng.standard_normal(16).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-5)
    fused = rng.standard_normal((5, 64)).astype(np.float32)
    view = fused[:, 16:48].reshape(5, 2, 16)
    expect = view / np.sqrt((view.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    rms_norm(view, None, 1e-6, out=view)
    np.testing.assert_allclose(fused[:, 16:48].reshape(5, 2, 16), expect, rtol=1e-5, atol=1e-6)


def test_gelu_tanh_and_geglu():
    x = np.linspace(-60, 60, 2001).astype(np.float32)
    xd = x.astype(np.float64)
    ref = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(gelu_tanh(x), ref, rtol=1e-5, atol=1e-6)
    up = np.cos(x)
    np.testing.assert_allclose(geglu_tanh(x.copy(), up), ref * up, rtol=1e-5, atol=1e-5)
    g = x.copy()
    out = geglu_tanh(g, up, out=g)  # in place over the gate
    assert out is g and np.all(np.isfinite(out))


def test_swiglu():
    x = np.linspace(-100, 100, 1001).astype(np.float32)
    up = np.sin(x)
    ref = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64))) * up
    np.testing.assert_allclose(swiglu(x.copy(), up), ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_is_ggmls_formula_at_every_batch_size():
    """The compiled row loop: squares summed in f64, the scale in f32, `(x * s) * w`; a row
    gets the same bits alone or in a batch of 100 (a short and a long prefill chunk)."""
    rng = np.random.default_rng(1)
    for d in (1, 7, 256, 640, 2048):
        x = (rng.standard_normal((100, d)) * 5).astype(np.float32)
        w = rng.standard_normal(d).astype(np.float32)
        got = rms_norm(x, w, 1e-6)
        ss = (x.astype(np.float64) ** 2).sum(-1, keepdims=True)
        s = (np.float32(1.0) / np.sqrt((ss / d).astype(np.float32) + np.float32(1e-6)))
        np.testing.assert_array_equal(got, (x * s.astype(np.float32)) * w)
        for r in (0, 37, 99):
            np.testing.assert_array_equal(rms_norm(x[r : r + 1], w, 1e-6), got[r : r + 1])
        np.testing.assert_allclose(got, rms_norm_numpy(x, w, 1e-6), rtol=2e-6, atol=1e-6)
        y = x.copy()
        assert rms_norm(y, w, 1e-6, out=y) is y
        np.testing.assert_array_equal(y, got)


def test_rms_norm_bad_input_is_a_value_error():
    x = np.ones((3, 8), np.float32)
    with pytest.raises(ValueError):
        rms_norm(x, np.ones(7, np.float32), 1e-6)  # weight of the wrong length
    with pytest.raises(ValueError):
        _core.rms_norm(x, None, 1e-6, np.ones((3, 7), np.float32))  # out of another shape
    with pytest.raises(ValueError):
        _core.rms_norm(x, None, 1e-6, x[1:])  # overlapping, not x itself


@pytest.mark.parametrize("kind,ref", [("gelu_tanh", geglu_tanh), ("silu", swiglu)])
def test_glu_over_the_fused_projection(kind, ref):
    """`glu` computes act(gate) * up over the gate half of the fused gate|up output in place,
    as the NumPy forms do (to float rounding), and leaves the up half alone."""
    rng = np.random.default_rng(2)
    for n, ff in ((1, 9), (160, 2048), (3, 1)):
        gu = (rng.standard_normal((n, 2 * ff)) * 4).astype(np.float32)
        gu[0, 0] = -60.0  # exp overflow in the gate: the limit, not NaN
        before = gu.copy()
        a = glu(gu, kind)
        assert a.shape == (n, ff) and np.shares_memory(a, gu)
        want = ref(before[:, :ff].copy(), before[:, ff:])
        np.testing.assert_allclose(a, want, rtol=4e-6, atol=1e-30)
        np.testing.assert_array_equal(gu[:, ff:], before[:, ff:])
    with pytest.raises(ValueError):
        glu(np.ones((2, 4), np.float32), "relu")
    with pytest.raises(ValueError):
        _core.glu_in_place(np.ones((2, 5), np.float32), "silu")


def test_embedding():
    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    np.testing.assert_array_equal(embedding(table, np.array([4, 0]), 2.0), table[[4, 0]] * 2)
    with pytest.raises(IndexError):
        embedding(table, np.array([5]))
