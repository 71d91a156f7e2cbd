"""OpenAI `n` in the engine: the choices fork from one prefill and share its blocks; each has
its own sampler; `logit_bias` moves the sampler. Real models: the default Gemma 3 270M and the
tiny hybrids (a fork resumes from the checkpoint its parent saved at the prompt's end)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import default_model_path, load_model
from kvshare.model.tokenizer import Tokenizer

MODELS = Path(__file__).parent / "data" / "models"
GREEDY = SamplingParams(temperature=0.0)


def _parts(path):
    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    return model, tok, ChatTemplate.from_gguf(path, tok), bytes.fromhex(model.fingerprint)


@pytest.fixture(scope="module")
def gemma():
    return _parts(default_model_path())


def make_engine(parts, **kw) -> Engine:
    model, tok, tmpl, fp = parts
    cfg = EngineConfig(**{"kv_blocks": 256, "block_size": 16, "prefill_chunk": 512, **kw})
    return Engine(model, tok, tmpl, fp, cfg)


def chat_tokens(parts, user: str) -> list[int]:
    _, tok, tmpl, _ = parts
    text = tmpl.render([{"role": "system", "content": "You are a helpful assistant. " * 8},
                        {"role": "user", "content": user}])
    return tok.encode(text)


def run(eng: Engine, req: GenerationRequest):
    h = eng.submit(req)
    peak = 0
    while eng.scheduler.has_work() or eng._inbox:
        eng._drain_inbox()
        if not eng.scheduler.has_work():
            break
        eng.step()
        peak = max(peak, eng.pool.stats()["used"])
    events = list(h.events(timeout=0))
    fins = [e for e in events if isinstance(e, FinishEvent)]
    toks: dict[int, list[int]] = {}
    for e in events:
        if not isinstance(e, FinishEvent) and e.token_id >= 0:
            toks.setdefault(e.index, []).append(e.token_id)
    eng.pool.check_invariants()
    return toks, fins, peak


def test_n4_costs_one_prefill(gemma):
    ids = chat_tokens(gemma, "Name a colour.")
    eng = make_engine(gemma)
    sampling = SamplingParams(temperature=1.0, seed=7)
    toks, fins, peak = run(eng, GenerationRequest(prompt_tokens=ids, max_tokens=12, n=4,
                                                  sampling=sampling, ignore_eos=True))
    assert sorted(f.index for f in fins) == [0, 1, 2, 3]
    assert all(f.reason == "length" for f in fins)
    assert sorted(toks) == [0, 1, 2, 3] and all(len(t) == 12 for t in toks.values())
    assert len({tuple(t) for t in toks.values()}) > 1  # independent samplers
    by = {f.index: f for f in fins}
    assert by[0].timings.prompt_n == len(ids)  # choice 0 computed the prompt ...
    for i in (1, 2, 3):  # ... and the others reused all of it
        assert by[i].timings.cache_n == len(ids) and by[i].timings.prompt_n == 0
    bs = 16
    prompt_blocks = -(-len(ids) // bs)
    private = -(-((len(ids) % bs) + 12) // bs)  # the copied partial block + what it generates
    assert peak <= prompt_blocks + 4 * private


def test_n_choice_matches_single_request(gemma):
    """Choice i of an n request samples exactly like a lone request with seed + i."""
    ids = chat_tokens(gemma, "Say something.")
    eng = make_engine(gemma)
    toks, _, _ = run(eng, GenerationRequest(prompt_tokens=ids, max_tokens=8, n=3, ignore_eos=True,
                                            sampling=SamplingParams(temperature=0.8, seed=100)))
    for i in range(3):
        solo = make_engine(gemma, slot_attach=False)
        t, _, _ = run(solo, GenerationRequest(prompt_tokens=ids, max_tokens=8, ignore_eos=True,
                                              sampling=SamplingParams(temperature=0.8, seed=100 + i)))
        assert toks[i] == t[0]


def test_n_cancel_stops_every_choice(gemma):
    ids = chat_tokens(gemma, "Count to one hundred.")
    eng = make_engine(gemma)
    h = eng.submit(GenerationRequest(prompt_tokens=ids, max_tokens=50, n=3, ignore_eos=True,
                                     sampling=SamplingParams(temperature=1.0, seed=1)))
    for _ in range(3):
        eng._drain_inbox()
        eng.step()
    h.cancel()
    eng.run_until_idle()
    events = list(h.events(timeout=0))
    assert any(isinstance(e, FinishEvent) and e.reason == "cancelled" for e in events)
    assert not eng.scheduler.has_work() and eng.pool.stats()["used"] == 0


def test_n_above_max_is_refused(gemma):
    eng = make_engine(gemma, max_n=2)
    with pytest.raises(ValueError, match="n must be"):
        eng.submit(GenerationRequest(prompt_tokens=[2, 3, 4], max_tokens=2, n=3))


def test_logit_bias_bans_and_forces(gemma):
    _, tok, _, _ = gemma
    ids = chat_tokens(gemma, "Hello")
    eng = make_engine(gemma)
    base, _, _ = run(eng, GenerationRequest(prompt_tokens=ids, max_tokens=4, sampling=GREEDY,
                                            ignore_eos=True))
    first = base[0][0]
    banned, _, _ = run(make_engine(gemma), GenerationRequest(
        prompt_tokens=ids, max_tokens=4, ignore_eos=True,
        sampling=SamplingParams(temperature=0.0, logit_bias=((first, -100.0),))))
    assert first not in banned[0]
    target = tok.encode(" banana", add_special=False)[0]
    forced, _, _ = run(make_engine(gemma), GenerationRequest(
        prompt_tokens=ids, max_tokens=3, ignore_eos=True,
        sampling=SamplingParams(temperature=1.0, seed=3, logit_bias=((target, 100.0),))))
    assert forced[0] == [target] * 3


@pytest.mark.parametrize("name", ["tiny-qwen35.gguf", "tiny-lfm2.gguf"])
def test_hybrid_forks_resume_from_prompt_checkpoint(name):
    parts = _parts(MODELS / name)
    ids = chat_tokens(parts, "hello there")
    eng = make_engine(parts, kv_blocks=256)
    toks, fins, _ = run(eng, GenerationRequest(prompt_tokens=ids, max_tokens=6, n=3, ignore_eos=True,
                                               sampling=SamplingParams(temperature=1.0, seed=5)))
    by = {f.index: f for f in fins}
    assert by[0].timings.prompt_n == len(ids)
    for i in (1, 2):
        assert by[i].timings.cache_n == len(ids), by[i].timings
    # each choice equals a lone request with its seed (state resumed exactly)
    for i in range(3):
        t, _, _ = run(make_engine(parts, kv_blocks=256, slot_attach=False), GenerationRequest(
            prompt_tokens=ids, max_tokens=6, ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, seed=5 + i)))
        assert toks[i] == t[0]
