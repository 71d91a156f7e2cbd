"""gpt-oss's harmony format through a real `kvshare serve` on loopback, driven by the `openai`
SDK: the tiny random gpt-oss model (tests/data/models/tiny-gpt-oss.gguf, whose GGUF carries a
ChatML template) served with gpt-oss's template (`--chat-template-file`), so the tool format is
detected as `harmony`; a forced call (tool_choice required and named) comes back as
`tool_calls` with schema-valid arguments, streamed and whole, and never as markup in
`content`. (Under these grammars the random model goes straight to the call; the analysis
channel as `reasoning_content` is tested on recorded replies in test_harmony.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tier_helpers import Server

DATA = Path(__file__).parent / "data"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
MARKUP = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "to=functions")


@pytest.fixture(scope="module")
def server(launcher):
    s = Server(launcher, "--ctx-size", "2048", "--chat-template-file",
               str(DATA / "templates" / "openai-gpt-oss-120b.jinja"),
               model=DATA / "models" / "tiny-gpt-oss.gguf")
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-dummy", max_retries=0,
                         timeout=300)


def _streamed(client, **kw):
    content, reasoning, calls = "", "", {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get(
            "reasoning_content") or ""
        for tc in d.tool_calls or ():
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_the_template_is_harmony(server):
    import httpx

    props = httpx.get(server.url + "/props").json()
    assert "<|channel|>" in props["chat_template"]
    prompt = httpx.post(server.url + "/apply-template",
                        json={"messages": QUESTION, "tools": [WEATHER]}).json()["prompt"]
    assert prompt.endswith("<|start|>assistant") and "type get_weather" in prompt


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_comes_back_as_tool_calls(client, choice):
    calls = 0
    for seed in range(4):
        # one call: the grammar ends after it (the random model would go on calling)
        kw = dict(model="m", messages=QUESTION, tools=[WEATHER], tool_choice=choice, seed=seed,
                  max_tokens=120, parallel_tool_calls=False)
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert not any(m in (msg.content or "") for m in MARKUP), msg.content
        content, reasoning, streamed, finish = _streamed(client, **kw)
        assert not any(m in content for m in MARKUP), content
        assert finish == r.choices[0].finish_reason
        if not msg.tool_calls:
            assert finish == "length"  # (the random model still in its analysis message)
            continue
        calls += 1
        assert r.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"] * len(msg.tool_calls)
        for c in msg.tool_calls:
            assert isinstance(json.loads(c.function.arguments)["city"], str)
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert calls >= 1
