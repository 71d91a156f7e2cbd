"""The HTTP layer against a fake engine: validation and error shapes, SSE framing, auth,
root_path, body limits, tokenize formats, metrics, disconnects and graceful shutdown (the last
ones through a real Hypercorn server in a thread)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from kvshare.engine.api import (FinishEvent, RequestRejected,
                               Timings)
from kvshare.server import cli
from kvshare.server.app import create_app
from kvshare.server.launcher import bind_socket, serve_app, socket_url
from kvshare.server.settings import ServerSettings

from fake_engine import BOS, REPLY, FakeEngine, FakeHandle  # noqa: F401 - other tests import them here


# --------------------------------------------------------------------------- fixtures

@pytest.fixture
def engine():
    return FakeEngine()


def make_client(engine, **settings) -> TestClient:
    return TestClient(create_app(engine, ServerSettings(**settings)))


@pytest.fixture
def client(engine):
    with make_client(engine) as c:
        yield c


def sse_events(text: str) -> list[str]:
    """Split an SSE body into `data:` payloads, checking the framing strictly."""
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    events = text[:-2].split("\n\n")
    out = []
    for ev in events:
        assert ev.startswith("data: "), ev
        assert "\n" not in ev, "one data line per event"
        out.append(ev[len("data: "):])
    return out


def assert_error(resp, status: int, param=..., code=...):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not ...:
        assert err["param"] == param
    if code is not ...:
        assert err["code"] == code
    return err


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- basics

def test_lifespan_starts_and_stops_engine(engine):
    with make_client(engine) as c:
        assert engine.started and not engine.stopped
        assert c.get("/health").json() == {"status": "ok"}
    assert engine.stopped


def test_models_with_and_without_v1(client):
    for path in ("/v1/models", "/models"):
        body = client.get(path).json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["fake-model"]
        assert body["data"][0]["object"] == "model"
        assert body["data"][0]["meta"]["n_ctx"] == 128


def test_chat_completion_shape(client, engine):
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    n_prompt = len(engine.requests[0].prompt_tokens)
    u = body["usage"]
    assert u == {"prompt_tokens": n_prompt, "completion_tokens": len(REPLY),
                 "total_tokens": n_prompt + len(REPLY),
                 "prompt_tokens_details": {"cached_tokens": 0}}
    t = body["timings"]
    for k in ("prompt_n", "cache_n", "prompt_ms", "prompt_per_second", "predicted_n",
              "predicted_ms", "predicted_per_second"):
        assert k in t
    assert t["prompt_n"] + t["cache_n"] == n_prompt
    # the prompt is the rendered template, tokenized with BOS once (template BOS deduplicated)
    req = engine.requests[0]
    assert req.prompt_tokens[:2] != [BOS, BOS] and req.prompt_tokens[0] == BOS
    assert engine.detokenize(req.prompt_tokens) == "<user>hi\n<assistant>"
    assert req.first_user_boundary == 2  # shifted by the dropped duplicate BOS
    # the same request again reuses the prompt: cached_tokens reported
    body2 = client.post("/chat/completions", json=CHAT).json()
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1


def test_chat_request_fields_reach_the_engine(client, engine):
    body = dict(CHAT, temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, seed=42,
                presence_penalty=0.5, frequency_penalty=-0.5, repeat_penalty=1.1,
                repeat_last_n=32, stop="\n", max_completion_tokens=5, ignore_eos=True,
                cache_salt="tenant-a",
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                tool_choice="auto", chat_template_kwargs={"enable_thinking": False})
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 20, 0.05, 42)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert (s.repetition_penalty, s.penalty_last_n) == (1.1, 32)
    assert req.stop == ["\n"] and req.max_tokens == 5 and req.ignore_eos
    assert req.cache_salt == hashlib.sha256(b"tenant-a").digest()
    messages, tools, agp, kwargs = engine.template_calls[-1]
    assert tools == body["tools"] and agp is True and kwargs == {"enable_thinking": False}
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == REPLY[:5]


def test_chat_messages_are_normalized(client, engine):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "1", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "42"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs})  # no model: the default
    assert r.status_code == 200, r.text
    sent = engine.template_calls[-1][0]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[1]["content"] == "a\nb"
    assert sent[2]["content"] == "" and sent[2]["tool_calls"] == msgs[2]["tool_calls"]
    assert sent[3]["tool_call_id"] == "1"


def test_max_tokens_defaults_to_rest_of_context(client, engine):
    client.post("/v1/chat/completions", json=CHAT)
    req = engine.requests[-1]
    assert req.max_tokens == engine.ctx_size - len(req.prompt_tokens)
    # a max_tokens within ctx but past the end of the context is clamped, not refused
    client.post("/v1/chat/completions", json=dict(CHAT, max_tokens=128))
    req = engine.requests[-1]
    assert req.max_tokens == engine.ctx_size - len(req.prompt_tokens)


# --------------------------------------------------------------------------- streaming

def test_chat_stream_framing(client):
    with client.stream("POST", "/v1/chat/completions", json=dict(CHAT, stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == REPLY
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["delta"] == {}
    assert last["usage"]["completion_tokens"] == len(REPLY)
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    assert last["timings"]["predicted_n"] == len(REPLY)


def test_stream_include_usage_adds_openai_usage_chunk(client):
    body = dict(CHAT, stream=True, stream_options={"include_usage": True}, max_tokens=3)
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 3


def test_completion_stream(client):
    body = {"prompt": "abc", "stream": True, "max_tokens": 4}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY[:4]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["prompt_tokens"] == 4  # BOS + 'abc'


def test_engine_error_in_stream_is_reported_in_band(client, engine):
    engine.fail_with = "kaboom"
    with client.stream("POST", "/v1/chat/completions", json=dict(CHAT, stream=True)) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "kaboom" in err["message"] and err["type"] == "server_error"
    r = client.post("/v1/chat/completions", json=CHAT)
    assert_error(r, 500, code="engine_error")


def test_engine_error_status_cause_and_retry_after(client, engine, monkeypatch):
    """A FinishEvent's error status and cause become the response's; a 503 carries
    Retry-After."""
    def finish(self, reason, n, t0, error=None):
        self.finished = True
        p = len(self.req.prompt_tokens)
        return FinishEvent(reason=reason, prompt_tokens=p, completion_tokens=n,
                           timings=Timings(p, 0, 1.0, n, 1.0), time_to_first_token_s=0.0,
                           error=error, error_status=503, error_cause="queue_timeout",
                           retry_after_s=4.6)
    monkeypatch.setattr(FakeHandle, "_finish", finish)
    engine.fail_with = "the server is busy"
    r = client.post("/v1/chat/completions", json=CHAT)
    err = assert_error(r, 503, code="queue_timeout")
    assert r.headers["Retry-After"] == "5" and err["message"] == "the server is busy"


def test_health_says_loading_while_the_engine_warms_up(client, engine):
    """While the engine prepares a GPU model's steps, /health answers as llama-server does
    while its model loads: a 503 with a "Loading model" error object."""
    engine.warming_up = lambda: True
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json() == {"status": "loading model", "error": {
        "code": 503, "message": "Loading model", "type": "unavailable_error"}}
    engine.warming_up = lambda: False
    assert client.get("/health").json() == {"status": "ok"}


def test_health_reports_a_stalled_engine(client, engine):
    engine.stalled_for = lambda: 0.5
    assert client.get("/health").json() == {"status": "ok"}
    engine.stalled_for = lambda: 75.0
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "engine stalled"


# --------------------------------------------------------------------------- completions

@pytest.mark.parametrize("prompt", ["abc", ["abc"], [1, 97, 98, 99], [[1, 97, 98, 99]]])
def test_completion_prompt_forms(client, engine, prompt):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": prompt,
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == REPLY[:3]
    assert body["choices"][0]["finish_reason"] == "length"
    assert engine.requests[-1].prompt_tokens == [1, 97, 98, 99]
    assert engine.requests[-1].sampling.greedy
    assert body["usage"]["prompt_tokens"] == 4


def test_completion_text_prompt_parses_special_tokens(client, engine):
    client.post("/completions", json={"prompt": "<bos>x", "max_tokens": 1})
    assert engine.requests[-1].prompt_tokens == [BOS, BOS, ord("x")]


def test_completion_echo_and_legacy_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "echo": True,
                                             "logprobs": 2})
    body = r.json()
    ch = body["choices"][0]
    assert ch["text"] == "ab" + REPLY[:3]
    lp = ch["logprobs"]
    assert lp["tokens"] == list(REPLY[:3])
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [2, 3, 4]
    assert all(len(d) == 2 for d in lp["top_logprobs"])


def test_chat_logprobs_shape(client):
    body = dict(CHAT, logprobs=True, top_logprobs=2, max_tokens=2)
    ch = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = ch["logprobs"]["content"]
    assert [c["token"] for c in content] == list(REPLY[:2])
    for c in content:
        assert c["logprob"] == -0.25 and c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == 2
        assert set(c["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    with client.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        chunks = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [x["content"][0]["token"] for x in lps] == list(REPLY[:2])


# --------------------------------------------------------------------------- bad input

BAD_CHAT = [
    ("malformed json", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("empty body", b"", 400, None),
    ("messages missing", {"model": "fake-model"}, 400, "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("role missing", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("user content missing", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("max_tokens string", dict(CHAT, max_tokens="5"), 400, "max_tokens"),
    ("max_tokens float", dict(CHAT, max_tokens=2.5), 400, "max_tokens"),
    ("max_tokens bool", dict(CHAT, max_tokens=True), 400, "max_tokens"),
    ("max_tokens negative", dict(CHAT, max_tokens=-1), 400, "max_tokens"),
    ("max_tokens zero", dict(CHAT, max_tokens=0), 400, "max_tokens"),
    ("temperature string", dict(CHAT, temperature="hot"), 400, "temperature"),
    ("temperature negative", dict(CHAT, temperature=-1), 400, "temperature"),
    ("top_p > 1", dict(CHAT, top_p=1.5), 400, "top_p"),
    ("top_k float", dict(CHAT, top_k=1.5), 400, "top_k"),
    ("seed string", dict(CHAT, seed="x"), 400, "seed"),
    ("stream string", dict(CHAT, stream="yes"), 400, "stream"),
    ("stop number", dict(CHAT, stop=5), 400, "stop"),
    ("stop too many", dict(CHAT, stop=["a"] * 17), 400, "stop"),
    ("n above --max-n", dict(CHAT, n=9), 400, "n"),
    ("n zero", dict(CHAT, n=0), 400, "n"),
    ("top_logprobs without logprobs", dict(CHAT, top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs > 20", dict(CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("logprobs int in chat", dict(CHAT, logprobs=3), 400, "logprobs"),
    ("cache_salt empty", dict(CHAT, cache_salt=""), 400, "cache_salt"),
    ("cache_salt number", dict(CHAT, cache_salt=3), 400, "cache_salt"),
    ("tools not a list", dict(CHAT, tools={"a": 1}), 400, "tools"),
    ("tool without name", dict(CHAT, tools=[{"type": "function", "function": {}}]), 400,
     "tools"),
    ("bad tool_choice", dict(CHAT, tool_choice="always"), 400, "tool_choice"),
    ("unknown response_format", dict(CHAT, response_format={"type": "xml"}), 400,
     "response_format"),
    ("json_schema without schema object", dict(CHAT, response_format={
        "type": "json_schema", "json_schema": "x"}), 400, "response_format"),
    ("tool_choice undeclared", dict(CHAT, tools=[{"type": "function", "function": {
        "name": "a"}}], tool_choice={"type": "function", "function": {"name": "b"}}), 400,
     "tool_choice"),
    ("tool_choice required without tools", dict(CHAT, tool_choice="required"), 400,
     "tool_choice"),
    ("tool declared twice", dict(CHAT, tools=[{"type": "function", "function": {"name": "a"}}] * 2),
     400, "tools"),
    ("tool name with spaces", dict(CHAT, tools=[{"type": "function", "function": {
        "name": "a b"}}]), 400, "tools"),
    ("logit_bias out of range", dict(CHAT, logit_bias={"1": 500}), 400, "logit_bias"),
    ("logit_bias bad token", dict(CHAT, logit_bias={"999": 5}), 400, "logit_bias"),
    ("logit_bias key", dict(CHAT, logit_bias={"x": 5}), 400, "logit_bias"),
    ("two constraints", dict(CHAT, response_format={"type": "json_object"}, grammar="root ::= \"a\""),
     400, "grammar"),
    ("model wrong type", dict(CHAT, model=3), 400, "model"),
    ("template error", {"messages": [{"role": "user", "content": "RAISE"}]}, 400, "messages"),
    ("prompt too long", {"messages": [{"role": "user", "content": "x" * 200}]}, 400,
     "messages"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests(client, engine, name, body, status, param):
    if isinstance(body, bytes):
        r = client.post("/v1/chat/completions", content=body,
                        headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/chat/completions", json=body)
    assert_error(r, status, param=param)
    assert engine.requests == []


BAD_COMPLETIONS = [
    ("prompt missing", {}, "prompt"),
    ("prompt number", {"prompt": 5}, "prompt"),
    ("prompt empty list", {"prompt": []}, "prompt"),
    ("an empty prompt in a list", {"prompt": ["a", []]}, "prompt"),
    ("a bad token prompt in a list", {"prompt": [[1, 2], [256]]}, "prompt"),
    ("mixed prompt", {"prompt": [1, "a"]}, "prompt"),
    ("token out of range", {"prompt": [1, 256]}, "prompt"),
    ("negative token", {"prompt": [-1]}, "prompt"),
    ("empty text prompt", {"prompt": "", "max_tokens": 1}, None),
    ("n above --max-n", {"prompt": "a", "n": 30}, "n"),
    ("best_of", {"prompt": "a", "best_of": 2}, "best_of"),
    ("suffix", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("logprobs bool", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("logprobs > 20", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("echo string", {"prompt": "a", "echo": "yes"}, "echo"),
]


@pytest.mark.parametrize("name,body,param", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_requests(client, engine, name, body, param):
    if name == "empty text prompt":
        engine.tokenize = lambda text, add_special=True, parse_special=True: []  # no BOS model
    r = client.post("/v1/completions", json=body)
    assert_error(r, 400, param=param if param else "prompt")
    assert engine.requests == []


def test_prompt_longer_than_context(client):
    r = client.post("/v1/completions", json={"prompt": "x" * 127})  # 128 tokens with BOS
    assert_error(r, 400, param="prompt", code="context_length_exceeded")
    r = client.post("/v1/completions", json={"prompt": [5] * 500})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")
    r = client.post("/v1/completions", json={"prompt": "x" * 126, "max_tokens": 5})
    assert r.status_code == 200  # 127 tokens: room for one
    assert r.json()["usage"]["completion_tokens"] == 1


def test_any_model_name_is_served_and_echoed(client):
    for path, body in (("/v1/chat/completions", dict(CHAT, model="gpt-4o")),
                       ("/v1/completions", {"model": "nope", "prompt": "a"})):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == body["model"]
    r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.json()["model"] == "fake-model"


def test_max_tokens_beyond_context_is_clamped(client, engine):
    r = client.post("/v1/completions", json={"prompt": "x" * 110, "max_tokens": 10**9})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].max_tokens == 128 - 111  # the room left after the prompt
    assert r.json()["choices"][0]["finish_reason"] == "length"  # a 27-char reply


def test_wrong_content_type_is_415(client):
    r = client.post("/v1/chat/completions", content=json.dumps(CHAT),
                    headers={"content-type": "image/png"})
    assert_error(r, 415, code="unsupported_media_type")
    # `curl -d` labels JSON as a form: read as JSON (as llama-server does), but not when a
    # browser page sent it (an Origin: the "simple" types skip the CORS preflight)
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = client.post("/v1/chat/completions", content=json.dumps(CHAT),
                        headers={"content-type": ctype})
        assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", content=json.dumps(CHAT),
                        headers={"content-type": ctype, "origin": "https://evil.example"})
        assert_error(r, 415, code="unsupported_media_type")
    # application/json with parameters, and a missing content type, are fine
    r = client.post("/v1/chat/completions", content=json.dumps(CHAT),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_body_limit(engine):
    with make_client(engine, max_body_bytes=1000) as c:
        big = dict(CHAT, pad="x" * 2000)
        assert_error(c.post("/v1/chat/completions", json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: counted while streaming
            yield b'{"pad": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}'

        r = c.post("/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        assert_error(c.post("/tokenize", json={"content": "x" * 2000}), 413)
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert engine.requests and len(engine.requests) == 1


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_error(client.get("/v1/chat/completions"), 405, code="method_not_allowed")


def test_submit_rejection_is_400_with_its_code_and_crash_is_500(client, engine):
    # the code comes from the engine's typed error, never from its message text
    engine.submit_error = RequestRejected("too long for the pool", "context_length_exceeded")
    assert_error(client.post("/v1/chat/completions", json=CHAT), 400,
                 code="context_length_exceeded")
    engine.submit_error = RequestRejected("the context is what it is", "invalid_request")
    assert_error(client.post("/v1/chat/completions", json=CHAT), 400, code="invalid_request")
    engine.submit_error = RuntimeError("boom")
    err = assert_error(client.post("/v1/chat/completions", json=CHAT), 500)
    assert err["code"] == "internal_error"
    assert client.get("/health").json() == {"status": "ok"}


# --------------------------------------------------------------------------- auth, root path

def test_api_key(engine):
    with make_client(engine, api_key="s3cret") as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/slots", "/cache"):
            assert_error(c.get(path), 401, code="invalid_api_key")
        assert_error(c.post("/v1/chat/completions", json=CHAT), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "s3cret"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/v1/models", headers={"X-Api-Key": "s3cret"}).status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT,
                   headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
    assert len(engine.requests) == 1


def test_root_path(engine):
    with make_client(engine, root_path="/kv", api_key="k") as c:
        h = {"Authorization": "Bearer k"}
        assert c.get("/kv/health").json() == {"status": "ok"}  # open with the prefix too
        assert c.get("/kv/v1/models", headers=h).status_code == 200
        assert c.get("/v1/models", headers=h).status_code == 200  # proxy stripped the prefix
        assert_error(c.get("/kv/v1/models"), 401)
        r = c.post("/kv/v1/chat/completions", json=CHAT, headers=h)
        assert r.status_code == 200


# --------------------------------------------------------------------------- tokenize

def test_tokenize_formats(client):
    assert client.post("/tokenize", json={"content": "ab"}).json() == {"tokens": [97, 98]}
    r = client.post("/tokenize", json={"content": "ab", "add_special": True})
    assert r.json() == {"tokens": [BOS, 97, 98]}
    r = client.post("/tokenize", json={"content": "<bos>a", "with_pieces": True})
    assert r.json() == {"tokens": [{"id": BOS, "piece": "<bos>"}, {"id": 97, "piece": "a"}]}
    r = client.post("/tokenize", json={"content": "<bos>", "parse_special": False})
    assert r.json() == {"tokens": list(b"<bos>")}
    assert_error(client.post("/tokenize", json={"content": 5}), 400, param="content")
    assert_error(client.post("/tokenize", json={"content": "a", "with_pieces": "y"}), 400)


def test_detokenize(client):
    assert client.post("/detokenize", json={"tokens": [BOS, 104, 105]}).json() == \
        {"content": "hi"}
    assert client.post("/detokenize", json={}).json() == {"content": ""}
    assert_error(client.post("/detokenize", json={"tokens": [1, 999]}), 400, param="tokens")
    assert_error(client.post("/detokenize", json={"tokens": "hi"}), 400, param="tokens")


# --------------------------------------------------------------------------- observability

def test_metrics(client, engine):
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json=dict(CHAT, max_tokens=-1))
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in ('kvshare_kv_blocks{state="used"} 0.0', 'kvshare_kv_blocks{state="free"} 64.0',
                 'kvshare_kv_blocks{state="cached"} 5.0', "kvshare_kv_blocks_shared 1.0",
                 "kvshare_kv_tokens_used 0.0", "kvshare_prompt_tokens_total 100.0",
                 "kvshare_prompt_tokens_cached_total 40.0",
                 "kvshare_generated_tokens_total 7.0",
                 'kvshare_requests_total{endpoint="chat",status="200"} 1.0',
                 'kvshare_requests_total{endpoint="chat",status="400"} 1.0',
                 "kvshare_time_to_first_token_seconds_count 1.0",
                 "kvshare_requests_in_flight 0.0"):
        assert line in text, line


def test_each_app_has_its_own_registry(engine):
    with make_client(engine) as a, make_client(FakeEngine()) as b:
        a.post("/v1/chat/completions", json=CHAT)
        assert 'status="200"} 1.0' in a.get("/metrics").text
        assert 'status="200"}' not in b.get("/metrics").text


def test_slots_and_cache(client, engine):
    assert client.get("/slots").json() == []
    cache = client.get("/cache").json()
    assert cache["pool"]["used"] == 0 and cache["pool"]["total"] == 64
    assert cache["counters"]["prompt_tokens_total"] == 100
    assert "slots" not in cache


def test_request_log_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="kvshare.server.requests"):
        client.post("/v1/chat/completions", json=CHAT)
        client.post("/v1/chat/completions", json=dict(CHAT, n=99))
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "kvshare.server.requests"]
    assert len(lines) == 2
    ok, bad = lines
    for k in ("id", "endpoint", "status", "prompt_tokens", "cache_n", "prompt_n",
              "completion_tokens", "ttft_ms", "prepare_ms", "duration_ms"):
        assert k in ok, k
    assert ok["status"] == 200 and ok["completion_tokens"] == len(REPLY)
    # the server's time before the engine, within the request's
    assert 0 < ok["prepare_ms"] <= ok["duration_ms"]
    assert bad["status"] == 400 and "error" in bad and "prepare_ms" not in bad


# --------------------------------------------------------------------------- real server

class ThreadServer:
    """The app under Hypercorn in a background thread, with a stop switch."""

    def __init__(self, engine, graceful_timeout: float = 5.0, **settings):
        self.engine = engine
        self.app = create_app(engine, ServerSettings(**settings))
        sock = bind_socket("127.0.0.1", 0)
        self.url = socket_url(sock)
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        ready = threading.Event()

        async def main():
            self.stop_event = asyncio.Event()
            ready.set()
            await serve_app(self.app, sock, graceful_timeout=graceful_timeout,
                            stop=self.stop_event, install_signal_handlers=False)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       daemon=True)
        self.thread.start()
        ready.wait(5)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self, wait: bool = True) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        if wait:
            self.thread.join(15)
            assert not self.thread.is_alive()


@pytest.fixture
def live():
    servers = []

    def start(engine, **kw):
        s = ThreadServer(engine, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        if s.thread.is_alive():
            s.stop()


def test_real_server_50mb_body_gets_413(live):
    s = live(FakeEngine())
    body = b'{"prompt": "' + b"x" * (50 * 1024 * 1024) + b'"}'
    r = httpx.post(s.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 413, code="request_too_large")

    def gen():  # chunked transfer, no Content-Length
        for _ in range(50):
            yield b"x" * (1024 * 1024)

    r = httpx.post(s.url + "/v1/completions", content=gen(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 413, code="request_too_large")
    assert httpx.get(s.url + "/health").json() == {"status": "ok"}


def test_real_server_disconnect_cancels(live):
    engine = FakeEngine(delay=0.2)
    s = live(engine)
    # streaming: read the first chunk, then hang up
    with (httpx.Client(timeout=10) as c,
          c.stream("POST", s.url + "/v1/chat/completions", json=dict(CHAT, stream=True)) as r):
        it = r.iter_lines()
        assert next(it).startswith("data: ")
    # non-streaming: give up before the reply is complete
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=0.5)
    want = 'kvshare_requests_total{endpoint="chat",status="499"} 2.0'
    deadline = time.time() + 60  # a bound for a broken run only: the loop ends when they show
    while time.time() < deadline and not (len(engine.handles) == 2 and not engine.running
                                          and want in httpx.get(s.url + "/metrics").text):
        time.sleep(0.05)
    assert len(engine.handles) == 2
    assert all(h.cancelled for h in engine.handles)
    assert want in httpx.get(s.url + "/metrics").text
    assert engine.running == set()


def test_real_server_graceful_shutdown_finishes_streams(live):
    engine = FakeEngine(delay=0.05)  # ~1.4 s per reply; the grace period is far longer (load)
    s = live(engine, graceful_timeout=30.0)
    result = {}

    def client():
        with httpx.stream("POST", s.url + "/v1/chat/completions",
                          json=dict(CHAT, stream=True), timeout=10) as r:
            result["text"] = r.read().decode()

    t = threading.Thread(target=client)
    t.start()
    while not engine.handles:
        time.sleep(0.01)
    s.stop(wait=False)
    t.join(40)
    s.thread.join(40)
    assert not s.thread.is_alive()
    events = sse_events(result["text"])
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"
    assert engine.stopped


def test_real_server_shutdown_cancels_streams_past_the_grace_period(live):
    engine = FakeEngine(delay=0.3)
    engine.reply = REPLY * 3  # ~24 s per reply: far longer than the grace period + any load
    s = live(engine, graceful_timeout=1.5)
    result = {}

    def client():
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "a", "stream": True}, timeout=10) as r:
            result["text"] = r.read().decode()

    t = threading.Thread(target=client)
    t.start()
    while not engine.handles:
        time.sleep(0.01)
    t0 = time.time()
    s.stop(wait=False)
    t.join(30)
    s.thread.join(30)
    assert time.time() - t0 < 15  # cut off after the grace period, not at the reply's end
    events = sse_events(result["text"])
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "cancelled"


# --------------------------------------------------------------------------- CLI

def test_cli_env_vars_and_flags():
    env = {"KVSHARE_PORT": "9001", "KVSHARE_API_KEY": "k", "KVSHARE_NO_SLOT_ATTACH": "1",
           "KVSHARE_KV_MEM": "512", "KVSHARE_ROOT_PATH": "/kv"}
    a = cli.parse_args(["serve"], env)
    assert (a.port, a.api_key, a.no_slot_attach, a.kv_mem, a.root_path) == \
        (9001, "k", True, 512, "/kv")
    assert a.host == "127.0.0.1" and a.parallel == 4
    a = cli.parse_args(["serve", "--port", "9002", "--parallel", "2", "--ctx-size", "1024"], env)
    assert (a.port, a.parallel, a.ctx_size) == (9002, 2, 1024)
    kw = cli.engine_config_kwargs(a)  # llama-server's --ctx-size: the total of 2 sequences
    assert kw == {"parallel": 2, "slot_attach": False, "device": "cpu", "ctx_size": 512,
                  "kv_mem_mib": 512}
    a = cli.parse_args(["serve", "--cache-ram", "64", "--cache-ram-pin", "16", "--threads", "1"],
                       {})
    kw = cli.engine_config_kwargs(a)
    assert (kw["cache_ram_mib"], kw["cache_ram_pin_mib"], kw["threads"]) == (64, 16, 1)


@pytest.mark.parametrize("argv,env", [
    (["serve", "--port", "x"], {}),
    (["serve"], {"KVSHARE_PORT": "eighty"}),
    (["serve"], {"KVSHARE_NO_SLOT_ATTACH": "maybe"}),
    (["serve", "--kv-mem", "1", "--kv-blocks", "2"], {}),
    (["serve", "--device", "tpu"], {}),
    (["serve", "--parallel", "0"], {}),
])
def test_cli_bad_arguments_exit_2(argv, env):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv, env)
    assert e.value.code == 2


def test_cli_missing_model_file(capsys, tmp_path):
    code = cli.main(["serve", "--model", str(tmp_path / "nope.gguf"), "--port", "0"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model file not found" in err[0]


def test_cli_port_in_use(capsys, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        code = cli.main(["serve", "--port", str(s.getsockname()[1])])
    finally:
        s.close()
    assert code == 2
    assert "cannot listen" in capsys.readouterr().err
