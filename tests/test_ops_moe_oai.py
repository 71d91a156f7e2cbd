"""gpt-oss's experts on the grouped kernels (`moe_ffn_grouped` with per-expert biases and the
clamped `swiglu_oai`, MXFP4 blocks): against the float64 oracle, and bit for bit against the
per-expert path (`moe_ffn` on `BlockWeight`s over the same bytes), with f32 activations,
8-bit activations and ggml's Q8_0-rounded activations (`blocks-q8`'s `Q8_0Acts`)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvshare import _core
from kvshare.model.moe import Q8_0Acts
from kvshare.ops.blockweight import BlockWeight
from kvshare.ops.moe import (Routing, StackedExperts, moe_ffn, moe_ffn_grouped,
                             moe_ffn_reference, route, swiglu_oai)

pytestmark = pytest.mark.skipif(not hasattr(_core, "moe_gate_up"),
                                reason="this build has no grouped MoE kernels")

MX = int(Q.MXFP4)


def _mxfp4(rng, rows, cols):
    """`[rows, cols / 32 * 17]` MXFP4 blocks, scales 2^-7..2^-4 (|w| <= 0.75)."""
    raw = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(121, 125, raw.shape[0])
    return raw.reshape(rows, -1)


def _experts(rng, E, ff, d, acts, q8_0):
    g, u, dn = _mxfp4(rng, E * ff, d), _mxfp4(rng, E * ff, d), _mxfp4(rng, E * d, ff)
    gu_s = StackedExperts((g, u), (MX, MX), E, d, acts, q8_0_acts=q8_0)
    d_s = StackedExperts((dn,), (MX,), E, ff, acts, q8_0_acts=q8_0)
    gate_up = [BlockWeight.concat([(g[e * ff:(e + 1) * ff], MX, d),
                                   (u[e * ff:(e + 1) * ff], MX, d)], activations=acts)
               for e in range(E)]
    down = [BlockWeight(dn[e * d:(e + 1) * d], MX, ff, activations=acts) for e in range(E)]
    if q8_0:
        gate_up, down = [Q8_0Acts(w) for w in gate_up], [Q8_0Acts(w) for w in down]
    return gu_s, d_s, gate_up, down


@pytest.mark.parametrize("acts,q8_0", [("f32", False), ("q8", False), ("f32", True)],
                         ids=["f32", "q8", "q8_0"])
@pytest.mark.parametrize("n_tokens", [1, 5, 40])
def test_grouped_equals_the_per_expert_path(acts, q8_0, n_tokens):
    rng = np.random.default_rng(n_tokens)
    E, ff, d = 8, 128, 256
    gu_s, d_s, gate_up, down = _experts(rng, E, ff, d, acts, q8_0)
    router = (rng.standard_normal((E, d)) * 0.2).astype(np.float32)
    h = rng.standard_normal((n_tokens, d)).astype(np.float32)
    rb = rng.standard_normal(E).astype(np.float32)
    gub = (rng.standard_normal((E, 2 * ff)) * 4).astype(np.float32)
    db = rng.standard_normal((E, d)).astype(np.float32)
    r = Routing(E, 4, gating="softmax_weight", norm=False)
    kw = dict(router_bias=rb, gate_up_bias=gub, down_bias=db)
    got = moe_ffn_grouped(h, router, gu_s, d_s, r, "swiglu_oai", **kw)
    per_expert = moe_ffn(h, router, gate_up, down, r, "swiglu_oai", **kw)
    ids, _ = route(h @ router.T + rb, r)
    most = np.bincount(ids.reshape(-1), minlength=E).max()
    if acts == "f32" or most <= 16:
        # the same kernels per expert (8-bit activations above 16 tokens: BLAS on the
        # round-tripped values there, the panel GEMM here)
        np.testing.assert_array_equal(got, per_expert)
    want = moe_ffn_reference(h, router, [w.dequantize() for w in _blocks(gate_up)],
                             [w.dequantize() for w in _blocks(down)], r,
                             activation="swiglu_oai", **kw)
    err = np.abs(got - want).max() / np.abs(want).max()
    # f32: summation order; 8-bit activations: ~0.5% of sum |w x| per product
    assert err < (1e-5 if acts == "f32" and not q8_0 else 0.03), err
    g = np.stack([h @ w.dequantize()[:ff].T for w in _blocks(gate_up)]) + gub[:, None, :ff]
    assert (g > 7).any() and (g < 7).any()  # the clamp is exercised


def _blocks(ws):
    return [getattr(w, "w", w) for w in ws]


def test_swiglu_oai_kernel_against_the_numpy_formula():
    rng = np.random.default_rng(4)
    gu = (rng.standard_normal((7, 2 * 45)) * 6).astype(np.float32)
    want = swiglu_oai(gu.copy())
    got = gu.copy()
    _core.glu_in_place(got, "swiglu_oai")
    # Cephes' exp on AVX2 against NumPy's: a few ulp
    np.testing.assert_allclose(got[:, :45], want, rtol=2e-6, atol=1e-30)
    np.testing.assert_array_equal(got[:, 45:], gu[:, 45:])


def test_grouped_refuses_an_unknown_activation_and_a_bad_bias():
    rng = np.random.default_rng(5)
    gu_s, d_s, _, _ = _experts(rng, 2, 32, 32, "f32", False)
    router = np.zeros((2, 32), np.float32)
    h = np.ones((1, 32), np.float32)
    with pytest.raises(ValueError):
        moe_ffn_grouped(h, router, gu_s, d_s, Routing(2, 1), "relu")
    with pytest.raises(ValueError):
        moe_ffn_grouped(h, router, gu_s, d_s, Routing(2, 1), "swiglu_oai",
                        gate_up_bias=np.zeros((2, 63), np.float32))
