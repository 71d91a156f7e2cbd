"""Several prompts in one request (llama-server's list of prompts) on `/completion`,
`/completions` and `/v1/completions`, against the fake engine: llama-server's prompt-list
semantics, one result per prompt with its `index`, streams whose chunks carry their
prompt's `index`, and the bound on the count (`--max-n`)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings

from fake_engine import BOS, REPLY, FakeEngine


@pytest.fixture
def engine():
    return FakeEngine(ctx_size=256)


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, ServerSettings())) as c:
        yield c


def data_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_native_list_of_prompts_one_result_each(client, engine, path):
    prompt = ["first", [10, 11, 12], ["mixed ", 13]]
    r = client.post(path, json={"prompt": prompt, "n_predict": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and [x["index"] for x in body] == [0, 1, 2]
    assert all(x["content"] == REPLY[:4] and x["stop"] is True for x in body)
    # each prompt is its own sequence: BOS before a leading text piece, ids as given
    sent = [q.prompt_tokens for q in engine.requests]
    assert sent == [[BOS, *b"first"], [10, 11, 12], [BOS, *b"mixed ", 13]]
    assert [x["tokens_evaluated"] for x in body] == [6, 3, 8]
    assert body[1]["prompt"] == engine.detokenize([10, 11, 12])


def test_flat_ids_or_mixed_array_is_one_prompt(client, engine):
    for prompt in ([10, 11, 12], ["a", 10, "b"], ["only"]):
        engine.requests.clear()
        body = client.post("/completion", json={"prompt": prompt, "n_predict": 2}).json()
        assert isinstance(body, dict) and body["index"] == 0, prompt
        assert len(engine.requests) == 1


def test_native_stream_chunks_carry_their_index(client):
    r = client.post("/completion", json={"prompt": ["a", "b"], "n_predict": 3,
                                         "stream": True})
    assert r.status_code == 200 and "[DONE]" not in r.text
    events = data_events(r.text)
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert "".join(e["content"] for e in mine) == REPLY[:3]
        assert [e["stop"] for e in mine] == [False] * 3 + [True]
        assert mine[-1]["tokens_predicted"] == 3 and mine[-1]["stop_type"] == "limit"


def test_v1_completions_list_of_prompts(client, engine):
    r = client.post("/v1/completions", json={"prompt": ["one", "two", [20, 21]],
                                             "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == REPLY[:2] for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 4 + 4 + 2  # BOS + text, twice; two ids
    assert body["usage"]["completion_tokens"] == 6


def test_v1_completions_echo_per_prompt(client):
    body = client.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 1,
                                                "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == ["one" + REPLY[0], "two" + REPLY[0]]


def test_v1_completions_stream(client):
    r = client.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 3,
                                             "stream": True})
    assert r.text.endswith("data: [DONE]\n\n") and r.text.count("[DONE]") == 1
    events = data_events(r.text)
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == REPLY[:3]
        assert mine[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("path,extra", [("/completion", {}), ("/v1/completions", {"n": 3})])
def test_count_is_bounded_by_max_n(client, engine, path, extra):
    max_n = engine.info.max_n
    too_many = ["p"] * (max_n + 1) if not extra else ["p"] * (max_n // 3 + 1)
    r = client.post(path, json={"prompt": too_many, "max_tokens": 1, **extra})
    assert r.status_code == 400 and "--max-n" in r.text
    assert engine.requests == []


def test_a_bad_prompt_in_the_list_refuses_the_request(client, engine):
    r = client.post("/completion", json={"prompt": ["ok", [300]], "n_predict": 1})
    assert r.status_code == 400
    r = client.post("/completion", json={"prompt": ["ok", []], "n_predict": 1})
    assert r.status_code == 400
    assert engine.requests == []
