"""Context shift (llama-server's --context-shift, engine/context_shift.py) in the engine: a
reply that fills its context drops part of its past and goes on; the tokens after each shift
are what a cold computation of the shifted token list gives; off, the reply ends with
`length`; a block another live sequence shares is never written; hybrids do not shift. Then a
real kvshare server started with llama.cpp's test_ctx_shift.py command lines (-c 512 -np 2
-n 128, with and without --context-shift) answers that test's requests as llama-server does;
its prompts are repeated to the token counts the test means on this model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.context_shift import plan_shift
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer
from tier_helpers import TINY_MODEL, Server

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


# ---------------------------------------------------------------------------- the flags

def test_flags():
    from kvshare.server import cli
    from kvshare.server.cli import engine_config_kwargs, llama_settings_kwargs

    args = cli.parse_args(["-m", "x.gguf", "--context-shift", "--keep", "5"], {})
    assert engine_config_kwargs(args)["context_shift"] is True
    assert llama_settings_kwargs(args)["n_keep"] == 5
    args = cli.parse_args(["-m", "x.gguf", "--context-shift", "--no-context-shift"], {})
    assert "context_shift" not in engine_config_kwargs(args)
    args = cli.parse_args(["-m", "x.gguf"], {"LLAMA_ARG_CONTEXT_SHIFT": "true"})
    assert engine_config_kwargs(args)["context_shift"] is True
    assert llama_settings_kwargs(cli.parse_args(["-m", "x.gguf"], {}))["n_keep"] == 0


def test_bad_keep_is_one_line_and_exit_2(capsys):
    from kvshare.server import cli

    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-m", "x.gguf", "--keep", "-2"], {})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep" in err[0], err


# ---------------------------------------------------------------------------- a real server
# llama.cpp tools/server/tests/unit/test_ctx_shift.py
SHORT_TEXT = """
Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.
Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat.
Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu fugiat nulla pariatur.
""".strip()
LONG_TEXT = SHORT_TEXT + """
Excepteur sint occaecat cupidatat non proident, sunt in culpa qui officia deserunt mollit anim id est laborum."""
PRESET = ("-c", "512", "-np", "2", "-n", "128", "--temp", "0", "--seed", "42")
SLOT_CTX = 256  # 512 / 2


def n_tokens(server: Server, text: str) -> int:
    return len(server.post("/tokenize", {"content": text, "add_special": True})["tokens"])


def text_of(server: Server, lo: int, hi: int, base: str = SHORT_TEXT) -> tuple[str, int]:
    """`base` repeated until it tokenizes to lo..hi tokens (with BOS): the test's 226-token
    prompt of a 256-token slot, on this model's tokenizer."""
    text = base
    while n_tokens(server, text) < lo:
        text += "\n" + base
    n = n_tokens(server, text)
    while n > hi:
        text = text[: len(text) * 9 // 10]
        n = n_tokens(server, text)
    assert lo // 2 <= n <= hi
    return text, n


@pytest.fixture(scope="module")
def shifting(launcher):
    # --context-shift through llama-server's environment variable, as its preset sets it
    s = Server(launcher, *PRESET, env={"LLAMA_ARG_CONTEXT_SHIFT": "1"})
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def not_shifting(launcher):
    s = Server(launcher, *PRESET)
    yield s
    s.terminate()


def test_server_ctx_shift_enabled(shifting):
    """test_ctx_shift_enabled: a 226-token prompt in a 256-token slot; 96 tokens are
    generated thanks to the shift."""
    text, n = text_of(shifting, 200, 240)
    r = shifting.client.post("/completion", json={"n_predict": 96, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["timings"]["prompt_n"] == n
    assert body["timings"]["predicted_n"] == 96
    assert body["truncated"] is True
    # tokens in the cache at the end: fewer than the context after the shift
    assert body["tokens_cached"] < SLOT_CTX
    props = shifting.client.get("/props").json()
    assert props["default_generation_settings"]["params"]["n_keep"] == 0
    assert shifting.client.get("/metrics").status_code == 200


def test_server_n_keep_all_of_the_prompt(shifting):
    """n_keep -1 keeps the whole prompt (and BOS): a shift discards only generated tokens."""
    text, n = text_of(shifting, 200, 240)
    r = shifting.client.post("/completion", json={"n_predict": 96, "prompt": text,
                                                 "n_keep": -1, "n_discard": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["timings"]["predicted_n"] == 96 and body["truncated"] is True
    assert body["generation_settings"]["n_keep"] == -1
    assert body["generation_settings"]["n_discard"] == 8


def test_server_bad_n_keep_is_a_400(shifting):
    r = shifting.client.post("/completion", json={"prompt": "Hi", "n_keep": "all"})
    assert r.status_code == 400
    assert "n_keep" in r.json()["error"]["message"]


@pytest.mark.parametrize("n_predict,n_token_output,truncated", [
    (64, 64, False),
    (-1, None, True),  # prompt + generated = the slot's 256 tokens
])
def test_server_ctx_shift_disabled_short_prompt(not_shifting, n_predict, n_token_output,
                                                truncated):
    # ignore_eos: the tiny test model may say EOS before the context is full
    r = not_shifting.client.post("/completion", json={"n_predict": n_predict,
                                                      "prompt": "Hi how are you",
                                                      "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    if n_token_output is None:
        n_token_output = SLOT_CTX - n_tokens(not_shifting, "Hi how are you")
    assert body["timings"]["predicted_n"] == n_token_output
    assert body["truncated"] == truncated


def test_server_ctx_shift_disabled_long_prompt(not_shifting):
    text, _ = text_of(not_shifting, 300, 400, LONG_TEXT)
    r = not_shifting.client.post("/completion", json={"n_predict": 64, "prompt": text})
    assert r.status_code != 200
    assert "exceeds the available context size" in r.json()["error"]["message"]


def test_server_long_prompt_is_refused_with_shift_too(shifting):
    """llama-server shifts only while generating: a prompt over the slot is an error."""
    text, _ = text_of(shifting, 300, 400, LONG_TEXT)
    r = shifting.client.post("/completion", json={"n_predict": 64, "prompt": text})
    assert r.status_code == 400
    assert "exceeds the available context size" in r.json()["error"]["message"]


def test_server_ctx_shift_disabled_stream(not_shifting):
    import json

    content, reasons = "", []
    with not_shifting.client.stream("POST", "/v1/completions", json={
            "n_predict": 256, "prompt": "Once", "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["finish_reason"] == "length":
                assert len(content) > 0
            else:
                assert choice["finish_reason"] is None
                content += choice["text"]
            reasons.append(choice["finish_reason"])
    assert reasons[-1] == "length"
