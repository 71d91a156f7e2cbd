"""llama-server's native API in-process (server/llama_native.py, against test_server_http's
fake engine): /completion and /completions, /infill, /props, /apply-template,
/chat/completions/input_tokens, /slots and /slots/{id} actions, field by field in the shapes
llama-server answers with (captured from its binary); bad input is a 4xx in llama-server's
error shape and the app serves on; the chat conventions (assistant prefill,
continue_final_message / add_generation_prompt, system_fingerprint, --n-predict,
--reasoning-format) and ChatTemplate's continue_final on real tokenizers."""

from __future__ import annotations

import json
import os

import pytest
from starlette.testclient import TestClient

from kvshare.engine.api import GenerationRequest, RequestRejected
from kvshare.apis import llama_server as N
from kvshare.apis import parsing as P
from kvshare.server.app import create_app
from kvshare.server.errors import APIError
from kvshare.server.settings import ServerSettings

from test_server_http import BOS, REPLY, FakeEngine, FakeHandle, sse_events

# llama-server's /completion response and generation_settings keys, in its order (captured
# from llama-server b1-0c1e570)
FINAL_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
              "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
              "stop_type", "stopping_word", "tokens_cached", "timings"]
PARTIAL_KEYS = ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted",
                "tokens_evaluated"]
SETTINGS_KEYS = [
    "seed", "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p",
    "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p", "repeat_last_n",
    "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat",
    "mirostat_tau", "mirostat_eta", "adaptive_target", "adaptive_decay", "stop", "max_tokens",
    "n_predict", "n_keep", "n_discard", "ignore_eos", "stream", "logit_bias", "n_probs",
    "min_keep", "grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens",
    "chat_format", "reasoning_format", "reasoning_in_content", "generation_prompt",
    "samplers", "speculative.types", "timings_per_token", "post_sampling_probs",
    "backend_sampling", "lora"]
METRICS_SETTINGS_KEYS = [k for k in SETTINGS_KEYS if k not in (
    "dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy",
    "grammar_triggers", "preserved_tokens")]
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                "predicted_n", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second"}
SLOT_KEYS = ["id", "n_ctx", "speculative", "is_processing", "id_task", "n_prompt_tokens",
             "n_prompt_tokens_processed", "n_prompt_tokens_cache", "params", "next_token"]
PRE, SUF, MID = 2, 3, 4  # the fake's FIM token ids


# --------------------------------------------------------------------------- fake engine

class StopHandle(FakeHandle):
    """FakeHandle whose normal end may be a stop string (engine.stop_string)."""

    def _finish(self, reason, n, t0, error=None):
        fin = super()._finish(reason, n, t0, error)
        if reason == "stop" and self.engine.stop_string:
            from dataclasses import replace
            fin = replace(fin, stop_string=self.engine.stop_string)
        return fin


class LlamaFake(FakeEngine):
    """The fake engine with `--parallel 2`, FIM tokens, a BOS id and continue_final."""

    def __init__(self, *a, fim: bool = True, **kw):
        super().__init__(*a, parallel=2, block_size=16, max_n=8,
                         fim_ids={"pre": PRE, "suf": SUF, "mid": MID} if fim else {}, **kw)
        self.stop_string: str | None = None
        self.continued: list[bool] = []

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True,
                            continue_final=False, **kwargs):
        text, boundary = super().apply_chat_template(
            messages, tools, False if continue_final else add_generation_prompt, **kwargs)
        if continue_final:  # the last message's turn left open
            text = text[:-1]
        return text, boundary

    def chat_prompt(self, messages, tools=None, *, add_generation_prompt=True,
                    template_kwargs=None, cache_after=None, continue_final=False):
        self.continued.append(continue_final)
        kw = dict(template_kwargs or {})
        if continue_final:
            kw["continue_final"] = True
        return super().chat_prompt(messages, tools, add_generation_prompt=add_generation_prompt,
                                   template_kwargs=kw, cache_after=cache_after)

    def submit(self, req: GenerationRequest):
        h = super().submit(req)
        h.__class__ = StopHandle
        return h


@pytest.fixture
def engine():
    return LlamaFake()


def make_client(engine, **settings) -> TestClient:
    return TestClient(create_app(engine, ServerSettings(**settings)))


@pytest.fixture
def client(engine):
    with make_client(engine) as c:
        yield c


def assert_llama_error(resp, status: int, type: str | None = None) -> dict:
    """llama-server's error shape: {"error": {"code", "message", "type"}} (+ context fields)."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert {"code", "message", "type"} <= set(err)
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    want = type or {400: "invalid_request_error", 404: "not_found_error",
                    501: "not_supported_error", 503: "unavailable_error"}.get(status)
    if want is not None:
        assert err["type"] == want
    return err


def serves(client) -> None:
    r = client.post("/completion", json={"prompt": "ok", "n_predict": 2})
    assert r.status_code == 200 and r.json()["stop"] is True and r.json()["content"]


# --------------------------------------------------------------------------- /completion

def test_completion_shape(client, engine):
    r = client.post("/completion", json={"prompt": "abc", "n_predict": 5})
    assert r.status_code == 200, r.text
    d = r.json()
    assert list(d) == FINAL_KEYS
    assert d["index"] == 0 and d["content"] == REPLY[:5] and d["tokens"] == []
    assert d["id_slot"] == 0 and d["stop"] is True and d["model"] == "fake-model"
    assert d["tokens_predicted"] == 5 and d["tokens_evaluated"] == 4  # BOS + abc
    assert d["prompt"] == "abc"  # the fake's detokenize drops BOS
    assert d["has_new_line"] is False and d["truncated"] is False
    assert d["stop_type"] == "limit" and d["stopping_word"] == ""
    assert d["tokens_cached"] == 4 + 5 - 1  # llama-server: the tokens in the slot's cache
    assert set(d["timings"]) >= TIMINGS_KEYS and d["timings"]["predicted_n"] == 5
    gs = d["generation_settings"]
    assert list(gs) == SETTINGS_KEYS
    assert gs["temperature"] == 0.8 and gs["top_k"] == 40 and gs["top_p"] == 0.95
    assert gs["min_p"] == 0.05 and gs["repeat_last_n"] == 64 and gs["repeat_penalty"] == 1.0
    assert gs["seed"] == 4294967295 and gs["n_predict"] == gs["max_tokens"] == 5
    assert gs["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    req = engine.requests[-1]
    assert req.prompt_tokens == [BOS, 97, 98, 99] and req.max_tokens == 5
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.penalty_last_n) == (0.8, 40, 0.95,
                                                                            0.05, 64)
    assert req.reuse_cache is True and not req.logprobs


def test_completions_without_v1_is_native_and_v1_stays_openai(client):
    assert list(client.post("/completions", json={"prompt": "a", "n_predict": 2}).json()) \
        == FINAL_KEYS
    d = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).json()
    assert d["object"] == "text_completion" and d["choices"][0]["text"] == REPLY[:2]
    assert d["system_fingerprint"].startswith("kvshare-")


@pytest.mark.parametrize("prompt,tokens", [
    ("abc", [BOS, 97, 98, 99]),
    ([97, 98], [97, 98]),  # ids: no BOS added
    ([97, "bc"], [97, 98, 99]),  # mixed: BOS only before a leading string
    (["ab", 99], [BOS, 97, 98, 99]),
    (["abc"], [BOS, 97, 98, 99]),  # one prompt in an array
    ({"prompt_string": "abc"}, [BOS, 97, 98, 99]),
    ("<bos>x", [BOS, BOS, 120]),  # special tokens parsed
])
def test_prompt_forms(client, engine, prompt, tokens):
    r = client.post("/completion", json={"prompt": prompt, "n_predict": 1})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_tokens == tokens
    assert r.json()["tokens_evaluated"] == len(tokens)


def test_stream(client):
    r = client.post("/completion", json={"prompt": "abc", "n_predict": 3, "stream": True,
                                         "n_probs": 2})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r.text)]  # no [DONE] on the native endpoint
    parts, final = events[:-1], events[-1]
    assert len(parts) == 3
    for i, c in enumerate(parts):
        assert list(c) == PARTIAL_KEYS + ["completion_probabilities"]
        assert c["content"] == REPLY[i] and c["tokens"] == [ord(REPLY[i])]
        assert c["stop"] is False and c["id_slot"] == -1  # as llama-server streams it
        assert c["tokens_predicted"] == i + 1 and c["tokens_evaluated"] == 4
        (p,) = c["completion_probabilities"]
        assert p["id"] == ord(REPLY[i]) and p["token"] == REPLY[i] and len(p["top_logprobs"]) == 2
    assert list(final) == FINAL_KEYS  # no completion_probabilities in a stream's final
    assert final["stop"] is True and final["content"] == "" and final["tokens"] == []
    assert final["tokens_predicted"] == 3 and final["id_slot"] == 0


def test_stream_without_probs(client):
    r = client.post("/completion", json={"prompt": "abc", "n_predict": 2, "stream": True})
    events = [json.loads(e) for e in sse_events(r.text)]
    assert [list(e) for e in events[:-1]] == [PARTIAL_KEYS] * 2
    assert "".join(e["content"] for e in events) == REPLY[:2]


def test_n_probs_and_return_tokens(client, engine):
    d = client.post("/completion", json={"prompt": "abc", "n_predict": 3, "n_probs": 2,
                                         "return_tokens": True}).json()
    assert list(d) == FINAL_KEYS + ["completion_probabilities"]
    assert d["tokens"] == [ord(c) for c in REPLY[:3]]
    probs = d["completion_probabilities"]
    assert len(probs) == 3
    for ch, p in zip(REPLY, probs):
        assert list(p) == ["id", "token", "bytes", "logprob", "top_logprobs"]
        assert p["id"] == ord(ch) and p["token"] == ch and p["bytes"] == list(ch.encode())
        assert p["logprob"] == -0.25
        assert [list(t) for t in p["top_logprobs"]] == [["id", "token", "bytes", "logprob"]] * 2
        assert [t["logprob"] for t in p["top_logprobs"]] == [-0.25, -1.25]
    assert engine.requests[-1].logprobs and engine.requests[-1].top_logprobs == 2
    assert d["generation_settings"]["n_probs"] == 2
    # "logprobs" is n_probs' alias
    client.post("/completion", json={"prompt": "abc", "n_predict": 1, "logprobs": 3})
    assert engine.requests[-1].top_logprobs == 3


def test_response_fields(client):
    d = client.post("/completion", json={
        "prompt": "abc", "n_predict": 2,
        "response_fields": ["content", "generation_settings/n_predict", "nope",
                            "timings/predicted_n", "stop_type/x"]}).json()
    assert d == {"content": REPLY[:2], "generation_settings/n_predict": 2,
                 "timings/predicted_n": 2}


def test_n_predict_forms(engine):
    with make_client(engine) as c:
        c.post("/completion", json={"prompt": "a"})
        assert engine.requests[-1].max_tokens == 128 - 2  # until the context is full
        d = c.post("/completion", json={"prompt": "a", "n_predict": -1}).json()
        assert engine.requests[-1].max_tokens == 126
        assert d["generation_settings"]["n_predict"] == -1
        c.post("/completion", json={"prompt": "a", "n_predict": 0})  # llama-server: one token
        assert engine.requests[-1].max_tokens == 1
        c.post("/completion", json={"prompt": "a", "max_tokens": 4})
        assert engine.requests[-1].max_tokens == 4
    with make_client(engine, default_max_tokens=3) as c:  # --n-predict
        d = c.post("/completion", json={"prompt": "a"}).json()
        assert engine.requests[-1].max_tokens == 3 and d["generation_settings"]["n_predict"] == 3
        c.post("/completion", json={"prompt": "a", "n_predict": -1})
        assert engine.requests[-1].max_tokens == 126
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert engine.requests[-1].max_tokens == 3
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert engine.requests[-1].max_tokens == 5


def test_sampling_options_reach_the_engine(client, engine):
    d = client.post("/completion", json={
        "prompt": "a", "n_predict": 1, "temperature": 0, "top_k": -5, "top_p": 1.5,
        "min_p": 0.1, "seed": 42, "repeat_penalty": 1.1, "repeat_last_n": 16,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": ["\n\n", ""],
        "ignore_eos": True, "logit_bias": [[65, 2.0], [66, False]], "cache_prompt": False,
    }).json()
    req = engine.requests[-1]
    s = req.sampling
    assert s.greedy and s.top_k == 0 and s.top_p == 1.0 and s.min_p == 0.1 and s.seed == 42
    assert s.repetition_penalty == 1.1 and s.penalty_last_n == 16
    assert s.presence_penalty == 0.5 and s.frequency_penalty == 0.25
    assert s.logit_bias == ((65, 2.0), (66, -100.0))
    assert req.stop == ["\n\n"] and req.ignore_eos and req.reuse_cache is False
    gs = d["generation_settings"]
    assert gs["seed"] == 42 and gs["stop"] == ["\n\n"] and gs["ignore_eos"] is True
    assert gs["logit_bias"] == [{"bias": 2.0, "token": 65}, {"bias": -100.0, "token": 66}]
    # text keys are tokenized (llama-server); an object works too
    client.post("/completion", json={"prompt": "a", "n_predict": 1,
                                     "logit_bias": {"ab": -1, "67": 3}})
    assert engine.requests[-1].sampling.logit_bias == ((97, -1.0), (98, -1.0), (67, 3.0))


def test_samplers(client, engine):
    d = client.post("/completion", json={"prompt": "a", "n_predict": 1,
                                         "samplers": ["Temperature", "top-k", "dry"]}).json()
    s = engine.requests[-1].sampling
    assert s.top_k == 40 and s.top_p == 1.0 and s.min_p == 0.0 and s.temperature == 0.8
    assert d["generation_settings"]["samplers"] == ["top_k", "temperature"]
    client.post("/completion", json={"prompt": "a", "n_predict": 1, "samplers": "kp"})
    s = engine.requests[-1].sampling
    assert s.top_k == 40 and s.top_p == 0.95 and s.min_p == 0.0 and s.temperature == 1.0
    for bad in (["nope"], "kz", 5, ["adaptive_p"]):
        assert_llama_error(client.post("/completion", json={"prompt": "a", "samplers": bad}),
                           400)
    serves(client)


def test_stop_types(client, engine):
    engine.reply = "ab"
    d = client.post("/completion", json={"prompt": "x", "n_predict": 5}).json()
    assert d["stop_type"] == "eos" and d["stopping_word"] == ""  # the reply ended: EOS
    engine.stop_string = "STOP"
    d = client.post("/completion", json={"prompt": "x", "n_predict": 5, "stop": ["STOP"]}).json()
    assert d["stop_type"] == "word" and d["stopping_word"] == "STOP"
    # llama-server leaves the stop word's tokens out of the probabilities
    engine.reply = "abST"
    engine.stop_string = "ST"
    d = client.post("/completion", json={"prompt": "x", "n_predict": 9, "stop": ["ST"],
                                         "n_probs": 1}).json()
    assert [p["token"] for p in d["completion_probabilities"]] == ["a", "b"]
    engine.reply = "a\nb"
    d = client.post("/completion", json={"prompt": "x", "n_predict": 2}).json()
    assert d["stop_type"] == "limit" and d["has_new_line"] is True


def test_truncated_when_the_context_fills(client, engine):
    engine.reply = "x" * 200
    d = client.post("/completion", json={"prompt": "a" * 100, "n_predict": -1}).json()
    assert d["tokens_predicted"] == 128 - 101 and d["truncated"] is True
    assert d["stop_type"] == "limit"


@pytest.mark.parametrize("stream", [False, True])
def test_n_indent_stops_early(client, engine, stream):
    """llama-server's n_indent: the first line (after a newline) indented less ends the
    generation, that line cut from the content."""
    engine.reply = "a\n  b\nc\nd and more"
    r = client.post("/completion", json={"prompt": "x", "n_predict": 30, "n_indent": 2,
                                         "stream": stream})
    if stream:
        events = [json.loads(e) for e in sse_events(r.text)]
        assert "".join(e["content"] for e in events) == "a\n  b\nc"  # what was sent
        d = events[-1]
    else:
        d = r.json()
        assert d["content"] == "a\n  b\n"
    assert d["stop_type"] == "limit" and d["tokens_predicted"] == 7
    assert engine.handles[-1].cancelled  # the generation was stopped, not run out
    serves(client)


def test_t_max_predict_ms(engine):
    engine.delay = 0.02
    engine.reply = "ab\ncd\nef"
    with make_client(engine) as c:
        d = c.post("/completion", json={"prompt": "x", "n_predict": 8,
                                        "t_max_predict_ms": 1}).json()
    assert d["content"] == "ab\n" and d["stop_type"] == "limit"


def test_bad_completion_requests(client, engine):
    bad = [
        {}, {"prompt": 5}, {"prompt": None}, {"prompt": []}, {"prompt": ["a", []]},
        {"prompt": [[1, 2], [999]]}, {"prompt": [1, {"x": 1}]}, {"prompt": [999]},
        {"prompt": "x", "n_predict": "a"}, {"prompt": "x", "n_predict": -2},
        {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "temperature": True},
        {"prompt": "x", "n_probs": 101}, {"prompt": "x", "stop": [1]},
        {"prompt": "x", "mirostat": 2}, {"prompt": "x", "typical_p": 0.5},
        {"prompt": "x", "dry_multiplier": 0.8}, {"prompt": "x", "post_sampling_probs": "yes"},
        {"prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}, {"prompt": "x", "n_cmpl": 2},
        {"prompt": "x", "response_fields": "content"}, {"prompt": "x", "id_slot": "a"},
        {"prompt": "x", "grammar": "not a grammar"}, {"prompt": "x", "json_schema": 5},
        {"prompt": "x", "logit_bias": [[65, "x"]]}, {"prompt": "x", "cache_prompt": "no"},
        {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}},
    ]
    for body in bad:
        r = client.post("/completion", json=body)
        assert 400 <= r.status_code < 600 and r.status_code in (400, 501), (body, r.text)
        assert_llama_error(r, r.status_code)
    assert_llama_error(client.post("/completion", content=b"{nope",
                                   headers={"content-type": "application/json"}), 400)
    assert not engine.requests
    serves(client)


def test_prompt_too_long_is_llama_servers_error(client):
    err = assert_llama_error(client.post("/completion", json={"prompt": "a" * 200}), 400,
                             "exceed_context_size_error")
    assert err["n_prompt_tokens"] == 201 and err["n_ctx"] == 128
    assert err["message"] == ("request (201 tokens) exceeds the available context size "
                              "(128 tokens), try increasing it")


def test_http_errors_on_native_paths(client):
    assert_llama_error(client.get("/completion"), 405, "invalid_request_error")
    assert_llama_error(client.get("/infill"), 405)
    assert_llama_error(client.delete("/props"), 405)


def test_engine_errors_in_llama_shape(client, engine):
    engine.fail_with = "boom"
    err = assert_llama_error(client.post("/completion", json={"prompt": "a"}), 500,
                             "server_error")
    assert "boom" in err["message"]
    r = client.post("/completion", json={"prompt": "a", "stream": True})
    (ev,) = [json.loads(e) for e in sse_events(r.text)]  # in-band, then the stream ends
    assert set(ev) == {"error"} and ev["error"]["code"] == 500
    assert ev["error"]["type"] == "server_error"
    engine.fail_with = None
    engine.submit_error = RequestRejected("no room", "context_length_exceeded")
    assert_llama_error(client.post("/completion", json={"prompt": "a"}), 400,
                       "exceed_context_size_error")
    engine.submit_error = None
    serves(client)


def test_json_schema_and_grammar(client, engine, monkeypatch):
    seen = []
    monkeypatch.setattr("kvshare.server.pipeline.compile_constraint",
                        lambda eng, c, rules=None: seen.append(c) or object())
    client.post("/completion", json={"prompt": "a", "n_predict": 1, "json_schema": {}})
    assert seen[-1].kind == "json_schema" and json.loads(seen[-1].source) == {"type": "object"}
    d = client.post("/completion", json={"prompt": "a", "n_predict": 1, "grammar": "root ::= \"x\"",
                                         "json_schema": {"type": "string"}}).json()
    assert seen[-1].kind == "gbnf"  # llama-server: grammar wins
    assert d["generation_settings"]["grammar"] == "root ::= \"x\""


# --------------------------------------------------------------------------- /infill

def test_infill_prompt_layout(client, engine):
    """llama-server's format_prompt_infill: [extra] BOS FIM_PRE prefix prompt FIM_SUF suffix
    FIM_MID (no FIM_REP / FIM_SEP: extra chunks behind a '--- snippet ---' line)."""
    d = client.post("/infill", json={"input_prefix": "ab", "input_suffix": "cd",
                                     "prompt": "P", "n_predict": 2}).json()
    assert list(d) == FINAL_KEYS and d["content"] == REPLY[:2]
    assert engine.requests[-1].prompt_tokens == [BOS, PRE, 97, 98, 80, SUF, 99, 100, MID]
    # token ids in the prefix; extra context before the prefix when the context has room
    eng = LlamaFake(ctx_size=4096)
    with make_client(eng) as c:
        c.post("/infill", json={"input_prefix": ["a", 66], "input_suffix": "",
                                "input_extra": [{"filename": "f.py", "text": "E"}],
                                "n_predict": 1})
    snippet = list(b"\n\n--- snippet ---\n\n")
    assert eng.requests[-1].prompt_tokens == [*snippet, 69, BOS, PRE, 97, 66, SUF, MID]


def test_infill_accepts_what_llama_vim_sends(client, engine):
    """llama.vim's request: infill sampler, time limits, response_fields."""
    d = client.post("/infill", json={
        "input_prefix": "def f(x):\n", "input_suffix": "\n", "prompt": "    ",
        "input_extra": [{"filename": "u.py", "text": "import os\n"}], "n_predict": 5,
        "n_indent": 4, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"],
        "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000, "response_fields": [
            "content", "timings/prompt_n", "timings/predicted_n", "timings/predicted_ms",
            "truncated", "tokens_cached"]}).json()
    assert set(d) == {"content", "timings/prompt_n", "timings/predicted_n",
                      "timings/predicted_ms", "truncated", "tokens_cached"}
    assert d["content"] == REPLY[:5]
    s = engine.requests[-1].sampling
    assert s.top_k == 40 and s.top_p == 0.9 and s.min_p == 0.0


def test_infill_repo_level_pattern():
    class Tok:
        def tokenize(self, text, add_special, parse_special):
            return list(text.encode())
    fim = {"pre": 2, "suf": 3, "mid": 4, "rep": 5, "sep": 6}
    got = N.format_infill(Tok(), fim, [97], [98], [{"filename": "f", "text": "T"}], [],
                          n_ctx=4096)
    want = [5, *b"myproject\n", 6, *b"f\n", *b"T", 6, *b"filename\n", 2, 97, 3, 98, 4]
    assert got == want
    # the prefix keeps its end, the suffix its start (3/4 and 1/4 of the batch)
    got = N.format_infill(Tok(), {"pre": 2, "suf": 3, "mid": 4}, list(range(10, 20)),
                          list(range(30, 40)), [], [7], n_ctx=64, n_batch=16)
    assert got == [2, *range(10, 20), 7, 3, 30, 4]


def test_infill_without_fim_tokens_is_501():
    eng = LlamaFake(fim=False)
    with make_client(eng) as c:
        err = assert_llama_error(c.post("/infill", json={"input_prefix": "a",
                                                         "input_suffix": "b"}), 501)
        assert err["message"] == ("Infill is not supported by this model: prefix token is "
                                  "missing. suffix token is missing. middle token is missing. ")
        serves(c)


def test_bad_infill_requests(client, engine):
    for body in ({"input_suffix": "b"}, {"input_prefix": "a"},
                 {"input_prefix": "a", "input_suffix": "b", "prompt": 5},
                 {"input_prefix": "a", "input_suffix": "b", "input_extra": {}},
                 {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": 1}]},
                 {"input_prefix": "a", "input_suffix": "b",
                  "input_extra": [{"text": "x", "filename": 3}]},
                 {"input_prefix": 5, "input_suffix": "b"},
                 {"input_prefix": ["a", 999], "input_suffix": "b"},
                 {"input_prefix": "a", "input_suffix": "b", "temperature": "x"}):
        assert_llama_error(client.post("/infill", json=body), 400)
    assert not engine.requests
    serves(client)


# --------------------------------------------------------------------------- /props etc.

def test_props(client):
    d = client.get("/props").json()
    for k in ("default_generation_settings", "total_slots", "model_alias", "model_path",
              "modalities", "endpoint_slots", "endpoint_props", "chat_template", "bos_token",
              "eos_token", "build_info", "is_sleeping"):
        assert k in d, k
    dgs = d["default_generation_settings"]
    assert set(dgs) == {"params", "n_ctx"} and dgs["n_ctx"] == 128
    assert list(dgs["params"]) == METRICS_SETTINGS_KEYS
    assert dgs["params"]["n_predict"] == -1 and dgs["params"]["temperature"] == 0.8
    assert d["total_slots"] == 2 and d["modalities"] == {"vision": False, "video": False,
                                                         "audio": False}
    assert d["endpoint_slots"] is True and d["endpoint_props"] is False
    assert d["build_info"].startswith("kvshare-") and d["is_sleeping"] is False
    assert_llama_error(client.post("/props", json={}), 501)


def test_apply_template(client, engine):
    msgs = [{"role": "user", "content": "hi"}]
    assert client.post("/apply-template", json={"messages": msgs}).json() == {
        "prompt": "<bos><user>hi\n<assistant>"}
    prefill = msgs + [{"role": "assistant", "content": "Sure"}]
    assert client.post("/apply-template", json={"messages": prefill}).json() == {
        "prompt": "<bos><user>hi\n<assistant>Sure"}
    assert client.post("/apply-template", json={
        "messages": msgs, "add_generation_prompt": False}).json() == {"prompt": "<bos><user>hi\n"}
    for bad in ({}, {"messages": "x"}, {"messages": [{"role": "user", "content": "RAISE"}]},
                {"messages": msgs, "add_generation_prompt": True,
                 "continue_final_message": True}):
        assert_llama_error(client.post("/apply-template", json=bad), 400)


def test_chat_input_tokens(client, engine):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    d = client.post("/v1/chat/completions/input_tokens", json=body).json()
    want = len(engine.chat_prompt(body["messages"]).tokens)
    assert d == {"input_tokens": want, "object": "response.input_tokens"}
    assert client.post("/chat/completions/input_tokens", json=body).json() == d
    r = client.post("/v1/chat/completions/input_tokens", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# --------------------------------------------------------------------------- slots

def test_slots_shape(client, engine):
    s = client.get("/slots").json()
    assert [list(x) for x in s] == [["id", "n_ctx", "speculative", "is_processing"]] * 2
    assert [x["id"] for x in s] == [0, 1] and not any(x["is_processing"] for x in s)
    client.post("/completion", json={"prompt": "abc", "n_predict": 3, "temperature": 0})
    s0, s1 = client.get("/slots").json()
    assert list(s0) == SLOT_KEYS and list(s1) == ["id", "n_ctx", "speculative",
                                                  "is_processing"]
    assert s0["n_ctx"] == 128 and s0["is_processing"] is False and s0["n_prompt_tokens"] == 4
    assert list(s0["params"]) == METRICS_SETTINGS_KEYS and s0["params"]["temperature"] == 0
    assert s0["next_token"] == [{"has_next_token": False, "has_new_line": False,
                                 "n_remain": -1, "n_decoded": 3}]
    # a chat request takes a slot too (its params from what it was submitted with)
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 2, "temperature": 0.5})
    s0 = client.get("/slots").json()[0]
    assert s0["params"]["temperature"] == 0.5 and s0["params"]["n_predict"] == 2
    assert s0["id_task"] == 1


def test_slots_while_processing(engine):
    """A running request shows in its slot, with kvshare's figures; more requests than slots
    wait for one; id_slot picks an idle slot."""
    import threading
    import time
    engine.delay = 0.05
    with make_client(engine) as c:
        results = {}

        def run(i, body):
            results[i] = c.post("/completion", json=body).json()
        ts = [threading.Thread(target=run, args=(i, {"prompt": f"p{i}", "n_predict": 20,
                                                   "id_slot": 1 if i == 0 else -1}))
              for i in range(3)]
        for t in ts:
            t.start()
            time.sleep(0.02)
        deadline = time.time() + 5
        while time.time() < deadline:
            s = c.get("/slots").json()
            if all(x["is_processing"] for x in s):
                break
            time.sleep(0.01)
        assert all(x["is_processing"] for x in s)
        assert s[1]["kvshare"]["sequences"][0]["n_prompt"] == 3
        assert {"request_id", "sequences", "cached_tokens", "shared_blocks"} <= set(s[1]["kvshare"])
        assert s[1]["next_token"][0]["has_next_token"] is True
        assert_llama_error(c.get("/slots", params={"fail_on_no_slot": 1}), 503)
        for t in ts:
            t.join()
        assert results[0]["id_slot"] == 1  # the slot it asked for
        # the third waited and took whichever slot freed first
        assert sorted(r["id_slot"] for r in results.values()) in ([0, 0, 1], [0, 1, 1])
        assert not any(x["is_processing"] for x in c.get("/slots").json())


def test_slots_endpoint_off(engine):
    with make_client(engine, slots_endpoint=False) as c:
        assert_llama_error(c.get("/slots"), 501)


def test_slot_save_restore_erase(engine, tmp_path):
    with make_client(engine) as c:  # no --slot-save-path
        for action in ("save", "restore", "erase"):
            assert_llama_error(c.post("/slots/0", params={"action": action},
                                      json={"filename": "a"}), 501)
    with make_client(engine, slot_save_path=str(tmp_path)) as c:
        c.post("/completion", json={"prompt": "abc", "n_predict": 3, "id_slot": 0})
        d = c.post("/slots/0?action=save", json={"filename": "conv.json"}).json()
        assert list(d) == ["id_slot", "filename", "n_saved", "n_written", "timings"]
        assert d["id_slot"] == 0 and d["filename"] == "conv.json" and d["n_saved"] == 7
        assert set(d["timings"]) == {"save_ms"}
        saved = json.loads((tmp_path / "conv.json").read_text())
        assert saved["tokens"] == [BOS, 97, 98, 99, *map(ord, REPLY[:3])]
        assert d["n_written"] == os.path.getsize(tmp_path / "conv.json")
        n_before = len(engine.requests)
        d = c.post("/slots/1?action=restore", json={"filename": "conv.json"}).json()
        assert list(d) == ["id_slot", "filename", "n_restored", "n_read", "timings"]
        assert d["id_slot"] == 1 and d["n_restored"] == 7 and set(d["timings"]) == {"restore_ms"}
        warm = engine.requests[n_before]  # the tokens computed into the cache
        assert warm.prompt_tokens == saved["tokens"] and warm.max_tokens == 1
        s1 = c.get("/slots").json()[1]
        assert s1["is_processing"] is False
        d = c.post("/slots/1?action=erase").json()
        assert d == {"id_slot": 1, "n_erased": 7}
        assert c.post("/slots/1?action=erase").json() == {"id_slot": 1, "n_erased": 0}
        # bad requests
        for name in ("../x", "a/b", "", ".", "x\x00", 5, None):
            assert_llama_error(c.post("/slots/0?action=save", json={"filename": name}), 400)
        assert_llama_error(c.post("/slots/7?action=erase"), 400)
        assert_llama_error(c.post("/slots/x?action=erase"), 400)
        assert_llama_error(c.post("/slots/0?action=nope"), 400)
        # a missing file reads as another tenant's would: 404 (tests/test_slot_tenancy.py)
        assert_llama_error(c.post("/slots/0?action=restore", json={"filename": "missing"}), 404)
        (tmp_path / "junk").write_text("not json")
        assert_llama_error(c.post("/slots/0?action=restore", json={"filename": "junk"}), 400)
        other = dict(saved, model="another-model")
        (tmp_path / "other").write_text(json.dumps(other))
        assert_llama_error(c.post("/slots/0?action=restore", json={"filename": "other"}), 400)
        serves(c)


# --------------------------------------------------------------------------- chat conventions

MSGS = [{"role": "user", "content": "hi"}]


def test_assistant_prefill_is_continued(client, engine):
    body = {"messages": MSGS + [{"role": "assistant", "content": "Sure, "}], "max_tokens": 3}
    d = client.post("/v1/chat/completions", json=body).json()
    assert engine.continued[-1] is True
    text = bytes(t for t in engine.requests[-1].prompt_tokens if t != BOS).decode()
    assert text.endswith("<assistant>Sure, ")  # the turn left open, no generation prompt
    assert d["choices"][0]["message"]["content"] == REPLY[:3]  # the continuation only
    # vLLM's spelling, and turning it off
    client.post("/v1/chat/completions", json={**body, "continue_final_message": True,
                                              "add_generation_prompt": False})
    assert engine.continued[-1] is True
    client.post("/v1/chat/completions", json={**body, "continue_final_message": False})
    assert engine.continued[-1] is False
    assert engine.template_calls[-1][2] is True  # a new assistant turn after it
    # llama-server: a prefill wins over add_generation_prompt true
    client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert engine.continued[-1] is True


def test_add_generation_prompt_false(client, engine):
    client.post("/v1/chat/completions", json={"messages": MSGS, "add_generation_prompt": False,
                                              "max_tokens": 1})
    assert engine.continued[-1] is False and engine.template_calls[-1][2] is False


@pytest.mark.parametrize("body,param", [
    ({"messages": MSGS + [{"role": "assistant", "content": "a"}],
      "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    ({"messages": MSGS + [{"role": "assistant", "content": "a"}] * 2}, "messages"),
    ({"messages": MSGS + [{"role": "assistant", "content": "",
                           "tool_calls": [{"id": "1", "type": "function", "function": {
                               "name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": MSGS, "continue_final_message": "reasoning_content"},
     "continue_final_message"),
    ({"messages": MSGS, "continue_final_message": 1}, "continue_final_message"),
    ({"messages": MSGS, "add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_continuation_rules(client, engine, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not engine.requests


def test_system_fingerprint(client):
    d = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).json()
    assert isinstance(d["system_fingerprint"], str) and d["system_fingerprint"].startswith(
        "kvshare-")
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1,
                                                  "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    assert {c["system_fingerprint"] for c in chunks} == {d["system_fingerprint"]}


def test_reasoning_format_default():
    assert P.parse_chat({"messages": MSGS}).reasoning_format == "auto"
    assert P.parse_chat({"messages": MSGS}, reasoning_format="none").reasoning_format == "none"
    assert P.parse_chat({"messages": MSGS, "reasoning_format": "deepseek"},
                        reasoning_format="none").reasoning_format == "deepseek"


def test_template_kwargs_cannot_set_renderer_options():
    chat = P.parse_chat({"messages": MSGS, "chat_template_kwargs": {
        "continue_final": True, "strip_bos": False, "enable_thinking": False}})
    assert chat.template_kwargs == {"enable_thinking": False} and not chat.continue_final


def test_error_body_shape():
    e = APIError(400, "bad", code="context_length_exceeded")
    e.details = {"n_prompt_tokens": 9, "n_ctx": 8}
    assert N.llama_error_body(e) == {"error": {"code": 400, "message": (
        "request (9 tokens) exceeds the available context size (8 tokens), try increasing it"),
                                               "type": "exceed_context_size_error",
                                               "n_prompt_tokens": 9, "n_ctx": 8}}
    assert N.llama_error_body(APIError(503, "busy")) == {
        "error": {"code": 503, "message": "busy", "type": "unavailable_error"}}


def test_select_fields():
    res = {"a": 1, "b": {"c": 2}}
    assert N.select_fields(res, []) is res
    assert N.select_fields(res, ["b/c", "a", "b/x", "z"]) == {"b/c": 2, "a": 1}


def test_health_503_carries_an_error_object(client):
    assert client.get("/health").json() == {"status": "ok"}
    client.app.state.server.begin_shutdown()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"


# --------------------------------------------------------------------------- continue_final

def _tok(path):
    from kvshare.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module", params=["gemma", "tiny-qwen3-chat"])
def template(request):
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.loader import default_model_path
    path = (default_model_path() if request.param == "gemma"
            else os.path.join(os.path.dirname(__file__), "data", "models",
                              "tiny-qwen3-chat.gguf"))
    tok = _tok(path)
    return ChatTemplate.for_tokenizer(tok), tok


@pytest.mark.parametrize("content", ["The answer is", "The answer is ", "", " lead",
                                     "two\nlines\n"])
def test_continue_final_renders_an_open_turn(template, content):
    t, tok = template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"},
            {"role": "assistant", "content": content}]
    text = t.render(msgs, continue_final=True)
    closed = t.render(msgs, add_generation_prompt=False)
    before = t.render(msgs[:-1], add_generation_prompt=False)
    assert text.startswith(before)  # the conversation before it, as rendered
    # the message's text ends the prompt (a template that trims may drop leading space);
    # trailing whitespace is kept: the reply continues after it
    assert text.endswith(content) or text.endswith(content.lstrip())
    tail = closed[len(text.rstrip()):] if closed.startswith(text.rstrip()) else None
    assert tail, (text, closed)  # the closed render goes on: the turn's end marker
    assert not text.rstrip().endswith(("<end_of_turn>", "<|im_end|>"))
    p = t.apply(tok, msgs, continue_final=True)
    assert p.text == text and p.ids == tok.encode(text, add_special=True, parse_special=True)
    assert p.first_user_token is not None and p.first_user_token < len(p.ids)


def test_continue_final_fallback_and_errors():
    """A template that does not print the content verbatim: llama.cpp's construction (the
    conversation before it with a generation prompt, then the content)."""
    from kvshare.model.chat_template import ChatTemplate, ChatTemplateError
    src = ("{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</s>{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}")
    t = ChatTemplate(src)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go on"}]
    assert t.render(msgs, continue_final=True) == "<user>HI</s><assistant>go on"
    with pytest.raises(ChatTemplateError):
        t.render([], continue_final=True)
