"""`kvshare.ops.moe`: routing as llama.cpp's `build_moe_ffn` computes it, grouping of tokens by
expert (ragged loads: idle experts, every token on one expert), and the grouped products on
experts in GGUF block formats against a float64 oracle on the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, quants

import importlib.util
import sys
from pathlib import Path

from kvshare.ops.blockweight import BlockWeight
from kvshare.ops.moe import Routing, group_by_expert, moe_ffn, moe_ffn_reference, route


def _softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_route_softmax_top_k_normalised():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 8)).astype(np.float32) * 2
    ids, w = route(logits, Routing(8, 3))
    p = _softmax(logits.astype(np.float64))
    want = np.argsort(-p, 1, kind="stable")[:, :3]
    np.testing.assert_array_equal(ids, want)
    pw = np.take_along_axis(p, want, 1)
    np.testing.assert_allclose(w, pw / pw.sum(1, keepdims=True), rtol=1e-6)
    assert (np.diff(w, axis=1) <= 0).all()  # slot 0 is the most probable expert


def test_route_without_norm_and_scaled():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((9, 6)).astype(np.float32)
    p = _softmax(logits.astype(np.float64))
    ids, w = route(logits, Routing(6, 2, norm=False))
    np.testing.assert_allclose(w, np.take_along_axis(p, ids, 1), rtol=1e-6)
    _, w2 = route(logits, Routing(6, 2, norm=False, scale=2.5))
    np.testing.assert_allclose(w2, 2.5 * w, rtol=1e-6)
    ids, w = route(logits, Routing(6, 2, gating="sigmoid", norm=False))
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(w, np.take_along_axis(s, ids, 1), rtol=1e-6)
    ids, w = route(logits, Routing(6, 2, gating="softmax_weight", norm=False))
    np.testing.assert_allclose(w, _softmax(np.take_along_axis(logits, ids, 1).astype(
        np.float64)), rtol=1e-6)
    with pytest.raises(ValueError):
        Routing(4, 5)
    with pytest.raises(ValueError):
        route(logits, Routing(5, 2))


def test_group_by_expert_is_ragged():
    ids = np.array([[2, 0], [2, 3], [0, 2]])
    pairs, offsets = group_by_expert(ids, 5)
    assert offsets.tolist() == [0, 2, 2, 5, 6, 6]  # experts 1 and 4 idle
    # pair t * k + j: expert 0 has token 0 slot 1 and token 2 slot 0, expert 2 tokens 0, 1, 2
    assert pairs[0:2].tolist() == [1, 4]
    assert pairs[2:5].tolist() == [0, 2, 5]
    assert pairs[5:6].tolist() == [3]
    with pytest.raises(IndexError):
        group_by_expert(np.array([[5]]), 5)


def _random_k_blocks(qt, n_blocks, rng):
    """Valid random Q4_K / Q6_K blocks (gguf-py cannot quantize to them): the generator of
    scripts/make_random_gguf.py."""
    name = "make_random_gguf"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / "make_random_gguf.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name].random_blocks(qt, n_blocks, rng)


def _experts(rng, qtypes, n_expert, ff, n_embd):
    """Per expert a BlockWeight of gate|up (parts of qtypes[0], qtypes[1]) and of down
    (qtypes[2]), and their dequantized f32 twins."""
    def blocks(qt, rows, cols):
        x = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if qt == Q.F16:
            raw = x.astype(np.float16).view(np.uint8)
        elif qt == Q.F32:
            raw = x.view(np.uint8)
        elif qt in (Q.Q4_K, Q.Q6_K):
            raw = _random_k_blocks(qt, rows * cols // 256, rng)
        else:
            raw = np.asarray(quants.quantize(x, qt))
        return np.ascontiguousarray(raw).reshape(-1)

    gate_up, down, gate_up_f, down_f = [], [], [], []
    for _ in range(n_expert):
        g, u = blocks(qtypes[0], ff, n_embd), blocks(qtypes[1], ff, n_embd)
        d = blocks(qtypes[2], n_embd, ff)
        gu = BlockWeight.concat([(g, int(qtypes[0]), n_embd), (u, int(qtypes[1]), n_embd)])
        dw = BlockWeight(d, int(qtypes[2]), ff)
        gate_up.append(gu)
        down.append(dw)
        gate_up_f.append(gu.dequantize())
        down_f.append(dw.dequantize())
    return gate_up, down, gate_up_f, down_f


@pytest.mark.parametrize("qtypes", [(Q.Q8_0, Q.Q4_0, Q.Q5_0), (Q.Q4_K, Q.Q4_K, Q.Q6_K),
                                    (Q.F16, Q.F16, Q.F32)],
                         ids=["q8_0-q4_0-q5_0", "q4_k-q6_k", "f16-f32"])
@pytest.mark.parametrize("n_tokens", [1, 5, 40])
def test_moe_ffn_matches_the_oracle(qtypes, n_tokens):
    rng = np.random.default_rng(n_tokens)
    E, ff, n_embd = 6, 256, 256
    gate_up, down, gu_f, d_f = _experts(rng, qtypes, E, ff, n_embd)
    router = (rng.standard_normal((E, n_embd)) * 0.2).astype(np.float32)
    h = rng.standard_normal((n_tokens, n_embd)).astype(np.float32)
    r = Routing(E, 2)
    got = moe_ffn(h, router, gate_up, down, r)
    want = moe_ffn_reference(h, router, gu_f, d_f, r)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err


def test_moe_ffn_ragged_loads():
    """Every token on one expert (the others idle), and a token's result whatever else is in
    its batch."""
    rng = np.random.default_rng(7)
    E, ff, n_embd = 4, 64, 64
    gate_up, down, gu_f, d_f = _experts(rng, (Q.Q8_0, Q.Q8_0, Q.Q8_0), E, ff, n_embd)
    router = np.zeros((E, n_embd), np.float32)
    router[2] = 1.0  # h > 0 everywhere: expert 2 first for every token
    h = np.abs(rng.standard_normal((30, n_embd))).astype(np.float32)
    r = Routing(E, 1)
    ids, _ = route(h @ router.T, r)
    assert (ids == 2).all()
    got = moe_ffn(h, router, gate_up, down, r)
    want = moe_ffn_reference(h, router, gu_f, d_f, r)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    router = (rng.standard_normal((E, n_embd))).astype(np.float32)
    r = Routing(E, 3)
    full = moe_ffn(h, router, gate_up, down, r)
    for sl in (slice(0, 1), slice(3, 20), slice(29, 30)):
        np.testing.assert_allclose(moe_ffn(h[sl], router, gate_up, down, r), full[sl],
                                   rtol=0, atol=1e-6 * np.abs(full).max())
