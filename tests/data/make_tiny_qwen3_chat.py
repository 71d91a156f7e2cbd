"""Write tests/data/models/tiny-qwen3-chat.gguf: a tiny attention-only `qwen3` model with random
weights and a real tokenizer (the 367-token SentencePiece vocabulary and the ChatML template
copied from tiny-qwen35.gguf). It loads in milliseconds, so the tier integration tests can
restart (and kill -9) `kvshare serve` dozens of times.

    python tests/data/make_tiny_qwen3_chat.py        # regenerates the file (deterministic)

The weights are seeded, so the file (and therefore the model fingerprint) is byte-identical on
every run. Float32 throughout, about 0.5 MB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "models" / "tiny-qwen35.gguf"
TARGET = HERE / "models" / "tiny-qwen3-chat.gguf"

N_LAYERS, N_HEAD, N_KV, HEAD_DIM, EMBD, FF = 2, 4, 2, 16, 64, 96


def _tokenizer_metadata() -> dict:
    sys.path.insert(0, str(HERE.parents[1] / "python"))
    from kvshare.model.gguf_file import GGUFFile

    meta = GGUFFile(SOURCE).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def _add_kv(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        if key.endswith("token_type"):
            w.add_array(key, [int(v) for v in value])  # INT32, as llama.cpp writes it
        elif key.endswith("scores"):
            w.add_key_value(key, [float(v) for v in value], GGUFValueType.ARRAY,
                            sub_type=GGUFValueType.FLOAT32)
        else:
            w.add_array(key, list(value))
    else:
        raise TypeError(f"{key}: cannot copy a {type(value).__name__}")


def write(path: Path = TARGET, seed: int = 1234) -> Path:
    tok = _tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "qwen3")
    w.add_name("tiny-qwen3-chat-random")
    w.add_block_count(N_LAYERS)
    w.add_context_length(32768)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(vocab)
    for key, value in tok.items():
        _add_kv(w, key, value)

    def add(name, shape, scale=0.2, offset=0.0):
        a = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        w.add_tensor(name, a)

    add("token_embd.weight", (vocab, EMBD), 1.0)
    add("output_norm.weight", (EMBD,), 0.1, offset=1.0)
    # Larger output weights: peaked logits, so greedy choices are far from ties.
    add("output.weight", (vocab, EMBD), 0.5)
    for il in range(N_LAYERS):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (EMBD,), 0.1, offset=1.0)
        add(p + "attn_q.weight", (N_HEAD * HEAD_DIM, EMBD), 0.15)
        add(p + "attn_k.weight", (N_KV * HEAD_DIM, EMBD), 0.15)
        add(p + "attn_v.weight", (N_KV * HEAD_DIM, EMBD), 0.15)
        add(p + "attn_q_norm.weight", (HEAD_DIM,), 0.1, offset=1.0)
        add(p + "attn_k_norm.weight", (HEAD_DIM,), 0.1, offset=1.0)
        add(p + "attn_output.weight", (EMBD, N_HEAD * HEAD_DIM), 0.15)
        add(p + "ffn_norm.weight", (EMBD,), 0.1, offset=1.0)
        add(p + "ffn_gate.weight", (FF, EMBD), 0.15)
        add(p + "ffn_up.weight", (FF, EMBD), 0.15)
        add(p + "ffn_down.weight", (EMBD, FF), 0.15)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    out = write(Path(sys.argv[1]) if len(sys.argv) > 1 else TARGET)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
