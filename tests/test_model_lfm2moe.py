"""LFM2 MoE (`lfm2moe`) against llama.cpp's full logits at every position of the five public
texts (tools_long: its first 2,048 tokens), one-shot, chunked and prefill-then-decode, and its
greedy continuations; the grouped kernels against the per-expert path.

Model (`scripts/make_tiny_lfm2moe.py`, from tiny-lfm2): 4 layers (short conv, attention,
short conv, attention), layer 0 dense (`leading_dense_block_count` 1), layers 1-3 with 8 F16
experts of FFN 32, 2 per token, sigmoid gating with a selection bias (`exp_probs_b`).
Tolerance: the dense and hybrid models' (tests/test_model_hybrid.py, tests/test_model_moe.py):
top-1 agreement >= 99.5% and max |delta logit| <= 0.5% of the position's logit range, at every
position whose routing is decided; a position where some layer's k-th and (k+1)-th selection
scores (sigmoid probability + bias) are within `TIE` (1e-4) may pick the other expert in
llama.cpp (f16 attention), and only such positions may differ by more.
Reference data: `tests/data/tiny-lfm2moe.logits.npz`, written by
`scripts/make_reference_logits.py` with llama.cpp built from the llama-cpp-python 0.3.36 sdist
(f16 KV, flash attention off, 2 threads).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import kvshare.ops.moe as ops_moe
from kvshare.backend import CPU_THREADS
from kvshare.model.batch import SeqChunk
from kvshare.model.loader import load_model
from kvshare.model.moe import MoeFFN

DATA = Path(__file__).parent / "data"
NAME = "tiny-lfm2moe"
CASES = ("short", "chat", "unicode", "code", "tools_long")
BS = 16
TOP1_MIN = 0.995
REL_MAX = 0.005
TIE = 1e-4
N_MOE = 3


@lru_cache(maxsize=None)
def model():
    return load_model(DATA / "models" / f"{NAME}.gguf")


@lru_cache(maxsize=None)
def reference(case: str) -> dict:
    with np.load(DATA / f"{NAME}.logits.npz") as d:
        q = d[f"{case}/logits_u16"].astype(np.float64)
        lo, rng = d[f"{case}/lo"], d[f"{case}/range"]
        return dict(tokens=d[f"{case}/tokens"], logits=lo[:, None] + q / 65535.0 * rng[:, None],
                    range=rng, top1=d[f"{case}/top1"].astype(np.int64), greedy=d[f"{case}/greedy"])


def n_blocks(n: int) -> int:
    return -(-n // BS)


@contextlib.contextmanager
def selection_gaps():
    """Per MoE layer call, the gap between the k-th and (k+1)-th selection score of each row
    (one thread, so each layer is one call over the step's rows in order)."""
    gaps: list[np.ndarray] = []
    route = ops_moe.route

    def recording(logits, routing, **kw):
        x = np.asarray(logits, np.float32)
        s = 1.0 / (1.0 + np.exp(-x))
        if kw.get("selection_bias") is not None:
            s = s + kw["selection_bias"]
        s = np.sort(s, axis=1)[:, ::-1]
        gaps.append(s[:, routing.k - 1] - s[:, routing.k])
        return route(logits, routing, **kw)

    threads = CPU_THREADS.max_threads
    ops_moe.route = recording
    CPU_THREADS.set_max(1)
    try:
        yield gaps
    finally:
        ops_moe.route = route
        CPU_THREADS.set_max(threads)


def run(m, tokens, schedule=None, kv="f16"):
    """(logits of every position, per position the smallest selection gap of any layer)."""
    n = len(tokens)
    cache = m.new_cache(n_blocks(n) + 1, BS, kv_dtype=kv, n_state_slots=1)
    table = np.arange(n_blocks(n))
    out, ties, i = [], [], 0
    for size in (schedule or [n]):
        size = min(size, n - i)
        if size <= 0:
            break
        with selection_gaps() as gaps:
            out.append(m.forward([SeqChunk(tokens[i : i + size], i, table, logits="all",
                                           state_slot=0)], cache)[0])
        assert len(gaps) == N_MOE
        ties.append(np.min(np.stack(gaps), axis=0))
        i += size
    assert i == n
    return np.concatenate(out), np.concatenate(ties)


def check(got, gaps, ref, what=""):
    decided = gaps >= TIE
    rel = np.abs(got - ref["logits"]).max(1) / ref["range"]
    top1 = float((got.argmax(1) == ref["top1"])[decided].mean())
    worst = float(rel[decided].max())
    print(f"{what}: top-1 {100 * top1:.2f}%, max |dlogit| {100 * worst:.4f}% (median "
          f"{100 * float(np.median(rel)):.4f}%) of range at {int(decided.sum())} decided "
          f"positions; ties at {np.nonzero(~decided)[0].tolist()} "
          f"(|dlogit| {[round(100 * float(r), 2) for r in rel[~decided]]}%)")
    assert top1 >= TOP1_MIN, what
    assert worst <= REL_MAX, what
    assert (~decided).sum() <= max(4, 0.05 * len(decided)), what


def test_load_layers_routing_and_experts():
    m = model()
    cfg = m.config
    assert type(m).__name__ == "Lfm2MoeModel" and cfg.arch == "lfm2moe"
    assert [type(L).__name__ for L in m.layers] == [
        "ShortConvLayer", "MoeAttentionLayer", "ShortConvLayer", "MoeAttentionLayer"]
    assert not isinstance(m.layers[0].w_gate_up, MoeFFN)  # the leading dense layer
    moe = m.layers[2].w_gate_up
    assert isinstance(moe, MoeFFN) and m.layers[2].w_down is None
    assert moe.routing.gating == "sigmoid" and moe.routing.norm and moe.routing.k == 2
    assert moe.selection_bias.shape == (8,) and moe.n_ff_exp == 32
    assert m.layers[1].moe.stacked_gate_up is not None  # the grouped kernels on the CPU


@pytest.mark.parametrize("case", CASES)
def test_one_shot_matches_llama_cpp(case):
    ref = reference(case)
    got, gaps = run(model(), ref["tokens"])
    check(got, gaps, ref, what=f"{NAME}/{case} one-shot")


@pytest.mark.parametrize("case", ("short", "chat", "unicode", "code"))
def test_chunked_decode_and_f32_kv_match_llama_cpp(case):
    ref = reference(case)
    toks = ref["tokens"]
    n = len(toks)
    for sched, kv in (([7] * 20, "f16"), ([n - 8] + [1] * 8, "f16"), (None, "f32")):
        got, gaps = run(model(), toks, sched, kv)
        check(got, gaps, ref, what=f"{NAME}/{case} {kv} chunks {(sched or [n])[:2]}...")


def test_greedy_continuation():
    """llama.cpp's 24 greedy tokens after each text, one decode step at a time."""
    m = model()
    for case in CASES:
        ref = reference(case)
        toks, want = ref["tokens"], ref["greedy"].tolist()
        n = len(toks)
        cache = m.new_cache(n_blocks(n + len(want)) + 1, BS, kv_dtype="f16", n_state_slots=1)
        table = np.arange(n_blocks(n + len(want)))
        chunk = SeqChunk(toks, 0, table, logits="last", state_slot=0)
        out = []
        for i in range(len(want)):
            lg = m.forward([chunk], cache)[0]
            out.append(int(lg[-1].argmax()))
            chunk = SeqChunk([out[-1]], n + i, table, state_slot=0)
        assert out == want, case


def test_grouped_kernels_equal_the_per_expert_path():
    m = model()
    toks = reference("code")["tokens"]
    grouped, _ = run(m, toks, kv="f32")
    saved = [(L.moe if hasattr(L, "moe") else L.w_gate_up) for L in m.layers[1:]]
    stacks = [(moe.stacked_gate_up, moe.stacked_down) for moe in saved]
    try:
        for moe in saved:
            moe.stacked_gate_up = moe.stacked_down = None
        per_expert, _ = run(m, toks, kv="f32")
    finally:
        for moe, (gu, d) in zip(saved, stacks):
            moe.stacked_gate_up, moe.stacked_down = gu, d
    # F16 experts with more than 16 tokens take NumPy's matmul on the per-expert path
    np.testing.assert_allclose(grouped, per_expert, rtol=0, atol=1e-5 * np.abs(grouped).max())
