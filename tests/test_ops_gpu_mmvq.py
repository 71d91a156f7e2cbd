"""The 8-bit-activation mat-vec (`kvshare.ops.gpu_mmvq`, kernels/mmvq.cu, llama.cpp's mmvq)
against NumPy: `quantize_q8_1` bit for bit against a port of ggml-cuda's quantize_q8_1, and
`linear` for every type, m = 1 .. 8 rows (so every kernel M = 1, 2, 4, 8, with m < M too),
bias, accumulate, strided outputs, fused parts, row counts that are not multiples of the rows
per CTA and rows longer than one pass of a CTA. Marked `gpu`: skipped without a CUDA device
(conftest); runs on the CPU emulator too (tests/gpu_emu).

Oracles and tolerances:
- `ref`: float64 from the q8_1-rounded activations (a = f16(d) * q) and the weights as
  `gguf.quants.dequantize` gives them, plus the term llama.cpp's formula leaves in on purpose:
  Q4_0 / Q5_0 subtract their offset (8 / 16) times the block's f16 sum s of the float32 inputs,
  Q4_1 / Q5_1 add their min times s, where the exact product would use sum(a). The kernels
  differ from it by float32 rounding only: |y - ref| <= 1e-5 * sum|a||w|.
- the float32 product x @ W.T: within the 8-bit rounding bound, per output
  sum_j |w_j| * e(block of j) + |the s term| + 1e-5 * sum|x||w|, with
  e = d / 2 (rounding to the nearest multiple of d) + 127 |f16(d) - d| (the stored scale) +
  a float32 ulp of slack, d = amax / 127 of the block.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvshare.ops import gpu_blocks, gpu_mmvq

from test_ops_gpu_blocks import random_rows

pytestmark = pytest.mark.gpu

TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
         Q.IQ4_NL, Q.IQ4_XS]
QK = {t: (256 if t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS) else 32) for t in TYPES}
# the weight's per-block offset / min reaches the result through s: (multiplier of d, of m)
S_TERM = {Q.Q4_0: 8.0, Q.Q5_0: 16.0}
MIN_TYPES = (Q.Q4_1, Q.Q5_1)


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415

    return cupy


# --- NumPy ports -----------------------------------------------------------------------------

def q8_1_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ggml-cuda's quantize_q8_1 of float32 rows x [m, k] (padded with zeros to
    gpu_mmvq.padded_k(k)): (bytes [m, nb * 36], q int8 [m, nb, 32], d f16 [m, nb], s f16
    [m, nb]). d = amax / 127 and q = roundf(x / d) in float32; s is the sum of the 32 inputs
    in the order of the warp's butterfly reduction (lane pairs 16 apart, then 8, ...)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    kp = gpu_mmvq.padded_k(k)
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    b = xp.reshape(m, kp // 32, 32)
    amax = np.abs(b).max(-1)
    t = b
    for h in (16, 8, 4, 2, 1):
        t = (t[..., :h] + t[..., h : 2 * h]).astype(np.float32)
    s = t[..., 0]
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = (b / d[..., None]).astype(np.float32).astype(np.float64)
    r = np.sign(v) * np.floor(np.abs(v) + 0.5)  # roundf: halves away from zero
    q = np.where(amax[..., None] == 0, 0, r).astype(np.int8)
    d16, s16 = d.astype(np.float16), s.astype(np.float16)
    raw = np.concatenate([d16.view(np.uint8).reshape(m, -1, 2), s16.view(np.uint8).reshape(m, -1, 2),
                          q.view(np.uint8)], axis=-1).reshape(m, -1)
    return raw, q, d16, s16


def weight_ref(raw: np.ndarray, qtype: Q, k: int):
    """(W float64 [n, k] as gguf dequantizes it, the s-term coefficient per (row, 32-block)
    or None): kernel = a @ W.T + sum_b coef[:, b] * (s_b - sum(a over block b))."""
    n = raw.shape[0]
    w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    coef = None
    if qtype in S_TERM or qtype in MIN_TYPES:
        blk = raw.reshape(n, k // 32, -1)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
        if qtype in S_TERM:
            coef = -S_TERM[qtype] * d
        else:
            coef = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return w, coef


def mmvq_ref(x: np.ndarray, raw: np.ndarray, qtype: Q, k: int):
    """(ref [m, n], scale sum|a||w| [m, n], f32 product x @ W.T [m, n], 8-bit bound [m, n])."""
    _, q, d16, s16 = q8_1_ref(x)
    m = x.shape[0]
    a = (d16.astype(np.float64)[..., None] * q).reshape(m, -1)[:, :k]
    w, coef = weight_ref(raw, qtype, k)
    ref = a @ w.T
    term = np.zeros_like(ref)
    if coef is not None:
        nb = k // 32
        ds = s16[:, :nb].astype(np.float64) - a.reshape(m, nb, 32).sum(-1)
        term = ds @ coef.T
        ref = ref + term
    scale = np.abs(a) @ np.abs(w).T
    xf = x.astype(np.float64)
    prod = xf @ w.T
    d = (np.abs(np.asarray(x, np.float32)).reshape(m, -1, 32).max(-1) / np.float32(127))
    d = d.astype(np.float64)
    e = d * (0.5 + 2.0 ** -20) + 127 * np.abs(d16[:, : k // 32].astype(np.float64) - d)
    bound = (np.repeat(e, 32, axis=1) @ np.abs(w).T + np.abs(term)
             + 1e-5 * (np.abs(xf) @ np.abs(w).T))
    return ref, scale, prod, bound


def make_weight(rng, parts):
    """A GpuBlockWeight from [(qtype, n, k)] and the raw rows of each part."""
    raws = [random_rows(rng, qt, n, k) for qt, n, k in parts]
    w = gpu_blocks.GpuBlockWeight.from_parts([(r, qt, k) for r, (qt, _, k) in zip(raws, parts)])
    return w, raws


def check(cp, y, x, raws, parts, *, bias=None, base=None):
    """y (device [m, n]) against the oracles, part by part."""
    yh = cp.asnumpy(y).astype(np.float64)
    for raw, (qt, n, k), p in zip(raws, parts, range(len(parts))):
        c0 = sum(pp[1] for pp in parts[:p])
        ref, scale, prod, bound = mmvq_ref(x, raw, qt, k)
        add = np.zeros_like(ref)
        if bias is not None:
            add = add + bias[c0 : c0 + n]
        if base is not None:
            add = add + base[:, c0 : c0 + n]
        got = yh[:, c0 : c0 + n] - add
        err = np.abs(got - ref)
        assert np.all(err <= 1e-5 * scale + 1e-30), \
            f"{qt.name}: max err {err.max():.3g} vs {(1e-5 * scale).max():.3g}"
        assert np.all(np.abs(got - prod) <= bound), f"{qt.name}: past the 8-bit rounding bound"


# --- tests -----------------------------------------------------------------------------------

def test_quantize_q8_1_matches_ggml_bit_for_bit(cp):
    rng = np.random.default_rng(0)
    for m, k in ((1, 40), (3, 512), (2, 1000)):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30, (m, 1))).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block: d = s = 0, q = 0
        x[-1, 5] = 1e-30  # a block whose amax is tiny
        if k >= 96:
            x[-1, 64:96] = 3.0  # every element at amax: q = 127
        wide = cp.asarray(np.concatenate([x, np.ones((m, 9), np.float32)], axis=1))
        xd = wide[:, :k]  # row stride k + 9
        got = cp.asnumpy(gpu_mmvq.quantize_q8_1(xd))
        want = q8_1_ref(x)[0]
        assert got.shape == want.shape == (m, gpu_mmvq.padded_k(k) // 32 * 36)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_every_m(cp, qtype):
    rng = np.random.default_rng(int(qtype))
    k = 2 * QK[qtype] if QK[qtype] == 256 else 96  # 96: not a multiple of 256
    parts = [(qtype, 5, k)]  # 5 rows: not a multiple of 2 rows per CTA
    w, raws = make_weight(rng, parts)
    for m in range(1, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = gpu_mmvq.linear(cp.asarray(x), w)
        assert y is not None and y.shape == (m, 5)
        check(cp, y, x, raws, parts)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_bias_accumulate_strided_long_rows(cp, qtype):
    """Rows of more weight blocks than a CTA takes in one pass (the K loop iterates), bias and
    y += into a strided output, m = 1, 3 and 8."""
    rng = np.random.default_rng(100 + int(qtype))
    k = 9 * 256 if QK[qtype] == 256 else 70 * 32
    n = 3
    parts = [(qtype, n, k)]
    w, raws = make_weight(rng, parts)
    bias = rng.standard_normal(n).astype(np.float32)
    for m in (1, 3, 8):
        x = rng.standard_normal((m, k)).astype(np.float32)
        base = rng.standard_normal((m, n + 4)).astype(np.float32)
        buf = cp.asarray(base)
        out = buf[:, :n]
        y = gpu_mmvq.linear(cp.asarray(x), w, cp.asarray(bias), out=out, accumulate=True)
        assert y is out
        check(cp, out, x, raws, parts, bias=bias, base=base[:, :n].astype(np.float64))
        np.testing.assert_array_equal(cp.asnumpy(buf)[:, n:], base[:, n:])  # untouched
        y2 = gpu_mmvq.linear(cp.asarray(x), w, bias)  # bias, written (not accumulated)
        check(cp, y2, x, raws, parts, bias=bias)


def test_linear_fused_parts_of_different_types(cp):
    """A Q4_K_M-style fused projection: Q4_K and Q6_K parts, each written at its col0."""
    rng = np.random.default_rng(7)
    k = 512
    parts = [(Q.Q4_K, 3, k), (Q.Q6_K, 4, k), (Q.Q8_0, 1, k)]
    w, raws = make_weight(rng, parts)
    bias = rng.standard_normal(8).astype(np.float32)
    for m in (1, 2, 6):
        x = rng.standard_normal((m, k)).astype(np.float32)
        check(cp, gpu_mmvq.linear(cp.asarray(x), w, cp.asarray(bias)), x, raws, parts, bias=bias)


def test_linear_declines_what_it_does_not_cover(cp):
    rng = np.random.default_rng(3)
    w, _ = make_weight(rng, [(Q.Q4_K, 2, 256)])
    assert gpu_mmvq.linear(cp.asarray(rng.standard_normal((9, 256)).astype(np.float32)), w) is None
    wf, _ = make_weight(rng, [(Q.Q4_K, 2, 256), (Q.F16, 2, 256)])
    assert not gpu_mmvq.supports(wf.parts[1]) and gpu_mmvq.supports(wf.parts[0])
    assert gpu_mmvq.linear(cp.asarray(np.ones((1, 256), np.float32)), wf) is None


def test_model_decode_on_the_q8_design(tmp_path, monkeypatch):
    """`KVSHARE_GPU_MATVEC=q8` on a Q4_K_M model with block weights: `gpu_blocks` hands a
    decode step's products (Q4_K and Q6_K parts, the output head included) to the mmvq
    kernels; replayed as CUDA graphs (quantize_q8_1's scratch from the workspace) the logits
    equal the eager steps bit for bit, and they stay within the 8-bit rounding of the f32
    design's (bmv) logits."""
    import subprocess
    import sys
    from pathlib import Path

    from kvshare.model import gpu_graphs
    from kvshare.model.batch import SeqChunk
    from kvshare.model.loader import load_model

    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "tiny-q4_k_m.gguf"
    subprocess.run([sys.executable, str(root / "scripts" / "make_random_gguf.py"), "--arch",
                    "qwen3", "--size", "tiny", "--out", str(path), "--tokenizer-from",
                    str(root / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf")],
                   check=True, capture_output=True)
    monkeypatch.setenv("KVSHARE_GPU_WEIGHTS", "blocks")

    def run(design: str, graphs: bool) -> np.ndarray:
        monkeypatch.setenv(gpu_mmvq.MATVEC_ENV, design)
        model = load_model(path, "cuda")
        model.cuda_graphs = graphs
        cache = model.new_cache(16, 16)
        tables = [np.arange(0, 8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)]
        rng = np.random.default_rng(0)
        for t in tables:
            model.forward([SeqChunk(rng.integers(0, 367, 11), 0, t, logits="none")], cache)
        out = []
        for step in range(4):
            lg = model.forward([SeqChunk(rng.integers(0, 367, 1), 11 + step, t)
                                for t in tables], cache)
            out.append(np.concatenate(lg))
        if graphs:
            r = gpu_graphs.runner(model)
            assert r is not None and not r.failures and r.replays >= 2
        return np.stack(out)

    log = _launch_log()
    before = len(log) if log is not None else 0
    q8_eager = run("q8", False)
    if log is not None:
        names = [e[0] for e in log[before:]]
        assert any(n.startswith("mmvq_q4_k") for n in names)
        assert any(n.startswith("mmvq_q6_k") for n in names)
    q8_graph = run("q8", True)
    f32_eager = run("f32", False)
    assert np.array_equal(q8_graph, q8_eager)
    rel = np.abs(q8_eager - f32_eager).max() / np.abs(f32_eager).max()
    assert 0 < rel <= 2e-2, rel


def _launch_log():
    """The emulator's record of kernel launches (None on a GPU)."""
    import cupy

    return getattr(cupy, "LAUNCHES", None)
