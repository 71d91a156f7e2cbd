"""Malformed requests against a real server: every one gets a response below 500 (a clear 4xx
for bad input), and the server stays healthy. Bodies are valid ones mutated at random with a
fixed seed: fields replaced by values of the wrong type or range, NaN/Infinity, lone surrogates
(JSON "\\ud800"), NUL bytes, deep or empty structures, missing fields."""

from __future__ import annotations

import json
import random

import pytest

from tier_helpers import Server

WEIRD = [None, True, False, 0, -1, 1, 2**63, -2**63, 1e308, -1e308, 1e-300, float("nan"),
         float("inf"), "", "x", "\ud800", "\udfff", "a\u0000b", "\U0001F600", [], {}, [1, 2],
         {"a": 1}, "🙂" * 50, [None], [[]], ["\ud800"], {"\ud800": 1}, 0.5, -0.5, 3.7, "1",
         "true", [0, -1, 10**9]]
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stream", "stream_options", "logprobs",
          "top_logprobs", "n", "presence_penalty", "frequency_penalty", "repeat_penalty",
          "repeat_last_n", "cache_salt", "logit_bias", "user", "tools", "tool_choice",
          "response_format", "ignore_eos", "chat_template_kwargs", "prompt", "echo", "best_of",
          "suffix", "cache_prompt"]
MESSAGE_VALUES = WEIRD + [[{"type": "text", "text": "\ud800"}], [{"type": "image_url"}],
                          [{"type": "text"}]]
PROMPTS = WEIRD + [[1, 2, 3], [[1, 2], [3]], [-5], [10**12], ["a", 1]]
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/completions"]


def mutated(rng: random.Random, path: str) -> dict:
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0}
    elif "compl" in path:
        body = {"prompt": "hello", "max_tokens": 3}
    else:
        body = {"content": "hi", "tokens": [1, 2]}
        for k in ("content", "tokens", "with_pieces", "add_special", "parse_special"):
            if rng.random() < 0.4:
                body[k] = rng.choice(WEIRD)
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.5:
            body[rng.choice(FIELDS)] = rng.choice(WEIRD)
        elif r < 0.7 and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][0]
            if isinstance(msg, dict):
                key = rng.choice(["role", "content", "name", "tool_calls", "tool_call_id", "x"])
                msg[key] = rng.choice(MESSAGE_VALUES)
        elif r < 0.8 and body:
            body.pop(rng.choice(list(body)))
        else:
            body["prompt"] = rng.choice(PROMPTS)
    return body


@pytest.fixture(scope="module")
def server(launcher):
    # a small context: a mutated max_tokens (2**63, or none) is clamped to the room left, so
    # such a request generates until the context is full
    s = Server(launcher, "--parallel", "4", "--ctx-size", "256")
    yield s
    s.terminate()


@pytest.mark.parametrize("seed", [1, 2])
def test_malformed_requests_never_get_a_5xx(server, seed):
    rng = random.Random(seed)
    failures = []
    statuses = set()
    for _ in range(400):
        path = rng.choice(PATHS)
        raw = json.dumps(mutated(rng, path), allow_nan=True)  # NaN/Infinity as Python writes
        r = server.client.post(path, content=raw.encode("utf-8", "surrogatepass"),
                               headers={"Content-Type": "application/json"})
        statuses.add(r.status_code)
        if r.status_code >= 500:
            failures.append((path, raw[:200], r.status_code, r.text[:200]))
        elif r.status_code >= 400:
            assert "error" in r.json(), r.text  # the API's own error shape
    assert not failures, failures[:5]
    assert 200 in statuses and 400 in statuses  # the mutations reach both outcomes
    assert server.client.get("/health").json() == {"status": "ok"}
