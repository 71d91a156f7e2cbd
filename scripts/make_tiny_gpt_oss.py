#!/usr/bin/env python3
"""Write the tiny gpt-oss test model: the tokenizer (and chat template) of the tiny qwen3moe
model, random weights in the layout llama.cpp's `openai-moe` graph reads.

    python scripts/make_tiny_gpt_oss.py --out tests/data/models/tiny-gpt-oss.gguf

Layout (gpt-oss-20b's, scaled down): 4 layers, n_embd 64, 4 query heads and 2 KV heads of 32,
q/k/v/o biases, per-head attention sinks `attn_sinks.weight`, sliding window 128 on the even
layers (llama.cpp's default pattern 2), YaRN rope (factor 32 over an original context of
4,096, base 150,000, as gpt-oss's GGUFs say), `post_attention_norm` before the experts; 16
experts of FFN 64, 4 per token, in MXFP4 (`ffn_{gate,up,down}_exps`, quantized by gguf-py),
with F32 biases, a router `ffn_gate_inp` with bias; an untied output head. Dense tensors F32.

Random values: normal of std gain/sqrt(fan-in), seeded; the experts. gain (1.5) and biases
put a few gate and up values past the SwiGLU clamp (7), so the clamp is exercised.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import (GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType,
                  quants)

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "data" / "models" / "tiny-qwen3moe.gguf"
ARCH = "gpt-oss"
N_LAYER, N_HEAD, N_KV, HEAD_DIM = 4, 4, 2, 32
N_EXPERT, N_USED, FF_EXP = 16, 4, 64
WINDOW = 128


def write(out: Path, base: Path = BASE, seed: int = 0) -> None:
    r = GGUFReader(str(base))
    w = GGUFWriter(str(out), ARCH)
    for key, f in r.fields.items():
        if not key.startswith(("tokenizer.", "general.")) or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        val = f.contents()
        if key == "general.name":
            val = "tiny-gpt-oss-random"
        w.add_key_value(key, val, vtype, sub_type=sub)
    n_embd = int(r.fields["qwen3moe.embedding_length"].contents())
    w.add_block_count(N_LAYER)
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(FF_EXP)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(WINDOW)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_USED)
    w.add_expert_feed_forward_length(FF_EXP)
    rng = np.random.default_rng(seed)

    def normal(*shape, gain=1.0):
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    def vec(*shape, std=1.0):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def mxfp4(name, x):
        raw = quants.quantize(x.reshape(-1, x.shape[-1]), GGMLQuantizationType.MXFP4)
        w.add_tensor(name, raw.reshape(*x.shape[:-1], -1),
                     raw_dtype=GGMLQuantizationType.MXFP4)

    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    vocab = int(embd.shape[1])
    w.add_tensor("token_embd.weight", np.array(embd.data, np.float32))
    E, H, K, D = N_EXPERT, N_HEAD, N_KV, HEAD_DIM
    for il in range(N_LAYER):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", 1.0 + vec(n_embd, std=0.1))
        w.add_tensor(p + "attn_q.weight", normal(H * D, n_embd))
        w.add_tensor(p + "attn_q.bias", vec(H * D, std=0.2))
        w.add_tensor(p + "attn_k.weight", normal(K * D, n_embd))
        w.add_tensor(p + "attn_k.bias", vec(K * D, std=0.2))
        w.add_tensor(p + "attn_v.weight", normal(K * D, n_embd))
        w.add_tensor(p + "attn_v.bias", vec(K * D, std=0.2))
        w.add_tensor(p + "attn_output.weight", normal(n_embd, H * D))
        w.add_tensor(p + "attn_output.bias", vec(n_embd, std=0.2))
        w.add_tensor(p + "attn_sinks.weight", vec(H, std=1.0))
        w.add_tensor(p + "post_attention_norm.weight", 1.0 + vec(n_embd, std=0.1))
        w.add_tensor(p + "ffn_gate_inp.weight", normal(E, n_embd, gain=2.0))
        w.add_tensor(p + "ffn_gate_inp.bias", vec(E, std=0.5))
        mxfp4(p + "ffn_gate_exps.weight", normal(E, FF_EXP, n_embd, gain=1.5))
        w.add_tensor(p + "ffn_gate_exps.bias", vec(E, FF_EXP, std=0.5))
        mxfp4(p + "ffn_up_exps.weight", normal(E, FF_EXP, n_embd, gain=1.5))
        w.add_tensor(p + "ffn_up_exps.bias", vec(E, FF_EXP, std=0.5))
        mxfp4(p + "ffn_down_exps.weight", normal(E, n_embd, FF_EXP, gain=0.5))
        w.add_tensor(p + "ffn_down_exps.bias", vec(E, n_embd, std=0.2))
    w.add_tensor("output_norm.weight", 1.0 + vec(n_embd, std=0.1))
    w.add_tensor("output.weight", normal(vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, default=BASE)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write(args.out, args.base, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
