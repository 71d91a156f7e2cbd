"""scripts/make_random_gguf.py: the tiny qwen3 size is written with llama.cpp's Q4_K_M mix of
block formats, is byte-identical for a seed, loads in kvshare with its copied tokenizer and
chat template, and computes finite logits."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, quants

from kvshare.model.batch import SeqChunk
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.gguf_file import GGUFFile
from kvshare.model.loader import block_formats, load_model
from kvshare.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"


def _script():
    spec = importlib.util.spec_from_file_location("make_random_gguf",
                                                  ROOT / "scripts" / "make_random_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen():
    return _script()


@pytest.fixture(scope="module")
def tiny(gen, tmp_path_factory):
    path = tmp_path_factory.mktemp("rand") / "tiny.gguf"
    info = gen.write(path, "qwen3", "tiny", TOKENIZER, seed=0)
    return path, info


def test_use_more_bits_matches_llama_cpp(gen):
    # llama.cpp's Q4_K_M on a 28-layer model: attn_v / ffn_down Q6_K in layers 0-2, 5, 8, ...,
    # 23, 24-27 (first and last eighth, every third between)
    more = [il for il in range(28) if gen.use_more_bits(il, 28)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert [il for il in range(2) if gen.use_more_bits(il, 2)] == [1]


def test_tensor_types_and_metadata(tiny):
    path, info = tiny
    gf = GGUFFile(path)
    try:
        t = {name: ti.qtype for name, ti in gf.tensors.items()}
        md = gf.metadata
        shapes = {name: ti.numpy_shape for name, ti in gf.tensors.items()}
    finally:
        gf.close()
    vocab = len(md["tokenizer.ggml.tokens"])
    assert vocab == info["vocab"] == 367
    assert md["general.architecture"] == "qwen3"
    assert md["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert md["qwen3.block_count"] == 2 and md["qwen3.embedding_length"] == 256
    assert md["qwen3.attention.head_count"] == 4 and md["qwen3.attention.head_count_kv"] == 2
    assert md["qwen3.attention.key_length"] == 64
    assert md["qwen3.rope.freq_base"] == pytest.approx(1e6)
    assert md["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert "tokenizer.chat_template" in md
    # tied: the embedding is the output head, quantized as it (Q6_K)
    assert "output.weight" not in t and t["token_embd.weight"] == Q.Q6_K
    assert shapes["token_embd.weight"] == (vocab, 256)
    for il, more in ((0, False), (1, True)):
        p = f"blk.{il}."
        assert t[p + "attn_v.weight"] == t[p + "ffn_down.weight"] == (Q.Q6_K if more else Q.Q4_K)
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert t[p + n + ".weight"] == Q.Q4_K
        for n in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm"):
            assert t[p + n + ".weight"] == Q.F32
    assert shapes["blk.0.attn_q_norm.weight"] == (64,)
    assert shapes["blk.0.ffn_down.weight"] == (256, 768)
    gf = GGUFFile(path)
    try:
        assert set(block_formats(gf)) == {"Q4_K", "Q6_K", "F32"}
    finally:
        gf.close()


def test_blocks_are_valid_and_small(tiny):
    """Every quantized tensor dequantizes (gguf's reference) to finite values with a std near
    0.02 and a mean near 0; norms are 1."""
    path, _ = tiny
    gf = GGUFFile(path)
    try:
        for name, ti in gf.tensors.items():
            x = np.array(quants.dequantize(np.array(gf.raw(name)), ti.qtype), np.float32)
            assert np.isfinite(x).all(), name
            if ti.qtype == Q.F32:
                assert (x == 1.0).all(), name
            else:
                assert 0.01 < float(x.std()) < 0.04, name
                assert abs(float(x.mean())) < 0.005, name
    finally:
        gf.close()


def test_deterministic(gen, tiny, tmp_path):
    path, _ = tiny
    again = tmp_path / "again.gguf"
    gen.write(again, "qwen3", "tiny", TOKENIZER, seed=0)
    assert again.read_bytes() == Path(path).read_bytes()
    other = tmp_path / "other.gguf"
    gen.write(other, "qwen3", "tiny", TOKENIZER, seed=1)
    assert other.read_bytes() != Path(path).read_bytes()


def test_loads_and_computes_finite_logits(tiny):
    path, _ = tiny
    model = load_model(path)
    cfg = model.config
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim,
            cfg.n_ff, cfg.vocab_size) == ("qwen3", 2, 256, 4, 2, 64, 768, 367)
    assert cfg.rope_base == pytest.approx(1e6)
    tok = Tokenizer.from_gguf(path)
    template = ChatTemplate.from_gguf(path, tok)
    ids = tok.encode(template.render([{"role": "user", "content": "hello there"}]))
    assert len(ids) > 4
    cache = model.new_cache(8, 16)
    table = np.arange(-(-len(ids) // 16))
    (logits,) = model.forward([SeqChunk(ids, 0, table, logits="all")], cache)
    assert logits.shape == (len(ids), 367)
    assert np.isfinite(logits).all()
    assert float(logits.std()) > 1e-3  # not degenerate
    # one decode step after the prompt
    (last,) = model.forward([SeqChunk([int(logits[-1].argmax())], len(ids),
                                      np.arange(-(-(len(ids) + 1) // 16)))], cache)
    assert last.shape == (1, 367) and np.isfinite(last).all()


def test_cli_rejects_unknown_size(gen, tmp_path):
    with pytest.raises(SystemExit):
        gen.main(["--size", "70b", "--out", str(tmp_path / "x.gguf")])
