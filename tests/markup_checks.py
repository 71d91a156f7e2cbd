"""Shared by the real-server tool tests: the weather tool and the question that needs it, an
`openai` client for a server, and one request cut by max_tokens through every API (OpenAI
chat, streamed and not; Anthropic Messages; Responses), whose text must hold none of the call
markup strings given."""

from __future__ import annotations

import httpx

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def openai_client(url: str):
    import openai  # noqa: PLC0415

    return openai.OpenAI(base_url=url + "/v1", api_key="sk-dummy", max_retries=0, timeout=600)


def assert_no_markup_in_cut_replies(url: str, client, tool: dict, messages: list[dict],
                                    choice: str, max_tokens: int, markup: tuple[str, ...],
                                    seed: int = 3) -> None:
    """`tool`: an OpenAI function tool; `choice`: "required" or "auto". The Anthropic and
    Responses requests carry no seed (their APIs have none): the server's `--seed` makes them
    reproducible."""
    r = client.chat.completions.create(model="m", messages=messages, tools=[tool],
                                       tool_choice=choice, max_tokens=max_tokens, seed=seed)
    assert not any(m in (r.choices[0].message.content or "") for m in markup)
    assert r.choices[0].finish_reason in ("length", "tool_calls")
    stream = client.chat.completions.create(
        model="m", messages=messages, tools=[tool], tool_choice=choice,
        max_tokens=max_tokens, seed=seed, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert not any(m in text for m in markup), text
    fn = tool["function"]
    a = httpx.post(url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": max_tokens, "messages": messages,
        "tools": [{"name": fn["name"], "description": fn.get("description", ""),
                   "input_schema": fn["parameters"]}],
        "tool_choice": {"type": "any" if choice == "required" else "auto"}}).json()
    for block in a["content"]:
        assert block["type"] in ("text", "tool_use")
        assert not any(m in block.get("text", "") for m in markup)
    rs = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": "m", "input": messages[-1]["content"], "max_output_tokens": max_tokens,
        "tools": [{"type": "function", **fn}], "tool_choice": choice}).json()
    for item in rs["output"]:
        for part in item.get("content") or ():
            assert not any(m in part.get("text", "") for m in markup)
