"""RMSNorm, the gated activations and the embedding lookup against naive formulas."""

import math

import numpy as np
import pytest

from kvshare.ops.activation import geglu_tanh, gelu_tanh, swiglu
from kvshare.ops.embedding import embedding
from kvshare.ops.norm import rms_norm


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


def test_embedding():
    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    np.testing.assert_array_equal(embedding(table, np.array([4, 0]), 2.0), table[[4, 0]] * 2)
    with pytest.raises(IndexError):
        embedding(table, np.array([5]))
