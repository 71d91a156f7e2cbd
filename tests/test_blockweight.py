"""BlockWeight and the block-format kernels (`_core.block_matmul_t`, `_core.block_dequantize`)
against gguf's NumPy reference (`gguf.quants`) for every supported GGUF type."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare import _core
from kvshare.ops.blockweight import BLOCK_KERNEL_MAX, BLOCK_TYPES, FLOAT_TYPES, BlockWeight

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K,
         Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
# types gguf.quants can quantize; the others get random valid blocks
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
# byte offsets of the f16 scale fields in a block
F16_FIELDS = {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q8_0: [0], Q.IQ4_NL: [0], Q.IQ4_XS: [0],
              Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
              Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q6_K: [208]}


def block_of(t: Q) -> int:
    return max(32, GGML_QUANT_SIZES[t][0])


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


def oracle(raw: np.ndarray, t: Q) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, t), np.float32)


def assert_close_8bit(got, x, w, t):
    """Within the error of 8-bit activations (each value off by at most amax / 254 of its
    32-block) plus f32 summation slack; f32 products for float weight types."""
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    if t in (Q.F32, Q.F16, Q.BF16):
        tol = 1e-5 * mag + 1e-6
    else:
        M, k = x.shape
        amax = np.abs(x).reshape(M, k // 32, 32).max(-1).astype(np.float64)
        wsum = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(-1).astype(np.float64)
        tol = 1.01 * (amax @ wsum.T) / 254 + 1e-4 * mag + 1e-6
    err = np.abs(got - want)
    assert (err <= tol).all(), f"{t.name}: max err {err.max()} (tol at worst {tol.flat[err.argmax()]})"


@pytest.fixture(params=[False, True], ids=["simd", "portable"])
def path(request):
    _core.block_force_portable(request.param)
    yield request.param
    _core.block_force_portable(False)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(t):
    rng = np.random.default_rng(int(t))
    for n, nb in [(1, 1), (7, 2), (33, 4)]:
        k = nb * block_of(t)
        raw = make_raw(t, n, k, rng)
        w = BlockWeight(raw, int(t), k, activations="q8")
        ref = oracle(raw, t)
        got = w.dequantize()
        assert got.shape == (n, k) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        np.testing.assert_array_equal(w.dequantize(1, n), got[1:])
        ids = rng.integers(0, n, 5)
        np.testing.assert_array_equal(w.rows(ids), got[ids])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_small_batches(t, path):
    rng = np.random.default_rng(100 + int(t))
    for M, n, nb in [(1, 1, 1), (3, 33, 2), (4, 70, 1), (5, 31, 3), (16, 45, 4)]:
        k = nb * block_of(t)
        raw = make_raw(t, n, k, rng)
        wf = oracle(raw, t)
        x = rng.standard_normal((M, k)).astype(np.float32)
        got = BlockWeight(raw, int(t), k, activations="q8").matmul_t(x)
        assert got.shape == (M, n)
        assert_close_8bit(got, x, wf, t)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_large_batches_match_the_kernel(t):
    """Above BLOCK_KERNEL_MAX rows: dequantized weights times the values the kernel's 8-bit
    activations stand for, in f32 (so a row's result does not depend on the batch it is in:
    the kernel's rows agree to float summation order)."""
    rng = np.random.default_rng(200 + int(t))
    k = 2 * block_of(t)
    raw = make_raw(t, 37, k, rng)
    wf = oracle(raw, t)
    x = rng.standard_normal((BLOCK_KERNEL_MAX + 9, k)).astype(np.float32)
    xq = x.copy()
    if int(t) not in FLOAT_TYPES:
        _core.block_act_round_trip(xq)
        assert 0 < np.abs(xq - x).max() <= np.abs(x).max() / 254 * 1.0001
    out = np.full((x.shape[0], 37), np.nan, np.float32)
    w = BlockWeight(raw, int(t), k, activations="q8")
    got = w.matmul_t(x, out=out)
    assert got is out
    ref = xq.astype(np.float64) @ wf.T.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    small = w.matmul_t(x[:BLOCK_KERNEL_MAX])
    np.testing.assert_allclose(small, got[:BLOCK_KERNEL_MAX], rtol=1e-4,
                               atol=1e-5 * np.abs(ref).max())


def test_fused_parts_of_different_types(path):
    rng = np.random.default_rng(5)
    k = 512
    specs = [(Q.Q4_K, 40), (Q.Q8_0, 17), (Q.F16, 9), (Q.Q6_K, 33)]
    parts = [(make_raw(t, n, k, rng), int(t), k) for t, n in specs]
    w = BlockWeight.concat([BlockWeight(*parts[0], activations="q8"), *parts[1:]],
                           activations="q8")
    wf = np.concatenate([oracle(r, Q(t)) for r, t, _ in parts])
    assert w.shape == (99, k) and w.ndim == 2 and w.dtype == np.float32
    assert w.nbytes == sum(r.nbytes for r, _, _ in parts)
    np.testing.assert_allclose(w.dequantize(), wf, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w.dequantize(30, 70), wf[30:70], rtol=1e-6, atol=1e-6)
    ids = np.array([98, 0, 45, 57, 39, 40])
    np.testing.assert_allclose(w.rows(ids), wf[ids], rtol=1e-6, atol=1e-6)
    for M in (1, 4, 16):
        x = rng.standard_normal((M, k)).astype(np.float32)
        got = w.matmul_t(x)
        for (t, _), a in zip(specs, np.cumsum([0] + [n for _, n in specs])):
            b = a + dict(specs)[t]
            assert_close_8bit(got[:, a:b], x, wf[a:b], t)
        # a strided destination (a column slice of a larger output)
        big = np.zeros((M, 120), np.float32)
        w.matmul_t(x, out=big[:, 10:109])
        np.testing.assert_array_equal(big[:, 10:109], got)
    # large batches: quantized parts see the 8-bit activations' values, the F16 part x itself
    x = rng.standard_normal((40, k)).astype(np.float32)
    xq = x.copy()
    _core.block_act_round_trip(xq)
    ref = np.concatenate([(x if t == Q.F16 else xq) @ wf[a : a + n].T
                          for (t, n), a in zip(specs, np.cumsum([0] + [n for _, n in specs]))],
                         axis=1)
    np.testing.assert_allclose(w.matmul_t(x), ref, rtol=1e-4, atol=1e-3)


def test_read_only_mapped_bytes(tmp_path):
    rng = np.random.default_rng(9)
    raw = make_raw(Q.Q4_0, 64, 256, rng)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r")
    w = BlockWeight(mapped, int(Q.Q4_0), 256, activations="q8")
    assert not w.parts[0].raw.flags.writeable
    assert np.shares_memory(w.parts[0].raw, mapped)  # no copy of the file's bytes
    x = rng.standard_normal((2, 256)).astype(np.float32)
    assert_close_8bit(w.matmul_t(x), x, oracle(raw, Q.Q4_0), Q.Q4_0)
    from_bytes = BlockWeight(raw.tobytes(), int(Q.Q4_0), 256, activations="q8")
    np.testing.assert_array_equal(from_bytes.dequantize(), w.dequantize())


def test_threads_do_not_change_results():
    from kvshare.backend import CPU_THREADS  # noqa: PLC0415

    rng = np.random.default_rng(11)
    raw = make_raw(Q.Q5_K, 1500, 1024, rng)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    one, many = np.empty((3, 1500), np.float32), np.empty((3, 1500), np.float32)
    _core.block_matmul_t(x, raw, int(Q.Q5_K), one, 1)
    _core.block_matmul_t(x, raw, int(Q.Q5_K), many, max(2, CPU_THREADS.max_threads))
    np.testing.assert_array_equal(one, many)


def test_bad_input_raises_value_error():
    rng = np.random.default_rng(1)
    raw = make_raw(Q.Q4_K, 4, 256, rng)
    with pytest.raises(ValueError, match="no block kernels"):
        BlockWeight(raw, int(Q.IQ2_XXS), 256, activations="q8")
    with pytest.raises(ValueError, match="multiple"):
        BlockWeight(raw, int(Q.Q4_K), 128, activations="q8")
    with pytest.raises(ValueError, match="whole rows"):
        BlockWeight(raw.reshape(-1)[:-1], int(Q.Q4_K), 256, activations="q8")
    with pytest.raises(ValueError, match="uint8"):
        BlockWeight(raw.view(np.int8), int(Q.Q4_K), 256, activations="q8")
    with pytest.raises(ValueError, match="input sizes"):
        BlockWeight.concat([(raw, int(Q.Q4_K), 256), (make_raw(Q.Q8_0, 2, 64, rng), 8, 64)],
                           activations="q8")
    w = BlockWeight(raw, int(Q.Q4_K), 256, activations="q8")
    with pytest.raises(ValueError):
        w.matmul_t(np.zeros((2, 255), np.float32))
    with pytest.raises(ValueError):
        w.matmul_t(np.zeros((2, 256), np.float32), out=np.zeros((2, 5), np.float32))
    x = np.zeros((2, 256), np.float32)
    out = np.zeros((2, 4), np.float32)
    bad_calls = [
        lambda: _core.block_matmul_t(x, raw, 99, out),  # unknown type
        lambda: _core.block_matmul_t(x, raw[:, :100], int(Q.Q4_K), out),  # strided raw
        lambda: _core.block_matmul_t(x, raw[:, :100].copy(), int(Q.Q4_K), out),  # row bytes
        lambda: _core.block_matmul_t(x, raw, int(Q.Q4_K), np.zeros((2, 3), np.float32)),
        lambda: _core.block_matmul_t(x.astype(np.float64), raw, int(Q.Q4_K), out),
        lambda: _core.block_matmul_t(np.zeros((17, 256), np.float32), raw, int(Q.Q4_K),
                                     np.zeros((17, 4), np.float32)),  # too many rows
        lambda: _core.block_dequantize(raw, int(Q.Q4_K), 256, np.zeros((4, 255), np.float32)),
        lambda: _core.block_dequantize(raw, int(Q.Q4_K), 200, np.zeros((4, 200), np.float32)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    ro = np.zeros((2, 4), np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        _core.block_matmul_t(x, raw, int(Q.Q4_K), ro)


def test_type_table_matches_gguf():
    for t in TYPES:
        assert BLOCK_TYPES[int(t)] == tuple(GGML_QUANT_SIZES[t])


@pytest.mark.parametrize("gemm", [True, False], ids=["block-gemm", "tiles+blas"])
def test_f32_large_batches_of_fused_parts(gemm, monkeypatch):
    """Prefill products with f32 activations: `_core.block_gemm_f32` per quantized part (where
    AVX-512 runs it), BLAS on dequantized tiles otherwise; F16 parts always BLAS. Both equal
    `x @ dequantize(w).T` to f32 summation order, into contiguous or strided outputs."""
    import kvshare.ops.blockweight as bw
    if gemm and not _core.block_gemm_available():
        pytest.skip("block_gemm_f32 needs AVX-512")
    monkeypatch.setattr(bw, "USE_GEMM", gemm)
    rng = np.random.default_rng(11)
    k = 512
    specs = [(Q.Q4_K, 40), (Q.Q8_0, 17), (Q.F16, 9), (Q.Q6_K, 33)]
    parts = [(make_raw(t, n, k, rng), int(t), k) for t, n in specs]
    w = BlockWeight.concat([BlockWeight(*p) for p in parts])
    wf = np.concatenate([oracle(r, Q(t)) for r, t, _ in parts]).astype(np.float64)
    for M in (BLOCK_KERNEL_MAX + 1, 75):
        x = rng.standard_normal((M, k)).astype(np.float32)
        ref = x.astype(np.float64) @ wf.T
        tol = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(wf).T)
        got = w.matmul_t(x)
        assert (np.abs(got - ref) <= tol).all()
        big = np.zeros((M, 120), np.float32)
        w.matmul_t(x, out=big[:, 10:109])
        np.testing.assert_array_equal(big[:, 10:109], got)
        assert not big[:, :10].any() and not big[:, 109:].any()


VNNI = bool(getattr(_core, "block_vnni_available", lambda: False)())
VNNI_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K]


def assert_close_vnni(got, x, w, t):
    """Within the error of the VNNI kernels' 8-bit activations: K-quants per 256 values (as
    ggml's Q8_K: off by at most amax / 254 of the 256), the others per 32; other types (the
    f32 path) as `assert_close_8bit`."""
    if t not in VNNI_TYPES:
        return assert_close_8bit(got, x, w, t)
    block, slack = (256, 0.0) if t in (Q.Q4_K, Q.Q6_K) else (32, 0.0)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    M, k = x.shape
    amax = np.abs(x).reshape(M, k // block, block).max(-1).astype(np.float64)
    wsum = np.abs(w).reshape(w.shape[0], k // block, block).sum(-1).astype(np.float64)
    tol = 1.01 * (amax @ wsum.T) * (1 / 254 + slack) + 1e-4 * mag + 1e-6
    err = np.abs(got - want)
    assert (err <= tol).all(), f"{t.name}: max err {err.max()} (tol at worst {tol.flat[err.argmax()]})"


def test_vnni_support_table():
    """The types the VNNI kernel takes (the rest of a "vnni" weight takes the f32 path)."""
    assert {t for t in TYPES if _core.block_vnni_supports(int(t))} == set(VNNI_TYPES)


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
def test_vnni_fused_parts_at_every_batch_size():
    """activations="vnni": within 8-bit error of the oracle at 1, 5 and 40 rows (a type
    without a VNNI kernel, Q4_1, and a float part take the f32 path), and every row the same
    bits whatever batch it is computed in."""
    rng = np.random.default_rng(11)
    k = 512
    specs = [(Q.Q4_K, 40), (Q.Q8_0, 17), (Q.Q4_1, 12), (Q.F16, 9), (Q.Q6_K, 33), (Q.Q5_0, 8)]
    parts = [(make_raw(t, n, k, rng), int(t), k) for t, n in specs]
    w = BlockWeight.concat(parts, activations="vnni")
    wf = np.concatenate([oracle(r, Q(t)) for r, t, _ in parts])
    x = rng.standard_normal((40, k)).astype(np.float32)
    full = w.matmul_t(x)
    starts = np.cumsum([0] + [n for _, n in specs])
    for t, a, b in zip([t for t, _ in specs], starts, starts[1:]):
        assert_close_vnni(full[:, a:b], x, wf[a:b], t)
    vnni_cols = np.concatenate([np.arange(a, b) for (t, _), a, b in zip(specs, starts, starts[1:])
                                if t in VNNI_TYPES])
    for lo, hi in [(3, 4), (0, 5), (7, 23)]:
        part = w.matmul_t(x[lo:hi])
        np.testing.assert_array_equal(part[:, vnni_cols], full[lo:hi, vnni_cols])
        for t, a, b in zip([t for t, _ in specs], starts, starts[1:]):
            assert_close_vnni(part[:, a:b], x[lo:hi], wf[a:b], t)
    # one call for parts that all have VNNI kernels, into a strided destination
    wv = BlockWeight.concat([parts[0], parts[1], parts[4]], activations="vnni")
    big = np.zeros((5, 100), np.float32)
    wv.matmul_t(x[:5], out=big[:, 3:93])
    np.testing.assert_array_equal(big[:, 3:93], wv.matmul_t(x[:5]))


def assert_rows_match_batches(t, x, rng, batches, rows=35):
    """For `rows` random weight rows of type `t` (35: two groups of 16 and three rows alone),
    the 8-bit-activation products of all of `x`'s rows are within 8-bit error of the oracle,
    and each of `batches` (slices of `x`'s rows) gives its rows the same bits as the whole
    batch."""
    k = x.shape[1]
    raw = make_raw(t, rows, k, rng)
    w = BlockWeight(raw, int(t), k, activations="vnni")
    full = w.matmul_t(x)
    assert_close_vnni(full, x, oracle(raw, t), t)
    for b in batches:
        np.testing.assert_array_equal(w.matmul_t(x[b]), full[b])


def alone(*rows):
    """Each row as a batch of its own (`assert_rows_match_batches`)."""
    return [slice(i, i + 1) for i in rows]


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
def test_vnni_rows_read_in_order_match_every_batch_size():
    """One activation row takes the one-row lane kernels (`lanes_q4_k_16`, `one_q6_k_16`,
    which reads each weight row in order in windows of blocks, and `lanes_legacy_one`): with
    27 K-quant blocks a row (two windows, the last block alone; 216 legacy blocks) and 35
    weight rows (two groups of 16 and a tail), a row's result is the same bits as in batches
    of 3 (K-quants: `many_*_16`; legacy: `lanes_legacy` on a packed tile) and 40 (the packed
    kernels), and within 8-bit error of the oracle."""
    rng = np.random.default_rng(12)
    k = 256 * 27
    x = rng.standard_normal((40, k)).astype(np.float32)
    for t in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q4_0):
        assert_rows_match_batches(t, x, rng, alone(0, 17, 39) + [slice(5, 8)])


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
@pytest.mark.parametrize("nb", [1, 4, 5, 8, 9, 20, 36, 40, 47])
def test_vnni_legacy_tails_match_every_batch_size(nb):
    """Legacy rows of every length around 16 blocks (Gemma 3 270M's rows are 20 blocks;
    the one-row kernel once took chunks of 16 and a tail of 1-8, and a packed tile takes
    blocks in pairs, an odd last block alone): for 35 weight rows (two groups of 16 and
    three rows alone) a row's result is the same bits alone, in a batch of 5 (the 8-lane
    kernels) and in a batch of 40 (the 16-lane ones), and within 8-bit error of the
    oracle."""
    rng = np.random.default_rng(nb)
    k = 32 * nb
    x = rng.standard_normal((40, k)).astype(np.float32)
    for t in (Q.Q8_0, Q.Q5_0, Q.Q4_0):
        assert_rows_match_batches(t, x, rng, alone(0, 21, 39) + [slice(3, 8)])


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
@pytest.mark.parametrize("nb", [1, 2, 7, 20])
def test_vnni_legacy_lanes_match_every_batch_size(nb):
    """2-8 activation rows take legacy weights 16 rows at a time in lanes (`lanes_legacy`,
    transposed codes against broadcast activations; 4 or 8 rows of the tile): for 53 weight
    rows (three groups of 16 and five alone, split between threads) and even and odd block
    counts, every batch of 2 to 8 rows gives each row the same bits as it gets alone and in
    a batch of 40, within 8-bit error of the oracle."""
    rng = np.random.default_rng(100 + nb)
    k = 32 * nb
    x = rng.standard_normal((40, k)).astype(np.float32)
    for t in (Q.Q8_0, Q.Q5_0, Q.Q4_0):
        assert_rows_match_batches(t, x, rng, [slice(m, 2 * m) for m in range(2, 9)] + alone(9),
                                  rows=53)


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
@pytest.mark.parametrize("nsb", [1, 3, 8])
def test_vnni_k_quant_rows_match_every_batch_size(nsb):
    """Q4_K takes 1-8 activation rows with the weight rows' codes turned into lanes
    (`lanes_q4_k_16`), Q6_K 1-4 (`one_q6_k_16`, `many_q6_k_16`) and then the packed tiles:
    for 37 weight rows (two groups of 16 and five alone, split between threads) every batch
    of 1 to 8 rows gives each row the same bits as a batch of 40, within 8-bit error of the
    oracle."""
    rng = np.random.default_rng(200 + nsb)
    k = 256 * nsb
    x = rng.standard_normal((40, k)).astype(np.float32)
    for t in (Q.Q4_K, Q.Q6_K):
        assert_rows_match_batches(t, x, rng, [slice(m, 2 * m) for m in range(1, 9)], rows=37)


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
def test_vnni_bad_input_raises_value_error():
    rng = np.random.default_rng(12)
    raw = make_raw(Q.Q4_K, 4, 256, rng)
    out = np.empty((2, 4), np.float32)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="VNNI kernel"):
        _core.block_matmul_t_vnni(x, [make_raw(Q.Q2_K, 4, 256, rng)], [int(Q.Q2_K)], out)
    with pytest.raises(ValueError):
        _core.block_matmul_t_vnni(x[:, :128], [raw], [int(Q.Q4_K)], out)
    with pytest.raises(ValueError):
        _core.block_matmul_t_vnni(x, [raw], [int(Q.Q4_K)], np.empty((2, 5), np.float32))
    with pytest.raises(ValueError):
        BlockWeight(raw, int(Q.Q4_K), 256, activations="int4")


@pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")
def test_vnni_nibble_lanes_match_the_per_row_unpack(tmp_path):
    """Q4_0 / Q5_0 blocks are turned before they are unpacked where the CPU has AVX512-VBMI2
    and BITALG (`nibble_lanes`), else unpacked row by row. The two give the same bits: the
    products of 1, 2, 5 and 8 activation rows with 35 weight rows (a last group whose last
    block takes the per-row path either way) of 1, 7 and 20 blocks, here and in a process
    with `KVSHARE_KERNEL_NO_VBMI2=1` (the per-row path on every block)."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(21)
    cases = {}
    for t in (Q.Q4_0, Q.Q5_0):
        for nb in (1, 7, 20):
            k = 32 * nb
            raw = make_raw(t, 35, k, rng)
            x = rng.standard_normal((8, k)).astype(np.float32)
            np.save(tmp_path / f"raw_{t.name}_{nb}.npy", raw)
            np.save(tmp_path / f"x_{t.name}_{nb}.npy", x)
            w = BlockWeight(raw, int(t), k, activations="vnni")
            cases[(t.name, nb)] = [w.matmul_t(x[:m]) for m in (1, 2, 5, 8)]
    script = f"""
import numpy as np
from gguf import GGMLQuantizationType as Q
from kvshare.ops.blockweight import BlockWeight
d = {str(tmp_path)!r}
for t in (Q.Q4_0, Q.Q5_0):
    for nb in (1, 7, 20):
        raw = np.load(f"{{d}}/raw_{{t.name}}_{{nb}}.npy"); x = np.load(f"{{d}}/x_{{t.name}}_{{nb}}.npy")
        w = BlockWeight(raw, int(t), 32 * nb, activations="vnni")
        for m in (1, 2, 5, 8):
            np.save(f"{{d}}/y_{{t.name}}_{{nb}}_{{m}}.npy", w.matmul_t(x[:m]))
"""
    env = dict(os.environ, KVSHARE_KERNEL_NO_VBMI2="1")
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    for (name, nb), ys in cases.items():
        for m, y in zip((1, 2, 5, 8), ys):
            other = np.load(tmp_path / f"y_{name}_{nb}_{m}.npy")
            np.testing.assert_array_equal(other, y, err_msg=f"{name}, {nb} blocks, {m} rows")
