"""The engine's sharing on the mixture-of-experts models (tiny random qwen3moe, qwen35moe and
lfm2moe hybrids, gpt-oss with sliding-window layers; real tokenizer): a shared prefix is
computed once and attached, the RAM and disk tiers give back what they took, the hybrids
resume at checkpoints, gpt-oss's window group behaves as Gemma 3's — and none of it changes a
token or a logprob against a cold run. Routing is decided per token, so an expert pick that a
cached prefix changed would show here as a different token or logprob. Logprobs agree within
1e-4, as the dense suites': a prefix computed in other chunks (its tail alone after an attach,
a hybrid's prefill cut at a checkpoint) sums its products in another order (measured: <= 2e-5)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvshare import _core
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.base import LayerKinds
from kvshare.model.batch import SeqChunk
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer

MODELS = Path(__file__).parent / "data" / "models"
GREEDY = SamplingParams(temperature=0.0)
ALL = ["tiny-qwen3moe", "tiny-qwen35moe", "tiny-lfm2moe", "tiny-gpt-oss"]
HYBRIDS = ["tiny-qwen35moe", "tiny-lfm2moe"]
BS = 16

_LOADED: dict[str, tuple] = {}


def load(name: str):
    """(model, tokenizer, template, fingerprint), once per model for the whole module."""
    if name not in _LOADED:
        path = MODELS / f"{name}.gguf"
        model = load_model(path)
        tok = Tokenizer.from_gguf(path)
        _LOADED[name] = (model, tok, ChatTemplate.from_gguf(path, tok),
                         bytes.fromhex(model.fingerprint))
    return _LOADED[name]


@pytest.fixture(params=ALL)
def parts(request):
    return load(request.param)


@pytest.fixture(params=HYBRIDS)
def hybrid(request):
    return load(request.param)


def engine(parts, **kw) -> Engine:
    model, tok, tmpl, fp = parts
    cfg = EngineConfig(**{"kv_blocks": 256, "block_size": BS, "prefill_chunk": 128,
                          "cache_ram_mib": 0, "cache_min_tokens": 32, **kw})
    return Engine(model, tok, tmpl, fp, cfg)


def chat_request(eng: Engine, system: str, user: str, n: int = 6) -> GenerationRequest:
    text, boundary = eng.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": user}])
    return GenerationRequest(prompt_tokens=eng.tokenize(text), max_tokens=n, sampling=GREEDY,
                             first_user_boundary=boundary, logprobs=True, top_logprobs=3)


def outputs(handle):
    """[(token, logprob, top-3 logprobs)] and the finish event of a finished request."""
    toks, fin = handle.result(timeout=0)
    return [(t.token_id, t.logprob and t.logprob.logprob,
             tuple((a.token_id, a.logprob) for a in t.top_logprobs))
            for t in toks if t.token_id >= 0], fin


def choices(handle, n: int) -> list[list[int]]:
    """Each choice's tokens, read until all `n` have finished."""
    out: list[list[int]] = [[] for _ in range(n)]
    for ev in handle.events(timeout=0):
        if hasattr(ev, "token_id") and ev.token_id >= 0:
            out[ev.index].append(ev.token_id)
    return out


def same_output(got, ref) -> None:
    """Equal tokens; the chosen and top-3 logprobs within 1e-4."""
    assert [t for t, _, _ in got] == [t for t, _, _ in ref]
    if ref and ref[0][1] is not None:
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in ref], abs=1e-4)
        for (_, _, top), (_, _, ref_top) in zip(got, ref):
            assert sorted(lp for _, lp in top) == pytest.approx(sorted(lp for _, lp in ref_top),
                                                               abs=1e-4)


def submit(eng: Engine, req: GenerationRequest):
    """Submit a copy: `Engine.submit` gives the request its id, and the same request goes to
    several engines here (ids from each engine's own counter would collide)."""
    return eng.submit(dataclasses.replace(req, request_id=""))


def serve(eng: Engine, req: GenerationRequest):
    h = submit(eng, req)
    eng.run_until_idle()
    return outputs(h)


def cold_run(parts, req: GenerationRequest):
    """The request alone on an engine that shares nothing."""
    return serve(engine(parts, slot_attach=False), req)[0]


def assert_idle(eng: Engine) -> None:
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0
    assert not eng.scheduler.running and not eng.scheduler.waiting
    if eng.windows is not None:
        eng.windows.pool.check_invariants()
        assert eng.windows.pool.stats()["used"] == 1  # the null block only


def common_len(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def system_prompt(name: str, n_words: int = 60) -> str:
    """An agent's system prompt: ~6 tokens a word with these models' small vocabulary (past
    gpt-oss's 128-token window several times over)."""
    tools = " ".join(f"tool{i}(arg) does thing {i};" for i in range(n_words // 5))
    return f"You are the {name} build agent. {tools} Answer in one line."


# ---------------------------------------------------------------------------- prefix sharing

@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_a_shared_prefix_is_computed_once_and_changes_nothing(parts, together):
    """Three sessions of one agent, one after another or submitted at once: the second and
    third attach to the first's prefix (>= 95% of the shared tokens cached; submitted at once,
    on the models whose later sessions wait for a donor's blocks) and generate the tokens and
    logprobs (top 3 included) of a cold run."""
    eng = engine(parts)
    system = system_prompt(parts[0].config.arch)
    reqs = [chat_request(eng, system, q) for q in
            ("List the failing tests.", "Open the build log.", "Who changed main.py?")]
    shared = common_len(reqs[0].prompt_tokens, reqs[1].prompt_tokens)
    assert shared >= 300 and shared == common_len(reqs[0].prompt_tokens, reqs[2].prompt_tokens)
    cold = [cold_run(parts, r) for r in reqs]
    if together:
        handles = [submit(eng, r) for r in reqs]
        eng.run_until_idle()
        got = [outputs(h) for h in handles]
    else:
        got = [serve(eng, r) for r in reqs]
    for (out, _), ref in zip(got, cold):
        same_output(out, ref)
    assert got[0][1].timings.cache_n == 0
    if together and not eng.cache.waits_for_donors:
        # a hybrid resumes only at checkpoints, none of which exists while all three prefill
        # (arrivals during the donor's decode attach: the checkpoint tests below)
        assert_idle(eng)
        return
    for _, fin in got[1:]:
        assert fin.timings.cache_n >= 0.95 * shared, (fin.timings.cache_n, shared)
        assert fin.timings.prompt_n <= len(reqs[0].prompt_tokens) - 0.95 * shared + BS
    assert_idle(eng)


def test_a_finished_conversation_is_continued_from_its_cache(parts):
    """Turn 2 (turn 1 + its reply + a new user message) attaches to all of turn 1, and n = 2
    choices fork from one prompt: both as a cold run computes them."""
    eng = engine(parts)
    first = chat_request(eng, system_prompt("release"), "Tag version two.", n=7)
    reply, _ = serve(eng, first)
    second = turn2(eng, first, reply)
    got, fin = serve(eng, second)
    same_output(got, cold_run(parts, second))
    n1 = len(first.prompt_tokens)
    assert fin.timings.cache_n >= n1 - BS, (fin.timings.cache_n, n1)
    h = eng.submit(GenerationRequest(prompt_tokens=second.prompt_tokens, max_tokens=4,
                                     sampling=GREEDY, n=2))
    eng.run_until_idle()
    assert choices(h, 2) == [[t for t, _, _ in got[:4]]] * 2
    assert_idle(eng)


def turn2(eng: Engine, first: GenerationRequest, reply) -> GenerationRequest:
    nxt = eng.tokenize("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
                       add_special=False)
    return GenerationRequest(prompt_tokens=first.prompt_tokens + [t for t, _, _ in reply] + nxt,
                             max_tokens=6, sampling=GREEDY,
                             first_user_boundary=first.first_user_boundary, logprobs=True,
                             top_logprobs=3)


# ---------------------------------------------------------------------------------- the tiers

def flush_device(eng: Engine) -> None:
    """Forget everything the device holds: cached blocks (windows included) and stored
    checkpoints; what the tiers hold stays."""
    eng.tiers.flush()
    eng.pool.evict_all_cached()
    if eng.windows is not None:
        eng.windows.pool.evict_all_cached()
    if eng.checkpoints is not None:
        store = eng.checkpoints.store
        for key in list(store.keys()):
            store.remove(key)


def test_the_ram_tier_gives_back_an_evicted_conversation(parts):
    eng = engine(parts, cache_ram_mib=8)
    first = chat_request(eng, system_prompt("audit"), "Who changed the config?", n=7)
    reply, _ = serve(eng, first)
    second = turn2(eng, first, reply)
    flush_device(eng)
    keys = _core.hash_blocks(eng.cache.root_key(None), first.prompt_tokens, BS)
    assert eng.pool.match_prefix(keys)[0] == [], "turn 1 should be out of the pool"
    got, fin = serve(eng, second)
    same_output(got, cold_run(parts, second))
    n1 = len(first.prompt_tokens)
    assert fin.timings.cache_n >= n1 - BS, (fin.timings.cache_n, n1)
    ram = eng.snapshot()["tiers"]["ram"]
    assert ram["restores"] >= 1 and ram["tokens_served"] >= n1 - BS, ram
    if eng.checkpoints is not None:
        assert ram["checkpoints_served"] == 1
    # a new session of the same agent: the pinned prefix entry comes back from RAM
    flush_device(eng)
    other = chat_request(eng, system_prompt("audit"), "Roll back the last tag.", n=4)
    got, fin = serve(eng, other)
    same_output(got, cold_run(parts, other))
    boundary = other.first_user_boundary
    assert fin.timings.cache_n >= boundary - boundary % BS - (BS if eng.windows else 0)
    eng.tiers.ram.check_invariants()
    assert_idle(eng)


def test_the_disk_tier_survives_a_restart(parts, tmp_path):
    eng = engine(parts, cache_dir=str(tmp_path))
    first = chat_request(eng, system_prompt("deploy"), "Deploy the canary.", n=7)
    reply, _ = serve(eng, first)
    second = turn2(eng, first, reply)
    eng.shutdown(timeout=1)
    eng2 = engine(parts, cache_dir=str(tmp_path))
    got, fin = serve(eng2, second)
    same_output(got, cold_run(parts, second))
    n1 = len(first.prompt_tokens)
    assert fin.timings.cache_n >= n1 - BS, (fin.timings.cache_n, n1)
    disk = eng2.snapshot()["tiers"]["disk"]
    assert disk["restores"] >= 1 and disk["bytes_read"] > 0 and disk["errors"] == 0, disk
    eng2.shutdown(timeout=1)
    assert_idle(eng2)


# -------------------------------------------------------------------- hybrids: checkpoints

def test_hybrid_moe_resumes_at_a_divergence_checkpoint(hybrid):
    """A and B split at ~600 tokens inside the system prompt: B saves a checkpoint exactly at
    the split, and C (a third prompt splitting there) resumes at it, computing only its tail;
    every output as a cold run's."""
    eng = engine(hybrid, kv_blocks=512)
    dates = ("1 March 2026", "2 April 2027", "3 May 2028")

    def prompts(n_words):
        return [chat_request(eng, system_prompt("ops", n_words) + f" Today is {d}. "
                             + " ".join(f"rule {i}: cite sources." for i in range(12)),
                             "What is on the schedule?") for d in dates]

    a, b, c = prompts(100)
    split = common_len(a.prompt_tokens, b.prompt_tokens)
    assert split >= 500 and common_len(a.prompt_tokens, c.prompt_tokens) == split
    assert c.first_user_boundary > split + 100
    for r in (a, b):
        same_output(serve(eng, r)[0], cold_run(hybrid, r))
    got, fin = serve(eng, c)
    same_output(got, cold_run(hybrid, c))
    assert fin.timings.cache_n == split
    assert fin.timings.prompt_n == len(c.prompt_tokens) - split
    assert_idle(eng)


def test_hybrid_moe_sessions_share_checkpoints_while_running(hybrid):
    """Sessions that arrive while a donor decodes attach at its checkpoints; the checkpoints
    they hold are counted once; outputs as solo runs'."""
    eng = engine(hybrid, prefill_chunk=64)
    system = system_prompt("triage", 80)
    reqs = [chat_request(eng, system, q, n=8) for q in ("List files.", "Run tests.", "Diff.")]
    solo = [cold_run(hybrid, r) for r in reqs]
    handles = [submit(eng, reqs[0])]
    while not eng.scheduler.running or eng.scheduler.running[0].n_generated < 3:
        eng._drain_inbox()
        eng.step()
    handles += [submit(eng, r) for r in reqs[1:]]
    for _ in range(3):
        eng._drain_inbox()
        eng.step()
    held = [ck for s in eng.scheduler.running for ck in s.held_checkpoints]
    distinct = {ck.key: ck.nbytes for ck in held}
    assert len(held) > len(distinct), "sessions should share a checkpoint"
    snap = eng.snapshot()["checkpoints"]
    assert snap["live_bytes"] == snap["unique_bytes"] >= sum(distinct.values())
    eng.run_until_idle()
    for h, ref in zip(handles, solo):
        same_output(outputs(h)[0], ref)
    assert_idle(eng)


def test_hybrid_moe_layer_groups():
    for name, kinds in (("tiny-qwen35moe", LayerKinds(full_attention=1, recurrent=3)),
                        ("tiny-lfm2moe", LayerKinds(full_attention=2, recurrent=2))):
        parts = load(name)
        assert parts[0].layer_kinds() == kinds
        eng = engine(parts)
        assert [g.kind for g in eng.cache.groups] == ["full_attention", "recurrent"]
        assert eng.cache.stateful and not eng.cache.waits_for_donors


# ------------------------------------------------------ gpt-oss: the sliding-window group

@pytest.fixture(scope="module")
def oss():
    return load("tiny-gpt-oss")


def test_gpt_oss_declares_its_window_layers_and_the_cache_follows(oss):
    model = oss[0]
    assert model.layer_kinds() == LayerKinds(full_attention=2, sliding_window=2, window=128)
    eng = engine(oss)
    assert [g.kind for g in eng.cache.groups] == ["full_attention", "sliding_window"]
    assert eng.cache.lead.kind == "sliding_window" and eng.cache.waits_for_donors
    assert [g.kind for g in engine(oss, swa_full=True).cache.groups] == ["full_attention"]


def test_gpt_oss_split_cache_computes_what_the_single_array_computes(oss):
    """The window layers in their own pool, in other block ids, with released blocks (before
    every query's window) pointing at the zero block: the logits of the single-array cache."""
    model = oss[0]
    W = model.config.sliding_window
    n = 2 * W + 100
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, model.config.vocab_size - 5, n).astype(np.int32)
    nb = -(-n // BS)
    table = np.arange(nb, dtype=np.int32)

    def run(cache, win_of):
        return np.stack([model.forward([SeqChunk(tokens[s:s + 48], s, table, "last",
                                                 win_block_table=win_of(s))], cache)[0]
                         for s in range(0, n, 48)])

    ref = run(model.new_cache(nb + 4, BS), lambda s: None)
    split = model.new_cache(nb + 4, BS, n_win_blocks=nb + 8)
    assert split.split
    win_table = np.arange(nb, 0, -1, dtype=np.int32)
    np.testing.assert_array_equal(run(split, lambda s: win_table), ref)
    released = model.new_cache(nb + 4, BS, n_win_blocks=nb + 8)

    def window_only(s):
        win = win_table.copy()
        win[:max(0, s - W + 1) // BS] = 0
        return win

    np.testing.assert_array_equal(run(released, window_only), ref)


def test_gpt_oss_windows_give_the_tokens_of_full_layers(oss):
    """Sharing with the window group, with every position kept (--swa-full) and without
    sharing: the same tokens, one after another, together, and as n = 2 choices; the window
    group holds less KV at the peak."""
    V = oss[0].config.vocab_size
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(5, V - 5, 420)]  # past three 128-token windows
    ps = [prefix + [int(t) for t in rng.integers(5, V - 5, 20 + 7 * i)] for i in range(4)]

    def run(eng, prompts, together=False, n=1, boundary=None):
        hs = []
        for p in prompts:
            hs.append(eng.submit(GenerationRequest(prompt_tokens=p, max_tokens=6, n=n,
                                                   sampling=GREEDY, first_user_boundary=boundary)))
            if not together:
                eng.run_until_idle()
        eng.run_until_idle()
        res = []
        for h in hs:
            toks, fin = h.result(timeout=0)
            res.append(([[t.token_id for t in toks if t.index == i and t.token_id >= 0]
                         for i in range(n)], fin.timings.cache_n))
        return res

    split, full, cold = (engine(oss, **kw) for kw in ({}, {"swa_full": True},
                                                      {"slot_attach": False}))
    assert split.windows is not None and full.windows is None
    seq = [ps[0], ps[1], ps[0] + [7, 8, 9]]
    a, b, c = (run(e, seq, boundary=len(prefix)) for e in (split, full, cold))
    assert [x[0] for x in a] == [x[0] for x in b] == [x[0] for x in c]
    assert a[1][1] == len(prefix)  # the boundary, its partial block copied in both pools
    assert a[2][1] >= len(ps[0]) + 5 - BS  # the finished sequence's end
    both = [ps[2], ps[3]]
    assert [x[0] for x in run(split, both, together=True)] == [x[0] for x in run(cold, both)]
    a3, b3 = run(split, [ps[3]], n=2), run(full, [ps[3]], n=2)
    assert a3[0][0] == b3[0][0] and a3[0][0][0] == run(cold, [ps[3]])[0][0][0]
    for e in (split, full, cold):
        assert_idle(e)
    held_split = split.snapshot()["pool"]["peak_kv_bytes_held"]
    held_full = full.snapshot()["pool"]["peak_kv_bytes_held"]
    assert held_split < 0.9 * held_full, (held_split, held_full)


def test_gpt_oss_preempted_windowed_sequences_resume_with_the_same_tokens(oss):
    V = oss[0].config.vocab_size
    rng = np.random.default_rng(7)
    prefix = [int(t) for t in rng.integers(5, V - 5, 300)]
    ps = [prefix + [int(t) for t in rng.integers(5, V - 5, 30 + 5 * i)] for i in range(4)]
    reqs = [GenerationRequest(prompt_tokens=p, max_tokens=24, sampling=GREEDY) for p in ps]
    ref = [[t for t, _, _ in cold_run(oss, r)] for r in reqs]
    # a main pool too small for four sessions at once: the youngest are preempted and resume
    # by attaching to what is still cached, windows included
    tight = engine(oss, kv_blocks=36)
    hs = [submit(tight, r) for r in reqs]
    tight.run_until_idle()
    got = [[t.token_id for t in h.result(timeout=0)[0] if t.token_id >= 0] for h in hs]
    assert got == ref
    assert tight.scheduler.n_preemptions > 0
    assert_idle(tight)
