"""A gpt-oss (harmony) reply is read whatever the request: its analysis channel is
`reasoning_content` and its final channel `content`, streamed and not, with tools and
without (fake engine replying in harmony markup; `--tool-parser harmony`)."""

import json

import pytest
from starlette.testclient import TestClient

from fake_engine import FakeEngine
from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings

REPLY = ("<|channel|>analysis<|message|>The user says hi.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there!")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _chat(stream: bool, tools: list | None) -> dict:
    engine = FakeEngine(ctx_size=512)
    engine.reply = REPLY
    body = {"model": "m", "stream": stream,
            "messages": [{"role": "user", "content": "hi"}], **({"tools": tools} if tools else {})}
    with TestClient(create_app(engine, ServerSettings(tool_parser="harmony"))) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]
    msg = {"content": "", "reasoning_content": ""}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                for k in msg:
                    msg[k] += ch["delta"].get(k) or ""
    return msg


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [None, [TOOL]])
def test_channels_are_split(stream, tools):
    msg = _chat(stream, tools)
    assert msg["content"] == "Hello there!", msg
    assert msg["reasoning_content"] == "The user says hi.", msg
