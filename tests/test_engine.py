"""The engine on the real default model (Gemma 3 270M): sharing changes nothing but speed.

Drives `Engine.step()` on the test's thread (`run_until_idle`) so interleavings are exact.
"""

from __future__ import annotations

import time

import pytest

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import default_model_path, load_model
from kvshare.model.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def parts():
    path = default_model_path()
    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    return model, tok, ChatTemplate.from_gguf(path, tok), bytes.fromhex(model.fingerprint)


def make_engine(parts, **kw) -> Engine:
    model, tok, tmpl, fp = parts
    cfg = EngineConfig(**{"kv_blocks": 256, "block_size": 16, "prefill_chunk": 64, **kw})
    return Engine(model, tok, tmpl, fp, cfg)


def prompt(parts, system: str, user: str) -> list[int]:
    model, tok, tmpl, _ = parts
    text = tmpl.render([{"role": "system", "content": system}, {"role": "user", "content": user}])
    return tok.encode(text)


SYSTEM = ("You are a terse assistant for a software team. Answer in one short sentence. "
          "Tools: search(query), open(path), run(cmd). ") * 3


def submit(eng: Engine, ids, n=8, **kw):
    return eng.submit(GenerationRequest(prompt_tokens=list(ids), max_tokens=n, sampling=kw.pop("sampling", GREEDY), **kw))


def collect(handle):
    tokens, fin = handle.result(timeout=0)
    return [t.token_id for t in tokens if t.token_id >= 0], fin


def solo(parts, ids, n=8, **kw):
    eng = make_engine(parts, slot_attach=False)
    h = submit(eng, ids, n, **kw)
    eng.run_until_idle()
    return collect(h)


def assert_idle(eng: Engine):
    eng.pool.check_invariants()
    stats = eng.pool.stats()
    assert stats["used"] == 0, stats
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_sharing_on_and_off_give_identical_tokens(parts):
    prompts = [prompt(parts, SYSTEM, q) for q in ["Where is main?", "List the tests.", "Who wrote this?"]]
    outs = {}
    for attach in (True, False):
        eng = make_engine(parts, slot_attach=attach)
        handles = [submit(eng, p) for p in prompts]
        eng.run_until_idle()
        outs[attach] = [collect(h) for h in handles]
        assert_idle(eng)
    for (a, _fa), (b, fb) in zip(outs[True], outs[False]):
        assert a == b
        assert fb.timings.cache_n == 0
    # With sharing the 2nd and 3rd sessions reuse the common prefix.
    common = len(_common_prefix(prompts[0], prompts[1]))
    assert outs[True][1][1].timings.cache_n >= common - 16


@pytest.mark.parametrize("swa_full", [True, False])
def test_concurrent_sessions_share_a_new_prefix_after_a_partial_attach(parts, swa_full):
    """An earlier, unrelated request leaves the chat template's opening tokens cached, so new
    prompts attach to part of a block (a copy-on-write of a few tokens) and start computing
    mid-block. Two such sessions arriving together on one new prefix must still compute it
    once: the second waits for the first's blocks instead of computing them too. With the
    sliding-window layers in their own pool (`swa_full` False) the partial block is copied in
    both pools, and the second session takes the first one's window blocks with its
    main-pool blocks."""
    eng = make_engine(parts, swa_full=swa_full)
    h0 = submit(eng, prompt(parts, "Be brief.", "Say OK."), 2)
    eng.run_until_idle()
    collect(h0)
    system = SYSTEM * 3
    a, b = prompt(parts, system, "Where is main?"), prompt(parts, system, "List the tests.")
    ha, hb = submit(eng, a), submit(eng, b)
    eng.run_until_idle()
    (ta, fa), (tb, fb) = collect(ha), collect(hb)
    common = len(_common_prefix(a, b))
    assert common > 4 * 64  # several chunks of the first session
    assert (eng.windows is None) == swa_full
    assert 0 < fa.timings.cache_n < 16  # the partial match of the template's opening
    # the second session computes at most the rest of its partial block and its own tail
    assert fb.timings.cache_n >= common - 2 * 16, (fb.timings.cache_n, common)
    assert (ta, tb) == (solo(parts, a)[0], solo(parts, b)[0])
    assert_idle(eng)


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_prompt_cache_semantics(parts):
    eng = make_engine(parts)
    base = prompt(parts, SYSTEM, "Explain the build.")
    h1 = submit(eng, base, 4)
    eng.run_until_idle()
    toks1, f1 = collect(h1)
    assert f1.timings.prompt_n + f1.timings.cache_n == len(base)
    # The same prompt again: all but at most one token reused.
    h2 = submit(eng, base, 4)
    eng.run_until_idle()
    toks2, f2 = collect(h2)
    assert f2.timings.cache_n >= len(base) - 1 and f2.timings.prompt_n >= 1
    assert f2.timings.prompt_n + f2.timings.cache_n == len(base)
    assert toks2 == toks1
    # A prompt extending the earlier one reuses the earlier one in full (not block aligned:
    # the partial last block is copied, never shared for writing).
    longer = base + toks1 + parts[1].encode(" And the tests?", add_special=False)
    h3 = submit(eng, longer, 4)
    eng.run_until_idle()
    toks3, f3 = collect(h3)
    assert f3.timings.cache_n >= len(base)
    assert toks3 == solo(parts, longer, 4)[0]
    assert_idle(eng)


def test_reuse_cache_false_recomputes_the_prompt(parts):
    """llama-server `cache_prompt: false`: the whole prompt is computed although it is cached,
    the reply is the same, and what it computed is shared again afterwards."""
    eng = make_engine(parts)
    base = prompt(parts, SYSTEM, "Explain the release.")
    toks1, f1 = collect(run_one(eng, base))
    toks2, f2 = collect(run_one(eng, base, reuse_cache=False))
    assert f2.timings.cache_n == 0 and f2.timings.prompt_n == len(base)
    assert toks2 == toks1
    toks3, f3 = collect(run_one(eng, base))
    assert f3.timings.cache_n >= len(base) - 1
    assert_idle(eng)


def run_one(eng: Engine, ids, n=4, **kw):
    h = submit(eng, ids, n, **kw)
    eng.run_until_idle()
    return h


def test_donor_unchanged_when_another_session_attaches_mid_generation(parts):
    donor_ids = prompt(parts, SYSTEM, "Describe the repository layout.")
    other_ids = prompt(parts, SYSTEM, "What does the CI run?")
    ref_donor, _ = solo(parts, donor_ids, 12)
    ref_other, _ = solo(parts, other_ids, 6)
    eng = make_engine(parts)
    hd = submit(eng, donor_ids, 12)
    # Run until the donor has produced a few tokens, then attach a second session.
    while not eng.scheduler.running or eng.scheduler.running[0].n_generated < 4:
        eng._drain_inbox()
        eng.step()
    ho = submit(eng, other_ids, 6)
    eng.run_until_idle()
    got_donor, fd = collect(hd)
    got_other, fo = collect(ho)
    assert got_donor == ref_donor
    assert got_other == ref_other
    assert fo.timings.cache_n >= len(_common_prefix(donor_ids, other_ids)) - 16
    assert_idle(eng)


def test_preemption_instead_of_failure(parts):
    prompts = [prompt(parts, SYSTEM + f" Session {i}.", "Say something.") for i in range(3)]
    refs = [solo(parts, p, 10)[0] for p in prompts]
    need = -(-(len(prompts[0]) + 10) // 16)
    # Room for about 1.5 sequences: the scheduler must preempt and resume, not fail.
    eng = make_engine(parts, kv_blocks=need + need // 2, slot_attach=False)
    handles = [submit(eng, p, 10) for p in prompts]
    eng.run_until_idle()
    for h, ref in zip(handles, refs):
        got, fin = collect(h)
        assert fin.reason == "length", fin
        assert got == ref
    assert eng.counters["preemptions"] >= 1
    assert_idle(eng)


def test_cancel_frees_blocks_and_reports(parts):
    eng = make_engine(parts)
    h = submit(eng, prompt(parts, SYSTEM, "Write a long story."), 200)
    for _ in range(4):
        eng._drain_inbox()
        eng.step()
    h.cancel()
    eng.run_until_idle()
    events = list(h.events(timeout=0))
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "cancelled"
    assert_idle(eng)


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(parts):
    ids = prompt(parts, SYSTEM, "Give me three words.")
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
    a, _ = solo(parts, ids, 8, sampling=sp)
    b, _ = solo(parts, ids, 8, sampling=sp)
    assert a == b
    eng = make_engine(parts)
    h = submit(eng, ids, 24)
    eng.run_until_idle()
    toks, _ = h.result(timeout=0)
    full = "".join(t.text for t in toks)
    assert len(full) > 3
    stop = full[2:4]
    h2 = submit(eng, ids, 24, stop=[stop])
    eng.run_until_idle()
    toks2, fin2 = h2.result(timeout=0)
    text2 = "".join(t.text for t in toks2)
    assert fin2.reason == "stop"
    assert stop not in text2 and full.startswith(text2)


def test_concurrent_prompts_get_their_first_tokens_one_step_after_another(parts):
    """Four ~150-token prompts at once (agent sessions sending their next turn): a step that
    finishes one prompt takes no other once it holds FINISHED_STEP_TOKENS prompt tokens, so
    the first tokens come one step after another instead of all at the end of one large
    step; short prompts still share a step."""
    from kvshare.engine.scheduler import FINISHED_STEP_TOKENS

    _, tok, _, _ = parts
    eng = make_engine(parts, prefill_chunk=512, parallel=4)
    long_prompts = [prompt(parts, f"Session {i} of the fleet. " + SYSTEM * 2, f"Task {i}: list the files.")
                    for i in range(4)]
    assert all(FINISHED_STEP_TOKENS <= len(p) <= 512 // 2 for p in long_prompts)
    handles = [submit(eng, ids, n=4) for ids in long_prompts]
    started = []
    for _ in range(4):
        eng._drain_inbox()
        eng.step()
        started.append(sum(not h._sync.empty() for h in handles))
    assert started == [1, 2, 3, 4]
    eng.run_until_idle()
    for ids, h in zip(long_prompts, handles):
        assert collect(h)[0] == solo(parts, ids, n=4)[0]

    short = [tok.encode(f"Question {i}: what is {i} plus {i}?") for i in range(4)]
    assert all(len(p) < FINISHED_STEP_TOKENS // 4 for p in short)
    handles = [submit(eng, ids, n=2) for ids in short]
    eng._drain_inbox()
    eng.step()
    assert all(not h._sync.empty() for h in handles)
    eng.run_until_idle()
    assert_idle(eng)


def test_warming_up_from_start_until_the_models_start_up_work_is_done(parts, monkeypatch):
    """A GPU model's engine says it is warming up (/health: loading) from `start` until the
    model's start-up work ends, and requests queue meanwhile; a CPU model's never does."""
    import threading  # noqa: PLC0415
    import types  # noqa: PLC0415

    eng = make_engine(parts)
    eng.start()
    assert not eng.warming_up()  # a CPU model: nothing to prepare
    eng.shutdown()

    eng = make_engine(parts)
    gate, entered = threading.Event(), threading.Event()

    def warm_up(*a):
        entered.set()
        assert gate.wait(10)
        return 0

    monkeypatch.setattr(eng, "model", types.SimpleNamespace(
        config=eng.model.config, backend=types.SimpleNamespace(is_gpu=True), warm_up=warm_up))
    eng.start()
    assert eng.warming_up()
    assert entered.wait(10)
    assert eng.warming_up()  # still preparing
    gate.set()
    deadline = time.monotonic() + 10
    while eng.warming_up() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng.warming_up()
    eng.shutdown()
