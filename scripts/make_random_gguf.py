#!/usr/bin/env python3
"""Write a random-weight GGUF of a real model's shapes and block formats, for memory and speed
work on models larger than the ones the tests ship, and the tiny test models.

    python scripts/make_random_gguf.py --arch qwen3 --size 1.5b --out /tmp/qwen3-1.5b-rand.gguf
    python scripts/make_random_gguf.py --arch qwen3 --size tiny --out /tmp/tiny.gguf \\
        --tokenizer-from tests/data/models/tiny-qwen3-chat.gguf
    python scripts/make_random_gguf.py --arch qwen3moe --size test \\
        --out tests/data/models/tiny-qwen3moe.gguf \\
        --tokenizer-from tests/data/models/tiny-qwen35.gguf
    python scripts/make_random_gguf.py --arch gpt-oss --size 20b --out /tmp/gpt-oss-20b-rand.gguf \\
        --tokenizer-from /path/to/gpt-oss-20b-mxfp4.gguf
    python scripts/make_random_gguf.py --arch lfm2moe --size 8b-a1b \\
        --out /tmp/lfm2-8b-a1b-rand.gguf --tokenizer-from /path/to/LFM2-8B-A1B-Q4_K_M.gguf

`--arch qwen3moe` (Qwen3 MoE: the qwen3 layer with a mixture of experts, `expert_count`,
`expert_used_count`, `expert_feed_forward_length`; tensors `ffn_gate_inp` (the router, F32 as
llama.cpp's quantizer leaves it) and the stacked `ffn_{gate,up,down}_exps [n_expert, rows,
cols]`): `--size 30b-a3b` is Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 32 query heads, 4
KV heads, head size 128, 128 experts of FFN 768, 8 per token, untied output head, ~17 GiB:
written tensor by tensor, it needs the disk but not the memory), `--size tiny` a 2-layer
hidden-256 one in the same Q4_K_M mix, `--size test` the test model
`tests/data/models/tiny-qwen3moe.gguf` (below; `tiny-qwen3moe-q8.gguf` is the same with
`--expert-types q8_0,q4_0,q5_0 --seed 1`).

`--arch gpt-oss` (llama.cpp's `openai-moe` graph, kvshare's `model/gpt_oss.py`): `--size 20b`
is gpt-oss-20b's shape (hidden 2880, 24 layers, 64 query heads and 8 KV heads of 64, 32
experts of FFN 2880, 4 per token, 128-token windows on the even layers (`sliding_window`, the
loader's default pattern 2), YaRN rope (`rope.scaling.type` yarn, factor 32 over an original
context of 4096; llama.cpp's default beta_fast 32 / beta_slow 1, which the file does not
carry), base 150000, RMS eps 1e-5, context 131072, untied output head), in the formats of
ggml-org's MXFP4 release (gpt-oss-20b-mxfp4.gguf, file type MXFP4_MOE): the experts
`ffn_{gate,up,down}_exps` MXFP4, the embedding, attention matrices and output head Q8_0, the
router `ffn_gate_inp`, the norms (`attn_norm`, `post_attention_norm`, `output_norm`), the
per-head `attn_sinks` and every bias (q/k/v/output, router, each expert's) F32; 459 tensors,
11.27 GiB (12.1 GB) of tensor data at o200k's 201088 tokens, as the real file's. Written tensor
by tensor, the largest (the embedding and the output head, 615 MB each at 201088 tokens) a
chunk of blocks at a time. `--size tiny`: 2 layers, hidden 256, 8 query heads and 2 KV heads
of 64, 8 experts of FFN 256, 2 per token, the same formats, windows and rope. Biases are
normal values of std 0.02, sinks of std 0.5.

`--arch lfm2moe` (LFM2 MoE, llama.cpp's `lfm2moe` graph, kvshare's `model/lfm2moe.py`): the
lfm2 hybrid of short-convolution layers (`shortconv.in_proj [3 n_embd, n_embd]`,
`shortconv.conv [n_embd, l_cache]` (GGUF order [l_cache, n_embd]), `shortconv.out_proj`) and
attention layers (the qwen3 layer: q/k per-head RMSNorm), marked by the per-layer
`attention.head_count_kv` array (0 for a short-conv layer; no `key_length`: the head size is
n_embd / head_count), a dense SwiGLU FFN in the `leading_dense_block_count` first layers and
experts in the others (router `ffn_gate_inp`, selection bias `exp_probs_b.bias`, stacked
`ffn_{gate,up,down}_exps`; `expert_gating_func` 2, sigmoid), the final norm stored as
`token_embd_norm`, the output head tied to the embedding, `vocab_size` and
`shortconv.l_cache` in the metadata: the names and keys of the shipped
`tests/data/models/tiny-lfm2moe.gguf`. `--size 8b-a1b` is LFM2-8B-A1B's shape (hidden 2048,
24 layers, attention at 2, 6, 10, 14, 18 and 21, short conv elsewhere with a kernel of 3,
32 query heads and 8 KV heads of 64, dense FFN 7168 in the first 2 layers, 32 experts of FFN
1792, 4 per token, rope base 1e6, RMS eps 1e-5, context 128000) in the Q4_K_M mix below
(attn_v's `use_more_bits` counts the attention layers only, as llama.cpp's `i_attention_wv`
does: Q6_K in layers 10 and 21; the short-conv projections Q4_K, the conv kernel, router and
selection bias F32): 256 tensors, 8.34 B parameters, 5.04 GB (4.70 GiB) of tensor data at
its 65536 tokens (LFM2-8B-A1B-Q4_K_M.gguf is listed at about 5.0 GB). `--size tiny`: 4
layers, attention at 1 and 3, hidden 256, 4 query heads and 2 KV heads of 64, dense FFN 768
in layer 0, 8 experts of FFN 256 (Q4_K rows are multiples of 256), 2 per token: the shipped
tiny-lfm2moe.gguf's layout. llama.cpp's Q4_K_M gives a model of exactly 8 experts attn_v
Q8_0 and attn_output Q5_K; the tiny sizes (qwen3moe's too) keep the general rule.

`--size 1.5b` is Qwen3-1.7B's shape: hidden 2048, 28 layers, 16 query heads, 8 KV heads, head
size 128, FFN 6144, per-head q/k RMSNorm, rope theta 1e6, RMS eps 1e-6, context 40960, output
head tied to the token embeddings (Qwen3-1.7B has no `output.weight`). `--size tiny`: 2 layers,
hidden 256, 4 query heads, 2 KV heads, head size 64, FFN 768.

Block formats follow llama.cpp's Q4_K_M mix (src/llama-quant.cpp, llama_tensor_get_type): Q4_K
for every matrix except attn_v and ffn_down of the layers `use_more_bits` picks (the first and
last eighth of the layers and every third one between) and the tied token embedding (quantized
as the output head), which are Q6_K; norms F32.

The `test` sizes are the shipped test models: hidden 64, F32 attention, embedding and router
(normal values of std 1/sqrt(fan-in), the router's twice that so that routing is decided),
the experts in block formats (`TEST_EXPERT_TYPES`, quantized with gguf-py from normal values
of the same std), norms 1.0.

The blocks are random but valid: random quant bytes (nibbles, Q6_K high bits, Q8_0's int8
values, MXFP4's E2M1 codes), random 6-bit sub-block scales and mins (Q4_K) or int8 scales
(Q6_K), and f16 (super-)block scales `d` / `dmin` (MXFP4: E8M0 exponents 119 or 120) picked so
that each matrix's elements have a standard deviation of about 0.02 and a mean of about 0
(finite activations through every layer). Norm weights are 1.0; a router (F32 outside the
`test` sizes too) normal of std 2/sqrt(fan-in), lfm2moe's conv kernel normal of std
1/sqrt(l_cache) and its selection bias of std 0.02. The generator is seeded: the same arguments
write the same bytes. Tensors are generated and written one at a time (Qwen3-1.7B's largest,
the embedding, is ~255 MB at 151936 x 2048 Q6_K).

The tokenizer (`tokenizer.*` metadata: vocabulary, merges, special ids, chat template) is copied
from a real GGUF (`--tokenizer-from`; default: the packaged Gemma 3 270M that
`kvshare.model.loader.default_model_path()` returns); the embedding has one row per token of
that vocabulary. For Qwen3-1.7B's exact vocabulary (151936 tokens) pass a Qwen2/Qwen3 tokenizer
GGUF, e.g. llama.cpp's `models/ggml-vocab-qwen2.gguf`; for gpt-oss-20b's (o200k, 201088
tokens) a gpt-oss GGUF.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, ExpertGatingFuncType, GGMLQuantizationType as Q,
                  GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType)

LLAMA_FTYPE_MOSTLY_F32 = 0
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
LLAMA_FTYPE_MOSTLY_MXFP4_MOE = 38  # gpt-oss's MXFP4 release (ggml-org/gpt-oss-20b-GGUF)
FILE_TYPES = {"q4_k_m": LLAMA_FTYPE_MOSTLY_Q4_K_M, "mxfp4": LLAMA_FTYPE_MOSTLY_MXFP4_MOE,
              "test": LLAMA_FTYPE_MOSTLY_F32}
TARGET_STD = 0.02  # standard deviation of a weight matrix's elements
SINK_STD = 0.5  # gpt-oss's attention sinks (one logit per head): normal values of this std
GGUF_ALIGNMENT = 32  # GGUFWriter's default: each tensor's data starts on this boundary
CHUNK_BLOCKS = 1 << 20  # Q8_0 / MXFP4 tensors are generated this many blocks at a time
GATING_SIGMOID = ExpertGatingFuncType.SIGMOID  # llama.cpp's expert_gating_func 2


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    context_length: int
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    tied: bool = True
    n_expert: int = 0  # mixture of experts: experts per layer, used per token, their FFN size
    n_expert_used: int = 0
    n_ff_exp: int = 0
    mix: str = "q4_k_m"  # block formats: llama.cpp's Q4_K_M mix, "mxfp4" (gpt-oss's MXFP4
    # release) or "test" (module docstring)
    sliding_window: int = 0  # gpt-oss: the window of the sliding-window layers (even ones)
    yarn_factor: float = 0.0  # YaRN rope scaling: factor over an original context (0: none)
    yarn_orig_ctx: int = 0
    # lfm2moe: the attention layers (the others short-conv ones), the short convolution's
    # kernel size (`shortconv.l_cache`), the leading layers with a dense FFN
    # (`leading_dense_block_count`) and the experts' gating function (`expert_gating_func`,
    # llama.cpp's llama_expert_gating_func_type: 2 sigmoid)
    attn_layers: tuple[int, ...] = ()
    conv_l_cache: int = 0
    n_dense_lead: int = 0
    gating_func: ExpertGatingFuncType | None = None


SIZES: dict[str, dict[str, Shape]] = {
    "qwen3": {
        # Qwen3-1.7B (config.json: hidden_size 2048, num_hidden_layers 28, num_attention_heads
        # 16, num_key_value_heads 8, head_dim 128, intermediate_size 6144, rope_theta 1e6,
        # rms_norm_eps 1e-6, max_position_embeddings 40960, tie_word_embeddings true)
        "1.5b": Shape(28, 2048, 16, 8, 128, 6144, 40960),
        "tiny": Shape(2, 256, 4, 2, 64, 768, 4096),
    },
    "qwen3moe": {
        # Qwen3-30B-A3B (config.json: hidden_size 2048, num_hidden_layers 48,
        # num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
        # num_experts_per_tok 8, moe_intermediate_size 768, intermediate_size 6144,
        # rope_theta 1e6, max_position_embeddings 40960, tie_word_embeddings false)
        "30b-a3b": Shape(48, 2048, 32, 4, 128, 6144, 40960, tied=False, n_expert=128,
                         n_expert_used=8, n_ff_exp=768),
        "tiny": Shape(2, 256, 4, 2, 64, 768, 4096, n_expert=8, n_expert_used=2, n_ff_exp=256),
        "test": Shape(4, 64, 2, 1, 32, 128, 32768, rope_base=1e7, n_expert=16, n_expert_used=4,
                      n_ff_exp=32, mix="test"),
    },
    "gpt-oss": {
        # gpt-oss-20b (config.json: hidden_size 2880, num_hidden_layers 24,
        # num_attention_heads 64, num_key_value_heads 8, head_dim 64, num_local_experts 32,
        # num_experts_per_tok 4, intermediate_size 2880, sliding_window 128, layer_types
        # sliding/full alternating from sliding, rope_theta 150000, rope_scaling yarn factor 32
        # over original_max_position_embeddings 4096, max_position_embeddings 131072,
        # rms_norm_eps 1e-5, tie_word_embeddings false)
        "20b": Shape(24, 2880, 64, 8, 64, 2880, 131072, rope_base=150000.0, rms_eps=1e-5,
                     tied=False, n_expert=32, n_expert_used=4, n_ff_exp=2880, mix="mxfp4",
                     sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096),
        "tiny": Shape(2, 256, 8, 2, 64, 256, 131072, rope_base=150000.0, rms_eps=1e-5,
                      tied=False, n_expert=8, n_expert_used=2, n_ff_exp=256, mix="mxfp4",
                      sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096),
    },
    "lfm2moe": {
        # LFM2-8B-A1B (config.json: hidden_size 2048, num_hidden_layers 24,
        # num_attention_heads 32, num_key_value_heads 8, layer_types full_attention at 2, 6,
        # 10, 14, 18, 21 and conv elsewhere, conv_L_cache 3, intermediate_size 7168,
        # num_dense_layers 2, num_experts 32, num_experts_per_tok 4, moe_intermediate_size
        # 1792, norm_topk_prob true, use_expert_bias true, sigmoid routing, rope_theta 1e6,
        # max_position_embeddings 128000, norm_eps 1e-5, tied embeddings)
        "8b-a1b": Shape(24, 2048, 32, 8, 64, 7168, 128000, rms_eps=1e-5, n_expert=32,
                        n_expert_used=4, n_ff_exp=1792, attn_layers=(2, 6, 10, 14, 18, 21),
                        conv_l_cache=3, n_dense_lead=2, gating_func=GATING_SIGMOID),
        "tiny": Shape(4, 256, 4, 2, 64, 768, 128000, rms_eps=1e-5, n_expert=8,
                      n_expert_used=2, n_ff_exp=256, attn_layers=(1, 3), conv_l_cache=3,
                      n_dense_lead=1, gating_func=GATING_SIGMOID),
    },
}
ARCHS = tuple(SIZES)
ALL_SIZES = sorted({s for sizes in SIZES.values() for s in sizes})
# the experts' block formats of the `test` mix (gate, up, down; `--expert-types`): f16
# blocks, which llama.cpp multiplies with activations rounded to f16 only, so that its
# logits and kvshare's differ by float rounding only; with a quantized format llama.cpp
# rounds the activations to 8 bits (tiny-qwen3moe-q8.gguf: Q8_0, Q4_0, Q5_0)
TEST_EXPERT_TYPES = (Q.F16, Q.F16, Q.F16)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in Q4_K_M."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def tensor_plan(arch: str, s: Shape, vocab: int, expert_types: tuple[Q, Q, Q] | None = None
                ) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, numpy shape [rows, cols], [n_expert, rows, cols] or [n], block format) of every
    tensor, in llama.cpp's order."""
    if arch not in SIZES:
        raise ValueError(f"architecture {arch!r} is not supported (one of {', '.join(ARCHS)})")
    if arch == "gpt-oss":
        return _gpt_oss_plan(s, vocab)
    if arch == "lfm2moe":
        return _lfm2moe_plan(s, vocab)
    H, K, D, E, F = s.n_head, s.n_head_kv, s.head_dim, s.n_embd, s.n_ff
    test = s.mix == "test"
    q4k = Q.F32 if test else Q.Q4_K

    def q6k(more: bool) -> Q:
        return Q.F32 if test else Q.Q6_K if more else Q.Q4_K

    plan: list[tuple[str, tuple[int, ...], Q]] = [
        # tied: the embedding is quantized as the output head (Q6_K)
        ("token_embd.weight", (vocab, E), q6k(s.tied))]
    for il in range(s.n_layers):
        p = f"blk.{il}."
        more = use_more_bits(il, s.n_layers)
        plan += [
            (p + "attn_norm.weight", (E,), Q.F32),
            (p + "attn_q.weight", (H * D, E), q4k),
            (p + "attn_k.weight", (K * D, E), q4k),
            (p + "attn_v.weight", (K * D, E), q6k(more)),
            (p + "attn_q_norm.weight", (D,), Q.F32),
            (p + "attn_k_norm.weight", (D,), Q.F32),
            (p + "attn_output.weight", (E, H * D), q4k),
            (p + "ffn_norm.weight", (E,), Q.F32),
        ]
        if s.n_expert:
            X, FX = s.n_expert, s.n_ff_exp
            gate_t, up_t, down_t = ((expert_types or TEST_EXPERT_TYPES) if test
                                    else (Q.Q4_K, Q.Q4_K, q6k(more)))
            plan += [
                (p + "ffn_gate_inp.weight", (X, E), Q.F32),
                (p + "ffn_gate_exps.weight", (X, FX, E), gate_t),
                (p + "ffn_up_exps.weight", (X, FX, E), up_t),
                (p + "ffn_down_exps.weight", (X, E, FX), down_t),
            ]
        else:
            plan += [
                (p + "ffn_gate.weight", (F, E), q4k),
                (p + "ffn_up.weight", (F, E), q4k),
                (p + "ffn_down.weight", (E, F), q6k(more)),
            ]
    plan.append(("output_norm.weight", (E,), Q.F32))
    if not s.tied:
        plan.append(("output.weight", (vocab, E), q6k(True)))
    return plan


def _gpt_oss_plan(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """gpt-oss's tensors as llama.cpp's `openai-moe` graph and kvshare's loader read them, in
    the formats of ggml-org's MXFP4 release: every matrix Q8_0 (embedding, attention, output
    head) but the experts, MXFP4; the router, norms, sinks and biases F32."""
    H, K, D, E = s.n_head, s.n_head_kv, s.head_dim, s.n_embd
    X, FX = s.n_expert, s.n_ff_exp
    plan: list[tuple[str, tuple[int, ...], Q]] = [("token_embd.weight", (vocab, E), Q.Q8_0)]
    for il in range(s.n_layers):
        p = f"blk.{il}."
        plan += [
            (p + "attn_norm.weight", (E,), Q.F32),
            (p + "attn_q.weight", (H * D, E), Q.Q8_0),
            (p + "attn_q.bias", (H * D,), Q.F32),
            (p + "attn_k.weight", (K * D, E), Q.Q8_0),
            (p + "attn_k.bias", (K * D,), Q.F32),
            (p + "attn_v.weight", (K * D, E), Q.Q8_0),
            (p + "attn_v.bias", (K * D,), Q.F32),
            (p + "attn_output.weight", (E, H * D), Q.Q8_0),
            (p + "attn_output.bias", (E,), Q.F32),
            (p + "attn_sinks.weight", (H,), Q.F32),
            (p + "post_attention_norm.weight", (E,), Q.F32),
            (p + "ffn_gate_inp.weight", (X, E), Q.F32),
            (p + "ffn_gate_inp.bias", (X,), Q.F32),
            (p + "ffn_gate_exps.weight", (X, FX, E), Q.MXFP4),
            (p + "ffn_gate_exps.bias", (X, FX), Q.F32),
            (p + "ffn_up_exps.weight", (X, FX, E), Q.MXFP4),
            (p + "ffn_up_exps.bias", (X, FX), Q.F32),
            (p + "ffn_down_exps.weight", (X, E, FX), Q.MXFP4),
            (p + "ffn_down_exps.bias", (X, E), Q.F32),
        ]
    plan += [("output_norm.weight", (E,), Q.F32), ("output.weight", (vocab, E), Q.Q8_0)]
    return plan


def _lfm2moe_plan(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """LFM2 MoE's tensors as llama.cpp's `lfm2moe` graph and kvshare's loader read them (the
    order of the shipped tiny-lfm2moe.gguf), in llama.cpp's Q4_K_M mix: Q4_K matrices; Q6_K
    the tied embedding, and attn_v and ffn_down(_exps) where `use_more_bits` picks (attn_v
    by the layer's index among the attention layers, as llama.cpp's i_attention_wv counts:
    the 6 of LFM2-8B-A1B give Q6_K in its 3rd and 6th); F32 the norms (the final one
    `token_embd_norm`), the short-conv kernel `shortconv.conv.weight` (numpy [n_embd,
    l_cache], GGUF [l_cache, n_embd]: llama.cpp does not quantize it), the router
    `ffn_gate_inp` and the selection bias `exp_probs_b.bias`."""
    H, K, D, E, F = s.n_head, s.n_head_kv, s.head_dim, s.n_embd, s.n_ff
    X, FX = s.n_expert, s.n_ff_exp
    attn = [il for il in range(s.n_layers) if il in s.attn_layers]

    def q6k(more: bool) -> Q:
        return Q.Q6_K if more else Q.Q4_K

    plan: list[tuple[str, tuple[int, ...], Q]] = [
        ("token_embd.weight", (vocab, E), q6k(True)),  # tied: quantized as the output head
        ("token_embd_norm.weight", (E,), Q.F32)]
    for il in range(s.n_layers):
        p = f"blk.{il}."
        more = use_more_bits(il, s.n_layers)
        plan += [(p + "attn_norm.weight", (E,), Q.F32), (p + "ffn_norm.weight", (E,), Q.F32)]
        if il in attn:
            plan += [
                (p + "attn_q.weight", (H * D, E), Q.Q4_K),
                (p + "attn_k.weight", (K * D, E), Q.Q4_K),
                (p + "attn_v.weight", (K * D, E),
                 q6k(use_more_bits(attn.index(il), len(attn)))),
                (p + "attn_output.weight", (E, H * D), Q.Q4_K),
                (p + "attn_q_norm.weight", (D,), Q.F32),
                (p + "attn_k_norm.weight", (D,), Q.F32),
            ]
        else:
            plan += [
                (p + "shortconv.conv.weight", (E, s.conv_l_cache), Q.F32),
                (p + "shortconv.in_proj.weight", (3 * E, E), Q.Q4_K),
                (p + "shortconv.out_proj.weight", (E, E), Q.Q4_K),
            ]
        if il < s.n_dense_lead:
            plan += [
                (p + "ffn_gate.weight", (F, E), Q.Q4_K),
                (p + "ffn_up.weight", (F, E), Q.Q4_K),
                (p + "ffn_down.weight", (E, F), q6k(more)),
            ]
        else:
            plan += [
                (p + "ffn_gate_inp.weight", (X, E), Q.F32),
                (p + "exp_probs_b.bias", (X,), Q.F32),
                (p + "ffn_gate_exps.weight", (X, FX, E), Q.Q4_K),
                (p + "ffn_up_exps.weight", (X, FX, E), Q.Q4_K),
                (p + "ffn_down_exps.weight", (X, E, FX), q6k(more)),
            ]
    return plan


def tensor_nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    """The bytes of a tensor of numpy `shape` in block format `qtype`."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    if cols % block:
        raise ValueError(f"row length {cols} is not a multiple of {qtype.name}'s {block}")
    return int(np.prod(lead, dtype=np.int64)) * (cols // block) * type_size


def plan_bytes(plan: list[tuple[str, tuple[int, ...], Q]]) -> int:
    """The tensor data bytes of a plan as the file holds them (each tensor padded to
    GGUF_ALIGNMENT): the file's size less its header and metadata."""
    return sum(-(-tensor_nbytes(shape, q) // GGUF_ALIGNMENT) * GGUF_ALIGNMENT
               for _, shape, q in plan)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` valid random blocks of `qtype` as uint8 [n_blocks, type_size], elements with
    a standard deviation of about TARGET_STD and a mean of about 0."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = np.frombuffer(rng.bytes(n_blocks * type_size), np.uint8).reshape(n_blocks, type_size).copy()
    jitter = rng.uniform(0.8, 1.2, n_blocks)
    if qtype == Q.Q4_K:
        # d f16, dmin f16, scales u8[12] (6-bit scale and min per sub-block of 32), qs u8[128]:
        # x = d * sc * q - dmin * m, q uniform in 0..15 (mean 7.5, std 4.6), sc and m uniform in
        # 0..63 (mean 31.5, std 18.5). dmin = 7.5 d centres each sub-block on average; the
        # element std is then about d * sqrt((31.5 * 4.6)^2 + 2 * (7.5 * 18.5)^2) ~ 240 d.
        d = TARGET_STD / 240.0 * jitter
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(7.5 * d)
    elif qtype == Q.Q6_K:
        # ql u8[128], qh u8[64], scales i8[16], d f16: x = d * sc * (q - 32), q uniform in
        # 0..63 (std 18.5); scales uniform in -32..32 (mean |sc| ~ 16): std ~ 16 * 18.5 d
        b[:, 192:208] = rng.integers(-32, 33, (n_blocks, 16), dtype=np.int8).view(np.uint8)
        d = TARGET_STD / (16.0 * 18.5) * jitter
        b[:, 208:210] = _f16_bytes(d)
    elif qtype == Q.Q8_0:
        # d f16, qs i8[32]: x = d * q, q uniform in -128..127 (std 73.9, mean -0.5)
        d = TARGET_STD / 73.9 * jitter
        b[:, 0:2] = _f16_bytes(d)
    elif qtype == Q.MXFP4:
        # e u8 (E8M0), qs u8[16] (32 4-bit E2M1 codes): x = kv[q] * 2^(e - 128) (ggml's
        # kvalues_mxfp4, the E2M1 values doubled, and GGML_E8M0_TO_FP32_HALF), q uniform in
        # 0..15: kv mean 0, std sqrt(274 / 8) = 5.85. e = 120 gives an element std of 0.023,
        # 119 half that; half the blocks each: ~0.018
        b[:, 0] = rng.integers(119, 121, n_blocks, dtype=np.uint8)
    else:
        raise ValueError(f"no random block generator for {qtype.name}")
    return b


def tensor_data(name: str, shape: tuple[int, ...], qtype: Q, seed: int, index: int) -> np.ndarray:
    """The stored bytes (or f32 values) of one tensor; its own seeded stream, so each tensor is
    the same whatever else is generated."""
    if name.endswith(".bias") or name.endswith(".attn_sinks.weight"):
        # gpt-oss's biases (std TARGET_STD) and attention sinks (SINK_STD), lfm2moe's expert
        # selection bias `exp_probs_b` (TARGET_STD), f32
        std = SINK_STD if "attn_sinks" in name else TARGET_STD
        rng = np.random.default_rng([seed, index])
        return (rng.standard_normal(shape) * std).astype(np.float32)
    if len(shape) == 1:
        return np.ones(shape, np.float32)  # norm weights
    block, type_size = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    rows = int(np.prod(lead))
    if cols % block:
        raise ValueError(f"{name}: row length {cols} is not a multiple of {qtype.name}'s {block}")
    rng = np.random.default_rng([seed, index])
    if qtype in (Q.Q4_K, Q.Q6_K):
        blocks = random_blocks(qtype, rows * cols // block, rng)
        return blocks.reshape(*lead, cols // block * type_size)
    if qtype in (Q.Q8_0, Q.MXFP4):
        # a chunk at a time: a tensor's bytes and no more (gpt-oss-20b's Q8_0 embedding and
        # output head are 615 MB at o200k's 201088 tokens)
        n = rows * cols // block
        blocks = np.empty((n, type_size), np.uint8)
        for i in range(0, n, CHUNK_BLOCKS):
            blocks[i : i + CHUNK_BLOCKS] = random_blocks(qtype, min(CHUNK_BLOCKS, n - i), rng)
        return blocks.reshape(*lead, cols // block * type_size)
    # the test mix (and every mix's F32 router, lfm2moe's F32 short-conv kernel [n_embd,
    # l_cache]): normal values of std 1/sqrt(fan-in) (a router twice that), stored as f32 or
    # quantized by gguf-py
    std = (2.0 if "ffn_gate_inp" in name else 1.0) / np.sqrt(cols)
    values = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
    if qtype == Q.F32:
        return values.reshape(shape)
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8).reshape(*lead, cols * 2)
    from gguf import quants  # noqa: PLC0415

    return np.asarray(quants.quantize(values, qtype)).reshape(*lead, cols // block * type_size)


# ----------------------------------------------------------------------------- tokenizer

def default_tokenizer_source() -> str:
    from kvshare.model.loader import default_model_path  # noqa: PLC0415

    return default_model_path()


def tokenizer_fields(path: str | os.PathLike) -> list[tuple[str, object, GGUFValueType,
                                                            GGUFValueType | None]]:
    """The `tokenizer.*` metadata of a GGUF file: (key, value, type, array element type)."""
    r = GGUFReader(str(path))
    out = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        val = f.contents()
        if isinstance(val, np.ndarray):
            val = val.tolist()
        out.append((key, val, vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise SystemExit(f"{path}: no tokenizer.ggml.tokens to copy")
    return out


# ----------------------------------------------------------------------------- writer

def write(out: str | os.PathLike, arch: str = "qwen3", size: str = "1.5b",
          tokenizer_from: str | os.PathLike | None = None, seed: int = 0,
          verbose: bool = False, expert_types: tuple[Q, Q, Q] | None = None,
          layers: int | None = None) -> dict:
    """Write the GGUF; returns a summary (vocab, parameter count, bytes per block format).
    `expert_types`: the experts' formats (gate, up, down) of a `test` size; `layers`: that
    many of the size's layers (a real model's per-layer shapes at a size that fits)."""
    try:
        s = SIZES[arch][size]
    except KeyError:
        raise ValueError(f"{arch} has no size {size!r} (one of "
                         f"{', '.join(SIZES.get(arch, {}))})") from None
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be positive, got {layers}")
        s = dataclasses.replace(s, n_layers=layers)
    src = tokenizer_from or default_tokenizer_source()
    tok = tokenizer_fields(src)
    vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    plan = tensor_plan(arch, s, vocab, expert_types)

    w = GGUFWriter(str(out), arch)
    w.add_name(f"random {arch} {size} (kvshare scripts/make_random_gguf.py, seed {seed})")
    w.add_file_type(FILE_TYPES[s.mix])
    w.add_quantization_version(2)
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    if arch == "lfm2moe":
        # per layer: the KV heads of an attention layer, 0 for a short-conv one; no
        # key_length (llama.cpp's converter writes none: head size n_embd / head_count)
        w.add_head_count_kv([s.n_head_kv if il in s.attn_layers else 0
                             for il in range(s.n_layers)])
        w.add_vocab_size(vocab)
        w.add_shortconv_l_cache(s.conv_l_cache)
    else:
        w.add_head_count_kv(s.n_head_kv)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.n_dense_lead:
        w.add_leading_dense_block_count(min(s.n_dense_lead, s.n_layers))
    if s.gating_func is not None:
        w.add_expert_gating_func(s.gating_func)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.yarn_factor:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)
    for key, val, vtype, sub in tok:
        w.add_key_value(key, val, vtype, sub_type=sub)

    by_type: dict[str, int] = {}
    params = 0
    for name, shape, qtype in plan:
        nbytes = tensor_nbytes(shape, qtype)
        if qtype == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            *lead, cols = shape
            w.add_tensor_info(name, (*lead, cols // block * type_size), np.dtype(np.uint8),
                              nbytes, raw_dtype=qtype)
        by_type[qtype.name] = by_type.get(qtype.name, 0) + nbytes
        params += int(np.prod(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for i, (name, shape, qtype) in enumerate(plan):
        w.write_tensor_data(tensor_data(name, shape, qtype, seed, i))
        if verbose and (i % 50 == 0 or i == len(plan) - 1):
            print(f"  {i + 1}/{len(plan)} tensors ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    w.close()
    return {"path": str(out), "arch": arch, "size": size, "vocab": vocab, "params": params,
            "tensors": len(plan), "bytes_by_type": by_type,
            "file_bytes": Path(out).stat().st_size, "tokenizer_from": str(src)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3", choices=ARCHS,
                    help="qwen3 (Q4_K_M mix), qwen3moe (Q4_K_M mix; `test`: the test "
                         "models' F32 / expert formats), gpt-oss (MXFP4 experts, Q8_0 "
                         "embedding / attention / output head, F32 router, norms, sinks, "
                         "biases), lfm2moe (LFM2 MoE: short-conv and attention layers, "
                         "leading dense FFN, sigmoid-routed experts; Q4_K_M mix, F32 conv "
                         "kernel, router, selection bias)")
    ap.add_argument("--size", default="1.5b", choices=ALL_SIZES,
                    help="per architecture: " + "; ".join(
                        f"{a}: {', '.join(sz)}" for a, sz in SIZES.items()))
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--tokenizer-from", default=None,
                    help="GGUF whose tokenizer.* metadata is copied (default: the packaged "
                         "Gemma 3 270M, kvshare.model.loader.default_model_path())")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None,
                    help="write only this many of the size's layers (e.g. Qwen3-30B-A3B's "
                         "layer shapes with --arch qwen3moe --size 30b-a3b --layers 2, "
                         "gpt-oss-20b's with --arch gpt-oss --size 20b --layers 2; lfm2moe: "
                         "the first layers with their kinds, e.g. --size 8b-a1b --layers 3 "
                         "for two dense short-conv layers and an attention + experts one)")
    ap.add_argument("--expert-types", default=None,
                    help="a test size's expert formats, gate,up,down (e.g. q8_0,q4_0,q5_0)")
    args = ap.parse_args(argv)
    if args.size not in SIZES[args.arch]:
        ap.error(f"--arch {args.arch} has no size {args.size!r}")
    t0 = time.perf_counter()
    types = None
    if args.expert_types:
        types = tuple(Q[t.strip().upper()] for t in args.expert_types.split(","))
        if len(types) != 3:
            ap.error("--expert-types takes three formats: gate,up,down")
    info = write(args.out, args.arch, args.size, args.tokenizer_from, args.seed, verbose=True,
                 expert_types=types, layers=args.layers)
    mib = {k: round(v / 2**20, 1) for k, v in info["bytes_by_type"].items()}
    print(f"wrote {info['path']}: {args.arch} {args.size}, vocab {info['vocab']} (from "
          f"{info['tokenizer_from']}), {info['params'] / 1e9:.3f}B parameters, "
          f"{info['tensors']} tensors, {info['file_bytes'] / 2**20:.1f} MiB (MiB by format: "
          f"{mib}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
