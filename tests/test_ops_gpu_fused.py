"""The fused decode ops on the GPU against their NumPy oracles (the CPU path's sequence of ops):
`linear_add` (the residual add fused into the block mat-vec: bmv's BMV_ACCUMULATE flag),
`linear_glu` (gate|up and the gated activation in one `bmvglu` launch), `qkv_rope_write` (q/k
norms, rope and the K/V store in one kernel, kernels/qkv_rope.cu), and the kernel launches of
a decode step with and without them. Marked `gpu`: skipped without a CUDA device (conftest);
runs on the CPU emulator too (tests/gpu_emu); the launch count runs there only (it counts the
emulator's launches).

Tolerances, as tests/test_ops_gpu_blocks.py and docs/gpu.md "Numerics": block mat-vec (m <=
16) |y - ref| <= 1e-4 * sum|x||w| (float32 sums in another order), m > 16 4e-3 * sum|x||w|
(f16 activations and weights), plus the float32 rounding of the add into y; the gated
activation propagates those bounds through act (|act'| <= 1.13 for SiLU and tanh-GELU) plus
1e-5 relative; rope without norms: 1e-6 relative (the same float32 operations); with q/k
norms: RMSNorm's 1e-5; f16 KV: one f16 rounding step (2^-10 relative) more, since a value
1e-6 away from an f16 rounding boundary may round the other way.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvshare.backend import CPU, get_backend
from kvshare.ops import gpu_blocks
from kvshare.ops.activation import glu
from kvshare.ops.linear import linear, linear_add, linear_glu
from kvshare.ops.rope import NEOX, NORM, qkv_rope_write, qkv_rope_write_unfused, rope_cos_sin
from test_model_gpu import _emulated
from test_ops_gpu_blocks import ALL_TYPES, _k_for, _long_k, random_rows, ref_dequant

pytestmark = pytest.mark.gpu

M_VALUES = [1, 3, 4, 9, 16, 17]


@pytest.fixture(scope="module")
def be():
    return get_backend("cuda")


def _bound(x: np.ndarray, w: np.ndarray, tol: float) -> np.ndarray:
    return tol * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-6


# --- linear_add ------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_linear_add_on_blocks(be, qtype, m):
    rng = np.random.default_rng(int(qtype) * 31 + m)
    n, k = 37, _k_for(qtype)
    with_bias = m in (3, 9, 17)  # every type with and without a bias
    raw = random_rows(rng, qtype, n, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(raw, int(qtype), k)], be)
    wr = ref_dequant(raw, qtype, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    y = be.asarray(y0)
    got = linear_add(be.asarray(x), w, None if bias is None else be.asarray(bias), y, backend=be)
    assert got is y
    ref = y0.astype(np.float64) + x.astype(np.float64) @ wr.astype(np.float64).T
    if bias is not None:
        ref += bias
    err = np.abs(be.to_host(y).astype(np.float64) - ref)
    bound = _bound(x, wr, 1e-4 if m <= 16 else 4e-3) + 2e-7 * np.abs(ref)
    assert (err <= bound).all(), f"max err {err.max():.3g}"


@pytest.mark.parametrize("m", [1, 5, 16])
def test_linear_add_parts_and_strided_y(be, m):
    """A fused weight of parts of different types with a bias, added into a column slice of a
    wider array (the row stride is not the weight's row count); the columns around it stay."""
    rng = np.random.default_rng(m)
    k = 256
    spec = [(Q.Q4_K, 21), (Q.Q6_K, 9), (Q.Q8_0, 13)]
    raws = [random_rows(rng, t, nr, k) for t, nr in spec]
    w = gpu_blocks.GpuBlockWeight.from_parts([(r, int(t), k) for r, (t, _) in zip(raws, spec)],
                                             be)
    wr = np.concatenate([ref_dequant(r, t, k) for r, (t, _) in zip(raws, spec)])
    n_out = wr.shape[0]
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32)
    wide0 = rng.standard_normal((m, n_out + 7)).astype(np.float32)
    wide = be.asarray(wide0)
    linear_add(be.asarray(x), w, be.asarray(bias), wide[:, 3 : 3 + n_out], backend=be)
    got = be.to_host(wide)
    assert np.array_equal(got[:, :3], wide0[:, :3]) and np.array_equal(got[:, 3 + n_out :],
                                                                        wide0[:, 3 + n_out :])
    ref = wide0[:, 3 : 3 + n_out] + x.astype(np.float64) @ wr.T.astype(np.float64) + bias
    err = np.abs(got[:, 3 : 3 + n_out] - ref)
    assert (err <= _bound(x, wr, 1e-4) + 2e-7 * np.abs(ref)).all()


def test_linear_add_f16_weights_match_linear_then_add(be):
    """Dense f16 weights compose `linear` and the add: the same bits as the two ops."""
    rng = np.random.default_rng(5)
    w = be.asarray(rng.standard_normal((24, 64)).astype(np.float16))
    x = be.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    y0 = rng.standard_normal((3, 24)).astype(np.float32)
    y = be.asarray(y0)
    linear_add(x, w, None, y, backend=be)
    assert np.array_equal(be.to_host(y), y0 + be.to_host(linear(x, w, backend=be)))


# --- linear_glu ------------------------------------------------------------------------------------

def _glu_check(got: np.ndarray, x: np.ndarray, wg: np.ndarray, wu: np.ndarray, kind: str,
               tol: float) -> None:
    x64 = x.astype(np.float64)
    g, u = x64 @ wg.astype(np.float64).T, x64 @ wu.astype(np.float64).T
    ref = glu(np.concatenate([g, u], 1).astype(np.float32), kind, backend=CPU).astype(np.float64)
    eg, eu = _bound(x, wg, tol), _bound(x, wu, tol)
    bound = 1.2 * np.abs(u) * eg + (np.abs(g) + 0.3) * eu + 1e-5 * np.abs(ref) + 1e-6
    err = np.abs(got.astype(np.float64) - ref)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert (err <= bound).all(), f"max err {err.max():.3g}"


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_linear_glu_on_blocks(be, qtype, m):
    rng = np.random.default_rng(int(qtype) * 17 + m)
    ff, k = 21, _k_for(qtype)  # 21 rows: the last warp's second gate row is past the end
    kind = "silu" if m % 2 else "gelu_tanh"
    rg, ru = random_rows(rng, qtype, ff, k), random_rows(rng, qtype, ff, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(rg, int(qtype), k), (ru, int(qtype), k)], be)
    assert gpu_blocks.glu_fuses(w, m) == (m <= 16)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = be.to_host(linear_glu(be.asarray(x), w, kind, backend=be))
    _glu_check(got, x, ref_dequant(rg, qtype, k), ref_dequant(ru, qtype, k), kind,
               1e-4 if m <= 16 else 4e-3)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_linear_glu_long_rows_split_across_warps(be, qtype):
    # rows over which bmvglu's 4 warps make more than two passes (`_long_k`): the unrolled
    # pair and the remainder of the M = 1 loop
    rng = np.random.default_rng(int(qtype))
    ff, k = 3, _long_k(qtype)
    rg, ru = random_rows(rng, qtype, ff, k), random_rows(rng, qtype, ff, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(rg, int(qtype), k), (ru, int(qtype), k)], be)
    x = rng.standard_normal((1, k)).astype(np.float32)
    got = be.to_host(linear_glu(be.asarray(x), w, "silu", backend=be))
    _glu_check(got, x, ref_dequant(rg, qtype, k), ref_dequant(ru, qtype, k), "silu", 1e-4)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_linear_glu_composes_where_it_cannot_fuse(be, kind):
    """Gate and up of different types (two bmv launches, then the activation) and f16 weights
    (cuBLAS): the oracle's values."""
    rng = np.random.default_rng(11)
    k, ff = 256, 16
    rg, ru = random_rows(rng, Q.Q4_K, ff, k), random_rows(rng, Q.Q6_K, ff, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(rg, int(Q.Q4_K), k), (ru, int(Q.Q6_K), k)], be)
    assert not gpu_blocks.glu_fuses(w, 2)
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = be.to_host(linear_glu(be.asarray(x), w, kind, backend=be))
    _glu_check(got, x, ref_dequant(rg, Q.Q4_K, k), ref_dequant(ru, Q.Q6_K, k), kind, 1e-4)
    w16 = rng.standard_normal((2 * ff, k)).astype(np.float16)
    got = be.to_host(linear_glu(be.asarray(x), be.asarray(w16), kind, backend=be))
    wf = w16.astype(np.float32)
    _glu_check(got, x, wf[:ff], wf[ff:], kind, 4e-3)


# --- qkv_rope_write --------------------------------------------------------------------------------

# (n_head, n_kv, head_dim, q/k norms, style, n_rot, freq factors): the tiny models' shapes
ROPE_CASES = {
    "qwen3": (4, 2, 128, True, NEOX, 128, False),
    "llama": (8, 2, 128, False, NORM, 128, True),
    "gemma3": (4, 1, 256, True, NEOX, 256, False),
    "qwen2": (4, 1, 80, False, NEOX, 80, False),
    "partial": (2, 1, 64, True, NORM, 32, False),
}


@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_qkv_rope_write_matches_the_ops(be, case, kv, n):
    H, K, D, norms, style, n_rot, ff = ROPE_CASES[case]
    rng = np.random.default_rng(len(case) * 100 + n)
    eps = 1e-6
    qkv0 = (rng.standard_normal((n, (H + 2 * K) * D)) * 2).astype(np.float32)
    qn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32) if norms else None
    kn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32) if norms else None
    pos = rng.integers(0, 5000, n)
    factors = np.linspace(1, 4, n_rot // 2).astype(np.float32) if ff else None
    cos, sin = rope_cos_sin(pos, n_rot, 1e6, 1.0, factors)
    dt = np.float16 if kv == "f16" else np.float32
    nb, bs = 4, 16
    cache0 = [rng.standard_normal((nb, bs, K, D)).astype(dt) for _ in range(2)]
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    if n > 1:
        slots[1] = -1  # a graph's padding row: nothing stored
    # the oracle: the CPU op (today's sequence) with the padding rows' K/V sent to a spare block
    ref_cache = [np.concatenate([c, np.zeros((1, bs, K, D), dt)]) for c in cache0]
    ref_slots = np.where(slots < 0, nb * bs, slots)
    ref_qkv = qkv0.copy()
    ref_q = qkv_rope_write(ref_qkv, qn, kn, eps, cos, sin, style, *ref_cache, ref_slots, H, K, D)
    qkv = be.asarray(qkv0)
    kc, vc = be.asarray(cache0[0]), be.asarray(cache0[1])
    q = qkv_rope_write(qkv, None if qn is None else be.asarray(qn),
                       None if kn is None else be.asarray(kn), eps, be.asarray(cos),
                       be.asarray(sin), style, kc, vc, be.asarray(slots), H, K, D, backend=be)
    assert tuple(q.shape) == (n, H, D)
    tol = 1e-5 if norms else 1e-6
    got_q = be.to_host(q)
    assert np.array_equal(be.to_host(qkv)[:, : H * D].reshape(n, H, D), got_q)  # in place
    assert (np.abs(got_q - ref_q) <= tol * np.maximum(1.0, np.abs(ref_q))).all()
    ctol = tol + (2.0 ** -10 if kv == "f16" else 0.0)
    keep = slots >= 0
    for got_c, want_c, c0 in zip((kc, vc), ref_cache, cache0):
        g = be.to_host(got_c).reshape(nb * bs, K, D).astype(np.float32)
        r = want_c[:nb].reshape(nb * bs, K, D).astype(np.float32)
        written = np.zeros(nb * bs, bool)
        written[slots[keep]] = True
        assert np.array_equal(g[~written], c0.reshape(nb * bs, K, D)[~written].astype(np.float32))
        assert (np.abs(g - r) <= ctol * np.maximum(1.0, np.abs(r))).all()


def test_qkv_rope_write_checks_host_slots(be):
    H, K, D = 2, 1, 64
    qkv = be.asarray(np.zeros((2, (H + 2 * K) * D), np.float32))
    cos, sin = rope_cos_sin(np.arange(2), D, 1e4)
    kc = be.asarray(np.zeros((1, 4, K, D), np.float16))
    vc = be.asarray(np.zeros((1, 4, K, D), np.float16))
    for bad in ([0, 4], [-1, 0]):
        with pytest.raises(IndexError):
            qkv_rope_write(qkv, None, None, 1e-6, cos, sin, NEOX, kc, vc, np.array(bad), H, K,
                           D, backend=be)
    with pytest.raises(ValueError):
        qkv_rope_write(qkv, None, None, 1e-6, cos, sin, NEOX, kc, vc, np.array([0]), H, K, D,
                       backend=be)


# --- launches per decode step ----------------------------------------------------------------------

def _composed(be):
    """Today's op sequences in place of the fused ops (what a layer launched before them)."""

    def add(x, w, bias, y, *, backend):
        y += linear(x, w, bias, backend=backend)

    def gl(x, w, kind, *, backend):
        return glu(linear(x, w, backend=backend), kind, backend=backend)

    return {"linear_add": add, "linear_glu": gl, "qkv_rope_write": qkv_rope_write_unfused}


def test_decode_step_launches_fewer_kernels(tmp_path, monkeypatch):
    """One decode step of the tiny qwen3 (q/k norms) on block weights, eager: the device
    operations each attention layer launches (kernels, cuBLAS calls, CuPy array operations),
    with the fused ops and with the op sequences they replace; the logits agree. With
    KVSHARE_GPU_FUSED=0 the step is the op sequences', launch for launch and bit for bit."""
    if not _emulated():
        pytest.skip("counts the CPU emulator's launches")
    import cupy  # noqa: PLC0415

    from kvshare.model import base  # noqa: PLC0415
    from kvshare.model.batch import SeqChunk  # noqa: PLC0415
    from kvshare.model.loader import load_model  # noqa: PLC0415
    from test_model_gpu import write_model  # noqa: PLC0415

    monkeypatch.setenv("KVSHARE_GPU_WEIGHTS", "blocks")
    path = tmp_path / "qwen3.gguf"
    write_model(path, "qwen3")
    model = load_model(path, "cuda")
    model.cuda_graphs = False
    assert isinstance(model.layers[0].w_gate_up, gpu_blocks.GpuBlockWeight)
    counts: list[int] = []
    ops = [0]
    orig_ufunc = cupy.ndarray.__array_ufunc__

    def ufunc(self, *a, **kw):
        ops[0] += 1
        return orig_ufunc(self, *a, **kw)

    monkeypatch.setattr(cupy.ndarray, "__array_ufunc__", ufunc)
    orig_layer = model._attention_layer

    def layer(*a, **kw):
        before = len(cupy.LAUNCHES) + cupy.cuda.cublas.calls + ops[0]
        r = orig_layer(*a, **kw)
        counts.append(len(cupy.LAUNCHES) + cupy.cuda.cublas.calls + ops[0] - before)
        return r

    model._attention_layer = layer

    def step():
        cache = model.new_cache(4, 16)
        table = np.arange(4)
        model.forward([SeqChunk(np.arange(1, 14), 0, table, logits="none")], cache)
        counts.clear()
        (lg,) = model.forward([SeqChunk(np.array([7]), 13, table)], cache)
        return list(counts), lg

    fused, lg_fused = step()
    # KVSHARE_GPU_FUSED=0 (gpu_check.sh's way around fused kernels failing on a device)
    monkeypatch.setenv("KVSHARE_GPU_FUSED", "0")
    switched, lg_switched = step()
    monkeypatch.delenv("KVSHARE_GPU_FUSED")
    for name, fn in _composed(model.backend).items():
        monkeypatch.setattr(base, name, fn)
    composed, lg_composed = step()
    print(f"launches per layer: composed {composed}, fused {fused}, "
          f"KVSHARE_GPU_FUSED=0 {switched}")
    assert switched == composed
    assert np.array_equal(lg_switched, lg_composed)
    n_layers = len(model.layers)
    assert len(fused) == len(composed) == n_layers
    # q, k, v (and gate, up) are each of one type here, so each group is one part of its
    # GpuBlockWeight (from_gguf stacks them): one mat-vec for q|k|v, one for gate|up.
    # per layer: rms_norm, the q|k|v mat-vec, (rms_norm + rope) x 2, kv_write, attention,
    # o mat-vec + add, rms_norm, the gate|up mat-vec + swiglu, down mat-vec + add = 15;
    # fused: rms_norm, the q|k|v mat-vec, qkv_rope_write, attention, o mat-vec (adds),
    # rms_norm, bmvglu, down mat-vec (adds) = 8; the first layer also computes the step's
    # rope tables (rope_cos_sin_f32)
    assert len(model.layers[0].wqkv.parts) == len(model.layers[0].w_gate_up.parts) == 1
    assert composed == [16] + [15] * (n_layers - 1)
    assert fused == [9] + [8] * (n_layers - 1)
    scale = np.abs(lg_composed).max()
    assert np.abs(lg_fused - lg_composed).max() <= 1e-3 * scale


# --- tensors of one type stacked into one part (GpuBlockWeight.from_gguf) ---------------------

def test_from_gguf_stacks_tensors_of_one_type(be, tmp_path):
    """Q and K of one type (a Q4_K_M file's attn_q / attn_k) become one part, V of another
    type its own: one mat-vec fewer a layer; gate and up of one type one part whose halves
    `linear_glu` takes (one `bmvglu` launch). The products equal the tensors' own."""
    from gguf import GGUFWriter

    from kvshare.model.gguf_file import GGUFFile

    rng = np.random.default_rng(7)
    k = 256
    spec = {"q": (Q.Q4_K, 24), "k": (Q.Q4_K, 8), "v": (Q.Q6_K, 8), "gate": (Q.Q4_K, 20),
            "up": (Q.Q4_K, 20)}
    raws = {nm: random_rows(rng, t, n, k) for nm, (t, n) in spec.items()}
    path = tmp_path / "w.gguf"
    w = GGUFWriter(str(path), "llama")
    for nm, (t, _n) in spec.items():
        w.add_tensor(nm, raws[nm], raw_shape=raws[nm].shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(path)
    qkv = gpu_blocks.GpuBlockWeight.from_gguf(gf, ["q", "k", "v"], be)
    assert [(p.qtype, p.n, p.col0) for p in qkv.parts] == [(int(Q.Q4_K), 32, 0),
                                                             (int(Q.Q6_K), 8, 32)]
    want = np.concatenate([ref_dequant(raws[nm], spec[nm][0], k) for nm in ("q", "k", "v")])
    for m in (1, 5, 20):
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = be.to_host(linear(be.asarray(x), qkv, backend=be))
        err = np.abs(got.astype(np.float64) - x.astype(np.float64) @ want.T.astype(np.float64))
        assert (err <= _bound(x, want, 1e-4 if m <= 16 else 4e-3)).all()
    gu = gpu_blocks.GpuBlockWeight.from_gguf(gf, ["gate", "up"], be)
    assert len(gu.parts) == 1 and gu.shape == (40, k) and gpu_blocks.glu_fuses(gu, 3)
    log = _launch_log()
    before = len(log) if log is not None else 0
    x = rng.standard_normal((3, k)).astype(np.float32)
    got = be.to_host(linear_glu(be.asarray(x), gu, "silu", backend=be))
    if log is not None:
        assert [e[0] for e in log[before:]] == ["bmvglu_q4_k_m4"]
    _glu_check(got, x, ref_dequant(raws["gate"], Q.Q4_K, k), ref_dequant(raws["up"], Q.Q4_K, k),
               "silu", 1e-4)
    gf.close()


def _launch_log():
    import cupy

    return getattr(cupy, "LAUNCHES", None)


# --- more rows than one mat-vec launch takes ($KVSHARE_GPU_MATVEC_MAX_ROWS) ------------------

def test_matvec_in_row_chunks(be, monkeypatch):
    """With the limit at 48 rows, 40 rows run the mat-vec kernels in launches of 16, 16 and 8
    rows (no dequantized tiles): linear, linear_add and linear_glu within the mat-vec's bounds
    of the float64 product; past the limit the tiles + cuBLAS again; a limit that is not a
    multiple of 16 is refused."""
    monkeypatch.setenv(gpu_blocks.MATVEC_ROWS_ENV, "48")
    rng = np.random.default_rng(11)
    k, m = 256, 40
    rq, rk = random_rows(rng, Q.Q4_K, 24, k), random_rows(rng, Q.Q6_K, 8, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(rq, int(Q.Q4_K), k), (rk, int(Q.Q6_K), k)], be)
    ref_w = np.concatenate([ref_dequant(rq, Q.Q4_K, k), ref_dequant(rk, Q.Q6_K, k)])
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ ref_w.T.astype(np.float64)
    log = _launch_log()
    before = len(log) if log is not None else 0
    got = be.to_host(linear(be.asarray(x), w, backend=be))
    if log is not None:
        names = [e[0] for e in log[before:]]
        assert names == ["bmv_q4_k_m16", "bmv_q6_k_m16"] * 2 + ["bmv_q4_k_m16", "bmv_q6_k_m16"]
    assert (np.abs(got - want) <= _bound(x, ref_w, 1e-4)).all()
    y0 = rng.standard_normal((m, 32)).astype(np.float32)
    y = be.asarray(y0)
    linear_add(be.asarray(x), w, None, y, backend=be)
    assert (np.abs(be.to_host(y) - (y0 + want)) <= _bound(x, ref_w, 1e-4) + 1e-6).all()
    rg, ru = random_rows(rng, Q.Q4_K, 20, k), random_rows(rng, Q.Q4_K, 20, k)
    gu = gpu_blocks.GpuBlockWeight.from_parts([(rg, int(Q.Q4_K), k), (ru, int(Q.Q4_K), k)], be)
    assert gpu_blocks.glu_fuses(gu, m) and not gpu_blocks.glu_fuses(gu, 49)
    got = be.to_host(linear_glu(be.asarray(x), gu, "silu", backend=be))
    _glu_check(got, x, ref_dequant(rg, Q.Q4_K, k), ref_dequant(ru, Q.Q4_K, k), "silu", 1e-4)
    before = len(log) if log is not None else 0
    x2 = rng.standard_normal((49, k)).astype(np.float32)
    linear(be.asarray(x2), w, backend=be)
    if log is not None:
        assert any(e[0].startswith("bdq_") for e in log[before:])
    monkeypatch.setenv(gpu_blocks.MATVEC_ROWS_ENV, "40")
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu_blocks.matvec_max_rows()


def _tiny_q4_k_m(tmp_path):
    """A one-layer random qwen3 in a Q4_K_M mix (scripts/make_random_gguf.py --size tiny)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "tiny-q4_k_m.gguf"
    subprocess.run([sys.executable, str(root / "scripts" / "make_random_gguf.py"), "--arch",
                    "qwen3", "--size", "tiny", "--layers", "1", "--out", str(path),
                    "--tokenizer-from",
                    str(root / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf")],
                   check=True, capture_output=True)
    return path


def _decode_steps(model, n: int, graphs: bool, seed: int) -> np.ndarray:
    """Logits of 3 decode steps of n sequences (5 random prompt tokens each), graphs on or
    off, from a fresh cache."""
    from kvshare.model.batch import SeqChunk

    model.cuda_graphs = graphs
    cache = model.new_cache(2 * n, 16)
    rng = np.random.default_rng(seed)
    tables = [np.array([2 * i, 2 * i + 1], np.int32) for i in range(n)]
    for t in tables:
        model.forward([SeqChunk(rng.integers(0, 367, 5), 0, t, logits="none")], cache)
    return np.stack([np.concatenate(model.forward(
        [SeqChunk(rng.integers(0, 367, 1), 5 + step, t) for t in tables], cache))
        for step in range(3)])


def test_decode_graphs_on_row_chunks(tmp_path, monkeypatch):
    """A decode step of 18 sequences (the graph of 32) with the mat-vec limit at 32 rows: its
    products run the mat-vec kernels in launches of 16 rows, captured and replayed; the
    replays equal the eager steps bit for bit."""
    from kvshare.model import gpu_graphs
    from kvshare.model.loader import load_model

    path = _tiny_q4_k_m(tmp_path)
    monkeypatch.setenv("KVSHARE_GPU_WEIGHTS", "blocks")
    monkeypatch.setenv(gpu_blocks.MATVEC_ROWS_ENV, "32")
    model = load_model(path, "cuda")
    n = 18

    log = _launch_log()
    before = len(log) if log is not None else 0
    eager = _decode_steps(model, n, False, seed=3)
    if log is not None:
        names = [e[0] for e in log[before:]]
        assert not any(nm.startswith("bdq_") for nm in names[-40:])  # the last decode step
    graph = _decode_steps(model, n, True, seed=3)
    r = gpu_graphs.runner(model)
    assert r is not None and not r.failures and r.replays >= 2
    assert gpu_graphs.StepShape.decode(32) in r.graphs
    assert np.array_equal(graph, eager)


def test_decode_graphs_without_fused_ops(tmp_path, monkeypatch):
    """KVSHARE_GPU_FUSED=0: decode steps still capture (the op sequences allocate nothing
    while a stream captures) and replay the eager steps' bits."""
    from kvshare.model import gpu_graphs
    from kvshare.model.loader import load_model

    path = _tiny_q4_k_m(tmp_path)
    monkeypatch.setenv("KVSHARE_GPU_WEIGHTS", "blocks")
    monkeypatch.setenv("KVSHARE_GPU_FUSED", "0")
    model = load_model(path, "cuda")
    n = 3

    log = _launch_log()
    before = len(log) if log is not None else 0
    eager = _decode_steps(model, n, False, seed=5)
    if log is not None:  # the emulator: the op sequences ran, not the fused kernels
        names = {e[0] for e in log[before:]}
        assert not any(nm.startswith(("qkv_rope_write", "bmvglu")) for nm in names)
        assert any(nm.startswith("kv_write") for nm in names)
    graph = _decode_steps(model, n, True, seed=5)
    r = gpu_graphs.runner(model)
    assert r is not None and not r.failures and r.replays >= 2
    assert gpu_graphs.StepShape.decode(4) in r.graphs
    assert np.array_equal(graph, eager)
