"""gpt-oss (`gpt-oss`) against llama.cpp's logits at every position of the five public texts,
and its parts against their oracles: YaRN tables against ggml's f32 `rope_yarn`, attention
with sinks against the float64 reference, the clamped SwiGLU experts with biases against
`moe_ffn_reference`.

Model (`scripts/make_tiny_gpt_oss.py`): 4 layers (sliding window 128 on layers 0 and 2),
4 query / 2 KV heads of 32 with biases and sinks, YaRN (factor 32), 16 MXFP4 experts of FFN
64, 4 per token, with biases. llama.cpp multiplies MXFP4 with activations rounded to 8 bits
(Q8_0) and, with an f16 KV cache, rounds q and the softmax weights to f16; on this random
model either moves the logits by ~1% of the range (median).

Both checks are tests/test_model_moe.py's for quantized experts (tiny-qwen3moe-q8): top-1
equal wherever llama.cpp's top-1 leads its top-2 by >= 0.5, and a median |delta logit| bound.
- The default (f32 activations) against llama.cpp with an f16 KV cache
  (`tiny-gpt-oss.logits.npz`; tools_long: its first 2,048 tokens): median < 1.5% of the
  range (measured 0.59-1.09%).
- `KVSHARE_CPU_WEIGHTS=blocks-q8` (the experts' activations rounded to Q8_0 as llama.cpp's)
  against llama.cpp with an f32 KV cache (`tiny-gpt-oss-f32kv.logits.npz`), one-shot and
  chunked then decoded: median < 0.5% (measured 0.0008-0.28%); `short` agrees at every
  position to the reference's storage precision (<= 0.001% of the range). Elsewhere an 8-bit
  rounding that lands the other way (the two sides sum in different orders) moves the later
  positions, by up to ~10% of the range on this random model.
Reference data: `scripts/make_reference_logits.py` with llama.cpp built from the
llama-cpp-python 0.3.36 sdist (flash attention off, 2 threads; `--kv f32` for the first file).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import kvshare.ops.moe as ops_moe
from kvshare.backend import CPU_THREADS
from kvshare.model.batch import SeqChunk
from kvshare.model.config import config_from_metadata
from kvshare.model.gguf_file import GGUFFile
from kvshare.model.loader import load_model
from kvshare.ops.attention import attention_reference, paged_attention, write_kv
from kvshare.ops.moe import Routing, moe_ffn, moe_ffn_reference
from kvshare.ops.rope_yarn import Yarn, corr_dims, yarn_cos_sin

DATA = Path(__file__).parent / "data"
MODEL = DATA / "models" / "tiny-gpt-oss.gguf"
CASES = ("short", "chat", "unicode", "code", "tools_long")
BS = 16


@lru_cache(maxsize=None)
def _load(mode: str):
    import os  # noqa: PLC0415

    old = os.environ.get("KVSHARE_CPU_WEIGHTS")
    os.environ["KVSHARE_CPU_WEIGHTS"] = mode
    try:
        return load_model(MODEL)
    finally:
        if old is None:
            del os.environ["KVSHARE_CPU_WEIGHTS"]
        else:
            os.environ["KVSHARE_CPU_WEIGHTS"] = old


@lru_cache(maxsize=None)
def reference(name: str, case: str) -> dict:
    with np.load(DATA / f"{name}.logits.npz") as d:
        q = d[f"{case}/logits_u16"].astype(np.float64)
        lo, rng = d[f"{case}/lo"], d[f"{case}/range"]
        return dict(tokens=d[f"{case}/tokens"], logits=lo[:, None] + q / 65535.0 * rng[:, None],
                    range=rng, top1=d[f"{case}/top1"].astype(np.int64))


def run(m, tokens, schedule=None, kv="f16"):
    """(logits of every position, per position the smallest router gap of any layer)."""
    n = len(tokens)
    nb = -(-n // BS)
    cache = m.new_cache(nb + 1, BS, kv_dtype=kv)
    table = np.arange(nb)
    gaps: list[np.ndarray] = []
    route = ops_moe.route

    def recording(logits, routing, **kw):
        s = np.sort(np.asarray(logits, np.float32), axis=1)[:, ::-1]
        gaps.append(s[:, routing.k - 1] - s[:, routing.k])
        return route(logits, routing, **kw)

    threads = CPU_THREADS.max_threads
    ops_moe.route = recording
    CPU_THREADS.set_max(1)
    out, ties, i = [], [], 0
    try:
        for size in (schedule or [n]):
            size = min(size, n - i)
            if size <= 0:
                continue
            gaps.clear()
            out.append(m.forward([SeqChunk(tokens[i : i + size], i, table, logits="all")],
                                 cache)[0])
            ties.append(np.min(np.stack(gaps), axis=0))
            i += size
    finally:
        ops_moe.route = route
        CPU_THREADS.set_max(threads)
    assert i == n
    return np.concatenate(out), np.concatenate(ties)


def test_load_layers_yarn_and_experts():
    m = _load("blocks")
    cfg = m.config
    assert type(m).__name__ == "GptOssModel" and cfg.arch == "gpt-oss"
    assert cfg.layer_windows == (128, 0, 128, 0)
    assert m.layer_kinds().sliding_window == 2 and m.layer_kinds().window == 128
    assert cfg.q_scale == pytest.approx(1 / math.sqrt(32))
    assert m.yarn == Yarn(freq_scale=1 / 32, n_ctx_orig=4096)
    L = m.layers[1]
    assert L.sinks.shape == (4,) and L.bo.shape == (64,) and L.bqkv.shape == (128 + 2 * 64,)
    moe = L.moe
    assert moe.routing == Routing(16, 4, gating="softmax_weight", norm=False)
    assert moe.activation == "swiglu_oai" and moe.router_bias.shape == (16,)
    assert moe.gate_up_bias.shape == (16, 128) and moe.down_bias.shape == (16, 64)
    assert moe.gate_up[3].shape == (128, 64) and moe.down[3].shape == (64, 64)
    q8 = _load("blocks-q8").layers[0].moe.gate_up[0]
    assert type(q8).__name__ == "Q8_0Acts" and type(q8.w).__name__ == "BlockWeight"


def _ggml_yarn_cache(pos, n_dims, base, y: Yarn):
    """ggml-cpu's ggml_rope_cache_init with rope_yarn, in f32 step by step (the oracle)."""
    f32 = np.float32
    low, high = corr_dims(n_dims, y.n_ctx_orig, base, y.beta_fast, y.beta_slow)
    theta_scale = f32(base) ** f32(-2.0 / n_dims)
    cos = np.empty((len(pos), n_dims // 2), f32)
    sin = np.empty_like(cos)
    for r, p in enumerate(pos):
        theta = f32(p)
        for i0 in range(0, n_dims, 2):
            t_e = theta
            t_i = f32(y.freq_scale) * t_e
            ramp = f32(1) - min(f32(1), max(f32(0), f32((i0 // 2 - low) /
                                                           max(0.001, high - low))))
            mix = ramp * f32(y.ext_factor)
            t = t_i * (f32(1) - mix) + t_e * mix
            ms = f32(y.attn_factor) * (f32(1) + f32(0.1) * np.log(f32(1) / f32(y.freq_scale)))
            cos[r, i0 // 2] = np.cos(t) * ms
            sin[r, i0 // 2] = np.sin(t) * ms
            theta = theta * theta_scale
    return cos, sin


def test_yarn_tables_match_ggml():
    y = Yarn(freq_scale=1 / 32, n_ctx_orig=4096)
    assert corr_dims(64, 4096, 150000.0, 32.0, 1.0) == (8.0, 18.0)
    pos = np.array([0, 1, 5, 127, 1000, 4095])
    cos, sin = yarn_cos_sin(pos, 64, 150000.0, y)
    gc, gs = _ggml_yarn_cache(pos, 64, 150000.0, y)
    # ggml forms each angle by 2-32 f32 products (~1e-6 relative, times the position)
    np.testing.assert_allclose(cos, gc, atol=2e-3 * 1.35)
    np.testing.assert_allclose(sin, gs, atol=2e-3 * 1.35)
    np.testing.assert_allclose(cos[:, :8] ** 2 + sin[:, :8] ** 2, 1.3466 ** 2, rtol=1e-4)


def test_config_reads_yarn_attn_factor_and_refuses_nothing_else():
    md = dict(GGUFFile(MODEL).metadata)
    cfg = config_from_metadata(md)
    assert cfg.rope_scale == cfg.rope_scale_swa == 1 / 32
    # llama_context: (0.1 ln 32 + 1) / (1 + 0.1 ln 32), formed in f32
    assert cfg.extra["yarn"]["attn_factor"] == pytest.approx(1.0, abs=1e-7)
    md["gpt-oss.rope.scaling.type"] = "linear"
    assert "yarn" not in config_from_metadata(md).extra


@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_match_the_reference(window):
    rng = np.random.default_rng(1)
    H, K, D, bs, n = 4, 2, 32, 4, 11
    kc = np.zeros((4, bs, K, D), np.float32)
    vc = np.zeros_like(kc)
    k = rng.standard_normal((n, K, D)).astype(np.float32)
    v = rng.standard_normal((n, K, D)).astype(np.float32)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) * 2
    table = np.array([[2, 0, 3]], np.int32)
    slots = (table[0][np.arange(n) // bs] * bs + np.arange(n) % bs).astype(np.int64)
    write_kv(kc, vc, slots, k, v)
    got = paged_attention(q, kc, vc, table, np.array([0, n]), np.array([0]), scale=0.3,
                          window=window, sinks=sinks)
    ref = attention_reference(q, k, v, np.arange(n), np.arange(n), scale=0.3, window=window,
                              sinks=sinks)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    plain = paged_attention(q, kc, vc, table, np.array([0, n]), np.array([0]), scale=0.3,
                            window=window)
    assert np.abs(plain - got).max() > 1e-2  # the sinks matter


def test_swiglu_oai_experts_with_biases_match_the_reference():
    rng = np.random.default_rng(2)
    E, ff, d, n = 6, 32, 32, 9
    h = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((E, d)).astype(np.float32)
    gu = [rng.standard_normal((2 * ff, d)).astype(np.float32) * 2 for _ in range(E)]
    down = [rng.standard_normal((d, ff)).astype(np.float32) / 4 for _ in range(E)]
    rb = rng.standard_normal(E).astype(np.float32)
    gub = rng.standard_normal((E, 2 * ff)).astype(np.float32)
    db = rng.standard_normal((E, d)).astype(np.float32)
    r = Routing(E, 3, gating="softmax_weight", norm=False)
    got = moe_ffn(h, router, gu, down, r, "swiglu_oai", router_bias=rb, gate_up_bias=gub,
                  down_bias=db)
    ref = moe_ffn_reference(h, router, gu, down, r, activation="swiglu_oai", router_bias=rb,
                            gate_up_bias=gub, down_bias=db)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    pre = np.stack([h @ g.T for g in gu])[..., :ff] + gub[:, None, :ff]
    assert (pre > 7).any()  # the clamp is exercised


def _report(got, ref, what):
    """(agreement where llama.cpp is sure, median |delta| / range), printed."""
    top2 = np.sort(ref["logits"], axis=1)[:, -2:]
    sure = top2[:, 1] - top2[:, 0] >= 0.5
    agree = got.argmax(1) == ref["top1"]
    rel = np.abs(got - ref["logits"]).max(1) / ref["range"]
    print(f"{what}: top-1 {100 * agree.mean():.2f}% of all, {100 * agree[sure].mean():.2f}% "
          f"of {int(sure.sum())} with margin >= 0.5; |dlogit| median {100 * np.median(rel):.4f}%"
          f", max {100 * rel.max():.4f}% of range")
    return agree[sure], rel


@pytest.mark.parametrize("case", CASES)
def test_q8_activations_match_llama_cpp_f32_kv(case):
    ref = reference("tiny-gpt-oss-f32kv", case)
    m = _load("blocks-q8")
    toks = ref["tokens"]
    n = len(toks)
    for sched in (None, [7] * ((n - 8) // 7) + [(n - 8) % 7] + [1] * 8):
        got, _ = run(m, toks, sched, kv="f32")
        agree, rel = _report(got, ref, f"gpt-oss/{case} q8 f32-KV {'chunked' if sched else ''}")
        assert agree.all()
        assert np.median(rel) < 0.005
        if case == "short":
            assert rel.max() < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_default_top1_where_llama_cpp_is_sure(case):
    ref = reference("tiny-gpt-oss", case)
    got, _ = run(_load("blocks"), ref["tokens"])
    agree, rel = _report(got, ref, f"gpt-oss/{case}")
    assert agree.all()
    assert np.median(rel) < 0.015


@pytest.mark.parametrize("mode", ["blocks", "blocks-q8"])
def test_experts_take_the_grouped_kernels_bit_for_bit(mode):
    """MXFP4 experts with biases and `swiglu_oai` on the grouped kernels: every layer's
    output equals the per-expert path's (`KVSHARE_MOE_GROUPED=0`), for 1, 5 and 40 rows."""
    import dataclasses  # noqa: PLC0415

    m = _load(mode)
    rng = np.random.default_rng(0)
    for L in m.layers:
        moe = L.moe
        assert moe.stacked_gate_up is not None and moe.stacked_down is not None
        assert moe.stacked_down.q8_0_acts == (mode == "blocks-q8")
        per_expert = dataclasses.replace(moe, stacked_gate_up=None, stacked_down=None)
        for n in (1, 5, 40):
            h = rng.standard_normal((n, m.config.n_embd)).astype(np.float32)
            np.testing.assert_array_equal(moe(h), per_expert(h))
