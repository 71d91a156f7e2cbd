"""Hybrid models in the engine: attach at shared immutable checkpoints, divergence checkpoints,
and sharing that changes nothing but speed (tiny qwen35 and lfm2 GGUFs, real tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer

MODELS = Path(__file__).parent / "data" / "models"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["tiny-qwen35.gguf", "tiny-lfm2.gguf"])
def parts(request):
    path = MODELS / request.param
    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    return model, tok, ChatTemplate.from_gguf(path, tok), bytes.fromhex(model.fingerprint)


def make_engine(parts, **kw) -> Engine:
    model, tok, tmpl, fp = parts
    return Engine(model, tok, tmpl, fp, EngineConfig(**{"kv_blocks": 1024, "prefill_chunk": 512, **kw}))


def system_prompt(tok, n_tokens: int, date: str) -> str:
    """A system prompt of about n_tokens tokens whose last words are a date."""
    words = []
    i = 0
    while len(tok.encode(" ".join(words), add_special=False)) < n_tokens:
        words.extend(f"tool{i}(arg) does thing {i};".split())
        i += 1
    return " ".join(words) + f" Today is {date}."


def chat(eng: Engine, system: str, user: str):
    text, boundary = eng.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": user}])
    return eng.tokenize(text), boundary


def run(eng: Engine, ids, boundary, n=6, logprobs=False):
    h = eng.submit(GenerationRequest(prompt_tokens=list(ids), max_tokens=n, sampling=GREEDY,
                                     first_user_boundary=boundary, logprobs=logprobs, top_logprobs=0))
    eng.run_until_idle()
    toks, fin = h.result(timeout=0)
    return [t.token_id for t in toks if t.token_id >= 0], fin, [t.logprob.logprob for t in toks if t.logprob]


def common_len(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_divergence_checkpoint_lets_a_third_prompt_resume_at_the_split(parts):
    tok = parts[1]
    eng = make_engine(parts)
    cold = make_engine(parts, slot_attach=False)
    dates = ("1 March 2026", "2 April 2027", "3 May 2028")

    def make(n):
        return [chat(eng, system_prompt(tok, n, d), "What is on the schedule?") for d in dates]

    first = make(3000)
    prompts = make(3000 - (common_len(first[0][0], first[1][0]) - 3000))  # split at ~3,000
    (a, ba), (b, bb), (c, bc) = prompts
    split = common_len(a, b)
    assert abs(split - 3000) <= 16 and common_len(a, c) == split == common_len(b, c)
    assert ba is not None and ba > split  # the split lies before the first user message
    for ids, bnd in prompts[:2]:
        got, fin, _ = run(eng, ids, bnd)
        assert got == run(cold, ids, bnd)[0]
    # B saved a checkpoint exactly at the split; C resumes there.
    got, fin, _ = run(eng, c, bc)
    assert got == run(cold, c, bc)[0]
    assert fin.timings.cache_n == split
    assert fin.timings.prompt_n <= len(c) - 3000 + 16
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0


def test_concurrent_sessions_match_solo_runs_and_count_checkpoints_once(parts):
    tok = parts[1]
    system = system_prompt(tok, 1500, "9 June 2026")
    eng = make_engine(parts, prefill_chunk=256)
    cold = make_engine(parts, slot_attach=False)
    sessions = [chat(eng, system, q) for q in ("List files.", "Run the tests.", "Show the diff.")]
    solo = [run(cold, ids, bnd, n=10, logprobs=True) for ids, bnd in sessions]
    # Donor first; the others arrive while it decodes and attach at its checkpoints.
    handles = [eng.submit(GenerationRequest(prompt_tokens=sessions[0][0], max_tokens=10, sampling=GREEDY,
                                            first_user_boundary=sessions[0][1], logprobs=True))]
    while not eng.scheduler.running or eng.scheduler.running[0].n_generated < 3:
        eng._drain_inbox()
        eng.step()
    for ids, bnd in sessions[1:]:
        handles.append(eng.submit(GenerationRequest(prompt_tokens=ids, max_tokens=10, sampling=GREEDY,
                                                    first_user_boundary=bnd, logprobs=True)))
    # While all three run, the checkpoints they hold are counted once.
    for _ in range(3):
        eng._drain_inbox()
        eng.step()
    held = [ck for s in eng.scheduler.running for ck in s.held_checkpoints]
    distinct = {ck.key: ck.nbytes for ck in held}
    snap = eng.snapshot()["checkpoints"]
    assert len(held) > len(distinct), "sessions should share a checkpoint"
    assert snap["live_bytes"] == snap["unique_bytes"] >= sum(distinct.values())
    eng.run_until_idle()
    for h, (ref_toks, _, ref_lp) in zip(handles, solo):
        toks, fin = h.result(timeout=0)
        assert [t.token_id for t in toks if t.token_id >= 0] == ref_toks
        lps = [t.logprob.logprob for t in toks if t.logprob]
        assert lps == pytest.approx(ref_lp, abs=1e-4)
    later = [run(eng, ids, bnd, n=1)[1] for ids, bnd in sessions[1:]]
    assert all(f.timings.cache_n >= sessions[0][1] for f in later)
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0


@pytest.mark.parametrize("min_step,split_at", [(1024, 1124), (1024, 1432), (1024, 3000),
                                               (4096, 3100)])
def test_divergence_checkpoint_placed_by_cost(parts, min_step, split_at):
    """Three prompts that split at one place 100 to 3,100 tokens past the checkpoint the second
    resumes at (periodic every `min_step`, or none): the second places a checkpoint at the
    split (it saves >= 64 tokens), and the third computes only its private tail (+ 32)."""
    tok = parts[1]
    eng = make_engine(parts, checkpoint_min_step=min_step)
    cold = make_engine(parts, slot_attach=False)
    dates = ("Monday", "Tuesday", "Wednesday")
    # shared text after the split keeps it ~200 tokens before the first user message (the
    # block-aligned checkpoint there must not be what C resumes at)
    rules = " ".join(f"rule {i}: cite sources." for i in range(40))

    def make(n):
        return [chat(eng, system_prompt(tok, n, d) + " " + rules, "What is on the schedule?")
                for d in dates]

    first = make(split_at)
    prompts = make(split_at - (common_len(first[0][0], first[1][0]) - split_at))
    (a, ba), (b, bb), (c, bc) = prompts
    split = common_len(a, b)
    assert abs(split - split_at) <= 16 and common_len(a, c) == split == common_len(b, c)
    assert bc is not None and bc > split + 150  # well before the first user message
    for ids, bnd in prompts[:2]:
        assert run(eng, ids, bnd)[0] == run(cold, ids, bnd)[0]
    got, fin, _ = run(eng, c, bc)
    assert got == run(cold, c, bc)[0]
    tail = len(c) - split
    assert fin.timings.prompt_n <= tail + 32, (fin.timings.prompt_n, tail)
    # the control: without divergence checkpoints (a gain no split reaches) C resumes at the
    # last periodic checkpoint, or computes everything
    eng2 = make_engine(parts, checkpoint_min_step=min_step, checkpoint_min_gain=10**6)
    for ids, bnd in prompts[:2]:
        run(eng2, ids, bnd)
    _, fin2, _ = run(eng2, c, bc)
    assert fin2.timings.prompt_n >= tail + (split - split // min_step * min_step) - 16
