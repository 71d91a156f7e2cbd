"""Tiny random-weight GGUF models of each supported architecture (written here with
`gguf.GGUFWriter`), checked against an independent dense float64 reference forward pass, and
used for the cheap exhaustive consistency checks: any chunking of a prefill, prefill followed
by token-by-token decode, shuffled block tables, several sequences per call and f16 KV all
give the same logits as one-shot prefill.

"Relative" below: |delta| / max|logit| per position (the 1e-4 tolerance of the spec).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFWriter, quants

from kvshare.model.batch import SeqChunk
from kvshare.model.gguf_file import GGUFError
from kvshare.model.loader import UnsupportedModelError, load_model

VOCAB, EMBD, FF = 96, 64, 96


def _spec(arch: str) -> dict:
    if arch == "gemma3":
        return dict(n_layers=7, n_head=4, n_kv=2, hd=32, window=8, base=1e6, base_swa=1e4,
                    qk_norm=True, post_norms=True, bias=False, act="gelu", embed_scale=True,
                    rope="neox", tied=True)
    if arch == "qwen3":
        return dict(n_layers=3, n_head=4, n_kv=2, hd=16, window=0, base=1e6, base_swa=1e6,
                    qk_norm=True, post_norms=False, bias=False, act="silu", embed_scale=False,
                    rope="neox", tied=False)
    if arch == "qwen2":
        return dict(n_layers=2, n_head=4, n_kv=1, hd=16, window=0, base=1e6, base_swa=1e6,
                    qk_norm=False, post_norms=False, bias=True, act="silu", embed_scale=False,
                    rope="neox", tied=True)
    if arch == "llama":
        return dict(n_layers=2, n_head=4, n_kv=4, hd=16, window=0, base=5e5, base_swa=5e5,
                    qk_norm=False, post_norms=False, bias=False, act="silu", embed_scale=False,
                    rope="norm", tied=False, freq_factors=True)
    raise ValueError(arch)


def write_tiny(path, arch: str, seed: int = 0) -> dict:
    """Write a tiny GGUF of `arch` with random weights; returns the weights (f32, as the file
    stores them after dequantization) and the spec."""
    s = _spec(arch)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(s["n_layers"])
    w.add_context_length(4096)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(FF)
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_kv"])
    w.add_key_length(s["hd"])
    w.add_value_length(s["hd"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(s["base"])
    w.add_vocab_size(VOCAB)
    if s["window"]:
        w.add_sliding_window(s["window"])
    weights: dict[str, np.ndarray] = {}
    qtypes = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0]

    def add(name, shape, scale=0.2, qtype=Q.F32, offset=0.0):
        a = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if qtype == Q.F32 or len(shape) == 1:
            w.add_tensor(name, a)
            weights[name] = a
        elif qtype == Q.F16:
            a16 = a.astype(np.float16)
            w.add_tensor(name, a16)
            weights[name] = a16.astype(np.float32)
        else:
            raw = quants.quantize(a, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            weights[name] = quants.dequantize(raw, qtype).reshape(shape).astype(np.float32)

    H, K, D = s["n_head"], s["n_kv"], s["hd"]
    add("token_embd.weight", (VOCAB, EMBD), 1.0 if not s["embed_scale"] else 0.1, Q.Q8_0)
    add("output_norm.weight", (EMBD,), 0.1, offset=1.0)
    if not s["tied"]:
        add("output.weight", (VOCAB, EMBD), 0.2, Q.F16)
    if s.get("freq_factors"):
        factors = np.linspace(1, 4, D // 2).astype(np.float32)
        w.add_tensor("rope_freqs.weight", factors)
        weights["rope_freqs.weight"] = factors
    for il in range(s["n_layers"]):
        p = f"blk.{il}."
        qt = qtypes[il % len(qtypes)]
        add(p + "attn_norm.weight", (EMBD,), 0.1, offset=1.0)
        add(p + "attn_q.weight", (H * D, EMBD), 0.15, qt)
        add(p + "attn_k.weight", (K * D, EMBD), 0.15, qt)
        add(p + "attn_v.weight", (K * D, EMBD), 0.15, qt)
        if s["bias"]:
            add(p + "attn_q.bias", (H * D,), 0.1)
            add(p + "attn_k.bias", (K * D,), 0.1)
            add(p + "attn_v.bias", (K * D,), 0.1)
        if s["qk_norm"]:
            add(p + "attn_q_norm.weight", (D,), 0.1, offset=1.0)
            add(p + "attn_k_norm.weight", (D,), 0.1, offset=1.0)
        add(p + "attn_output.weight", (EMBD, H * D), 0.15, qt)
        if s["post_norms"]:
            add(p + "post_attention_norm.weight", (EMBD,), 0.1, offset=1.0)
            add(p + "post_ffw_norm.weight", (EMBD,), 0.1, offset=1.0)
        add(p + "ffn_norm.weight", (EMBD,), 0.1, offset=1.0)
        add(p + "ffn_gate.weight", (FF, EMBD), 0.15, qt)
        add(p + "ffn_up.weight", (FF, EMBD), 0.15, qt)
        add(p + "ffn_down.weight", (EMBD, FF), 0.15, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"w": weights, "spec": s}


# ---- an independent dense float64 reference -------------------------------------------------

def _rms(x, wt, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * wt


def _rope(x, pos, base, style, factors=None):
    n, h, d = x.shape
    half = d // 2
    inv = base ** (-np.arange(half) * 2.0 / d)
    if factors is not None:
        inv = inv / factors
    ang = pos[:, None, None] * inv[None, None, :]
    if style == "neox":
        z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * ang)
        return np.concatenate([z.real, z.imag], -1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * ang)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def reference_logits(model_data: dict, tokens: np.ndarray) -> np.ndarray:
    W, s = model_data["w"], model_data["spec"]
    W = {k: v.astype(np.float64) for k, v in W.items()}
    H, K, D = s["n_head"], s["n_kv"], s["hd"]
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][tokens] * (math.sqrt(EMBD) if s["embed_scale"] else 1.0)
    for il in range(s["n_layers"]):
        p = f"blk.{il}."
        is_swa = bool(s["window"]) and il % 6 < 5
        base = s["base_swa"] if is_swa else s["base"]
        h = _rms(x, W[p + "attn_norm.weight"])
        q = h @ W[p + "attn_q.weight"].T
        k = h @ W[p + "attn_k.weight"].T
        v = h @ W[p + "attn_v.weight"].T
        if s["bias"]:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(n, H, D), k.reshape(n, K, D), v.reshape(n, K, D)
        if s["qk_norm"]:
            q, k = _rms(q, W[p + "attn_q_norm.weight"]), _rms(k, W[p + "attn_k_norm.weight"])
        ff = W.get("rope_freqs.weight")
        q, k = _rope(q, pos, base, s["rope"], ff), _rope(k, pos, base, s["rope"], ff)
        att = np.zeros((n, H, D))
        for i in range(n):
            for hh in range(H):
                kv = hh // (H // K)
                sc = k[: i + 1, kv] @ q[i, hh] / math.sqrt(D)
                if is_swa:
                    sc[: max(0, i - s["window"] + 1)] = -np.inf
                pr = np.exp(sc - sc.max())
                att[i, hh] = (pr / pr.sum()) @ v[: i + 1, kv]
        o = att.reshape(n, H * D) @ W[p + "attn_output.weight"].T
        if s["post_norms"]:
            o = _rms(o, W[p + "post_attention_norm.weight"])
        x = x + o
        h = _rms(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        if s["act"] == "gelu":
            a = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
        else:
            a = g / (1 + np.exp(-g)) * u
        y = a @ W[p + "ffn_down.weight"].T
        if s["post_norms"]:
            y = _rms(y, W[p + "post_ffw_norm.weight"])
        x = x + y
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"]) @ out.T


# ---- fixtures and helpers -------------------------------------------------------------------

ARCHS = ["gemma3", "qwen3", "qwen2", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    data = write_tiny(path, request.param)
    return load_model(path), data


def _rel(a, b):
    """max over positions of |a - b| / max|b| at that position."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return float((np.abs(a - b).max(-1) / np.abs(b).max(-1)).max())


# The checks at 1e-4 against the float64 reference (and between orders of the same f32
# arithmetic) pin an f32 pool: the default f16 pool rounds K/V by up to 2^-11 relative, ~1e-3
# in these logits (`test_f16_kv_cache_close` bounds that).
KV = "f32"


def _run_chunks(model, tokens, sizes, *, block_size=4, shuffle=False, seed=0, kv_dtype=KV):
    """Prefill `tokens` in chunks of the given sizes (cycling), logits 'all'; returns
    [n, vocab]."""
    n = len(tokens)
    nb = -(-n // block_size) + 2
    table = np.random.default_rng(seed).permutation(nb + 5)[:nb] if shuffle else np.arange(nb)
    cache = model.new_cache(nb + 5, block_size, kv_dtype=kv_dtype)
    out, pos, i = [], 0, 0
    while pos < n:
        c = sizes[i % len(sizes)]
        i += 1
        (lg,) = model.forward([SeqChunk(tokens[pos : pos + c], pos, table, logits="all")], cache)
        out.append(lg)
        pos += c
    return np.concatenate(out)


TOKENS = np.random.default_rng(5).integers(0, VOCAB, 40).astype(np.int32)


# ---- tests ---------------------------------------------------------------------------------

def test_matches_dense_reference(tiny):
    model, data = tiny
    ref = reference_logits(data, TOKENS)
    got = _run_chunks(model, TOKENS, [len(TOKENS)])
    assert _rel(got, ref) < 1e-4


@pytest.mark.parametrize("sizes", [[1], [7], [3, 11, 1, 5], [64], [1000]])
def test_chunked_prefill_matches_one_shot(tiny, sizes):
    model, _ = tiny
    one = _run_chunks(model, TOKENS, [len(TOKENS)])
    got = _run_chunks(model, TOKENS, sizes, shuffle=True, seed=len(sizes))
    assert _rel(got, one) < 1e-4


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_parallel_steps_match_the_reference(tiny, threads):
    """Big steps run as row-parallel parts (ops.parallel) for any thread count; a chunk that
    wants no logits still stores the last layer's K/V (the next chunk reads it)."""
    from kvshare.backend import set_cpu_threads

    model, data = tiny
    tokens = np.random.default_rng(6).integers(0, VOCAB, 120).astype(np.int32)
    ref = reference_logits(data, tokens)
    try:
        set_cpu_threads(threads)
        nb = 40
        cache = model.new_cache(nb, 4, kv_dtype=KV)
        table = np.random.default_rng(threads).permutation(nb)[:31]
        model.forward([SeqChunk(tokens[:50], 0, table, logits="none")], cache)
        (tail,) = model.forward([SeqChunk(tokens[50:], 50, table, logits="all")], cache)
        assert _rel(tail, ref[50:]) < 1e-4
    finally:
        set_cpu_threads(None)


def test_decode_after_prefill_and_last_logits(tiny):
    model, _ = tiny
    one = _run_chunks(model, TOKENS, [len(TOKENS)])
    cache = model.new_cache(16, 4, kv_dtype=KV)
    table = np.arange(15, 4, -1)  # descending ids: never a contiguous run
    (last,) = model.forward([SeqChunk(TOKENS[:25], 0, table, logits="last")], cache)
    assert last.shape == (1, VOCAB)
    assert _rel(last, one[24]) < 1e-4
    for p in range(25, len(TOKENS)):
        (lg,) = model.forward([SeqChunk(TOKENS[p : p + 1], p, table, logits="last")], cache)
        assert _rel(lg, one[p]) < 1e-4


def test_batched_sequences_match_separate_runs(tiny):
    model, _ = tiny
    a, b = TOKENS, TOKENS[::-1][:23].copy()
    ref_a = _run_chunks(model, a, [len(a)])
    ref_b = _run_chunks(model, b, [len(b)])
    cache = model.new_cache(40, 4, kv_dtype=KV)
    ta, tb = np.arange(0, 40, 2)[:11], np.arange(1, 40, 2)[:7]  # interleaved blocks
    # step 1: a prefill chunk of a, all of b's prompt but its last token; step 2: mixed
    out1 = model.forward([SeqChunk(a[:17], 0, ta, logits="all"),
                          SeqChunk(b[:22], 0, tb, logits="none")], cache)
    assert out1[1] is None
    out2 = model.forward([SeqChunk(b[22:23], 22, tb, logits="last"),
                          SeqChunk(a[17:40], 17, ta, logits="all")], cache)
    assert _rel(out1[0], ref_a[:17]) < 1e-4
    assert _rel(out2[1], ref_a[17:40]) < 1e-4
    assert _rel(out2[0], ref_b[22]) < 1e-4


def test_f16_kv_cache_close(tiny):
    model, _ = tiny
    one = _run_chunks(model, TOKENS, [len(TOKENS)])
    got = _run_chunks(model, TOKENS, [5], kv_dtype="f16")
    assert _rel(got, one) < 2e-2


def test_no_logits_requested(tiny):
    model, _ = tiny
    cache = model.new_cache(16, 4)
    assert model.forward([SeqChunk(TOKENS[:9], 0, np.arange(3), logits="none")], cache) == [None]


def test_bad_inputs(tiny):
    model, _ = tiny
    cache = model.new_cache(4, 4)
    with pytest.raises(IndexError):  # the block table cannot hold the positions
        model.forward([SeqChunk(TOKENS[:9], 0, np.arange(2))], cache)
    with pytest.raises(IndexError):
        model.forward([SeqChunk([VOCAB], 0, np.arange(1))], cache)
    with pytest.raises(ValueError):
        SeqChunk([], 0, np.arange(1))


def test_prefault_populates_the_pool_and_keeps_its_contents(tiny):
    """`KVArrays.prefault` maps the host pool's pages (MADV_POPULATE_WRITE) without changing
    a byte, also while KV is being written."""
    import psutil

    model, _ = tiny
    cache = model.new_cache(4096, 16)  # a few MB per layer: big enough to see in RSS
    cache.kv[0, 1, 7] = 2.5
    before = psutil.Process().memory_info().rss
    t = cache.prefault()
    cache.kv[-1, 0, 4000] = -1.0  # written while the pages are being populated
    t.join()
    if cache.prefaulted is False:
        pytest.skip("MADV_POPULATE_WRITE not supported by this kernel")
    assert cache.prefaulted is True
    grown = psutil.Process().memory_info().rss - before
    assert grown >= 0.5 * cache.kv.nbytes, (grown, cache.kv.nbytes)
    assert (cache.kv[0, 1, 7] == 2.5).all() and (cache.kv[-1, 0, 4000] == -1.0).all()
    assert np.count_nonzero(cache.kv) == cache.kv[0, 1, 7].size + cache.kv[-1, 0, 4000].size


def test_cache_block_moves(tiny):
    model, _ = tiny
    cache = model.new_cache(8, 4)
    model.forward([SeqChunk(TOKENS[:8], 0, np.array([3, 5]), logits="none")], cache)
    blk = cache.read_block(5)
    assert blk.shape == cache.block_shape and blk.nbytes == cache.block_nbytes
    cache.copy_block(5, 6, n_tokens=2)
    np.testing.assert_array_equal(cache.read_block(6)[:, :, :2], blk[:, :, :2])
    assert not cache.read_block(6)[:, :, 2:].any()
    cache.write_block(7, blk)
    np.testing.assert_array_equal(cache.read_block(7), blk)
    # a sequence that continues from the copied blocks sees the same state
    (x,) = model.forward([SeqChunk(TOKENS[8:9], 8, np.array([3, 7, 1]), logits="last")], cache)
    cache2 = model.new_cache(8, 4)
    model.forward([SeqChunk(TOKENS[:8], 0, np.array([0, 1]), logits="none")], cache2)
    (y,) = model.forward([SeqChunk(TOKENS[8:9], 8, np.array([0, 1, 2]), logits="last")], cache2)
    assert _rel(x, y) < 1e-5
    assert model.kv_bytes_per_token(cache.kv_dtype) * 4 == cache.block_nbytes
    with pytest.raises(ValueError):
        cache.write_block(0, blk[:1])


def test_unsupported_and_corrupt(tmp_path):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="supported: .*gemma3"):
        load_model(path)
    good = tmp_path / "g.gguf"
    write_tiny(good, "qwen3")
    data = good.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError):
        load_model(tmp_path / "trunc.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError):
        load_model(tmp_path / "junk.gguf")
    with pytest.raises(GGUFError):
        load_model(tmp_path / "missing.gguf")
