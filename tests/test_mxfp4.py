"""MXFP4 (GGML type 39, gpt-oss's experts) as a block format: the NumPy dequantization
(`kvshare.model.weights`) against gguf-py's `quants.MXFP4` (ggml's `dequantize_row_mxfp4`:
per 32 values an E8M0 exponent byte and 16 bytes of E2M1 codes, low nibbles first), bit for
bit, denormal exponents included; its integer split (the `int8` CPU form); and the loader's
checks accepting it."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q, quants

from kvshare.model.loader import _block_format_supported
from kvshare.model.weights import FAST_TYPES, dequantize, split_quantized


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
