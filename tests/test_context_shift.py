"""Context shift (llama-server's --context-shift, engine/context_shift.py) in the engine: a
reply that fills its context drops part of its past and goes on; the tokens after each shift
are what a cold computation of the shifted token list gives; off, the reply ends with
`length`; a block another live sequence shares is never written; hybrids do not shift.

The server half (llama.cpp's test_ctx_shift.py requests on a real kvshare server) is in
tests/test_context_shift_server.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.context_shift import plan_shift
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer
from tests.tier_helpers import TINY_MODEL

MODELS = Path(__file__).parent / "data" / "models"
GREEDY = SamplingParams(temperature=0.0)
CTX = 64
TEXT = ("Once upon a time there was a little cat who liked to sit in the sun and watch the "
        "birds fly over the old stone wall of the garden")


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(TINY_MODEL)), Tokenizer.from_gguf(str(TINY_MODEL))


def make_engine(parts, **kw) -> Engine:
    model, tok = parts
    cfg = EngineConfig(**{"ctx_size": CTX, "kv_blocks": 64, "block_size": 16,
                          "cache_ram_mib": 0, **kw})
    return Engine(model, tok, None, bytes.fromhex(model.fingerprint), cfg)


def request(ids: list[int], max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=list(ids), max_tokens=max_tokens, sampling=GREEDY,
                             ignore_eos=True, logprobs=True, top_logprobs=1, **kw)


def results(handle) -> tuple[list[int], list[float], FinishEvent]:
    events = list(handle.events(timeout=0))
    toks = [e for e in events if not isinstance(e, FinishEvent) and e.token_id >= 0]
    fin = events[-1]
    assert isinstance(fin, FinishEvent)
    return [e.token_id for e in toks], [e.logprob.logprob for e in toks], fin


def generate(eng: Engine, req: GenerationRequest):
    h = eng.submit(req)
    eng.run_until_idle()
    eng.pool.check_invariants()
    return results(h)


def shifted_lists(prompt: list[int], gen: list[int], n_keep: int, add_bos: bool,
                  ctx: int = CTX) -> list[tuple[int, list[int]]]:
    """llama-server's shifts replayed on the token list, written out independently of the
    engine: [(index of the first token generated after the shift, the token list it was
    computed from)]. The context is full when the tokens in it (all but the pending last
    one) plus one reach `ctx`."""
    toks, out = list(prompt), []
    for i, t in enumerate(gen):
        full = len(toks) + 1 >= ctx
        toks.append(t)
        if full:
            keep = min(ctx - 4, (len(prompt) if n_keep < 0 else n_keep) + (1 if add_bos else 0))
            n_left = len(toks) - 1 - keep
            toks = toks[:keep] + toks[keep + n_left // 2:]
            out.append((i + 1, list(toks)))
    return out


def assert_matches_cold(tiny, prompt, gen, lps, n_keep: int = 0, ctx: int = CTX) -> int:
    """Every token generated after a shift is what a cold engine (nothing cached, a context
    large enough) generates from the shifted token list; returns the shifts checked."""
    cold = make_engine(tiny, ctx_size=512, kv_blocks=64, slot_attach=False)
    shifts = shifted_lists(prompt, gen, n_keep, bool(tiny[1].add_bos), ctx)
    bounds = [i for i, _ in shifts[1:]] + [len(gen)]
    for (start, toks), end in zip(shifts, bounds):
        if start >= len(gen):
            continue
        want, want_lp, _ = generate(cold, request(toks, end - start))
        assert gen[start:end] == want, f"tokens after the shift at {start} differ"
        np.testing.assert_allclose(lps[start:end], want_lp, atol=2e-3)
    return len(shifts)


def prompt_ids(tiny, n: int) -> list[int]:
    ids = tiny[1].encode(TEXT * 4, add_special=True)
    assert len(ids) >= n
    return ids[:n]


def test_plan_shift_is_llama_servers_arithmetic():
    # test_ctx_shift.py's slot: n_ctx 256, full at 255 tokens, BOS added
    s = plan_shift(255, 226, 256)
    assert (s.n_keep, s.n_discard) == (1, 127)
    s = plan_shift(255, 226, 256, n_keep=-1)  # the whole prompt and BOS kept
    assert (s.n_keep, s.n_discard) == (227, 14)
    s = plan_shift(255, 226, 256, n_keep=10, n_discard=5, add_bos=False)
    assert (s.n_keep, s.n_discard) == (10, 5)
    s = plan_shift(255, 226, 256, n_keep=1000)  # at most n_ctx - 4 kept
    assert (s.n_keep, s.n_discard) == (252, 1)
    s = plan_shift(63, 10, 64, n_discard=1000)  # at least one token after the kept ones stays
    assert (s.n_keep, s.n_discard) == (1, 61)
    assert plan_shift(4, 2, 64, n_keep=-1).n_discard == 0  # nothing after the kept ones


def test_shift_off_stops_with_length(tiny):
    prompt = prompt_ids(tiny, 40)
    gen, _, fin = generate(make_engine(tiny), request(prompt, 200))
    assert fin.reason == "length" and fin.n_discarded == 0
    assert len(prompt) + len(gen) == CTX  # the last token never computed: the context is full


@pytest.mark.parametrize("n_keep", [0, 20, -1])
def test_shift_matches_cold_recomputation(tiny, n_keep):
    prompt = prompt_ids(tiny, 40)
    eng = make_engine(tiny, context_shift=True)
    gen, lps, fin = generate(eng, request(prompt, 120, n_keep=n_keep))
    assert fin.reason == "length" and len(gen) == 120
    n = assert_matches_cold(tiny, prompt, gen, lps, n_keep)
    assert n >= 2 and eng.counters["context_shifts"] == n
    assert fin.n_discarded > 0 and fin.timings.prompt_n == len(prompt)
    assert eng.pool.stats()["used"] == 0  # every block given back


def test_shift_never_writes_a_shared_block(tiny):
    """A keeps 21 tokens (n_keep 20 + BOS) of a prompt whose first two blocks B shares: after
    A's shift block 0 is still shared, block 1 is copied (copy-on-write) before A writes past
    the kept tokens; B's blocks hold the same K/V throughout and B's reply is its reply
    alone."""
    prompt = prompt_ids(tiny, 48)
    other = prompt[:32] + tiny[1].encode(" a dog", add_special=False)
    solo = generate(make_engine(tiny), request(other, 24))
    eng = make_engine(tiny, context_shift=True)
    ha = eng.submit(request(prompt, 40, n_keep=20))
    hb = eng.submit(request(other, 24))
    seqs = {s.request.prompt_tokens == prompt: s for s in eng._seqs.values()}
    a, b = seqs[True], seqs[False]
    before = None
    while eng.scheduler.has_work() or eng._inbox:
        eng._drain_inbox()
        eng.step()
        if before is None and len(b.block_table) >= 2 and b.n_computed >= 32:
            shared = list(b.block_table[:2])
            assert shared == a.block_table[:2]  # B attached to A's prompt blocks
            before = [eng.kv.read_block(x).copy() for x in shared]
        if eng.counters["context_shifts"] and a.n_computed == len(a.tokens) - 1:
            # A recomputed its shifted list while B is alive
            assert b in eng.scheduler.running
            assert a.block_table[0] == shared[0] and a.block_table[1] != shared[1]
            for x, data in zip(shared, before):
                np.testing.assert_array_equal(eng.kv.read_block(x), data)
            break
    else:
        pytest.fail("A never shifted")
    eng.run_until_idle()
    eng.pool.check_invariants()
    gen_a, lps_a, fin_a = results(ha)
    gen_b, lps_b, _ = results(hb)
    assert gen_b == solo[0]
    np.testing.assert_allclose(lps_b, solo[1], atol=2e-3)  # batched with A: float noise
    assert fin_a.n_discarded > 0
    assert_matches_cold(tiny, prompt, gen_a, lps_a, n_keep=20)


def test_choices_shift_each(tiny):
    """n = 2: each choice shifts its own list; the prompt blocks they share stay intact."""
    prompt = prompt_ids(tiny, 40)
    eng = make_engine(tiny, context_shift=True)
    req = request(prompt, 60, n=2)
    req.sampling = SamplingParams(temperature=1.0, seed=3)
    h = eng.submit(req)
    eng.run_until_idle()
    eng.pool.check_invariants()
    fins = [e for e in h.events(timeout=0) if isinstance(e, FinishEvent)]
    assert sorted(f.index for f in fins) == [0, 1]
    assert all(f.reason == "length" and f.completion_tokens == 60 and f.n_discarded > 0
               for f in fins)


def test_sliding_window_model_shifts_as_cold(tiny):
    """gpt-oss's sliding-window layers (a 128-token window, in a pool of their own): the
    re-admitted list's window is computed afresh, past the window as within it."""
    path = MODELS / "tiny-gpt-oss.gguf"
    parts = load_model(str(path)), Tokenizer.from_gguf(str(path))
    ctx = 224
    eng = make_engine(parts, context_shift=True, ctx_size=ctx)
    assert eng.windows is not None and eng.model.config.sliding_window < ctx
    prompt = parts[1].encode(TEXT * 4, add_special=True)[:150]
    gen, lps, fin = generate(eng, request(prompt, 240))
    assert fin.n_discarded > 0
    assert assert_matches_cold(parts, prompt, gen, lps, ctx=ctx) >= 2


def test_hybrid_does_not_shift():
    path = MODELS / "tiny-lfm2.gguf"
    parts = load_model(str(path)), Tokenizer.from_gguf(str(path))
    eng = make_engine(parts, context_shift=True)
    assert eng.hybrid and not eng.context_shift
    prompt = parts[1].encode(TEXT, add_special=True)[:40]
    gen, _, fin = generate(eng, request(prompt, 200))
    assert fin.reason == "length" and fin.n_discarded == 0
    assert len(prompt) + len(gen) == CTX
