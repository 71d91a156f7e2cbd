"""MXFP4 (GGML type 39, gpt-oss's experts) as a block format: the NumPy dequantization
(`kvshare.model.weights`) against gguf-py's `quants.MXFP4` (ggml's `dequantize_row_mxfp4`:
per 32 values an E8M0 exponent byte and 16 bytes of E2M1 codes, low nibbles first), bit for
bit, denormal exponents included; its integer split (the `int8` CPU form); the loader's
checks accepting it; and `BlockWeight` on MXFP4 blocks (kvshare-kernels' MXFP4 block type)
against that dequantization: the same bits, products with f32 and 8-bit activations."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare import _core
from kvshare.model.loader import _block_format_supported
from kvshare.model.weights import FAST_TYPES, dequantize, split_quantized
from kvshare.ops.blockweight import BLOCK_KERNEL_MAX, BLOCK_TYPES, HAVE_VNNI, BlockWeight


def _blocks(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(0, 251, n)  # 251+ overflow f32 for the largest codes
    raw[:4, 0] = [0, 1, 2, 250]  # denormal scales and a large one
    return raw


def test_dequantize_matches_gguf_py_bit_for_bit():
    raw = _blocks(4096)
    got = dequantize(raw, Q.MXFP4)
    with np.errstate(over="ignore"):
        ref = quants.dequantize(raw.reshape(-1), Q.MXFP4).astype(np.float32).reshape(-1)
    assert Q.MXFP4 in FAST_TYPES and got.shape == (4096 * 32,)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_quantize_round_trip_and_split():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    raw = quants.quantize(x, Q.MXFP4)
    assert raw.shape == (8, 4 * 17)
    w = dequantize(raw, Q.MXFP4).reshape(8, 128)
    assert np.abs(w - x).max() <= 0.5 * np.abs(x).max()  # 4-bit codes
    q, scale, mins, group = split_quantized(raw, Q.MXFP4, (8, 128))
    assert mins is None and group == 32 and q.dtype == np.int8
    np.testing.assert_array_equal(np.repeat(scale, 32, axis=1) * q, w)


def test_the_loader_accepts_mxfp4():
    assert _block_format_supported(Q.MXFP4)


def _weight_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """`[n, k / 32 * 17]`: random codes with exponents 2^-6..2^2 (no overflow in products),
    the first row's first blocks at denormal and large exponents."""
    raw = _blocks(n * k // 32, seed)
    raw[:, 0] = np.random.default_rng(seed).integers(122, 131, raw.shape[0])
    raw[:3, 0] = [0, 1, 160]
    return raw.reshape(n, -1)


def test_block_weight_dequantizes_as_the_oracle():
    raw = _blocks(3 * 1024, 3).reshape(3 * 32, -1)  # exponents 0..250, 32 blocks a row
    w = BlockWeight(raw, int(Q.MXFP4), 1024)
    assert BLOCK_TYPES[int(Q.MXFP4)] == tuple(GGML_QUANT_SIZES[Q.MXFP4]) == (32, 17)
    assert w.nbytes == raw.nbytes and w.shape == (96, 1024)
    ref = dequantize(raw, Q.MXFP4).reshape(96, 1024)
    np.testing.assert_array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(w.rows(np.array([5, 0, 95])), ref[[5, 0, 95]])


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 40])
def test_block_weight_products_match_the_oracle(m, portable):
    if portable and m > BLOCK_KERNEL_MAX:
        pytest.skip("larger batches take the GEMM or BLAS, not the row kernels")
    n, k = 70, 256
    raw = _weight_blocks(n, k, m)
    wf = dequantize(raw, Q.MXFP4).reshape(n, k).astype(np.float64)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ wf.T
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).T
    _core.block_force_portable(portable)
    try:
        f32 = BlockWeight(raw, int(Q.MXFP4), k).matmul_t(x)
        q8 = BlockWeight(raw, int(Q.MXFP4), k, activations="q8").matmul_t(x)
    finally:
        _core.block_force_portable(False)
    # f32 activations: exact up to f32 summation order
    assert (np.abs(f32 - want) <= 1e-5 * mag + 1e-30).all()
    # 8-bit activations: each value off by at most amax / 254 of its 32-block
    amax = np.abs(x).reshape(m, k // 32, 32).max(-1).astype(np.float64)
    wsum = np.abs(wf).reshape(n, k // 32, 32).sum(-1)
    tol = 1.01 * (amax @ wsum.T) / 254 + 1e-5 * mag + 1e-30
    assert (np.abs(q8 - want) <= tol).all()
    assert np.abs(q8 - f32).max() > 0  # the activations were rounded


def test_block_weight_vnni_takes_the_f32_path():
    if not HAVE_VNNI:
        pytest.skip("no AVX512-VNNI")
    assert not _core.block_vnni_supports(int(Q.MXFP4))
    raw = _weight_blocks(33, 128, 7)
    x = np.random.default_rng(7).standard_normal((5, 128)).astype(np.float32)
    got = BlockWeight(raw, int(Q.MXFP4), 128, activations="vnni").matmul_t(x)
    np.testing.assert_array_equal(got, BlockWeight(raw, int(Q.MXFP4), 128).matmul_t(x))
