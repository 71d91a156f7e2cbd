"""Agents on the default model (issue 43): a real `kvshare serve` on loopback with the catalog's
default model (`kvshare.model.catalog.DEFAULT_MODEL`), driven by the official `openai` SDK:
- `tool_choice: "auto"` on a question that needs the tool produces a call in at least 8 of 10
  seeds (the model writes its calls bare or in Markdown fences as often as in `<tool_call>`
  tags; the hermes reader takes all of them, as llama.cpp's does);
- a question no tool answers gets no call in most seeds;
- `required` without max_tokens ends with finish_reason "tool_calls": within 2 x the tokens of
  one call when parallel calls are off, and in 3 of 4 seeds when they are on (the grammar
  stops a model that goes on repeating its call at --max-parallel-tool-calls);
- with a small max_tokens no API's reply carries call markup.
The OpenAI Agents SDK on the same model is measured by bench/agents_sdk_default_model.py.
"""

from __future__ import annotations

import json

import pytest

from kvshare.model import catalog
from markup_checks import QUESTION, WEATHER, assert_no_markup_in_cut_replies, openai_client
from tier_helpers import Server

MARKUP = ("<tool_call", '{"name"', "```json")


@pytest.fixture(scope="module")
def server(launcher):
    path = catalog.ensure(catalog.DEFAULT_MODEL, progress=False)
    # --seed: the Anthropic and Responses requests carry none (their APIs have no seed)
    s = Server(launcher, "--parallel", "2", "--kv-unified-per-slot", "2048", "--seed", "3",
               model=path)
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _call_tokens(client) -> int:
    """Completion tokens of one forced call of get_weather (the unit the issue measures in)."""
    r = client.chat.completions.create(
        model="m", messages=QUESTION, tools=[WEATHER], seed=0, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    return r.usage.completion_tokens


def test_auto_calls_the_tool_in_8_of_10_seeds(client):
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
            assert [c.function.name for c in choice.message.tool_calls][0] == "get_weather"
            json.loads(choice.message.tool_calls[0].function.arguments)
    print(f"tool_choice auto: a call in {calls} of 10 seeds")
    assert calls >= 8


def test_auto_without_a_need_mostly_answers(client):
    q = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    calls = sum(bool(client.chat.completions.create(
        model="m", messages=q, tools=[WEATHER], seed=seed, max_tokens=60).choices[0]
        .message.tool_calls) for seed in range(5))
    print(f"tool_choice auto, no tool needed: a call in {calls} of 5 seeds")
    assert calls <= 1


@pytest.mark.parametrize("parallel", [True, False])
def test_required_ends_with_its_calls(client, parallel):
    """One call: within 2 x one call's tokens. Parallel calls allowed (the OpenAI default):
    the grammar ends after --max-parallel-tool-calls (8) calls, and most seeds stop after
    one (a model that goes on repeats its call: measured 1 seed of 4 with 7-8 calls)."""
    one_call = _call_tokens(client)
    tokens = []
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER],
                                           tool_choice="required", seed=seed,
                                           parallel_tool_calls=parallel)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert 1 <= len(choice.message.tool_calls) <= (8 if parallel else 1)
        assert json.loads(choice.message.tool_calls[0].function.arguments)["city"]
        tokens.append(r.usage.completion_tokens)
    print(f"required (parallel {parallel}): tokens {tokens}, one call {one_call}")
    if parallel:
        assert max(tokens) <= 8 * (one_call + 2)
        assert sorted(tokens)[1] <= 2 * one_call  # at least 3 of 4 within 2 x one call
    else:
        assert max(tokens) <= 2 * one_call


@pytest.mark.parametrize("max_tokens", [5, 12])
def test_cut_replies_carry_no_markup(server, client, max_tokens):
    for choice in ("required", "auto"):
        assert_no_markup_in_cut_replies(server.url, client, WEATHER, QUESTION, choice,
                                        max_tokens, MARKUP)
