"""Tools on a model whose chat template has none (issue 43): a real `kvshare serve` on
loopback with SmolLM2-135M-Instruct (the catalog's `smollm2-135m-instruct`: its template
ignores tools), driven by the official `openai` SDK. The tool polyfill puts the tools in the system message and the
generic JSON call format is forced by the grammar:
- /props and /v1/models say what the template supports and which polyfills are on;
- `tool_choice: "auto"` on a question that needs the tool calls it in some of 10 seeds
  (measured 2 of 10 at temperature 1: this 135M model can hardly tell when a tool helps; the
  default model's figures are in test_agent_default_model.py);
- `required` without max_tokens ends with finish_reason "tool_calls" (the grammar ends after
  at most --max-parallel-tool-calls calls; one call when parallel calls are off);
- with a small max_tokens no API's reply carries call markup or a cut-off call.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvshare.model import catalog
from markup_checks import QUESTION, WEATHER, assert_no_markup_in_cut_replies, openai_client
from tier_helpers import Server

MARKUP = ('"tool_call', "<tool_call", '"response"', '{"name"')


@pytest.fixture(scope="module")
def server(launcher):
    path = catalog.ensure("smollm2-135m-instruct", progress=False)
    # --seed: the Anthropic and Responses requests of the cut-reply check carry none
    s = Server(launcher, "--parallel", "4", "--kv-unified-per-slot", "4096", "--seed", "3",
               model=path)
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def test_props_and_models_say_what_is_polyfilled(server):
    props = httpx.get(server.url + "/props").json()
    caps = props["chat_template_caps"]
    assert caps["supports_tools"] and caps["supports_tool_calls"]  # polyfilled
    assert caps["supports_system_role"] and caps["supports_generation_prompt"]
    assert props["chat_template_polyfills"] == ["tools", "tool_calls", "tool_responses"]
    meta = httpx.get(server.url + "/v1/models").json()["data"][0]["meta"]
    assert meta["chat_template_caps"] == {k: v for k, v in caps.items() if k != "supports_string_content"}
    assert meta["chat_template_polyfills"] == props["chat_template_polyfills"]


def test_the_model_sees_the_tools(server):
    body = {"messages": QUESTION, "tools": [WEATHER]}
    prompt = httpx.post(server.url + "/apply-template", json=body).json()["prompt"]
    assert '"name": "get_weather"' in prompt and "Get the current weather" in prompt
    n = [httpx.post(server.url + "/v1/messages/count_tokens", json={
        "model": "m", "messages": QUESTION, **extra}).json()["input_tokens"]
        for extra in ({}, {"tools": [{"name": "get_weather", "description": "Weather.",
                                      "input_schema": WEATHER["function"]["parameters"]}]})]
    assert n[1] > n[0]


def test_auto_calls_the_tool(client):
    calls = 0
    for seed in range(10):
        r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER],
                                           seed=seed, max_tokens=100)
        choice = r.choices[0]
        content = choice.message.content or ""
        assert not any(m in content for m in MARKUP), content
        if choice.message.tool_calls:
            calls += 1
            assert choice.finish_reason == "tool_calls"
            assert choice.message.tool_calls[0].function.name == "get_weather"
    print(f"tool_choice auto: a call in {calls} of 10 seeds")
    assert calls >= 1  # measured 2 of 10; none before the polyfill


@pytest.mark.parametrize("parallel", [True, False])
def test_required_ends_with_its_calls(client, parallel):
    tokens = []
    for seed in range(3):
        r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER],
                                           tool_choice="required", seed=seed,
                                           parallel_tool_calls=parallel)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        n = len(choice.message.tool_calls)
        assert 1 <= n <= (8 if parallel else 1)
        assert all(json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls)
        tokens.append(r.usage.completion_tokens)
    one_call = 40  # tokens: a call of this tool is ~25 (its object, then end of turn)
    assert max(tokens) <= (8 if parallel else 1) * one_call
    print(f"required (parallel {parallel}): completion tokens {tokens}")


@pytest.mark.parametrize("max_tokens", [6, 12, 20])
def test_cut_replies_carry_no_markup(server, client, max_tokens):
    for choice in ("required", "auto"):
        assert_no_markup_in_cut_replies(server.url, client, WEATHER, QUESTION, choice,
                                        max_tokens, MARKUP)
