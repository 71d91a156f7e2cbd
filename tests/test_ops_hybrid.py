"""Ops of the hybrid models: the gated delta rule (chunked prefill form and decode step) and
the causal depthwise convolution with state, against token-by-token float64 references;
state carry-over (any split of a sequence equals one call); GPU twins vs NumPy (`gpu`)."""

from __future__ import annotations

import numpy as np
import pytest

from kvshare.ops.gated_delta import (gated_delta_chunked, gated_delta_reference,
                                     gated_delta_step)
from kvshare.ops.short_conv import causal_conv1d, causal_conv1d_reference, causal_conv1d_step


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def delta_inputs(T, Hk=2, Hv=4, D=16, seed=0, decay=0.3):
    rng = np.random.default_rng(seed)
    q = _unit(rng.standard_normal((T, Hk, D)))
    k = _unit(rng.standard_normal((T, Hk, D)))
    v = rng.standard_normal((T, Hv, D)).astype(np.float32)
    g = (-decay * np.abs(rng.standard_normal((T, Hv)))).astype(np.float32)
    b = (1 / (1 + np.exp(-rng.standard_normal((T, Hv))))).astype(np.float32)
    s0 = rng.standard_normal((Hv, D, D)).astype(np.float32)
    return q, k, v, g, b, s0


@pytest.mark.parametrize("T", [1, 2, 5, 63, 64, 65, 130, 300])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4), (1, 3)])
def test_gated_delta_chunked_matches_recurrence(T, heads):
    q, k, v, g, b, s0 = delta_inputs(T, *heads, seed=T)
    s = s0.copy()
    o = gated_delta_chunked(q, k, v, g, b, s, scale=0.25)
    ro, rs = gated_delta_reference(q, k, v, g, b, s0, scale=0.25)
    assert o.shape == v.shape and o.dtype == np.float32
    np.testing.assert_allclose(o, ro, rtol=0, atol=2e-5)
    np.testing.assert_allclose(s, rs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_gated_delta_chunk_size_and_splits(chunk):
    """Internal chunk size and splitting the sequence across calls change nothing."""
    q, k, v, g, b, s0 = delta_inputs(200, seed=1)
    s_ref = s0.copy()
    o_ref = gated_delta_chunked(q, k, v, g, b, s_ref, scale=0.25)
    s = s0.copy()
    outs = []
    for a, e in ((0, 37), (37, 38), (38, 150), (150, 200)):
        outs.append(gated_delta_chunked(q[a:e], k[a:e], v[a:e], g[a:e], b[a:e], s,
                                        scale=0.25, chunk_size=chunk))
    np.testing.assert_allclose(np.concatenate(outs), o_ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=0, atol=2e-5)


def test_gated_delta_strong_decay_and_long_chunks_stay_finite():
    # decays of exp(-40) per token underflow the in-chunk cumulative decay to 0: no inf/nan
    q, k, v, g, b, s0 = delta_inputs(256, seed=2, decay=40.0)
    s = s0.copy()
    o = gated_delta_chunked(q, k, v, g, b, s, scale=0.25)
    ro, rs = gated_delta_reference(q, k, v, g, b, s0, scale=0.25)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    np.testing.assert_allclose(o, ro, rtol=0, atol=2e-5)
    # beta = 1 with repeated keys: A's entries reach 1 (the hardest triangular systems)
    q, k, v, g, b, s0 = delta_inputs(128, seed=3, decay=0.0)
    k[:] = k[:1]
    b[:] = 1.0
    s = s0.copy()
    o = gated_delta_chunked(q, k, v, g, b, s, scale=0.25)
    ro, rs = gated_delta_reference(q, k, v, g, b, s0, scale=0.25)
    np.testing.assert_allclose(o, ro, rtol=0, atol=1e-4)
    np.testing.assert_allclose(s, rs, rtol=0, atol=1e-4)


def test_gated_delta_step_batch():
    B = 3
    q, k, v, g, b, _ = delta_inputs(B, seed=4)
    rng = np.random.default_rng(5)
    states = rng.standard_normal((B, 4, 16, 16)).astype(np.float32)
    s0 = states.copy()
    o = gated_delta_step(q, k, v, g, b, states, scale=0.25)
    for i in range(B):
        ro, rs = gated_delta_reference(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                                       b[i : i + 1], s0[i], scale=0.25)
        np.testing.assert_allclose(o[i], ro[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(states[i], rs, rtol=0, atol=1e-5)
    # a decode step equals a chunked call of one token
    s1 = s0[0].copy()
    o1 = gated_delta_chunked(q[:1], k[:1], v[:1], g[:1], b[:1], s1, scale=0.25)
    np.testing.assert_allclose(o1[0], o[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(s1, states[0], rtol=0, atol=1e-5)


def test_gated_delta_bad_state_shape():
    q, k, v, g, b, s0 = delta_inputs(4)
    with pytest.raises(ValueError, match="state"):
        gated_delta_chunked(q, k, v, g, b, s0[:, :8], scale=0.25)


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("T", [1, 2, 3, 10])
def test_causal_conv1d(K, T):
    rng = np.random.default_rng(K * 10 + T)
    C = 24
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    st0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    st = st0.copy()
    y = causal_conv1d(x, w, st)
    ry, rs = causal_conv1d_reference(x, w, st0)
    np.testing.assert_allclose(y, ry, rtol=0, atol=1e-5)
    np.testing.assert_allclose(st, rs, rtol=0, atol=0)
    # token by token with the decode step (a batch of 2 identical sequences)
    sts = np.stack([st0, st0])
    ys = [causal_conv1d_step(np.stack([x[t], x[t]]), w, sts) for t in range(T)]
    np.testing.assert_allclose(np.stack([a[0] for a in ys]), ry, rtol=0, atol=1e-5)
    np.testing.assert_allclose(sts[1], rs, rtol=0, atol=0)


def test_causal_conv1d_zero_state_is_causal_padding_and_strided_input():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((12, 40)).astype(np.float32)[:, 5:29]  # non-contiguous rows
    w = rng.standard_normal((24, 4)).astype(np.float32)
    st = np.zeros((3, 24), np.float32)
    y = causal_conv1d(x, w, st)
    xp = np.concatenate([np.zeros((3, 24)), x])
    want = sum(xp[j : j + 12] * w[:, j] for j in range(4))
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(st, x[-3:])


# --- GPU twins ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_hybrid_ops_match_numpy():
    from kvshare.backend import get_backend

    be = get_backend("cuda")
    cp = be.xp
    q, k, v, g, b, s0 = delta_inputs(300, seed=11)
    s = s0.copy()
    o = gated_delta_chunked(q, k, v, g, b, s, scale=0.25)
    sd = cp.asarray(s0)
    od = gated_delta_chunked(*(cp.asarray(a) for a in (q, k, v, g, b)), sd, scale=0.25,
                             backend=be)
    np.testing.assert_allclose(cp.asnumpy(od), o, rtol=0, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(sd), s, rtol=0, atol=1e-4)
    q1, k1, v1, g1, b1, _ = delta_inputs(5, seed=12)
    st = np.random.default_rng(13).standard_normal((5, 4, 16, 16)).astype(np.float32)
    std = cp.asarray(st)
    o1 = gated_delta_step(q1, k1, v1, g1, b1, st, scale=0.25)
    o1d = gated_delta_step(*(cp.asarray(a) for a in (q1, k1, v1, g1, b1)), std, scale=0.25,
                           backend=be)
    np.testing.assert_allclose(cp.asnumpy(o1d), o1, rtol=0, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(std), st, rtol=0, atol=1e-5)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((50, 128)).astype(np.float32)
    w = rng.standard_normal((128, 4)).astype(np.float32)
    cs = rng.standard_normal((3, 128)).astype(np.float32)
    csd = cp.asarray(cs)
    y = causal_conv1d(x, w, cs)
    yd = causal_conv1d(cp.asarray(x), cp.asarray(w), csd, backend=be)
    np.testing.assert_allclose(cp.asnumpy(yd), y, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(cp.asnumpy(csd), cs)
    xs = rng.standard_normal((4, 128)).astype(np.float32)
    sts = rng.standard_normal((4, 3, 128)).astype(np.float32)
    stsd = cp.asarray(sts)
    ys = causal_conv1d_step(xs, w, sts)
    ysd = causal_conv1d_step(cp.asarray(xs), cp.asarray(w), stsd, backend=be)
    np.testing.assert_allclose(cp.asnumpy(ysd), ys, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(cp.asnumpy(stsd), sts)
