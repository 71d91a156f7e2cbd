"""Decode steps launched ahead (engine/step_ahead.py) change nothing a client sees: the mix of
concurrent requests of tests/test_engine_overlap.py (greedy, seeded, stop strings and ids,
n = 3 choices, grammars, a context shift, logprobs, a cancellation, a failing row) streams
the same events with async scheduling on as off, on the GPU backend (CI: the CPU emulator,
where a launch runs at once, so a row read after the next launch reads that launch's
logits). Rows the sampling kernel hands back to the host are forced here (the tiny model's
vocabulary never makes the kernel do it): they are sampled from logits kept before the next
launch and their launched-ahead rows are computed again.

Each row's logits must not depend on the batch around it (a launched-ahead step holds rows
the scheduled step would not: sequences that just ended), as CUDA graphs padded to a larger
batch already assume.
"""

from __future__ import annotations

import pytest

from kvshare.engine import step_ahead
from kvshare.engine.device_sampling import PendingPicks
from kvshare.model import gpu_graphs
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer
from kvshare.ops import gpu_sampling

import test_engine_overlap as mix


@pytest.fixture(scope="module")
def gpu():
    model = load_model(mix.MODEL, device="cuda")
    tok = Tokenizer.from_gguf(mix.MODEL)
    return model, tok, ChatTemplate.from_gguf(mix.MODEL, tok), bytes.fromhex(model.fingerprint)


@pytest.fixture(scope="module")
def stops(gpu):
    return mix.pick_stops(gpu)


def run(gpu, stops, on: bool) -> tuple[object, dict, int]:
    """The mix with async scheduling on or off: (engine, streams, rows found void)."""
    void = [0]
    real = step_ahead.holds

    def counting(item, pick):
        ok = real(item, pick)
        void[0] += (not ok) and item.seq.state.value != "finished"
        return ok

    with pytest.MonkeyPatch.context() as m:
        m.setattr("kvshare.engine.engine.holds", counting)
        m.setattr(mix, "make_engine", _engine(on))
        eng, streams = mix.run_mix(gpu, None, stops)
    return eng, streams, void[0]


def _engine(on: bool):
    make = mix.make_engine

    def make_engine(parts, overlap, **kw):
        return make(parts, overlap, async_scheduling=on, **kw)

    return make_engine


def hand_back_some(monkeypatch) -> list[int]:
    """Make the kernel hand every sampled row whose uniform falls in a third of [0, 1) back
    to the host (the same rows whatever the batch: u is the sequence's own draw)."""
    real = gpu_sampling.PendingRows.results
    handed = [0]

    def results(self):
        out = real(self)
        for spec, res in zip(self.specs, out):
            if not spec.greedy and res.status == gpu_sampling.STATUS_OK and spec.u < 1 / 3:
                res.status, res.token, res.top = gpu_sampling.STATUS_HOST, -1, None
                handed[0] += 1
        return out

    monkeypatch.setattr(gpu_sampling.PendingRows, "results", results)
    return handed


def check(eng, streams, stops) -> None:
    mix.check_mix(streams, stops, exact=False)
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0
    assert not eng.scheduler.running and not eng.scheduler.waiting and eng._ahead is None


@pytest.mark.gpu
def test_async_streams_equal_sync(gpu, stops):
    eng_off, off, _ = run(gpu, stops, False)
    eng_on, on, void = run(gpu, stops, True)
    assert eng_off.counters["steps_ahead"] == 0
    if gpu_graphs.enabled_by_env():
        # most of the mix's steps are a steady decode
        assert eng_on.counters["steps_ahead"] > eng_on.counters["steps"] // 2
    else:  # KVSHARE_CUDA_GRAPHS=0: no step is launched ahead (it needs a graph)
        assert eng_on.counters["steps_ahead"] == 0
    assert void == 0  # every row held: nothing was handed back
    check(eng_on, on, stops)
    for name in off:
        assert on[name] == off[name], name


def by_choice(streams: dict) -> dict:
    """Each choice's events in order (a row computed again delays its choice by a step, so
    the choices of one request may interleave otherwise)."""
    return {(name, e.index): [x for x in events if x.index == e.index]
            for name, events in streams.items() for e in events}


graphs_on = pytest.mark.skipif(not gpu_graphs.enabled_by_env(),
                               reason="launches ahead need CUDA graphs (KVSHARE_CUDA_GRAPHS=0)")


@pytest.mark.gpu
@graphs_on
def test_rows_handed_back_are_sampled_from_kept_logits(gpu, stops, monkeypatch):
    with monkeypatch.context() as m:
        handed = hand_back_some(m)
        _, off, _ = run(gpu, stops, False)
        n_off = handed[0]
        eng, on, void = run(gpu, stops, True)
    assert n_off > 10 and handed[0] > n_off  # (the sync run's, then the async run's too)
    assert void > 0  # their launched-ahead rows were computed again
    check(eng, on, stops)
    a, b = by_choice(on), by_choice(off)
    # the cancellation comes after a number of steps: a row computed again delays its
    # sequence, which is cancelled with fewer tokens (the same ones)
    tok_a, tok_b = ([e.token_id for e in x[("cancelled", 0)][:-1]] for x in (a, b))
    assert tok_a == tok_b[: len(tok_a)] and len(tok_a) > 3
    del a[("cancelled", 0)], b[("cancelled", 0)]
    assert a == b


@pytest.mark.gpu
@graphs_on
def test_a_host_row_read_after_the_next_launch_is_caught(gpu, stops, monkeypatch):
    """The comparison can fail: without the kept logits, a handed-back row is sampled from
    the logits the launch ahead wrote over its own."""
    with monkeypatch.context() as m:
        hand_back_some(m)
        _, off, _ = run(gpu, stops, False)
        m.setattr(PendingPicks, "keep_logits", lambda self: None)
        _, on, _ = run(gpu, stops, True)
    a, b = by_choice(on), by_choice(off)
    assert any(a[k] != b[k] for k in a if k != ("cancelled", 0))


def test_switch(monkeypatch):
    monkeypatch.delenv(step_ahead.ENV, raising=False)
    assert step_ahead.wanted(True, None) and not step_ahead.wanted(False, None)
    assert not step_ahead.wanted(True, False) and not step_ahead.wanted(False, True)
    monkeypatch.setenv(step_ahead.ENV, "0")
    assert not step_ahead.wanted(True, None) and step_ahead.wanted(True, True)


@pytest.mark.gpu
@graphs_on
def test_cancelled_while_its_next_step_runs(gpu):
    """A request cancelled while its next step is launched ahead: the engine goes idle with
    nothing held, and the next request is served as by an engine that never launched ahead."""
    from kvshare.engine.api import GenerationRequest, TokenEvent

    def reply(eng, h):
        eng.run_until_idle()
        return [e.token_id for e in h.events(timeout=0) if isinstance(e, TokenEvent)]

    eng = mix.make_engine(gpu, None, async_scheduling=True)
    h = eng.submit(GenerationRequest(mix.chat(eng, "Count to five."), 40, mix.GREEDY,
                                     ignore_eos=True))
    eng._drain_inbox()
    while eng._ahead is None:
        eng.step()
    h.cancel()
    eng._drain_inbox()
    assert not eng.scheduler.has_work() and eng._ahead is not None  # its only row ended
    req = GenerationRequest(mix.chat(eng, "Say hi."), 12, mix.GREEDY, ignore_eos=True)
    got = reply(eng, eng.submit(req))
    assert eng._ahead is None and eng.counters["steps_ahead"] > 0
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0
    fresh = mix.make_engine(gpu, None, async_scheduling=False)
    assert len(got) == 12 and got == reply(fresh, fresh.submit(req))


@pytest.mark.gpu
def test_hybrids_do_not_launch_steps_ahead():
    """A hybrid's steps are never launched ahead, though its model takes fed steps: a launched
    step advances the recurrent state in place, so the state at a reply's block boundary (kept
    for the tiers when the step that reached it commits) held the next token's update. With
    async scheduling on, the reply's tail checkpoint is the one async scheduling off keeps:
    the state at the tail (without the check in `Engine._launch_ahead`, 38 steps ran ahead
    and the two checkpoints differed in 377 of 1,024 bytes)."""
    import numpy as np  # noqa: PLC0415

    from kvshare import _core  # noqa: PLC0415
    from kvshare.engine.api import GenerationRequest, SamplingParams  # noqa: PLC0415
    from kvshare.engine.cache.recurrent import RecurrentStateManager  # noqa: PLC0415
    from kvshare.engine.engine import Engine, EngineConfig  # noqa: PLC0415

    path = mix.MODEL.parent / "tiny-lfm2.gguf"
    model = load_model(path, device="cuda")
    tok = Tokenizer.from_gguf(path)
    assert model.fed_steps_apply()
    states: dict[int, np.ndarray] = {}
    commit = RecurrentStateManager.commit

    def recording(self, seq, start, end):  # the state each commit sees, by position
        commit(self, seq, start, end)
        states[end] = np.concatenate([np.array(s[seq.state_slot]).reshape(-1).view(np.uint8)
                                      for s in self.ctx.kv.states])

    def tail_checkpoint(on: bool):
        eng = Engine(model, tok, ChatTemplate.from_gguf(path, tok),
                     bytes.fromhex(model.fingerprint),
                     EngineConfig(kv_blocks=64, block_size=16, prefill_chunk=128,
                                  cache_ram_mib=4, cache_min_tokens=32, kv_dtype="f32",
                                  async_scheduling=on))
        prompt = eng.tokenize("Triage the new issues. " * 12)
        req = GenerationRequest(prompt_tokens=prompt, max_tokens=40, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0))
        states.clear()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(RecurrentStateManager, "commit", recording)
            h = eng.submit(req)
            eng.run_until_idle()
        reply = [t.token_id for t in h.result(timeout=0)[0] if t.token_id >= 0]
        computed = len(prompt) + len(reply) - 1
        tail = computed - computed % 16
        assert tail > len(prompt)
        ck = eng.checkpoints.store.get(_core.prefix_key(eng.cache.root_key(None),
                                                        (prompt + reply)[:tail], 16))
        assert ck is not None
        return eng, reply, np.array(np.asarray(ck)), states[tail]

    eng_off, reply_off, ck_off, state_off = tail_checkpoint(False)
    np.testing.assert_array_equal(ck_off, state_off)  # nothing ran ahead of that commit
    eng_on, reply_on, ck_on, _ = tail_checkpoint(True)
    assert eng_on.counters["steps_ahead"] == 0
    assert reply_on == reply_off
    np.testing.assert_array_equal(ck_on, ck_off)
