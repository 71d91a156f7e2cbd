"""Mixture-of-experts models on the 8-bit-activation products (`blocks-vnni`, the default for a
MoE file whose every matrix has a VNNI kernel, its F32 router aside): the router's product is
batch-invariant (`ops.moe.router_logits`: a row's logits are the same bits alone, in a batch of
7 or in a 40-row prefill chunk, on one thread or several), which `vnni_eligible` relies on to
accept such files; on one (a random 2-layer `qwen3moe` in llama.cpp's Q4_K_M mix, F32 router,
written by scripts/make_random_gguf.py) every chunking and batching of a prompt gives the same
logits bit for bit, and the engine's prefix sharing gives a cold run's tokens and logprobs
exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvshare import _core
from kvshare.backend import CPU_THREADS
from kvshare.model.batch import SeqChunk
from kvshare.model.gguf_file import GGUFFile
from kvshare.model.loader import load_model
from kvshare.model.weights import vnni_eligible
from kvshare.ops import moe as ops_moe
from kvshare.ops.linear import linear
from kvshare.ops.moe import router_logits
from kvshare.ops.moe_routing import Routing, route
from kvshare.ops.parallel import ROWS

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "data" / "models"
VNNI = bool(getattr(_core, "block_vnni_available", lambda: False)())
BS = 16


def _router(rng, n_expert=128, n_embd=2048):
    # Qwen3-30B-A3B's router shape by default
    return (rng.standard_normal((n_expert, n_embd)) / np.sqrt(n_embd)).astype(np.float32)


def test_router_row_alone_equals_the_row_inside_a_batch():
    """Row 3 of a batch of 7 (and row 21 of a 40-row chunk, past a 16-row boundary) has the
    logits and routing it has alone, bit for bit, with and without a bias, on one thread or
    all of them, inside a row-parallel part or not."""
    rng = np.random.default_rng(0)
    router = _router(rng)
    bias = rng.standard_normal(128).astype(np.float32)
    h = rng.standard_normal((40, 2048)).astype(np.float32)
    routing = Routing(n_expert=128, k=8)
    threads = CPU_THREADS.max_threads
    for b in (None, bias):
        batch7 = router_logits(h[:7], router, b)
        batch40 = router_logits(h, router, b)
        for i in (0, 3, 6):
            alone = router_logits(h[i : i + 1], router, b)
            np.testing.assert_array_equal(alone[0], batch7[i])
            np.testing.assert_array_equal(alone[0], batch40[i])
        for i in (16, 21, 39):
            np.testing.assert_array_equal(router_logits(h[i : i + 1], router, b)[0], batch40[i])
        ids7, w7 = route(batch7, routing)
        ids1, w1 = route(router_logits(h[3:4], router, b), routing)
        np.testing.assert_array_equal(ids1[0], ids7[3])
        np.testing.assert_array_equal(w1[0], w7[3])
        try:
            CPU_THREADS.set_max(1)
            one_thread = router_logits(h[:7], router, b)
        finally:
            CPU_THREADS.set_max(threads)
        np.testing.assert_array_equal(one_thread, batch7)
        in_parts = ROWS.run(lambda sl, b=b: router_logits(h[sl], router, b),
                            [slice(0, 20), slice(20, 40)])
        np.testing.assert_array_equal(np.concatenate(in_parts), batch40)
        # the same product as BLAS's up to float summation order
        np.testing.assert_allclose(batch40, linear(h, router, b), rtol=0, atol=1e-5)


def test_router_logits_of_other_forms_take_linear():
    """A router that is not an f32 array (block weights, f64 oracles) is `linear`'s."""
    rng = np.random.default_rng(1)
    router = _router(rng, 8, 64).astype(np.float64)
    h = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(router_logits(h, router), linear(h, router))


@pytest.fixture(scope="module")
def q4km_moe(tmp_path_factory) -> Path:
    """A random 2-layer hidden-256 qwen3moe (8 experts, 2 per token) in the Q4_K_M mix."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_random_gguf  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    out = tmp_path_factory.mktemp("moe") / "tiny-q4km-qwen3moe.gguf"
    make_random_gguf.write(out, "qwen3moe", "tiny", tokenizer_from=MODELS / "tiny-qwen3moe.gguf")
    return out


def test_vnni_eligible_takes_moe_files_with_an_f32_router(q4km_moe):
    """The Q4_K_M-mix MoE file (F32 routers) takes the VNNI default; MoE files with experts or
    projections of types without a VNNI kernel (f16 / F32 attention, MXFP4) or recurrent
    layers do not."""
    gf = GGUFFile(q4km_moe)
    assert any(n.endswith("ffn_gate_inp.weight") and int(t.qtype) == 0
               for n, t in gf.tensors.items())
    assert vnni_eligible(gf, 0)
    assert not vnni_eligible(gf, 1)
    for name in ("tiny-qwen3moe", "tiny-qwen3moe-q8", "tiny-gpt-oss"):
        assert not vnni_eligible(GGUFFile(MODELS / f"{name}.gguf"), 0), name


@pytest.fixture(scope="module")
def vnni_model(q4km_moe):
    if not VNNI:
        pytest.skip("needs AVX512-VNNI")
    mp = pytest.MonkeyPatch()
    mp.delenv("KVSHARE_CPU_WEIGHTS", raising=False)
    mp.delenv("KVSHARE_CPU_Q8", raising=False)
    try:
        m = load_model(q4km_moe)
    finally:
        mp.undo()
    moe = [L.moe for L in m.layers if getattr(L, "moe", None) is not None]
    assert moe and all(x.stacked_gate_up.activations == "vnni" for x in moe)
    return m


def _blocks(n: int) -> int:
    return -(-n // BS)


def _run(m, tokens, schedule, cache=None, table=None):
    n = len(tokens)
    if cache is None:
        cache = m.new_cache(_blocks(n) + 1, BS, kv_dtype="f32")
        table = np.arange(_blocks(n))
    out, i = [], 0
    for size in schedule:
        size = min(size, n - i)
        out.append(m.forward([SeqChunk(tokens[i : i + size], i, table, logits="all")],
                             cache)[0])
        i += size
    assert i == n
    return np.concatenate(out)


def test_vnni_moe_chunkings_and_batches_are_bit_equal(vnni_model):
    """One-shot, chunks, single decode steps and a batch of sequences with another's prefill
    give every token the same logits, bit for bit (with the router on BLAS they differed by
    ~1e-6)."""
    m = vnni_model
    rng = np.random.default_rng(2)
    toks = [rng.integers(0, 360, n).tolist() for n in (70, 50, 40)]
    solo = [_run(m, t, [len(t)]) for t in toks]
    for sched in ([7] * 10, [13, 20, 1, 1, 35], [64] + [1] * 6, [1] * 70):
        np.testing.assert_array_equal(_run(m, toks[0], sched), solo[0], err_msg=str(sched[:5]))
    cache = m.new_cache(40, BS, kv_dtype="f32")
    tables = [np.arange(i * 10, i * 10 + 10) for i in range(3)]
    got: list[list[np.ndarray]] = [[], [], []]

    def step(items):
        chunks = [SeqChunk(toks[s][a:b], a, tables[s], logits="all") for s, a, b in items]
        for (s, _, _), lg in zip(items, m.forward(chunks, cache)):
            got[s].append(lg)

    step([(0, 0, 40), (1, 0, 40)])
    step([(0, 40, 41), (1, 40, 41), (2, 0, 30)])
    for i in range(3):
        step([(0, 41 + i, 42 + i), (1, 41 + i, 42 + i), (2, 30 + i, 31 + i)])
    for s, end in enumerate((44, 44, 33)):
        np.testing.assert_array_equal(np.concatenate(got[s]), solo[s][:end])


def test_vnni_moe_router_is_the_invariant_one(vnni_model, monkeypatch):
    """The model's MoE layers take `router_logits` (a BLAS router would break the test
    above)."""
    calls = []
    real = ops_moe.router_logits

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ops_moe, "router_logits", counting)
    _run(vnni_model, [1, 2, 3], [3])
    assert len(calls) == vnni_model.config.n_layers


def test_vnni_moe_shared_prefix_changes_nothing(vnni_model, q4km_moe):
    """Through the engine: sessions sharing a system prompt, one after another and submitted
    together, generate a cold run's tokens and logprobs (top 3 included) exactly."""
    from test_engine_moe import (chat_request, cold_run, common_len, engine, outputs,  # noqa: PLC0415
                                 serve, submit, system_prompt)

    from kvshare.model.chat_template import ChatTemplate  # noqa: PLC0415
    from kvshare.model.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_gguf(q4km_moe)
    parts = (vnni_model, tok, ChatTemplate.from_gguf(q4km_moe, tok),
             bytes.fromhex(vnni_model.fingerprint))
    eng = engine(parts)
    system = system_prompt("qwen3moe")
    reqs = [chat_request(eng, system, q) for q in
            ("List the failing tests.", "Open the build log.", "Who changed main.py?")]
    assert common_len(reqs[0].prompt_tokens, reqs[1].prompt_tokens) >= 300
    cold = [cold_run(parts, r) for r in reqs]
    got = [serve(eng, r)[0] for r in reqs]
    assert got == cold
    handles = [submit(eng, r) for r in reqs]
    eng.run_until_idle()
    assert [outputs(h)[0] for h in handles] == cold
