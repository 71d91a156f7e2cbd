"""scripts/make_random_gguf.py: the tiny qwen3 size is written with llama.cpp's Q4_K_M mix of
block formats, is byte-identical for a seed, loads in kvshare with its copied tokenizer and
chat template, and computes finite logits. The tiny gpt-oss size has the tensors, metadata
and formats of gpt-oss's MXFP4 GGUFs (the shipped tiny-gpt-oss.gguf's names and keys; Q8_0
matrices, MXFP4 experts), loads as a GptOssModel and computes finite logits; the 20b plan is
gpt-oss-20b-mxfp4.gguf's 459 tensors and 11.27 GiB. The tiny lfm2moe size has the shipped
tiny-lfm2moe.gguf's tensor names and metadata keys (the per-layer head_count_kv array, 0 for
the short-conv layers), in the Q4_K_M mix, loads as an Lfm2MoeModel and computes finite
logits; the 8b-a1b plan has LFM2-8B-A1B's 256 tensors and 5.04 GB (its Q4_K_M file: ~5.0 GB)."""

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
from kvshare.model.gpt_oss import GptOssModel
from kvshare.model.lfm2moe import Lfm2MoeModel
from kvshare.model.loader import block_formats, load_model
from kvshare.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"
TINY_GPT_OSS = ROOT / "tests" / "data" / "models" / "tiny-gpt-oss.gguf"
TINY_LFM2MOE = ROOT / "tests" / "data" / "models" / "tiny-lfm2moe.gguf"


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


# ----------------------------------------------------------------------------- gpt-oss


@pytest.fixture(scope="module")
def gpt_oss_tiny(gen, tmp_path_factory):
    path = tmp_path_factory.mktemp("rand") / "gpt-oss-tiny.gguf"
    info = gen.write(path, "gpt-oss", "tiny", TOKENIZER, seed=0)
    return path, info


def _read(path):
    gf = GGUFFile(path)
    try:
        return (dict(gf.metadata), {n: ti.qtype for n, ti in gf.tensors.items()},
                {n: ti.numpy_shape for n, ti in gf.tensors.items()})
    finally:
        gf.close()


def test_gpt_oss_tiny_tensors_and_metadata(gpt_oss_tiny):
    path, info = gpt_oss_tiny
    md, t, shapes = _read(path)
    vocab = len(md["tokenizer.ggml.tokens"])
    assert vocab == info["vocab"] == 367
    assert md["general.architecture"] == "gpt-oss"
    assert md["general.file_type"] == 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    p = "gpt-oss."
    assert md[p + "block_count"] == 2 and md[p + "embedding_length"] == 256
    assert md[p + "attention.head_count"] == 8 and md[p + "attention.head_count_kv"] == 2
    assert md[p + "attention.key_length"] == md[p + "attention.value_length"] == 64
    assert md[p + "attention.sliding_window"] == 128
    assert md[p + "rope.scaling.type"] == "yarn"
    assert md[p + "rope.scaling.factor"] == pytest.approx(32.0)
    assert md[p + "rope.scaling.original_context_length"] == 4096
    assert md[p + "rope.freq_base"] == pytest.approx(150000.0)
    assert md[p + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert (md[p + "expert_count"], md[p + "expert_used_count"],
            md[p + "expert_feed_forward_length"]) == (8, 2, 256)
    # the names and keys of the shipped gpt-oss test model (scripts/make_tiny_gpt_oss.py,
    # which also writes rope.dimension_count, absent from gpt-oss's GGUFs: head_dim is it)
    ref_md, ref_t, _ = _read(TINY_GPT_OSS)
    assert set(t) == {n for n in ref_t if not n.startswith(("blk.2.", "blk.3."))}
    assert ({k for k in md if k.startswith(p)}
            == {k for k in ref_md if k.startswith(p)} - {p + "rope.dimension_count"})
    assert len(t) == info["tensors"] == 2 * 19 + 3
    # formats: ggml-org's MXFP4 release
    assert t["token_embd.weight"] == t["output.weight"] == Q.Q8_0
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (vocab, 256)
    for il in range(2):
        b = f"blk.{il}."
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            assert t[b + n + ".weight"] == Q.Q8_0, n
        for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert t[b + n + ".weight"] == Q.MXFP4, n
        for n in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
                  "attn_sinks.weight", "attn_norm.weight", "post_attention_norm.weight",
                  "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
                  "ffn_up_exps.bias", "ffn_down_exps.bias"):
            assert t[b + n] == Q.F32, n
    assert shapes["blk.0.attn_q.weight"] == (8 * 64, 256)
    assert shapes["blk.0.attn_k.weight"] == shapes["blk.0.attn_v.weight"] == (2 * 64, 256)
    assert shapes["blk.0.attn_output.weight"] == (256, 8 * 64)
    assert shapes["blk.0.attn_sinks.weight"] == (8,)
    assert shapes["blk.1.ffn_gate_inp.weight"] == (8, 256)
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (
        8, 256, 256)
    assert shapes["blk.1.ffn_down_exps.weight"] == (8, 256, 256)
    assert shapes["blk.1.ffn_up_exps.bias"] == shapes["blk.1.ffn_down_exps.bias"] == (8, 256)


def test_gpt_oss_blocks_are_valid_and_small(gpt_oss_tiny):
    """Every Q8_0 / MXFP4 matrix dequantizes (gguf's reference) to finite values of std near
    0.02 and mean near 0; norms are 1, biases small, sinks and the router finite."""
    path, _ = gpt_oss_tiny
    gf = GGUFFile(path)
    try:
        seen = set()
        for name, ti in gf.tensors.items():
            x = np.array(quants.dequantize(np.array(gf.raw(name)), ti.qtype), np.float32)
            assert np.isfinite(x).all(), name
            seen.add(ti.qtype)
            if ti.qtype in (Q.Q8_0, Q.MXFP4):
                assert 0.01 < float(x.std()) < 0.04, name
                assert abs(float(x.mean())) < 0.005, name
            elif name.endswith("norm.weight"):
                assert (x == 1.0).all(), name
            elif name.endswith(".bias"):
                assert 0.01 < float(x.std()) < 0.04, name
            elif "attn_sinks" in name:
                assert 0.0 < float(x.std()) < 2.0, name
            else:
                assert "ffn_gate_inp" in name, name
                assert 0.05 < float(x.std()) < 0.25, name  # 2 / sqrt(256)
        assert seen == {Q.Q8_0, Q.MXFP4, Q.F32}
    finally:
        gf.close()


def test_gpt_oss_deterministic(gen, gpt_oss_tiny, tmp_path):
    path, _ = gpt_oss_tiny
    again = tmp_path / "again.gguf"
    gen.write(again, "gpt-oss", "tiny", TOKENIZER, seed=0)
    assert again.read_bytes() == Path(path).read_bytes()
    other = tmp_path / "other.gguf"
    gen.write(other, "gpt-oss", "tiny", TOKENIZER, seed=1)
    assert other.read_bytes() != Path(path).read_bytes()


def test_gpt_oss_loads_and_computes_finite_logits(gpt_oss_tiny):
    path, info = gpt_oss_tiny
    assert Path(path).stat().st_size == info["file_bytes"] < 3 * 2**20
    model = load_model(path, "cpu")
    assert isinstance(model, GptOssModel)
    cfg = model.config
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim,
            cfg.vocab_size) == ("gpt-oss", 2, 256, 8, 2, 64, 367)
    assert cfg.layer_windows == (128, 0) and cfg.sliding_window == 128
    assert cfg.activation == "swiglu_oai" and not cfg.tied_embeddings
    assert cfg.rope_base == pytest.approx(150000.0)
    assert cfg.extra["expert_count"] == 8 and cfg.extra["expert_used_count"] == 2
    yarn = cfg.extra["yarn"]
    assert yarn["freq_scale"] == pytest.approx(1 / 32) and yarn["n_ctx_orig"] == 4096
    assert model.yarn is not None
    for layer in model.layers:
        assert layer.sinks.shape == (8,) and layer.bo.shape == (256,)
        assert layer.moe.routing.n_expert == 8 and layer.moe.routing.k == 2
    ids = list(range(3, 23))
    cache = model.new_cache(8, 16)
    (logits,) = model.forward([SeqChunk(ids, 0, np.arange(2), logits="all")], cache)
    assert logits.shape == (len(ids), 367)
    assert np.isfinite(logits).all()
    assert float(logits.std()) > 1e-3  # not degenerate
    (last,) = model.forward([SeqChunk([int(logits[-1].argmax())], len(ids), np.arange(2))],
                            cache)
    assert last.shape == (1, 367) and np.isfinite(last).all()


def test_gpt_oss_20b_plan_matches_the_mxfp4_release(gen):
    """gpt-oss-20b's plan at o200k's 201088 tokens: gpt-oss-20b-mxfp4.gguf's 459 tensors,
    20.91 B parameters and 11.27 GiB of tensor data (llama.cpp's `model size`), computed
    from the plan without writing it."""
    s = gen.SIZES["gpt-oss"]["20b"]
    assert (s.n_layers, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_expert,
            s.n_expert_used, s.n_ff_exp, s.sliding_window, s.context_length) == (
        24, 2880, 64, 8, 64, 32, 4, 2880, 128, 131072)
    assert (s.yarn_factor, s.yarn_orig_ctx, s.rope_base, s.rms_eps, s.tied) == (
        32.0, 4096, 150000.0, 1e-5, False)
    plan = gen.tensor_plan("gpt-oss", s, 201088)
    assert len(plan) == 459 == 24 * 19 + 3
    shapes = {n: shape for n, shape, _ in plan}
    types = {n: q for n, _, q in plan}
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (201088, 2880)
    assert shapes["blk.23.attn_q.weight"] == (4096, 2880)
    assert shapes["blk.23.attn_k.weight"] == shapes["blk.23.attn_v.weight"] == (512, 2880)
    assert shapes["blk.23.attn_output.weight"] == (2880, 4096)
    assert shapes["blk.23.attn_sinks.weight"] == (64,)
    assert shapes["blk.23.ffn_gate_inp.weight"] == (32, 2880)
    for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert shapes[f"blk.23.{n}.weight"] == (32, 2880, 2880)
        assert types[f"blk.23.{n}.weight"] == Q.MXFP4
    assert shapes["blk.23.ffn_down_exps.bias"] == (32, 2880)
    count = {q: sum(t == q for t in types.values()) for q in set(types.values())}
    assert count == {Q.MXFP4: 72, Q.Q8_0: 4 * 24 + 2, Q.F32: 12 * 24 + 1}
    params = sum(int(np.prod(shape)) for shape in shapes.values())
    assert params / 1e9 == pytest.approx(20.91, abs=0.005)
    nbytes = gen.plan_bytes(plan)
    assert nbytes / 2**30 == pytest.approx(11.27, abs=0.01)
    experts = sum(gen.tensor_nbytes(shapes[n], q) for n, q in types.items() if q == Q.MXFP4)
    assert experts == 72 * 32 * 2880 * (2880 // 32) * 17  # 17 bytes per 32 elements


def test_cli_gpt_oss_sizes(gen, tmp_path):
    with pytest.raises(SystemExit):  # a qwen3 size is not a gpt-oss size
        gen.main(["--arch", "gpt-oss", "--size", "1.5b", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()


# ----------------------------------------------------------------------------- lfm2moe


@pytest.fixture(scope="module")
def lfm2moe_tiny(gen, tmp_path_factory):
    path = tmp_path_factory.mktemp("rand") / "lfm2moe-tiny.gguf"
    info = gen.write(path, "lfm2moe", "tiny", TOKENIZER, seed=0)
    return path, info


def test_lfm2moe_tiny_tensors_and_metadata(lfm2moe_tiny):
    path, info = lfm2moe_tiny
    md, t, shapes = _read(path)
    vocab = len(md["tokenizer.ggml.tokens"])
    assert vocab == info["vocab"] == 367
    assert md["general.architecture"] == "lfm2moe"
    assert md["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    p = "lfm2moe."
    assert md[p + "block_count"] == 4 and md[p + "embedding_length"] == 256
    assert md[p + "feed_forward_length"] == 768 and md[p + "vocab_size"] == 367
    assert md[p + "attention.head_count"] == 4
    assert list(md[p + "attention.head_count_kv"]) == [0, 2, 0, 2]  # 0: short-conv layers
    assert md[p + "shortconv.l_cache"] == 3
    assert (md[p + "expert_count"], md[p + "expert_used_count"],
            md[p + "expert_feed_forward_length"], md[p + "leading_dense_block_count"],
            md[p + "expert_gating_func"]) == (8, 2, 256, 1, 2)  # 2: sigmoid
    assert md[p + "rope.freq_base"] == pytest.approx(1e6)
    assert md[p + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    # the names and keys of the shipped test model (scripts/make_tiny_lfm2moe.py: the same
    # layer layout, short-conv 0 and 2, attention 1 and 3, one leading dense layer)
    ref_md, ref_t, ref_shapes = _read(TINY_LFM2MOE)
    assert set(t) == set(ref_t)
    assert list(t) == list(ref_t)  # and their order
    assert {k for k in md if k.startswith(p)} == {k for k in ref_md if k.startswith(p)}
    assert len(t) == info["tensors"] == 46
    for name, shape in ref_shapes.items():  # the same dims, scaled to hidden 256
        assert len(shapes[name]) == len(shape), name
    # formats: llama.cpp's Q4_K_M mix
    assert t["token_embd.weight"] == Q.Q6_K and "output.weight" not in t  # tied
    assert shapes["token_embd.weight"] == (vocab, 256)
    assert t["token_embd_norm.weight"] == Q.F32
    for il in (0, 2):
        b = f"blk.{il}."
        assert t[b + "shortconv.conv.weight"] == Q.F32
        assert shapes[b + "shortconv.conv.weight"] == (256, 3)  # GGUF [3, 256]
        assert t[b + "shortconv.in_proj.weight"] == t[b + "shortconv.out_proj.weight"] == Q.Q4_K
        assert shapes[b + "shortconv.in_proj.weight"] == (3 * 256, 256)
    for il in (1, 3):  # attn_v: Q6_K where use_more_bits(attention index, 2 attention layers)
        b = f"blk.{il}."
        for n in ("attn_q", "attn_k", "attn_output"):
            assert t[b + n + ".weight"] == Q.Q4_K, n
        assert t[b + "attn_v.weight"] == (Q.Q6_K if il == 3 else Q.Q4_K)
        assert shapes[b + "attn_k.weight"] == shapes[b + "attn_v.weight"] == (2 * 64, 256)
        assert shapes[b + "attn_q_norm.weight"] == (64,)
    assert t["blk.0.ffn_gate.weight"] == t["blk.0.ffn_up.weight"] == Q.Q4_K
    assert t["blk.0.ffn_down.weight"] == Q.Q4_K  # use_more_bits(0, 4) is false
    assert shapes["blk.0.ffn_down.weight"] == (256, 768)
    for il in (1, 2, 3):
        b = f"blk.{il}."
        assert t[b + "ffn_gate_inp.weight"] == t[b + "exp_probs_b.bias"] == Q.F32
        assert shapes[b + "ffn_gate_inp.weight"] == (8, 256)
        assert shapes[b + "exp_probs_b.bias"] == (8,)
        assert t[b + "ffn_gate_exps.weight"] == t[b + "ffn_up_exps.weight"] == Q.Q4_K
        # use_more_bits(il, 4 layers): 2 and 3
        assert t[b + "ffn_down_exps.weight"] == (Q.Q6_K if il in (2, 3) else Q.Q4_K)
        assert shapes[b + "ffn_up_exps.weight"] == (8, 256, 256)
        assert shapes[b + "ffn_down_exps.weight"] == (8, 256, 256)
    for name, q in t.items():
        if len(shapes[name]) == 1:
            assert q == Q.F32, name


def test_lfm2moe_blocks_are_valid_and_small(lfm2moe_tiny):
    path, _ = lfm2moe_tiny
    gf = GGUFFile(path)
    try:
        for name, ti in gf.tensors.items():
            x = np.array(quants.dequantize(np.array(gf.raw(name)), ti.qtype), np.float32)
            assert np.isfinite(x).all(), name
            if ti.qtype in (Q.Q4_K, Q.Q6_K):
                assert 0.01 < float(x.std()) < 0.04, name
                assert abs(float(x.mean())) < 0.005, name
            elif name.endswith("norm.weight"):
                assert (x == 1.0).all(), name
            elif name.endswith("exp_probs_b.bias"):
                assert 0.005 < float(x.std()) < 0.05, name
            elif "shortconv.conv" in name:
                assert 0.3 < float(x.std()) < 0.9, name  # 1 / sqrt(3)
            else:
                assert "ffn_gate_inp" in name, name
                assert 0.05 < float(x.std()) < 0.25, name  # 2 / sqrt(256)
    finally:
        gf.close()


def test_lfm2moe_deterministic(gen, lfm2moe_tiny, tmp_path):
    path, _ = lfm2moe_tiny
    again = tmp_path / "again.gguf"
    gen.write(again, "lfm2moe", "tiny", TOKENIZER, seed=0)
    assert again.read_bytes() == Path(path).read_bytes()


def test_lfm2moe_loads_and_computes_finite_logits(lfm2moe_tiny):
    path, info = lfm2moe_tiny
    assert Path(path).stat().st_size == info["file_bytes"] < 4 * 2**20
    model = load_model(path, "cpu")
    assert isinstance(model, Lfm2MoeModel)
    cfg = model.config
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim,
            cfg.n_ff, cfg.vocab_size) == ("lfm2moe", 4, 256, 4, 2, 64, 768, 367)
    assert cfg.layer_kinds == ("recurrent", "attention", "recurrent", "attention")
    assert cfg.norm_eps == pytest.approx(1e-5) and cfg.rope_base == pytest.approx(1e6)
    ex = cfg.extra
    assert (ex["expert_count"], ex["expert_used_count"], ex["expert_feed_forward_length"],
            ex["leading_dense_block_count"], ex["expert_gating_func"],
            ex["shortconv.l_cache"]) == (8, 2, 256, 1, 2, 3)
    assert model.state_shapes() == [(2, 2, 256)]  # 2 short-conv layers, L - 1 = 2 rows
    ids = list(range(3, 19))
    cache = model.new_cache(8, 16, n_state_slots=1)
    (logits,) = model.forward([SeqChunk(ids, 0, np.arange(2), logits="all", state_slot=0)],
                              cache)
    assert logits.shape == (len(ids), 367)
    assert np.isfinite(logits).all()
    assert float(logits.std()) > 1e-3  # not degenerate
    (last,) = model.forward([SeqChunk([int(logits[-1].argmax())], len(ids), np.arange(2),
                                      state_slot=0)], cache)
    assert last.shape == (1, 367) and np.isfinite(last).all()


def test_lfm2moe_8b_a1b_plan_matches_the_q4_k_m_release(gen):
    """LFM2-8B-A1B's plan at its 65536 tokens: 256 tensors, 8.34 B parameters and 5.04 GB
    (4.70 GiB) of tensor data (LFM2-8B-A1B-Q4_K_M.gguf is listed at about 5.0 GB), computed
    from the plan without writing it."""
    s = gen.SIZES["lfm2moe"]["8b-a1b"]
    assert (s.n_layers, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, s.n_expert,
            s.n_expert_used, s.n_ff_exp, s.n_dense_lead, s.conv_l_cache) == (
        24, 2048, 32, 8, 64, 7168, 32, 4, 1792, 2, 3)
    assert s.attn_layers == (2, 6, 10, 14, 18, 21)
    assert (s.rope_base, s.rms_eps, s.tied, s.context_length, int(s.gating_func)) == (
        1e6, 1e-5, True, 128000, 2)
    plan = gen.tensor_plan("lfm2moe", s, 65536)
    # embedding + its norm; per layer 2 norms, attention 6 / short conv 3, dense FFN 3 /
    # experts 5
    assert len(plan) == 256 == 2 + 24 * 2 + 6 * 6 + 18 * 3 + 2 * 3 + 22 * 5
    shapes = {n: shape for n, shape, _ in plan}
    types = {n: q for n, _, q in plan}
    assert shapes["token_embd.weight"] == (65536, 2048) and "output.weight" not in shapes
    assert shapes["blk.21.attn_k.weight"] == (512, 2048)
    assert shapes["blk.23.shortconv.conv.weight"] == (2048, 3)
    assert shapes["blk.23.shortconv.in_proj.weight"] == (6144, 2048)
    assert shapes["blk.1.ffn_down.weight"] == (2048, 7168) and "blk.2.ffn_down.weight" not in shapes
    assert shapes["blk.2.ffn_gate_exps.weight"] == (32, 1792, 2048)
    assert shapes["blk.2.ffn_down_exps.weight"] == (32, 2048, 1792)
    q6 = sorted(n for n, q in types.items() if q == Q.Q6_K)
    # attn_v: the 3rd and 6th attention layers (use_more_bits over 6); ffn_down(_exps):
    # use_more_bits over 24 layers
    assert q6 == sorted(["token_embd.weight", "blk.10.attn_v.weight", "blk.21.attn_v.weight",
                         "blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
                        + [f"blk.{il}.ffn_down_exps.weight"
                           for il in (2, 5, 8, 11, 14, 17, 20, 21, 22, 23)])
    count = {q: sum(t == q for t in types.values()) for q in set(types.values())}
    assert count == {Q.Q6_K: 15, Q.Q4_K: 118, Q.F32: 123}
    params = sum(int(np.prod(shape)) for shape in shapes.values())
    assert params / 1e9 == pytest.approx(8.34, abs=0.005)
    nbytes = gen.plan_bytes(plan)
    assert nbytes / 1e9 == pytest.approx(5.04, abs=0.01)


def test_cli_lfm2moe_sizes(gen, tmp_path):
    with pytest.raises(SystemExit):  # a qwen3 size is not an lfm2moe size
        gen.main(["--arch", "lfm2moe", "--size", "1.5b", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()
