"""The grouped MoE kernels on GGUF blocks (`kvshare.ops.gpu_moe`, kernels/moe_blocks.cu) against
the NumPy oracle `ops.moe.moe_ffn_reference` (float64, token by token, on the dequantized
experts): several block types, gate and up of different types (two `gmv` launches and
`moe_glu_f32`) and of one type (`gmvglu`, two tensors or one fused `ffn_gate_up_exps`), ragged
expert loads, an idle expert, every token on the same experts, tiles of 1, 4 and 16 pairs,
biases and every activation, the dispatch from `ops.moe.moe_ffn_grouped`, and tiny MoE GGUFs'
layers (tiny-qwen3moe's; tiny-gpt-oss's MXFP4 experts with biases and swiglu_oai). Marked `gpu`: skipped without a CUDA device; runs on the CPU emulator (tests/gpu_emu).

Tolerance: the kernels accumulate in float32 in another order than the float64 oracle, and the
activation is float32: |y - ref| <= 2e-5 * max|ref| (observed well below 1e-5).
`test_plan_*` is host-side NumPy and runs everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvshare.ops import gpu_moe
from kvshare.ops.moe import Routing, moe_ffn_reference

# the float64 oracle's exp overflows for large negative gates (its limit, 0, is right)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

MODELS = Path(__file__).resolve().parent / "data" / "models"
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}
TOL = 2e-5


def random_rows(rng: np.random.Generator, qtype: Q, n: int, k: int) -> np.ndarray:
    """Raw rows `[n, row_bytes]` of valid blocks (random bytes, f16 scales of magnitude
    1e-3 .. 5e-2 with random signs); plain types: random values."""
    if qtype == Q.F32:
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        f = rng.standard_normal((n, k)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    qk, size = GGML_QUANT_SIZES[qtype]
    nb = n * (k // qk)
    blocks = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if qtype == Q.MXFP4:  # E8M0 exponents: scales 2^-10 .. 2^-4, a few denormal ones (e < 2)
        blocks[:, 0] = rng.integers(118, 125, nb)
        blocks[rng.integers(0, nb, 3), 0] = [0, 1, 2]
        return blocks.reshape(n, -1)
    for off in F16_FIELDS[qtype]:
        v = (rng.uniform(1e-3, 5e-2, nb) * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        blocks[:, off : off + 2] = v.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def dense(raw: np.ndarray, qtype: int, k: int) -> np.ndarray:
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(-1, k)
    if qtype == Q.F16:
        return raw.view(np.float16).reshape(-1, k).astype(np.float32)
    return np.asarray(dequantize(raw.reshape(-1), qtype), np.float32).reshape(-1, k)


def _k(*qtypes) -> int:
    return 256 if any(GGML_QUANT_SIZES[q][0] == 256 for q in qtypes) else 64


def make_layer(rng, E, d, ff, gq, uq, dq, fused=False):
    """(GpuStackedExperts gate|up, down, per-expert dense gate|up list, down list)."""
    g = random_rows(rng, gq, E * ff, d)
    u = random_rows(rng, uq, E * ff, d)
    dn = random_rows(rng, dq, E * d, ff)
    gd, ud, dd = dense(g, gq, d), dense(u, uq, d), dense(dn, dq, ff)
    gu_dense = [np.concatenate([gd[e * ff : (e + 1) * ff], ud[e * ff : (e + 1) * ff]])
                for e in range(E)]
    down_dense = [dd[e * d : (e + 1) * d] for e in range(E)]
    if fused:
        assert gq == uq
        rb = g.shape[1]
        both = np.concatenate([g.reshape(E, ff, rb), u.reshape(E, ff, rb)], axis=1)
        gu = gpu_moe.GpuStackedExperts.from_host([both.reshape(E * 2 * ff, rb)], [gq], E, d)
    else:
        gu = gpu_moe.GpuStackedExperts.from_host([g, u], [gq, uq], E, d)
    down = gpu_moe.GpuStackedExperts.from_host([dn], [dq], E, ff)
    return gu, down, gu_dense, down_dense


def check(h, router, gu, down, gu_dense, down_dense, routing, activation="silu", **kw):
    import cupy as cp

    y = cp.asnumpy(gpu_moe.moe_ffn(cp.asarray(h), router, gu, down, routing, activation, **kw))
    ref = moe_ffn_reference(h, router, gu_dense, down_dense, routing, activation=activation,
                            **kw)
    assert y.shape == ref.shape and np.isfinite(y).all()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err <= TOL, f"relative error {err:.3g}"
    return y


# --- host-side planning ------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,E", [(1, 2, 8), (5, 2, 8), (40, 4, 6), (3, 8, 128)])
def test_plan_tiles_cover_every_pair_once(n, k, E):
    rng = np.random.default_rng(n * 100 + k)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(n)])
    pairs, tiles, mt = gpu_moe.plan(ids, E)
    flat = ids.reshape(-1)
    assert sorted(pairs.tolist()) == list(range(n * k))
    assert mt in gpu_moe.GM_M
    seen = []
    for e, p0, c in tiles.tolist():
        assert 1 <= c <= mt
        assert all(flat[p] == e for p in pairs[p0 : p0 + c])
        seen += pairs[p0 : p0 + c].tolist()
    assert sorted(seen) == list(range(n * k))
    busiest = np.bincount(flat).max()
    assert mt == next((m for m in gpu_moe.GM_M if m >= busiest), gpu_moe.GM_M[-1])


def test_plan_all_pairs_on_one_expert():
    ids = np.full((40, 1), 3)
    pairs, tiles, mt = gpu_moe.plan(ids, 8)
    assert mt == 16
    assert tiles.tolist() == [[3, 0, 16], [3, 16, 16], [3, 32, 8]]
    with pytest.raises(IndexError):
        gpu_moe.plan(np.array([[8]]), 8)


# --- the kernels --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q3_K, Q.IQ4_XS,
                                   Q.F16, Q.BF16, Q.MXFP4])
def test_one_type_ragged_loads(qtype):
    rng = np.random.default_rng(int(qtype))
    E, k, n, d = 8, 2, 6, _k(qtype)
    ff = d
    gu, down, gud, dd = make_layer(rng, E, d, ff, qtype, qtype, qtype)
    h = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((E, d)).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[6] = -100.0  # expert 6 idle
    bias[1] = 3.0  # expert 1 busier than the rest
    routing = Routing(n_expert=E, k=k)
    check(h, router, gu, down, gud, dd, routing, router_bias=bias)


@pytest.mark.gpu
def test_mixed_gate_up_types_and_decode():
    # tiny-qwen3moe-q8's mix: gate Q8_0, up Q4_0, down Q5_0 (gmv per part + moe_glu_f32)
    rng = np.random.default_rng(7)
    E, d, ff = 16, 64, 32
    gu, down, gud, dd = make_layer(rng, E, d, ff, Q.Q8_0, Q.Q4_0, Q.Q5_0)
    router = rng.standard_normal((E, d)).astype(np.float32)
    for n, k in ((1, 4), (3, 4), (20, 2)):  # tiles of 1, of up to 4, of up to 16
        h = rng.standard_normal((n, d)).astype(np.float32)
        check(h, router, gu, down, gud, dd, Routing(n_expert=E, k=k))


@pytest.mark.gpu
@pytest.mark.parametrize("gq,dq,d", [(Q.Q4_K, Q.Q6_K, 2560), (Q.Q8_0, Q.Q4_0, 2336)],
                         ids=["q4_k", "q8_0"])
def test_long_rows_split_across_warps(gq, dq, d):
    # rows over which a CTA's 4 warps (GM_WARPS) pass more than twice: 320 chunks of 8 (2560)
    # or 292 (2336), so the M = 1 loop, unrolled by 2, runs its pair and its remainder;
    # decode (tiles of 1 pair) and a few tokens (tiles of up to 4)
    assert gpu_moe.GM_WARPS == 4
    rng = np.random.default_rng(int(gq))
    E, ff = 4, d
    gu, down, gud, dd = make_layer(rng, E, d, ff, gq, gq, dq, fused=True)
    router = rng.standard_normal((E, d)).astype(np.float32)
    for n in (1, 3):
        h = rng.standard_normal((n, d)).astype(np.float32)
        check(h, router, gu, down, gud, dd, Routing(n_expert=E, k=2))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_all_tokens_on_two_experts(fused):
    # every token on experts 3 and 5 (the others idle): 37 pairs each, tiles 16 + 16 + 5
    rng = np.random.default_rng(11)
    E, d, ff, n = 8, 256, 256, 37
    gu, down, gud, dd = make_layer(rng, E, d, ff, Q.Q4_K, Q.Q4_K, Q.Q6_K, fused=fused)
    h = rng.standard_normal((n, d)).astype(np.float32)
    router = (0.01 * rng.standard_normal((E, d))).astype(np.float32)
    bias = np.full(E, -50.0, np.float32)
    bias[3], bias[5] = 20.0, 19.0
    pairs, tiles, mt = gpu_moe.plan(np.tile([3, 5], (n, 1)), E)
    assert mt == 16 and len(tiles) == 6
    check(h, router, gu, down, gud, dd, Routing(n_expert=E, k=2), router_bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_activations_with_expert_biases(activation):
    rng = np.random.default_rng(len(activation))
    E, d, ff, n, k = 6, 64, 64, 5, 3
    gu, down, gud, dd = make_layer(rng, E, d, ff, Q.Q8_0, Q.Q8_0, Q.Q4_1)
    h = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((E, d)).astype(np.float32)
    kw = dict(router_bias=rng.standard_normal(E).astype(np.float32),
              gate_up_bias=rng.standard_normal((E, 2 * ff)).astype(np.float32),
              down_bias=rng.standard_normal((E, d)).astype(np.float32))
    routing = Routing(n_expert=E, k=k, gating="softmax_weight", norm=False)
    if activation == "gelu_tanh":
        # the oracle applies SwiGLU or swiglu_oai only: compare with the NumPy glu instead
        import cupy as cp

        from kvshare.ops.activation import glu
        from kvshare.ops.moe import route

        logits = h @ router.T + kw["router_bias"]
        ids, w = route(logits.astype(np.float32), routing)
        y = cp.asnumpy(gpu_moe.experts(cp.asarray(h), ids, w, gu, down, "gelu_tanh",
                                       gate_up_bias=kw["gate_up_bias"],
                                       down_bias=kw["down_bias"]))
        ref = np.zeros((n, d))
        for t in range(n):
            for j in range(k):
                e = ids[t, j]
                g = (gud[e] @ h[t] + kw["gate_up_bias"][e]).astype(np.float32)[None]
                a = glu(g.copy(), "gelu_tanh")[0].astype(np.float64)
                ref[t] += w[t, j] * (dd[e].astype(np.float64) @ a + kw["down_bias"][e])
        assert np.abs(y - ref).max() / np.abs(ref).max() <= TOL
        return
    check(h, router, gu, down, gud, dd, routing, activation, **kw)


@pytest.mark.gpu
def test_dispatch_from_moe_ffn_grouped():
    import cupy as cp

    from kvshare.ops.moe import moe_ffn_grouped

    rng = np.random.default_rng(3)
    E, d, ff, n = 8, 64, 64, 4
    gu, down, gud, dd = make_layer(rng, E, d, ff, Q.Q4_0, Q.Q4_0, Q.Q8_0)
    h = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((E, d)).astype(np.float32)
    routing = Routing(n_expert=E, k=2)
    y = moe_ffn_grouped(cp.asarray(h), router, gu, down, routing)
    assert isinstance(y, cp.ndarray)
    ref = moe_ffn_reference(h, router, gud, dd, routing)
    assert np.abs(cp.asnumpy(y) - ref).max() / np.abs(ref).max() <= TOL
    # the router as a device f16 weight (gpu.linear): the same experts chosen here
    y16 = gpu_moe.moe_ffn(cp.asarray(h), cp.asarray(router.astype(np.float16)), gu, down,
                          routing)
    assert y16.shape == (n, d)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-qwen3moe-q8", "tiny-qwen3moe"])
def test_tiny_moe_gguf_layer(model):
    import cupy as cp

    from kvshare.model.gguf_file import GGUFFile

    gf = GGUFFile(str(MODELS / f"{model}.gguf"))
    p = "blk.0."
    E = gf.tensors[p + "ffn_gate_inp.weight"].numpy_shape[0]
    gu = gpu_moe.GpuStackedExperts.from_gguf(
        gf, [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], E)
    down = gpu_moe.GpuStackedExperts.from_gguf(gf, [p + "ffn_down_exps.weight"], E)
    assert gu is not None and down is not None

    def experts_of(name):
        info = gf.tensors[name]
        rows, k = info.numpy_shape[1:]
        w = dense(np.asarray(gf.raw(name)).reshape(-1).view(np.uint8), int(info.qtype), k)
        return w.reshape(E, rows, k)

    g, u = experts_of(p + "ffn_gate_exps.weight"), experts_of(p + "ffn_up_exps.weight")
    dn = experts_of(p + "ffn_down_exps.weight")
    gud = [np.concatenate([g[e], u[e]]) for e in range(E)]
    router = dense(np.asarray(gf.raw(p + "ffn_gate_inp.weight")).reshape(-1).view(np.uint8),
                   int(gf.tensors[p + "ffn_gate_inp.weight"].qtype), gu.k)
    routing = Routing(n_expert=E, k=int(gf.metadata["qwen3moe.expert_used_count"]))
    rng = np.random.default_rng(5)
    for n in (1, 8):
        h = rng.standard_normal((n, gu.k)).astype(np.float32)
        y = cp.asnumpy(gpu_moe.moe_ffn(cp.asarray(h), router, gu, down, routing))
        ref = moe_ffn_reference(h, router, gud, list(dn), routing)
        assert np.abs(y - ref).max() / np.abs(ref).max() <= TOL


@pytest.mark.gpu
def test_tiny_gpt_oss_mxfp4_layer():
    """gpt-oss's experts as its GGUF holds them: MXFP4 gate, up and down (one `gmvglu` and one
    `gmv` launch on the 17-byte blocks), per-expert biases, `swiglu_oai`, the biased router's
    top k weighted by the softmax of the k logits."""
    from kvshare.model.gguf_file import GGUFFile

    gf = GGUFFile(str(MODELS / "tiny-gpt-oss.gguf"))
    p = "blk.1."
    E = gf.tensors[p + "ffn_gate_inp.weight"].numpy_shape[0]
    gu = gpu_moe.GpuStackedExperts.from_gguf(
        gf, [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], E)
    down = gpu_moe.GpuStackedExperts.from_gguf(gf, [p + "ffn_down_exps.weight"], E)
    assert gu is not None and down is not None and gu.qtypes == (Q.MXFP4, Q.MXFP4)

    def host(name):
        info = gf.tensors[name]
        raw = np.asarray(gf.raw(name)).reshape(-1).view(np.uint8)
        if info.qtype == Q.F32:
            return raw.view(np.float32).reshape(info.numpy_shape)
        rows, k = info.numpy_shape[1:]
        return dense(raw, int(info.qtype), k).reshape(E, rows, k)

    g, u, dn = (host(p + f"ffn_{m}_exps.weight") for m in ("gate", "up", "down"))
    kw = dict(router_bias=host(p + "ffn_gate_inp.bias"),
              gate_up_bias=np.concatenate([host(p + "ffn_gate_exps.bias"),
                                           host(p + "ffn_up_exps.bias")], axis=1),
              down_bias=host(p + "ffn_down_exps.bias"))
    router = host(p + "ffn_gate_inp.weight")
    routing = Routing(n_expert=E, k=int(gf.metadata["gpt-oss.expert_used_count"]),
                      gating="softmax_weight", norm=False)
    gud = [np.concatenate([g[e], u[e]]) for e in range(E)]
    rng = np.random.default_rng(9)
    for n in (1, 6):
        h = rng.standard_normal((n, gu.k)).astype(np.float32)
        check(h, router, gu, down, gud, list(dn), routing, "swiglu_oai", **kw)


# --- routing and planning on the device ----------------------------------------------------------

def _route_case(rng, n, E, ties):
    logits = rng.standard_normal((n, E)).astype(np.float32)
    if ties:  # exact ties between experts, the lower one first
        logits[:, E // 2 :] = logits[:, : E - E // 2]
    return logits


@pytest.mark.gpu
@pytest.mark.parametrize("gating,norm,scale,E,k,sel", [
    ("softmax", True, 0.0, 8, 2, False), ("softmax", False, 2.5, 160, 8, False),
    ("sigmoid", True, 1.0, 128, 8, True), ("softmax_weight", False, 0.0, 32, 4, False),
    ("softmax", True, 0.0, 64, 1, False), ("sigmoid", False, 0.5, 40, 3, True)])
@pytest.mark.parametrize("ties", [False, True])
def test_device_routing_equals_the_host_routing(gating, norm, scale, E, k, sel, ties):
    """`route_device` (moe_route_f32) picks the experts `ops.moe_routing.route` picks, in its
    slot order (ties: the lower expert), with its weights to float32 rounding of exp."""
    import cupy as cp

    from kvshare.ops.moe_routing import route

    rng = np.random.default_rng(E * 10 + k)
    routing = Routing(n_expert=E, k=k, gating=gating, norm=norm, scale=scale)
    bias = rng.uniform(-0.3, 0.3, E).astype(np.float32) if sel else None
    for n in (1, 7):
        logits = _route_case(rng, n, E, ties)
        ids_h, w_h = route(logits, routing, selection_bias=bias)
        ids_d, w_d = gpu_moe.route_device(cp.asarray(logits), routing, bias)
        assert ids_d.dtype == np.int32 and w_d.dtype == np.float32
        np.testing.assert_array_equal(cp.asnumpy(ids_d), ids_h)
        np.testing.assert_allclose(cp.asnumpy(w_d), w_h, rtol=3e-6, atol=0)


@pytest.mark.gpu
def test_device_routing_of_non_finite_logits_stays_in_range():
    """NaN logits (a warm-up step's garbage, a broken model) still give k distinct experts in
    range: the products never read past the experts."""
    import cupy as cp

    routing = Routing(n_expert=40, k=4)
    logits = np.full((3, 40), np.nan, np.float32)
    logits[1, 5] = np.inf
    ids, _ = gpu_moe.route_device(cp.asarray(logits), routing)
    ids = cp.asnumpy(ids)
    assert ((ids >= 0) & (ids < 40)).all()
    assert all(len(set(r)) == 4 for r in ids.tolist())
    with pytest.raises(ValueError, match="at most"):
        gpu_moe.route_device(cp.zeros((1, 600), np.float32), Routing(n_expert=600, k=2))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,E", [(1, 2, 8), (1, 8, 128), (3, 2, 8), (5, 4, 6), (40, 4, 6),
                                   (17, 8, 64)])
def test_device_plan_equals_the_host_plan(n, k, E):
    """`plan_device` (moe_sort_pairs): the host plan's pair order (by expert, token order
    kept), each expert's run cut into tiles of M = `tile_rows(n)` pairs in expert order, then
    empty tiles up to `max_tiles`."""
    import cupy as cp

    rng = np.random.default_rng(n * 1000 + k * 10 + E)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32)
    mt = gpu_moe.tile_rows(n)
    pairs, tiles, nt = gpu_moe.plan_device(cp.asarray(ids), E, mt)
    pairs_h, _, _ = gpu_moe.plan(ids, E)
    np.testing.assert_array_equal(cp.asnumpy(pairs), pairs_h)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert counts.max() <= mt or mt == gpu_moe.GM_M[-1]
    want, start = [], 0
    for e in range(E):
        for i in range(0, counts[e], mt):
            want.append([e, start + i, min(mt, counts[e] - i)])
        start += counts[e]
    tiles = cp.asnumpy(tiles)
    assert nt == gpu_moe.max_tiles(n * k, E, mt) >= len(want)
    assert tiles[: len(want)].tolist() == want and not tiles[len(want) :, 2].any()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 20])
def test_a_layer_routed_on_the_device_equals_the_host_routing(n, monkeypatch):
    """A device router's layer routed on the device (the default: device plan, empty tiles
    past the last) against the same layer routed on the host ($KVSHARE_GPU_MOE_ROUTING=host)
    and the float64 oracle."""
    import cupy as cp

    rng = np.random.default_rng(n)
    E, d, ff = 12, 64, 64
    gu, down, gud, dd = make_layer(rng, E, d, ff, Q.Q4_0, Q.Q4_0, Q.Q8_0)
    h = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((E, d)).astype(np.float32)
    routing = Routing(n_expert=E, k=3)
    y_dev = cp.asnumpy(gpu_moe.moe_ffn(cp.asarray(h), cp.asarray(router), gu, down, routing))
    monkeypatch.setenv(gpu_moe.ROUTING_ENV, "host")
    y_host = cp.asnumpy(gpu_moe.moe_ffn(cp.asarray(h), cp.asarray(router), gu, down, routing))
    ref = moe_ffn_reference(h, router, gud, dd, routing)
    assert np.abs(y_dev - ref).max() / np.abs(ref).max() <= TOL
    np.testing.assert_allclose(y_dev, y_host, rtol=0, atol=1e-5 * np.abs(ref).max())
