"""llama-server's `--alias`: every API's responses name the model by its first alias (when the
request names none), and `/v1/models` lists the model once with its `aliases` and `tags`, in
llama-server's shape."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings

from fake_engine import FakeEngine

MSG = [{"role": "user", "content": "hi"}]
# (path, body, where the model name is) for every generation API, none naming a model
REQUESTS = [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 3}, lambda b: b["model"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}, lambda b: b["model"]),
    ("/completion", {"prompt": "hi", "n_predict": 3}, lambda b: b["model"]),
    ("/v1/messages", {"messages": MSG, "max_tokens": 3}, lambda b: b["model"]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}, lambda b: b["model"]),
]


def client(**settings) -> TestClient:
    return TestClient(create_app(FakeEngine(), ServerSettings(**settings)))


def test_every_api_echoes_the_alias():
    with client(aliases=["my-alias", "other"]) as c:
        for path, body, model in REQUESTS:
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            assert model(r.json()) == "my-alias", path


def test_streams_echo_the_alias():
    with client(aliases=["my-alias"]) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3,
                                                 "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.split("\n")
                  if line.startswith("data: {")]
        assert chunks and all(ch["model"] == "my-alias" for ch in chunks)
        r = c.post("/completion", json={"prompt": "hi", "n_predict": 3, "stream": True})
        final = [json.loads(line[6:]) for line in r.text.split("\n")
                 if line.startswith("data: {")][-1]
        assert final["stop"] is True and final["model"] == "my-alias"


def test_without_alias_the_model_name():
    with client() as c:
        for path, body, model in REQUESTS:
            assert model(c.post(path, json=body).json()) == "fake-model", path


def test_request_model_still_echoed():
    with client(aliases=["my-alias"]) as c:
        r = c.post("/v1/chat/completions", json={"model": "gpt-4o-mini", "messages": MSG,
                                                 "max_tokens": 3})
        assert r.json()["model"] == "gpt-4o-mini"


def test_models_lists_aliases_and_tags_as_llama_server():
    with client(aliases=["my-alias", "other"]) as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list"
    [m] = body["data"]
    assert m["id"] == "my-alias" and m["aliases"] == ["my-alias", "other"]
    assert m["tags"] == [] and m["object"] == "model" and isinstance(m["created"], int)
    assert m["meta"]["n_ctx"] == 128
    [o] = body["models"]  # the Ollama-style entry llama-server sends beside `data`
    assert o["name"] == o["model"] == "my-alias" and o["capabilities"] == ["completion"]
    with client(aliases=["a"], tags=["chat", "fim"]) as c:  # --tags chat,fim
        body = c.get("/v1/models").json()
    assert body["data"][0]["tags"] == ["chat", "fim"] and body["models"][0]["tags"] == ["chat", "fim"]
    with client() as c:
        [m] = c.get("/models").json()["data"]
    assert m["id"] == "fake-model" and m["aliases"] == [] and m["tags"] == []


def test_metrics_carry_process_start_time():
    with client() as c:
        r = c.get("/metrics")
        r2 = c.get("/metrics")
    assert r.status_code == 200
    start = int(r.headers["process-start-time-unix"])
    assert start > 1_600_000_000 and r2.headers["process-start-time-unix"] == str(start)
