"""Overlapped emission (engine/deferred_emit.py) changes nothing a client sees: a mix of
concurrent requests streams the same events with `emit_overlap` forced on as with it off, on
the CPU (the tiny Qwen3 chat model), and the cache is as usable afterwards."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvshare.engine import deferred_emit
from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer

from test_engine_gpu import SCHEMA  # the record schema of the engine's GPU tests

MODEL = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"
GREEDY = SamplingParams(temperature=0.0)
CANCEL_AFTER_STEPS = 9
CTX = 96  # small enough that one reply shifts its context


@pytest.fixture(scope="module")
def parts():
    model = load_model(MODEL)
    tok = Tokenizer.from_gguf(MODEL)
    return model, tok, ChatTemplate.from_gguf(MODEL, tok), bytes.fromhex(model.fingerprint)


def make_engine(parts, overlap: bool | None, **kw) -> Engine:
    model, tok, tmpl, fp = parts
    cfg = EngineConfig(**{"kv_blocks": 256, "block_size": 16, "prefill_chunk": 64,
                          "parallel": 16, "emit_overlap": overlap, "ctx_size": CTX,
                          "context_shift": True, **kw})
    return Engine(model, tok, tmpl, fp, cfg)


def chat(eng: Engine, user: str) -> list[int]:
    return eng.tokenize(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def reference(parts, user: str, max_tokens: int = 40, **kw) -> list[TokenEvent]:
    """A reply's token events (greedy unless told), alone and without overlap: stop strings
    and ids are picked from these."""
    eng = make_engine(parts, False)
    h = eng.submit(GenerationRequest(prompt_tokens=chat(eng, user), max_tokens=max_tokens,
                                     **{"sampling": GREEDY, "ignore_eos": True, **kw}))
    eng.run_until_idle()
    return [e for e in h.events(timeout=0) if isinstance(e, TokenEvent)]


def across(events: list[TokenEvent], after: int) -> str:
    """A stop string made of the end of one token's text and the start of the next's."""
    for a, b in zip(events[after:], events[after + 1:]):
        if a.text and b.text and (a.text[-2:] + b.text[:1]).isprintable():
            return a.text[-2:] + b.text[:1]
    raise AssertionError("no two printable neighbours")


SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5)
N3 = dict(sampling=dataclasses.replace(SEEDED, seed=21), n=3)


@pytest.fixture(scope="module")
def stops(parts):
    return pick_stops(parts)


def pick_stops(parts) -> dict:
    """Stops the replies reach mid-way: a string within one token's text, strings across a
    token boundary (greedy, the second choice of n = 3, the logprobs request) and a token id."""
    within = next(e.text for e in reference(parts, "Count to five.")[3:]
                  if len(e.text) >= 2 and e.text.isprintable())
    n3 = [e for e in reference(parts, "Tell me a story.", 24, **N3) if e.index == 1]
    return {"within": within,
            "across": across(reference(parts, "Say hi."), 6),
            "n3": across(n3, 8),
            "logprobs": across(reference(parts, "Count to five.", 30, sampling=SEEDED), 10),
            "id": reference(parts, "Tell me a story.")[12].token_id}


def requests(eng: Engine, stops) -> dict[str, GenerationRequest]:
    grammar = eng.compile_grammar("json_schema", json.dumps(SCHEMA))
    return {
        "greedy": GenerationRequest(chat(eng, "Name three colours."), 40, GREEDY),
        "seeded": GenerationRequest(chat(eng, "Name three colours."), 40, SEEDED),
        "stop_within": GenerationRequest(chat(eng, "Count to five."), 40, GREEDY,
                                         stop=[stops["within"]]),
        "stop_across": GenerationRequest(chat(eng, "Say hi."), 40, GREEDY,
                                         stop=["zzz", stops["across"]]),
        "stop_id": GenerationRequest(chat(eng, "Tell me a story."), 40, GREEDY,
                                     stop_token_ids=[stops["id"]], ignore_eos=True),
        "short": GenerationRequest(chat(eng, "Say hi."), 5, SEEDED),
        "n3": GenerationRequest(chat(eng, "Tell me a story."), 24, ignore_eos=True,
                                stop=[stops["n3"]], **N3),
        # three choices completing the grammar at different steps: one ends while the others'
        # events of that step are queued
        "grammar": GenerationRequest(chat(eng, "Give me a record."), 50, SamplingParams(
            temperature=1.0, seed=11), grammar=grammar, n=3),
        "shift": GenerationRequest(chat(eng, "Count to five."), 90, SEEDED, ignore_eos=True),
        "logprobs": GenerationRequest(chat(eng, "Count to five."), 30, SEEDED, logprobs=True,
                                      top_logprobs=3, stop=[stops["logprobs"]]),
        "cancelled": GenerationRequest(chat(eng, "Name three colours."), 60, SEEDED,
                                       ignore_eos=True),
        "failing": GenerationRequest(chat(eng, "Say hi."), 20, GREEDY, fault="logits_nan"),
    }


def normalized(events) -> list:
    """The events with the timing values blanked (they differ run to run); the timings and
    their token counts must be there."""
    out = []
    for e in events:
        if isinstance(e, FinishEvent):
            assert e.timings is not None
            t = e.timings
            assert t.prompt_ms >= 0 and t.predicted_ms >= 0
            e = dataclasses.replace(e, timings=(t.prompt_n, t.cache_n, t.predicted_n),
                                    time_to_first_token_s=None)
        out.append(e)
    return out


def run_mix(parts, overlap: bool | None, stops) -> tuple[Engine, dict[str, list]]:
    eng = make_engine(parts, overlap)
    reqs = requests(eng, stops)
    handles = {name: eng.submit(req) for name, req in reqs.items()}
    for _ in range(CANCEL_AFTER_STEPS):  # the steps of run_until_idle, then a cancellation
        eng._drain_inbox()
        eng.step()
    handles["cancelled"].cancel()
    eng.run_until_idle()
    streams = {name: normalized(h.events(timeout=0)) for name, h in handles.items()}
    assert not len(eng._emits)
    return eng, streams


def check_mix(streams: dict[str, list], stops, exact: bool = True) -> None:
    """What the mix must show, overlap or not (so that the comparison compares something).
    Not `exact`: only what holds whatever the logits (the stops were picked from solo
    replies; a batch computed by other kernels may reply otherwise)."""

    def fins(name):
        return {e.index: e for e in streams[name] if isinstance(e, FinishEvent)}

    def text(name, index=0):
        return "".join(e.text for e in streams[name]
                       if isinstance(e, TokenEvent) and e.index == index)

    f = fins("failing")[0]
    assert f.reason == "error" and f.error_cause == "non_finite_logits"
    f = fins("cancelled")[0]
    assert f.reason == "cancelled" and 0 < f.completion_tokens < 60
    assert sorted(fins("n3")) == sorted(fins("grammar")) == [0, 1, 2]
    if not exact:
        return
    assert fins("greedy")[0].reason == "length" and fins("greedy")[0].completion_tokens == 40
    for name, stop, index in (("stop_within", stops["within"], 0),
                              ("stop_across", stops["across"], 0), ("n3", stops["n3"], 1),
                              ("logprobs", stops["logprobs"], 0)):
        f = fins(name)[index]
        assert f.reason == "stop" and f.stop_string == stop, (name, f)
        assert stop not in text(name, index) and f.completion_tokens > 3, name
    f = fins("stop_id")[0]
    assert f.reason == "stop" and f.completion_tokens == 13 and f.stop_string is None
    assert fins("short")[0].completion_tokens == 5
    by = fins("grammar")
    assert len({f.completion_tokens for f in by.values()}) > 1
    for i in range(3):
        assert by[i].reason == "stop"
        json.loads(text("grammar", i))
    f = fins("shift")[0]
    assert f.reason == "length" and f.completion_tokens == 90 and f.n_discarded > 0
    lp = [e for e in streams["logprobs"] if isinstance(e, TokenEvent) and e.token_id >= 0]
    assert lp and all(e.logprob is not None and len(e.top_logprobs) == 3 for e in lp)


def test_overlap_streams_equal_serial(parts, stops):
    runs = {}
    for overlap in (False, True):
        eng, streams = run_mix(parts, overlap, stops)
        check_mix(streams, stops)
        eng.pool.check_invariants()
        assert eng.pool.stats()["used"] == 0
        assert not eng.scheduler.running and not eng.scheduler.waiting
        # the finished replies' blocks stay findable: a follow-up that continues the reply a
        # stop string ended (finished from the deferred queue with overlap) hits the cache
        stop_req = requests(eng, stops)["stop_within"]
        done = [e.token_id for e in streams["stop_within"]
                if isinstance(e, TokenEvent) and e.token_id >= 0]
        follow = GenerationRequest(stop_req.prompt_tokens + done + chat(eng, "More.")[1:], 4,
                                   GREEDY)
        h = eng.submit(follow)
        eng.run_until_idle()
        fin = normalized(h.result(timeout=0)[1:])[0]
        eng.pool.check_invariants()
        runs[overlap] = streams, fin, dict(eng.failures)
    (off, fin_off, failed_off), (on, fin_on, failed_on) = runs[False], runs[True]
    assert failed_on == failed_off == {"non_finite_logits": 1}
    for name in off:
        assert on[name] == off[name], name
    assert fin_on == fin_off
    assert fin_on.timings[1] >= len(requests(eng, stops)["stop_within"].prompt_tokens) // 16 * 16


def test_overlap_queues_and_skips(parts, stops, monkeypatch):
    """With overlap the EMIT halves really are deferred (queued after a step, run after the
    next launch) and a sequence finished from the queue is skipped by that step."""
    eng = make_engine(parts, True)
    within = stops["within"]
    h = eng.submit(GenerationRequest(chat(eng, "Count to five."), 40, GREEDY, stop=[within]))
    queued, skipped, committed = [], [], []
    post, commit = eng._postprocess, eng.scheduler.commit

    def spy(plan, logits, allowed):
        skipped.extend(i.seq for i in plan if i.seq.state.value == "finished")
        return post(plan, logits, allowed)

    def spy_commit(item):
        committed.append(item.seq.state.value)
        return commit(item)

    monkeypatch.setattr(eng, "_postprocess", spy)
    monkeypatch.setattr(eng.scheduler, "commit", spy_commit)
    while eng.scheduler.has_work() or eng._inbox:
        eng._drain_inbox()
        eng.step()
        queued.append(len(eng._emits))
    assert max(queued) == 1
    assert len(skipped) == 1  # planned with its last token, finished by the stop string
    assert "finished" not in committed  # nothing recorded into its released blocks
    fin = h.result(timeout=0)[1]
    assert fin.reason == "stop" and fin.stop_string == within
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0


def test_a_wrong_emission_order_is_caught(parts, stops, monkeypatch):
    """The comparison can fail: queued events run newest first (n > 1 choices then stream in
    another order) do not pass."""

    def lifo(self, emit):
        if self._running or not self._items:
            return False
        while self._items:
            emit(self._items.pop())
        return True

    _, off = run_mix(parts, False, stops)
    monkeypatch.setattr(deferred_emit.EmitQueue, "run", lifo)
    _, on = run_mix(parts, True, stops)
    assert on["n3"] != off["n3"]


def test_switch(monkeypatch):
    class Model:
        class backend:  # noqa: N801 - stands for a backend object
            is_gpu = True

    monkeypatch.delenv(deferred_emit.ENV, raising=False)
    assert deferred_emit.wanted(Model, None)
    Model.backend.is_gpu = False
    assert not deferred_emit.wanted(Model, None)
    monkeypatch.setenv(deferred_emit.ENV, "1")
    assert deferred_emit.wanted(Model, None) and not deferred_emit.wanted(Model, False)
    Model.backend.is_gpu = True
    monkeypatch.setenv(deferred_emit.ENV, "0")
    assert not deferred_emit.wanted(Model, None) and deferred_emit.wanted(Model, True)


@pytest.mark.gpu
def test_on_by_default_on_the_gpu(parts, monkeypatch):
    """On the GPU backend (device sampling, logits on the device) overlap is on by default
    and the mix streams what it streams with overlap off there. A sequence a stop string
    ended runs one step more with overlap: this assumes each row's logits do not depend on
    the batch around it (as CUDA graphs padded to a larger batch already assume)."""
    monkeypatch.delenv(deferred_emit.ENV, raising=False)
    model = load_model(MODEL, device="cuda")
    gpu = (model, *parts[1:])
    stops = pick_stops(gpu)
    eng, on = run_mix(gpu, None, stops)
    assert eng.emit_overlap and eng.device_sampling is not None
    check_mix(on, stops, exact=False)
    eng.pool.check_invariants()
    _, off = run_mix(gpu, False, stops)
    for name in off:
        assert on[name] == off[name], name
