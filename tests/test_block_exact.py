"""`_core.block_matmul_t_f32` (f32 activations on GGUF blocks, crates/kvshare-kernels/src/blocks/
exact.rs) against gguf's NumPy dequantization (`gguf.quants`) for every supported type: the
product must equal `x @ dequantize(raw).T` up to f32 summation order, on the AVX2 and the
portable paths."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare import _core

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K,
         Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
F16_FIELDS = {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q8_0: [0], Q.IQ4_NL: [0], Q.IQ4_XS: [0],
              Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
              Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q6_K: [208]}


def make_raw(t: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[n, row_bytes]`: quantized random data, or random bytes with small finite
    scales for types gguf cannot quantize."""
    if t in QUANTIZABLE:
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = np.asarray(quants.quantize(w, t))
        return np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    bs, ts = GGML_QUANT_SIZES[t]
    nb = n * k // bs
    blocks = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        sign = rng.choice([-1.0, 1.0], nb)
        d = (sign * rng.uniform(2.0**-9, 1.0, nb)).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def dequantized(raw: np.ndarray, t: Q) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, t), np.float32)


@pytest.fixture(params=[False, True], ids=["simd", "portable"])
def path(request):
    _core.block_force_portable(request.param)
    yield request.param
    _core.block_force_portable(False)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_equals_dequantized_f32_product(t, path):
    rng = np.random.default_rng(100 + int(t))
    block = max(32, GGML_QUANT_SIZES[t][0])
    for m, n, nb in [(1, 1, 1), (3, 37, 2), (4, 64, 4), (7, 33, 8), (16, 65, 3)]:
        k = nb * block
        raw = make_raw(t, n, k, rng)
        raw.setflags(write=False)  # as a view into the mapped file is
        w = dequantized(raw, t)
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)
        _core.block_matmul_t_f32(x, raw, int(t), out, threads=2)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        mag = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
        err = np.abs(out - want)
        assert (err <= 1e-5 * mag + 1e-30).all(), f"{t.name} m={m}: {err.max()}"
        # and no further from the f64 product than numpy's own f32 product is, give or take
        f32 = x @ w.T
        assert err.max() <= 4 * np.abs(f32 - want).max() + 1e-6 * mag.max()


@pytest.mark.parametrize("t", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_1, Q.Q2_K],
                         ids=lambda t: t.name)
def test_one_hot_rows_pick_the_dequantized_weights(t, path):
    """0 + w * 1 is w exactly: each result is bit for bit a weight the kernel formed."""
    rng = np.random.default_rng(7)
    k, n = 256, 9
    raw = make_raw(t, n, k, rng)
    w = dequantized(raw, t)
    for j0 in range(0, k, 16):
        x = np.zeros((16, k), np.float32)
        x[np.arange(16), j0 + np.arange(16)] = 1.0
        out = np.empty((16, n), np.float32)
        _core.block_matmul_t_f32(x, raw, int(t), out)
        np.testing.assert_array_equal(out, w[:, j0 : j0 + 16].T)


def test_checks_raise_value_error():
    raw = np.zeros((2, 144), np.uint8)
    x = np.zeros((1, 256), np.float32)
    out = np.zeros((1, 2), np.float32)
    _core.block_matmul_t_f32(x, raw, int(Q.Q4_K), out)
    with pytest.raises(ValueError):
        _core.block_matmul_t_f32(x, raw, 99, out)  # no such type
    with pytest.raises(ValueError):
        _core.block_matmul_t_f32(x[:, :128], raw, int(Q.Q4_K), out)  # k vs row bytes
    with pytest.raises(ValueError):
        _core.block_matmul_t_f32(x, raw, int(Q.Q4_K), np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError):
        _core.block_matmul_t_f32(x.astype(np.float64), raw, int(Q.Q4_K), out)
    with pytest.raises(ValueError):
        _core.block_matmul_t_f32(np.zeros((17, 256), np.float32), raw, int(Q.Q4_K),
                                 np.zeros((17, 2), np.float32))
    ro = out.copy()
    ro.setflags(write=False)
    with pytest.raises(ValueError):
        _core.block_matmul_t_f32(x, raw, int(Q.Q4_K), ro)
    buf = np.zeros(256 + 2, np.float32)
    with pytest.raises(ValueError):  # out overlaps x
        _core.block_matmul_t_f32(buf[:256].reshape(1, 256), raw, int(Q.Q4_K),
                                 buf[1:3].reshape(1, 2))


_CPUINFO = Path("/proc/cpuinfo")
HAS_AVX512 = _CPUINFO.exists() and "avx512f" in _CPUINFO.read_text()


@pytest.mark.parametrize("specs", [
    [(Q.Q5_0, 40), (Q.Q5_0, 9), (Q.Q8_0, 9)],  # Gemma 3's Q/K/V
    [(Q.Q4_K, 70), (Q.Q6_K, 33)],
    [(Q.Q4_1, 5), (Q.Q3_K, 31), (Q.F16, 3), (Q.Q5_K, 64)],  # types without AVX-512 kernels
], ids=["q5_0-q8_0", "q4_k-q6_k", "mixed"])
def test_parts_in_one_call_equal_each_part_alone(specs, path):
    """`block_matmul_t_f32_parts` (fused Q/K/V, gate/up in one call) gives, column for column,
    bit for bit what each part gives alone."""
    rng = np.random.default_rng(31)
    k = 512
    raws = [make_raw(t, n, k, rng) for t, n in specs]
    for m in (1, 2, 3, 5, 8, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        alone = []
        for (t, n), raw in zip(specs, raws):
            o = np.empty((m, n), np.float32)
            _core.block_matmul_t_f32(x, raw, int(t), o, threads=2)
            alone.append(o)
        out = np.full((m, sum(n for _, n in specs)), np.nan, np.float32)
        _core.block_matmul_t_f32_parts(x, raws, [int(t) for t, _ in specs], out, threads=2)
        np.testing.assert_array_equal(out, np.concatenate(alone, axis=1))


@pytest.mark.skipif(not HAS_AVX512, reason="batch invariance is a property of the AVX-512 path")
@pytest.mark.parametrize("t", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda t: t.name)
def test_a_row_does_not_depend_on_its_batch(t):
    """On the AVX-512 path every (weight row, activation row) pair sums in one order whatever
    the batch: a sequence decoded alone or beside 15 others gets the same bits."""
    rng = np.random.default_rng(3)
    k, n = 768, 203  # n: groups of 8, 4 and 2 weight rows and a tail of 1
    raw = make_raw(t, n, k, rng)
    x = rng.standard_normal((16, k)).astype(np.float32)
    alone = np.empty((16, n), np.float32)
    for r in range(16):
        _core.block_matmul_t_f32(x[r : r + 1], raw, int(t), alone[r : r + 1], threads=1)
    for m in (2, 3, 4, 7, 16):
        out = np.empty((m, n), np.float32)
        _core.block_matmul_t_f32(x[:m], raw, int(t), out, threads=2)
        np.testing.assert_array_equal(out, alone[:m])


def test_parts_checks_raise_value_error():
    raw4k = np.zeros((2, 144), np.uint8)
    raw8 = np.zeros((3, 272), np.uint8)  # Q8_0 rows of 256
    x = np.zeros((1, 256), np.float32)
    _core.block_matmul_t_f32_parts(x, [raw4k, raw8], [int(Q.Q4_K), int(Q.Q8_0)],
                                   np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError):  # no parts
        _core.block_matmul_t_f32_parts(x, [], [], np.zeros((1, 0), np.float32))
    with pytest.raises(ValueError):  # one type short
        _core.block_matmul_t_f32_parts(x, [raw4k, raw8], [int(Q.Q4_K)],
                                       np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError):  # out is not [m, sum of rows]
        _core.block_matmul_t_f32_parts(x, [raw4k, raw8], [int(Q.Q4_K), int(Q.Q8_0)],
                                       np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError):  # a part's rows do not hold k values
        _core.block_matmul_t_f32_parts(x, [raw4k, np.zeros((3, 136), np.uint8)],
                                       [int(Q.Q4_K), int(Q.Q8_0)], np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError):  # unknown type
        _core.block_matmul_t_f32_parts(x, [raw4k], [99], np.zeros((1, 2), np.float32))


GEMM = pytest.mark.skipif(not _core.block_gemm_available(),
                          reason="block_gemm_f32 needs AVX-512")


@GEMM
@pytest.mark.parametrize("t", [t for t in TYPES if t not in (Q.F32, Q.F16, Q.BF16)],
                         ids=lambda t: t.name)
def test_gemm_equals_dequantized_f32_product(t):
    """`_core.block_gemm_f32`, the prefill product: `x @ dequantize(raw).T` into its columns
    of a wider out, for chunk sizes around its 32-row blocks and 12-row panels."""
    rng = np.random.default_rng(int(t))
    k, n = 512, 29
    raw = make_raw(t, n, k, rng)
    w = dequantized(raw, t).astype(np.float64)
    for m in (17, 40, 97):
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.full((m, n + 7), np.nan, np.float32)
        _core.block_gemm_f32(x, raw, int(t), out, col0=5, threads=2)
        want = x.astype(np.float64) @ w.T
        tol = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        assert (np.abs(out[:, 5 : 5 + n] - want) <= tol).all()
        assert np.isnan(out[:, :5]).all() and np.isnan(out[:, 5 + n :]).all()


@GEMM
@pytest.mark.parametrize("t", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_gemm_rows_do_not_depend_on_the_chunk(t):
    """Every output sums its k products in one order whatever the chunk: a prompt's token
    gets the same bits whether its chunk is 17 or 120 tokens long, and wherever it falls."""
    rng = np.random.default_rng(5)
    k, n, m = 768, 61, 120
    raw = make_raw(t, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    whole = np.empty((m, n), np.float32)
    _core.block_gemm_f32(x, raw, int(t), whole, threads=2)
    for lo, hi in ((0, 17), (17, 50), (50, 120), (3, 4)):
        part = np.empty((hi - lo, n), np.float32)
        _core.block_gemm_f32(x[lo:hi], raw, int(t), part, threads=1)
        np.testing.assert_array_equal(part, whole[lo:hi])


@GEMM
def test_gemm_checks_raise_value_error():
    raw = np.zeros((2, 144), np.uint8)  # Q4_K rows of 256
    x = np.zeros((20, 256), np.float32)
    _core.block_gemm_f32(x, raw, int(Q.Q4_K), np.zeros((20, 2), np.float32))
    with pytest.raises(ValueError):  # columns past out's width
        _core.block_gemm_f32(x, raw, int(Q.Q4_K), np.zeros((20, 2), np.float32), col0=1)
    with pytest.raises(ValueError):  # rows differ
        _core.block_gemm_f32(x, raw, int(Q.Q4_K), np.zeros((19, 2), np.float32))
    with pytest.raises(ValueError):  # float weights take BLAS
        _core.block_gemm_f32(x, np.zeros((2, 512), np.uint8), int(Q.F16),
                             np.zeros((20, 2), np.float32))
    with pytest.raises(ValueError):  # x's k is not the rows' k
        _core.block_gemm_f32(np.zeros((20, 512), np.float32), raw, int(Q.Q4_K),
                             np.zeros((20, 2), np.float32))
