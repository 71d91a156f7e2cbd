"""The element-wise kernels of qwen35's gated delta net decode step (`kvshare.ops.gpu_hybrid`
`gdn_gates`, `silu_l2norm_qk`, `mul_silu`; kernels/gdn_decode.cu) against NumPy's formulas
(`kvshare.model.hybrid`'s `sigmoid`, `silu`, `softplus`, `l2_norm_heads`) within float32
rounding: strided views of a fused projection, large |a| (both softplus branches and the
x > 20 cut), heads whose norm is below eps, head sizes below and above a warp's 32 lanes;
their argument checks; and `GatedDeltaNetLayer.gpu_step` (the GPU decode step of
tiny-qwen35's delta-net layers) allocating nothing outside the step's workspace: captured
as a CUDA graph with device slots (a padding row among them) under the CPU emulator, whose
capture refuses any allocation, host value or device read, its replay gives the eager
step's residual stream and states bit for bit. Marked `gpu`: skipped without a CUDA device;
runs on the CPU emulator (tests/gpu_emu).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.model.hybrid import l2_norm_heads, sigmoid, silu, softplus
from kvshare.ops import gpu_hybrid

pytestmark = pytest.mark.gpu

MODELS = Path(__file__).resolve().parent / "data" / "models"
# expf / log1pf within a few ulp of NumPy's (float32 ulp: 1.2e-7 relative)
RTOL = 2e-6


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def close(got, ref, what: str, atol: float = 0.0) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                               rtol=RTOL, atol=atol, err_msg=what)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# --- gdn_gates ------------------------------------------------------------------------------

@pytest.mark.parametrize("n,H", [(1, 4), (3, 16), (5, 7), (2, 300)])
def test_gates_match_numpy(cp, n, H):
    """beta and g from the b and a columns of a fused projection row (views, row stride the
    projection's), a spread from -60 to 60 (softplus's log1p(exp(x)) branch, its
    x + log1p(exp(-x)) branch and the x > 20 cut), dt_bias and ssm_a per head."""
    rng = np.random.default_rng(n * 1000 + H)
    lead, tail = 9, 3
    proj = rng.standard_normal((n, lead + 2 * H + tail)).astype(np.float32) * 4
    a = rng.uniform(-60.0, 60.0, (n, H)).astype(np.float32)
    a.flat[: min(a.size, 6)] = [0.0, 20.0, -20.0, 19.999998, 20.000002, 1e-30][: min(a.size, 6)]
    proj[:, lead + H : lead + 2 * H] = a
    proj[0, lead : lead + min(H, 3)] = [-100.0, 100.0, 0.0][: min(H, 3)]  # exp overflows
    dt = rng.standard_normal(H).astype(np.float32)
    dt[: min(H, 2)] = 0.0  # the exact cut values above reach softplus unchanged
    ssm_a = -np.exp(rng.standard_normal(H)).astype(np.float32)
    d = cp.asarray(proj)
    db, da = d[:, lead : lead + H], d[:, lead + H : lead + 2 * H]
    assert db.strides[0] == proj.shape[1] * 4
    beta, g = gpu_hybrid.gdn_gates(db, da, cp.asarray(dt), cp.asarray(ssm_a))
    assert beta.shape == g.shape == (n, H) and beta.dtype == g.dtype == np.float32
    want_beta = sigmoid(proj[:, lead : lead + H])
    want_g = softplus(a + dt) * ssm_a
    close(cp.asnumpy(beta), want_beta, "beta")
    close(cp.asnumpy(g), want_g, "g")
    assert np.isfinite(cp.asnumpy(g)).all() and np.isfinite(cp.asnumpy(beta)).all()


def test_gates_into_outs_and_checks(cp):
    rng = np.random.default_rng(5)
    n, H = 3, 4
    b, a = (cp.asarray(rng.standard_normal((n, H)).astype(np.float32)) for _ in range(2))
    dt, sa = cp.asarray(np.ones(H, np.float32)), cp.asarray(-np.ones(H, np.float32))
    big = cp.full((n, 2 * H + 2), 7.0, np.float32)
    bo, go = big[:, 1 : 1 + H], big[:, 1 + H : 1 + 2 * H]  # strided outputs
    r_b, r_g = gpu_hybrid.gdn_gates(b, a, dt, sa, beta_out=bo, g_out=go)
    assert r_b is bo and r_g is go
    h = cp.asnumpy(big)
    assert (h[:, 0] == 7.0).all() and (h[:, -1] == 7.0).all()
    close(h[:, 1 : 1 + H], sigmoid(cp.asnumpy(b)), "beta_out")
    close(h[:, 1 + H : 1 + 2 * H], softplus(cp.asnumpy(a) + 1.0) * -1.0, "g_out")
    with pytest.raises(ValueError):
        gpu_hybrid.gdn_gates(b, a[:, :3], dt, sa)
    with pytest.raises(ValueError):
        gpu_hybrid.gdn_gates(b, a, dt[:3], sa)
    with pytest.raises(ValueError):
        gpu_hybrid.gdn_gates(b, a, dt, sa[:3])
    with pytest.raises(ValueError):
        gpu_hybrid.gdn_gates(b, a, dt, sa, beta_out=cp.zeros((n, H + 1), np.float32))
    with pytest.raises(ValueError):
        gpu_hybrid.gdn_gates(b, a, dt, sa, g_out=cp.zeros((n, H), np.float64))
    with pytest.raises(ValueError):
        gpu_hybrid.gdn_gates(b[0], a[0], dt, sa)
    e = cp.zeros((0, H), np.float32)
    r_b, r_g = gpu_hybrid.gdn_gates(e, e, dt, sa)
    assert r_b.shape == r_g.shape == (0, H)


# --- silu_l2norm_qk -------------------------------------------------------------------------

def _qkv_ref(x: np.ndarray, Hk: int, Dk: int, eps: float) -> np.ndarray:
    """The model's CPU formulas: silu on all, then l2_norm_heads of q and k."""
    n = x.shape[0]
    kd = Hk * Dk
    s = silu(x, np)
    s[:, :kd] = l2_norm_heads(s[:, :kd].reshape(n, Hk, Dk), eps).reshape(n, kd)
    s[:, kd : 2 * kd] = l2_norm_heads(s[:, kd : 2 * kd].reshape(n, Hk, Dk), eps).reshape(n, kd)
    return s


@pytest.mark.parametrize("n,Hk,Dk,vd", [
    (1, 2, 16, 64),    # tiny-qwen35's heads: a head below a warp's lanes
    (3, 1, 80, 40),    # Dk not a multiple of 32; n * 2 Hk not a multiple of 4 warps
    (5, 3, 128, 700),  # Qwen3-Next's head size
    (2, 2, 32, 0),     # no v channels
])
def test_silu_l2norm_matches_numpy(cp, n, Hk, Dk, vd):
    """In place on a strided view (the rows of a wider buffer, edges untouched), one head
    near zero (its norm below eps: divided by eps), values up to |x| = 30."""
    rng = np.random.default_rng(n * 7 + Dk)
    eps = 1e-6
    C = 2 * Hk * Dk + vd
    x = (rng.standard_normal((n, C)) * 3).astype(np.float32)
    x[0, :Dk] *= 1e-8  # q head 0 of row 0: ||silu|| ~ 5e-9 sqrt(Dk) < eps
    x[-1, Hk * Dk : Hk * Dk + Dk] = 0.0  # a zero k head: stays zero
    x[0, -1] = 30.0
    x[-1, 0] = -30.0
    big = np.full((n, C + 5), 7.0, np.float32)
    big[:, 2 : 2 + C] = x
    d = cp.asarray(big)
    view = d[:, 2 : 2 + C]
    r = gpu_hybrid.silu_l2norm_qk(view, Hk, Dk, eps)
    assert r is view
    h = cp.asnumpy(d)
    assert (h[:, :2] == 7.0).all() and (h[:, 2 + C :] == 7.0).all()
    want = _qkv_ref(x, Hk, Dk, eps)
    got = h[:, 2 : 2 + C]
    close(got, want, "qkv", atol=1e-30)
    ss = np.sqrt((silu(x[0, :Dk], np) ** 2).sum())
    assert ss < eps  # the case is what it claims
    close(got[0, :Dk], silu(x[0, :Dk], np) / np.float32(eps), "the head below eps")
    assert (got[-1, Hk * Dk : Hk * Dk + Dk] == 0.0).all()
    norms = np.linalg.norm(got[:, : 2 * Hk * Dk].reshape(n, 2 * Hk, Dk), axis=-1)
    norms[0, 0] = norms[-1, Hk] = 1.0
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)


def test_silu_l2norm_checks_and_empty(cp):
    x = cp.zeros((2, 10), np.float32)
    with pytest.raises(ValueError):
        gpu_hybrid.silu_l2norm_qk(x, 2, 3, 1e-6)  # 12 channels of q and k > 10
    with pytest.raises(ValueError):
        gpu_hybrid.silu_l2norm_qk(np.zeros((2, 10), np.float32), 1, 2, 1e-6)  # host array
    with pytest.raises(ValueError):
        gpu_hybrid.silu_l2norm_qk(x.astype(np.float64), 1, 2, 1e-6)
    with pytest.raises(ValueError):
        gpu_hybrid.silu_l2norm_qk(x[:, ::2], 1, 2, 1e-6)  # last stride not unit
    with pytest.raises(ValueError):
        gpu_hybrid.silu_l2norm_qk(x.reshape(2, 2, 5), 1, 2, 1e-6)
    e = cp.zeros((0, 10), np.float32)
    assert gpu_hybrid.silu_l2norm_qk(e, 1, 2, 1e-6) is e


# --- mul_silu -------------------------------------------------------------------------------

@pytest.mark.parametrize("n,d", [(1, 64), (4, 300), (3, 1)])
def test_mul_silu_matches_numpy(cp, n, d):
    rng = np.random.default_rng(n + d)
    o = rng.standard_normal((n, d)).astype(np.float32)
    zfull = (rng.standard_normal((n, d + 6)) * 8).astype(np.float32)
    zfull[0, 3] = -100.0  # exp(-z) overflows: silu -0
    dz = cp.asarray(zfull)[:, 3 : 3 + d]  # a strided view (the projection's z columns)
    do = cp.asarray(o)
    assert gpu_hybrid.mul_silu(do, dz) is do
    z = zfull[:, 3 : 3 + d]
    close(cp.asnumpy(do), o * silu(z, np), "o * silu(z)", atol=1e-30)
    zfull2 = cp.asnumpy(dz)
    assert np.array_equal(bits(zfull2), bits(z))  # z untouched


def test_mul_silu_checks(cp):
    o = cp.zeros((2, 4), np.float32)
    with pytest.raises(ValueError):
        gpu_hybrid.mul_silu(o, cp.zeros((2, 5), np.float32))
    with pytest.raises(ValueError):
        gpu_hybrid.mul_silu(np.zeros((2, 4), np.float32), cp.zeros((2, 4), np.float32))
    with pytest.raises(ValueError):
        gpu_hybrid.mul_silu(o.reshape(2, 2, 2), cp.zeros((2, 2, 2), np.float32))
    e = cp.zeros((0, 4), np.float32)
    assert gpu_hybrid.mul_silu(e, e) is e


# --- qwen35's decode step: captured, it allocates nothing outside the workspace ------------

def test_qwen35_decode_step_is_capturable(cp):
    """A delta-net layer's `gpu_step` under a stream capture (emulator: any allocation
    outside the workspace, host array or device read raises `CaptureError`) with device
    slots (a padding row among them): nothing runs at capture, and the replay gives the
    eager step's x and states (conv and SSM, every slot and layer) bit for bit."""
    if not hasattr(cp, "CaptureError"):
        pytest.skip("checks the CPU emulator's capture model")
    from kvshare.model.loader import load_model
    from kvshare.model.qwen35 import GatedDeltaNetLayer
    from kvshare.ops import gpu_runtime as rt

    m = load_model(MODELS / "tiny-qwen35.gguf", "cuda")
    layers = [L for L in m.layers if isinstance(L, GatedDeltaNetLayer)]
    assert layers
    rng = np.random.default_rng(11)
    cache = m.new_cache(8, 16, n_state_slots=4, kv_dtype="f32")
    init = [rng.standard_normal(a.shape).astype(np.float32) * 0.5 for a in cache.states]
    slots = cp.asarray(np.array([2, -1, 0], np.int32))
    x0 = rng.standard_normal((3, m.config.n_embd)).astype(np.float32)

    def reset():
        for a, h in zip(cache.states, init):
            a[...] = cp.asarray(h)
        return cp.asarray(x0)

    def step(x):
        for L in layers:
            x = L.gpu_step(x, slots, cache)
        return x

    ws = rt.Workspace()
    x = reset()
    with rt.using(ws):  # eager (measuring the workspace: ordinary allocations)
        r = step(x)
    assert r is x
    want_x = cp.asnumpy(x)
    want_states = [cp.asnumpy(a) for a in cache.states]
    assert np.isfinite(want_x).all()
    for a, h in zip(want_states, init):  # the live slots changed, the padding row's not
        assert not np.array_equal(a[[0, 2]], h[[0, 2]])
        assert np.array_equal(bits(a[[1, 3]]), bits(h[[1, 3]]))

    ws.reserve(ws.peak)
    ws.reset()
    x = reset()
    st = cp.cuda.Stream(non_blocking=False)
    with st, rt.using(ws):
        st.begin_capture()
        try:
            with rt.capturing():
                r = step(x)
        finally:
            graph = st.end_capture()
    assert r is x
    names = [op[0] for op in graph._ops]
    n_layers = len(layers)
    for k in ("gdn_gates_f32", "silu_l2norm_qk_f32", "mul_silu_f32", "causal_conv1d_step_f32",
              "gated_delta_step_f32"):
        assert names.count(k) == n_layers, (k, names)
    # nothing ran during the capture
    assert np.array_equal(bits(cp.asnumpy(x)), bits(x0))
    assert all(np.array_equal(bits(cp.asnumpy(a)), bits(h)) for a, h in zip(cache.states, init))
    graph.launch(stream=st)
    st.synchronize()
    assert np.array_equal(bits(cp.asnumpy(x)), bits(want_x))
    for a, w in zip(cache.states, want_states):
        assert np.array_equal(bits(cp.asnumpy(a)), bits(w))


def test_qwen35_decode_step_allocation_is_refused_under_capture(cp):
    """The check above has teeth: the former array code (an allocating silu) is refused by
    the emulator's capture."""
    if not hasattr(cp, "CaptureError"):
        pytest.skip("checks the CPU emulator's capture model")
    x = cp.asarray(np.ones((2, 4), np.float32))
    st = cp.cuda.Stream(non_blocking=False)
    with st:
        st.begin_capture()
        try:
            with pytest.raises(cp.CaptureError):
                silu(x, cp)
        finally:
            st.end_capture()
