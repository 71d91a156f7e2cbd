"""`kvshare.ops.moe.moe_ffn_grouped` (`_core.moe_gate_up` / `_core.moe_down`: one Rust call per
MoE matrix product over the stacked expert tensors) against the float64 oracle on the
dequantized weights, and against the per-expert path (`moe_ffn` on `BlockWeight`s)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, quants

from kvshare import _core
from kvshare.ops.blockweight import BlockWeight
from kvshare.ops.moe import (Routing, StackedExperts, grouped_supported, moe_ffn,
                             moe_ffn_grouped, moe_ffn_reference, route)
from test_ops_moe import _random_k_blocks

pytestmark = pytest.mark.skipif(not hasattr(_core, "moe_gate_up"),
                                reason="this build has no grouped MoE kernels")


def _stacked(rng, qt, n_expert, rows, cols):
    """A stacked expert tensor of type qt: its bytes `[n_expert * rows, row_bytes]`."""
    x = (rng.standard_normal((n_expert * rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if qt == Q.F16:
        raw = x.astype(np.float16).view(np.uint8)
    elif qt == Q.F32:
        raw = x.view(np.uint8)
    elif qt in (Q.Q4_K, Q.Q6_K):
        raw = _random_k_blocks(qt, x.size // 256, rng)
    else:
        raw = np.asarray(quants.quantize(x, qt))
    return np.ascontiguousarray(raw).reshape(n_expert * rows, -1)


def _block(rng, qtypes, E, ff, n_embd, activations="f32"):
    """Stacked gate|up and down, per-expert BlockWeights over the same bytes, and their
    dequantized f32 twins."""
    g = _stacked(rng, qtypes[0], E, ff, n_embd)
    u = _stacked(rng, qtypes[1], E, ff, n_embd)
    d = _stacked(rng, qtypes[2], E, n_embd, ff)
    gu_s = StackedExperts((g, u), (int(qtypes[0]), int(qtypes[1])), E, n_embd, activations)
    d_s = StackedExperts((d,), (int(qtypes[2]),), E, ff, activations)
    gate_up = [BlockWeight.concat([(g[e * ff:(e + 1) * ff], int(qtypes[0]), n_embd),
                                   (u[e * ff:(e + 1) * ff], int(qtypes[1]), n_embd)],
                                  activations=activations) for e in range(E)]
    down = [BlockWeight(d[e * n_embd:(e + 1) * n_embd], int(qtypes[2]), ff,
                        activations=activations) for e in range(E)]
    return gu_s, d_s, gate_up, down


QTYPES = [(Q.Q8_0, Q.Q4_0, Q.Q5_0), (Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.F16, Q.F16, Q.F32)]
IDS = ["q8_0-q4_0-q5_0", "q4_k-q6_k", "f16-f32"]


@pytest.mark.parametrize("qtypes", QTYPES, ids=IDS)
@pytest.mark.parametrize("n_tokens", [1, 5, 40])
def test_grouped_matches_the_oracle_and_the_per_expert_path(qtypes, n_tokens):
    rng = np.random.default_rng(n_tokens)
    E, ff, n_embd = 6, 256, 256
    gu_s, d_s, gate_up, down = _block(rng, qtypes, E, ff, n_embd)
    router = (rng.standard_normal((E, n_embd)) * 0.2).astype(np.float32)
    h = rng.standard_normal((n_tokens, n_embd)).astype(np.float32)
    r = Routing(E, 2)
    got = moe_ffn_grouped(h, router, gu_s, d_s, r)
    want = moe_ffn_reference(h, router, [w.dequantize() for w in gate_up],
                             [w.dequantize() for w in down], r)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    per_expert = moe_ffn(h, router, gate_up, down, r)
    ids, _ = route(h @ router.T, r)
    most = np.bincount(ids.reshape(-1), minlength=E).max()
    if most <= 16 or qtypes[0] != Q.F16:
        # the same kernels per expert: the same bits (float experts with more than 16 tokens:
        # NumPy's matmul there, the exact kernel here)
        np.testing.assert_array_equal(got, per_expert)
    else:
        np.testing.assert_allclose(got, per_expert, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("activations", ["q8", "vnni"])
def test_grouped_8bit_activations(activations):
    qtypes = (Q.Q4_K, Q.Q8_0, Q.Q6_K)
    if not grouped_supported([int(q) for q in qtypes], activations):
        pytest.skip(f"{activations} activations do not run here")
    rng = np.random.default_rng(3)
    E, ff, n_embd = 5, 256, 512
    gu_s, d_s, gate_up, down = _block(rng, qtypes, E, ff, n_embd, activations)
    router = (rng.standard_normal((E, n_embd)) * 0.2).astype(np.float32)
    r = Routing(E, 2)
    for n in (1, 3, 60):
        h = rng.standard_normal((n, n_embd)).astype(np.float32)
        got = moe_ffn_grouped(h, router, gu_s, d_s, r)
        want = moe_ffn_reference(h, router, [w.dequantize() for w in gate_up],
                                 [w.dequantize() for w in down], r)
        # llama.cpp's approximation: 8-bit activations, ~0.5% of sum |w x| per product
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 0.03, (n, err)
        per_expert = moe_ffn(h, router, gate_up, down, r)
        if activations == "vnni" or n <= 16:
            np.testing.assert_array_equal(got, per_expert)


def test_grouped_ragged_loads():
    """Every token on one expert (the others idle), and a token's result alone equal to its
    result in the batch."""
    rng = np.random.default_rng(7)
    E, ff, n_embd = 4, 64, 64
    gu_s, d_s, gate_up, down = _block(rng, (Q.Q8_0, Q.Q8_0, Q.Q8_0), E, ff, n_embd)
    gu_f, d_f = [w.dequantize() for w in gate_up], [w.dequantize() for w in down]
    router = np.zeros((E, n_embd), np.float32)
    router[2] = 1.0  # h > 0 everywhere: expert 2 first for every token
    h = np.abs(rng.standard_normal((30, n_embd))).astype(np.float32)
    r = Routing(E, 1)
    assert (route(h @ router.T, r)[0] == 2).all()
    got = moe_ffn_grouped(h, router, gu_s, d_s, r)
    want = moe_ffn_reference(h, router, gu_f, d_f, r)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    router = rng.standard_normal((E, n_embd)).astype(np.float32)
    r = Routing(E, 3)
    full = moe_ffn_grouped(h, router, gu_s, d_s, r)
    for sl in (slice(0, 1), slice(3, 20), slice(29, 30)):
        np.testing.assert_allclose(moe_ffn_grouped(h[sl], router, gu_s, d_s, r), full[sl],
                                   rtol=0, atol=1e-6 * np.abs(full).max())
    assert moe_ffn_grouped(h[:0], router, gu_s, d_s, r).shape == (0, n_embd)


def test_grouped_rejects_bad_input():
    rng = np.random.default_rng(1)
    gu_s, d_s, _, _ = _block(rng, (Q.Q8_0, Q.Q8_0, Q.Q8_0), 4, 32, 32)
    x = np.zeros((2, 32), np.float32)
    out = np.zeros((2, 32), np.float32)
    raws, qts = list(gu_s.raws), list(gu_s.qtypes)
    with pytest.raises(ValueError, match="expert id"):
        _core.moe_gate_up(x, np.array([[0], [4]]), raws, qts, 4, out)
    with pytest.raises(ValueError):
        _core.moe_gate_up(x, np.array([[0], [1]]), raws, qts, 4, out[:1])
    with pytest.raises(ValueError):
        _core.moe_gate_up(x, np.array([[0], [1]]), raws, qts, 4, out, activations="int4")
    with pytest.raises(ValueError):
        _core.moe_down(out, np.array([[0], [1]]), np.ones((2, 2), np.float32),
                       list(d_s.raws), list(d_s.qtypes), 4, np.zeros((2, 32), np.float32))
