"""GGUF block weights on the GPU (`kvshare.ops.gpu_blocks`, kernels/blocks.cu) against
`gguf.quants.dequantize`: random valid blocks of every supported type (random bytes with sane
f16 scales, so every bit pattern of the packed values occurs), `linear` on the mat-vec path
(m <= 16) and the dequantized-tile + cuBLAS path (m > 16), fused parts of different types,
embedding rows, f16 dequantization. Marked `gpu`: skipped without a CUDA device (conftest);
runs on the CPU emulator too (tests/gpu_emu).

Tolerances: m <= 16: float32 accumulation in another order, |y - ref| <= 1e-4 * sum|x||w|;
m > 16: weights and activations rounded to f16 (relative 2^-11 each), 4e-3 * sum|x||w| as for
f16 weights in tests/test_ops_gpu.py; embedding rows and the f16 tiles: exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvshare.backend import get_backend
from kvshare.ops import gpu_blocks
from kvshare.ops.embedding import embedding
from kvshare.ops.linear import linear

pytestmark = pytest.mark.gpu

# type -> byte offsets of its f16 scale fields (d, and dmin / m where present)
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}
QUANT_TYPES = list(F16_FIELDS)
PLAIN_TYPES = [Q.F32, Q.F16, Q.BF16]
ALL_TYPES = QUANT_TYPES + PLAIN_TYPES


@pytest.fixture(scope="module")
def be():
    return get_backend("cuda")


def random_rows(rng: np.random.Generator, qtype: Q, n: int, k: int) -> np.ndarray:
    """Raw rows `[n, row_bytes]` of valid blocks: random bytes, f16 scales of magnitude
    1e-3 .. 5e-2 (random sign; mins too); plain types: random values."""
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
    for off in F16_FIELDS[qtype]:
        v = (rng.uniform(1e-3, 5e-2, nb) * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        blocks[:, off : off + 2] = v.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def ref_dequant(raw: np.ndarray, qtype: Q, k: int) -> np.ndarray:
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(-1, k)
    if qtype == Q.F16:
        return raw.view(np.float16).reshape(-1, k).astype(np.float32)
    return np.asarray(dequantize(raw, qtype), np.float32).reshape(-1, k)


def _k_for(qtype: Q) -> int:
    # 32-element blocks: 36 chunks of 8 per row (one full and one partial pass of 32 lanes);
    # 256-element ones: 2 super-blocks (64 chunks)
    return 288 if GGML_QUANT_SIZES[qtype][0] <= 32 else 512


def _check(y, ref_x, ref_w, tol, bias=None):
    x64, w64 = ref_x.astype(np.float64), ref_w.astype(np.float64)
    ref = x64 @ w64.T
    if bias is not None:
        ref = ref + bias
    bound = tol * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.isfinite(y).all()
    assert (err <= bound).all(), f"max err {err.max():.3g}, bound there {bound.flat[err.argmax()]:.3g}"


# --- linear --------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_linear_matches_dequantized_weights(be, qtype, m):
    rng = np.random.default_rng(int(qtype) * 100 + m)
    n, k = 37, _k_for(qtype)
    raw = random_rows(rng, qtype, n, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(raw, int(qtype), k)], be)
    assert w.shape == (n, k) and w.ndim == 2 and w.dtype == np.float32
    assert w.nbytes == raw.nbytes
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = be.to_host(linear(be.asarray(x), w, backend=be))
    assert y.shape == (m, n) and y.dtype == np.float32
    _check(y, x, ref_dequant(raw, qtype, k), 1e-4 if m <= 16 else 4e-3)


def _long_k(qtype: Q) -> int:
    # rows long enough that a bmv CTA's 128 lanes (4 warps, BMV_WARPS) pass over them more
    # than twice: 292 chunks of 8 for 32-element blocks (lanes 0..35 take 3 chunks, the rest
    # 2), 320 for 256-element ones (lanes 0..63 take 3): the M = 1 kernels' loop, unrolled
    # by 2, runs its pair and its remainder; every warp has chunks; warps end unevenly
    return 2336 if GGML_QUANT_SIZES[qtype][0] <= 32 else 2560


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_linear_long_rows_split_across_warps(be, qtype, m):
    assert gpu_blocks.BMV_WARPS == 4
    rng = np.random.default_rng(int(qtype) * 7 + m)
    n, k = 5, _long_k(qtype)  # 5 rows: the last CTA's second row is past the end (m = 1)
    raw = random_rows(rng, qtype, n, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(raw, int(qtype), k)], be)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = be.to_host(linear(be.asarray(x), w, backend=be))
    _check(y, x, ref_dequant(raw, qtype, k), 1e-4)


@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 20])
def test_fused_parts_of_different_types_with_bias(be, m, monkeypatch):
    # m > 16: tiles of at most 10 rows, so parts span several tiles and tiles end mid-part
    monkeypatch.setattr(gpu_blocks, "DEQUANT_TILE_ELEMS", 10 * 256)
    rng = np.random.default_rng(m)
    k = 256
    spec = [(Q.Q4_K, 21), (Q.Q6_K, 9), (Q.Q8_0, 13), (Q.F16, 3), (Q.Q5_1, 6)]
    raws = [random_rows(rng, t, n, k) for t, n in spec]
    w = gpu_blocks.GpuBlockWeight.from_parts([(r, int(t), k) for r, (t, _) in zip(raws, spec)],
                                             be)
    n_out = sum(n for _, n in spec)
    assert w.shape == (n_out, k) and w.qtypes == tuple(int(t) for t, _ in spec)
    assert [p.col0 for p in w.parts] == [0, 21, 30, 43, 46]
    ref_w = np.concatenate([ref_dequant(r, t, k) for r, (t, _) in zip(raws, spec)])
    # x as a strided, misaligned view (one float into a wider array)
    wide = rng.standard_normal((m, k + 5)).astype(np.float32)
    x_d = be.asarray(wide)[:, 1 : 1 + k]
    bias = rng.standard_normal(n_out).astype(np.float32)
    tol = 1e-4 if m <= 16 else 4e-3
    y = be.to_host(linear(x_d, w, bias, backend=be))
    _check(y, wide[:, 1 : 1 + k], ref_w, tol, bias)
    # into a given output buffer
    out = be.asarray(np.full((m, n_out), np.nan, np.float32))
    r = linear(x_d, w, bias, backend=be, out=out)
    assert r is out
    _check(be.to_host(out), wide[:, 1 : 1 + k], ref_w, tol, bias)


def test_linear_from_quantized_floats(be):
    """Blocks from gguf's own quantizer (realistic scales) for the types it can quantize."""
    rng = np.random.default_rng(7)
    k, n = 256, 19
    f = rng.standard_normal((n, k)).astype(np.float32)
    parts, refs = [], []
    for t in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1):
        raw = quantize(f, t)
        parts.append((raw, int(t), k))
        refs.append(ref_dequant(raw, t, k))
    w = gpu_blocks.GpuBlockWeight.from_parts(parts, be)
    ref_w = np.concatenate(refs)
    for m in (1, 4, 24):
        x = rng.standard_normal((m, k)).astype(np.float32) * 100
        y = be.to_host(linear(be.asarray(x), w, backend=be))
        _check(y, x, ref_w, 1e-4 if m <= 16 else 4e-3)


def test_grid_stride_loops(be, monkeypatch):
    """With at most 2 CTAs per launch, every kernel loops over its rows / chunks."""
    from kvshare.ops import gpu_runtime  # noqa: PLC0415

    monkeypatch.setattr(gpu_runtime, "MAX_GRID", 2)
    rng = np.random.default_rng(9)
    k = 512
    spec = [(Q.Q4_K, 23), (Q.Q5_0, 14)]
    raws = [random_rows(rng, t, n, k) for t, n in spec]
    w = gpu_blocks.GpuBlockWeight.from_parts([(r, int(t), k) for r, (t, _) in zip(raws, spec)],
                                             be)
    ref_w = np.concatenate([ref_dequant(r, t, k) for r, (t, _) in zip(raws, spec)])
    for m in (3, 18):
        x = rng.standard_normal((m, k)).astype(np.float32)
        _check(be.to_host(linear(be.asarray(x), w, backend=be)), x, ref_w,
               1e-4 if m <= 16 else 4e-3)
    table = gpu_blocks.GpuBlockWeight.from_parts([(raws[0], int(Q.Q4_K), k)], be)
    tokens = rng.integers(0, 23, 11).astype(np.int32)
    np.testing.assert_array_equal(be.to_host(embedding(table, tokens, backend=be)),
                                  ref_w[:23][tokens])


def test_linear_rejects_bad_shapes(be):
    rng = np.random.default_rng(0)
    w = gpu_blocks.GpuBlockWeight.from_parts([(random_rows(rng, Q.Q8_0, 4, 64), int(Q.Q8_0), 64)],
                                             be)
    with pytest.raises(ValueError):
        linear(be.asarray(np.zeros((2, 32), np.float32)), w, backend=be)
    with pytest.raises(ValueError):
        linear(be.asarray(np.zeros((2, 64), np.float32)), w, np.zeros(3, np.float32), backend=be)
    y = be.to_host(linear(be.asarray(np.zeros((0, 64), np.float32)), w, backend=be))
    assert y.shape == (0, 4)


# --- construction --------------------------------------------------------------------------------

def test_from_parts_validates():
    rng = np.random.default_rng(1)
    raw = random_rows(rng, Q.Q4_K, 3, 256)
    with pytest.raises(ValueError):
        gpu_blocks.GpuBlockWeight.from_parts([(raw, int(Q.Q4_K), 512)])  # 3 rows of 144 B
    with pytest.raises(ValueError):
        gpu_blocks.GpuBlockWeight.from_parts([(raw, int(Q.Q4_K), 200)])  # not whole blocks
    with pytest.raises(ValueError):
        gpu_blocks.GpuBlockWeight.from_parts([(raw, int(Q.IQ2_XXS), 256)])  # unsupported
    with pytest.raises(ValueError):
        gpu_blocks.GpuBlockWeight.from_parts([])
    assert gpu_blocks.row_bytes(int(Q.Q6_K), 512) == 420
    assert gpu_blocks.row_bytes(int(Q.F16), 64) == 128
    assert gpu_blocks.supports(int(Q.Q4_K), 512) and not gpu_blocks.supports(int(Q.Q4_K), 96)
    assert not gpu_blocks.supports(int(Q.IQ2_XXS), 256)


def test_from_parts_takes_device_bytes(be):
    """Raw bytes already on the device (here a misaligned flat view) are used as they are,
    or copied to an aligned buffer."""
    rng = np.random.default_rng(4)
    raw = random_rows(rng, Q.Q5_K, 5, 256)
    flat = np.concatenate([np.zeros(3, np.uint8), raw.reshape(-1)])
    w = gpu_blocks.GpuBlockWeight.from_parts([(be.asarray(flat)[3:], int(Q.Q5_K), 256)], be)
    assert w.shape == (5, 256) and w.parts[0].data.data.ptr % 16 == 0
    x = rng.standard_normal((2, 256)).astype(np.float32)
    _check(be.to_host(linear(be.asarray(x), w, backend=be)), x, ref_dequant(raw, Q.Q5_K, 256),
           1e-4)


def test_from_gguf(be):
    """From a GGUFFile-like object: `tensors` (name -> info with GGUF-order shape and qtype)
    and `raw(name)` (the stored bytes, flat)."""
    from types import SimpleNamespace  # noqa: PLC0415

    rng = np.random.default_rng(6)
    k = 256
    spec = {"q": (Q.Q4_K, 8), "k": (Q.Q6_K, 4), "v": (Q.Q8_0, 4), "odd": (Q.IQ2_XXS, 2)}
    raws = {n: (random_rows(rng, t, r, k) if t != Q.IQ2_XXS else np.zeros((r, 66), np.uint8))
            for n, (t, r) in spec.items()}
    gf = SimpleNamespace(
        tensors={n: SimpleNamespace(shape=(k, r), qtype=t) for n, (t, r) in spec.items()},
        raw=lambda n: raws[n].reshape(-1))
    w = gpu_blocks.GpuBlockWeight.from_gguf(gf, ["q", "k", "v"], be)
    assert w.shape == (16, k) and w.nbytes == sum(raws[n].nbytes for n in "qkv")
    ref_w = np.concatenate([ref_dequant(raws[n], spec[n][0], k) for n in "qkv"])
    x = rng.standard_normal((1, k)).astype(np.float32)
    _check(be.to_host(linear(be.asarray(x), w, backend=be)), x, ref_w, 1e-4)
    assert gpu_blocks.GpuBlockWeight.from_gguf(gf, ["q", "odd"], be) is None
    assert gpu_blocks.GpuBlockWeight.from_gguf(gf, ["q", "missing"], be) is None


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_f16_tiles(be, qtype):
    rng = np.random.default_rng(int(qtype) + 11)
    k = _k_for(qtype)
    raw = random_rows(rng, qtype, 9, k)
    w = gpu_blocks.GpuBlockWeight.from_parts([(raw, int(qtype), k)], be)
    ref = ref_dequant(raw, qtype, k)
    got = be.to_host(w.dequantize_f16())
    np.testing.assert_array_equal(got, ref.astype(np.float16), err_msg=_where_tiles_differ(
        got, ref.astype(np.float16), GGML_QUANT_SIZES[qtype][0]))
    np.testing.assert_array_equal(be.to_host(w.dequantize_f16(2, 7)), ref[2:7].astype(np.float16))


def _where_tiles_differ(got: np.ndarray, want: np.ndarray, qk: int) -> str:
    """Where in the block the differing elements are (by 8-element chunk of the block and by
    element of the chunk), and whether a wrong value is the right value of another element
    of its block: what tells a decoder's indexing bug from a conversion or load bug."""
    bad = (got != want) & ~(np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    if not bad.any():
        return ""
    r, c = np.nonzero(bad)
    pos = c % qk
    by_chunk = np.bincount(pos // 8, minlength=qk // 8)
    by_elem = np.bincount(pos % 8, minlength=8)
    moved = 0
    for i, j in zip(r[:200], c[:200]):
        b0 = j - j % qk
        moved += bool((want[i, b0 : b0 + qk] == got[i, j]).any())
    return (f"{bad.mean():.1%} of elements differ; per 8-element chunk of a {qk}-element "
            f"block: {by_chunk.tolist()}; per element of a chunk: {by_elem.tolist()}; "
            f"{moved} of the first {min(200, len(r))} wrong values occur elsewhere in their "
            f"block; first: row {r[0]} col {c[0]}: {got[r[0], c[0]]} != {want[r[0], c[0]]}")


# --- embedding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_exact(be, qtype):
    rng = np.random.default_rng(int(qtype) + 3)
    vocab, k = 29, _k_for(qtype)
    raw = random_rows(rng, qtype, vocab, k)
    table = gpu_blocks.GpuBlockWeight.from_parts([(raw, int(qtype), k)], be)
    ref = ref_dequant(raw, qtype, k)
    tokens = np.array([3, 0, 28, 3, 17, 5], np.int32)
    x = be.to_host(embedding(table, tokens, backend=be))
    np.testing.assert_array_equal(x, ref[tokens])
    x = be.to_host(embedding(table, be.asarray(tokens), 2.5, backend=be))
    np.testing.assert_array_equal(x, ref[tokens] * np.float32(2.5))


def test_embedding_bad_ids(be):
    rng = np.random.default_rng(5)
    table = gpu_blocks.GpuBlockWeight.from_parts(
        [(random_rows(rng, Q.Q8_0, 6, 64), int(Q.Q8_0), 64)], be)
    with pytest.raises(IndexError):
        embedding(table, np.array([1, 6]), backend=be)
    x = be.to_host(embedding(table, be.asarray(np.array([1, 6, -1], np.int32)), backend=be))
    assert np.isfinite(x[0]).all() and np.isnan(x[1:]).all()
    two = gpu_blocks.GpuBlockWeight.from_parts(
        [(random_rows(rng, Q.Q8_0, 2, 64), int(Q.Q8_0), 64)] * 2, be)
    with pytest.raises(ValueError):
        embedding(two, np.array([0]), backend=be)


# --- a whole model on block weights ----------------------------------------------------------------

M_VOCAB, M_EMBD, M_FF, M_H, M_K, M_D = 300, 256, 512, 4, 2, 64


def _model_rows(rng: np.random.Generator, qtype: Q, n: int, k: int) -> np.ndarray:
    """Raw rows with weights of a sane size for a forward pass: gguf's quantizer where it has
    one (from N(0, 0.15^2)), else random blocks with small scales (|w| <~ 0.4)."""
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1):
        return quantize((rng.standard_normal((n, k)) * 0.15).astype(np.float32), qtype)
    qk, size = GGML_QUANT_SIZES[qtype]
    nb = n * (k // qk)
    blocks = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    small = {Q.Q2_K: 4e-3, Q.Q3_K: 3e-3, Q.Q4_K: 4e-4, Q.Q5_K: 2e-4, Q.Q6_K: 1e-4,
             Q.IQ4_NL: 3e-3, Q.IQ4_XS: 1e-4}[qtype]
    for off in F16_FIELDS[qtype]:
        v = (rng.uniform(0.5, 1.0, nb) * small).astype(np.float16)
        blocks[:, off : off + 2] = v.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def _write_block_model(path) -> None:
    """A 2-layer llama GGUF whose matrices use 12 block types (fused Q/K/V and gate/up mix
    types), the embedding Q8_0 and an untied IQ4_XS output head."""
    from gguf import GGUFWriter  # noqa: PLC0415

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(M_EMBD)
    w.add_feed_forward_length(M_FF)
    w.add_head_count(M_H)
    w.add_head_count_kv(M_K)
    w.add_key_length(M_D)
    w.add_value_length(M_D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e4)
    w.add_vocab_size(M_VOCAB)

    def mat(name, qtype, n, k):
        w.add_tensor(name, _model_rows(rng, qtype, n, k), raw_dtype=qtype)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", Q.Q8_0, M_VOCAB, M_EMBD)
    mat("output.weight", Q.IQ4_XS, M_VOCAB, M_EMBD)
    vec("output_norm.weight", M_EMBD)
    types = [(Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.Q4_0, Q.Q5_1, Q.Q3_K),
             (Q.Q5_0, Q.Q4_1, Q.IQ4_NL, Q.Q6_K, Q.Q2_K, Q.Q4_K, Q.Q8_0)]
    for il, (tq, tk, tv, to, tg, tu, td) in enumerate(types):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", M_EMBD)
        vec(p + "ffn_norm.weight", M_EMBD)
        mat(p + "attn_q.weight", tq, M_H * M_D, M_EMBD)
        mat(p + "attn_k.weight", tk, M_K * M_D, M_EMBD)
        mat(p + "attn_v.weight", tv, M_K * M_D, M_EMBD)
        mat(p + "attn_output.weight", to, M_EMBD, M_H * M_D)
        mat(p + "ffn_gate.weight", tg, M_FF, M_EMBD)
        mat(p + "ffn_up.weight", tu, M_FF, M_EMBD)
        mat(p + "ffn_down.weight", td, M_EMBD, M_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def block_models(tmp_path_factory):
    """(cpu model on f32 weights, gpu model on GpuBlockWeight matrices) of the block-typed
    llama: the GPU load stacks each `WeightLoader.matrix` from the file's bytes
    (GpuBlockWeight.from_gguf), as the loader is meant to."""
    from kvshare.model.loader import load_model  # noqa: PLC0415
    from kvshare.model.weights import WeightLoader  # noqa: PLC0415

    path = tmp_path_factory.mktemp("blocks") / "llama-blocks.gguf"
    _write_block_model(path)
    mp = pytest.MonkeyPatch()
    # the oracle: f32 weights dequantized by the loader (the CPU's block kernels quantize
    # activations to 8 bits, a further 0.5% per product)
    mp.setenv("KVSHARE_CPU_WEIGHTS", "f32")
    try:
        cpu = load_model(path, "cpu")
    finally:
        mp.undo()
    orig = WeightLoader.matrix

    def matrix(self, names):
        if self.backend.is_gpu:
            w = gpu_blocks.GpuBlockWeight.from_gguf(self.gf, names, self.backend)
            if w is not None:
                return w
        return orig(self, names)

    mp = pytest.MonkeyPatch()
    mp.setattr(WeightLoader, "matrix", matrix)
    try:
        gpu = load_model(path, "cuda")
    finally:
        mp.undo()
    return cpu, gpu


def _run(model, tokens, chunks, block_size=16):
    """Logits of every token, fed in chunks of the given sizes."""
    from kvshare.model.batch import SeqChunk  # noqa: PLC0415

    nb = -(-len(tokens) // block_size) + 1
    cache = model.new_cache(nb, block_size)
    table = np.arange(nb)
    outs, s = [], 0
    for c in chunks:
        (lg,) = model.forward([SeqChunk(tokens[s : s + c], s, table, logits="all")], cache)
        outs.append(lg)
        s += c
    return np.concatenate(outs)


def test_model_on_block_weights_matches_cpu(block_models):
    cpu, gpu = block_models
    assert isinstance(gpu.tok_embd, gpu_blocks.GpuBlockWeight)
    assert isinstance(gpu.output, gpu_blocks.GpuBlockWeight)
    toks = np.random.default_rng(1).integers(0, M_VOCAB, 40).astype(np.int32)
    ref = _run(cpu, toks, [40])
    scale = np.abs(ref).max(-1, keepdims=True)
    assert np.isfinite(ref).all() and (ref.std(-1) > 0.05 * scale[:, 0]).all()
    # prefill (m = 40: dequantized tiles + GEMM), then chunks of 9 and 1 (the mat-vec kernels)
    for chunks in ([40], [24, 9, 1, 1, 5]):
        got = _run(gpu, toks, chunks)
        rel = float((np.abs(got - ref) / scale).max())
        assert rel <= 2e-2, (chunks, rel)
