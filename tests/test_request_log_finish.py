"""The request log's `finish_reason` is the one the client got: a reply the client received as
tool calls is logged as `tool_calls` in every API, streamed or not (fake engine, hermes
tool-call format)."""

import json
import logging

import pytest
from starlette.testclient import TestClient

from fake_engine import FakeEngine
from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
MSGS_TOOL = {"name": "get_weather", "input_schema": PARAMS}
Q = "What is the weather in Paris?"


def _logged(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "kvshare.server.requests"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,want", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": Q}],
                              "tools": [CHAT_TOOL]}, "tool_calls"),
    ("/v1/responses", {"input": Q, "tools": [RESP_TOOL]}, "tool_calls"),
    ("/v1/messages", {"max_tokens": 200, "messages": [{"role": "user", "content": Q}],
                      "tools": [MSGS_TOOL]}, "tool_calls"),
])
def test_logged_finish_reason_is_the_clients(caplog, path, body, want, stream):
    engine = FakeEngine(ctx_size=512)
    engine.reply = CALL
    with TestClient(create_app(engine, ServerSettings(tool_parser="hermes"))) as c, \
            caplog.at_level(logging.INFO, logger="kvshare.server.requests"):
        r = c.post(path, json={"model": "m", "stream": stream, **body})
        assert r.status_code == 200, r.text
        assert "get_weather" in r.text and "<tool_call>" not in r.text
    (line,) = _logged(caplog)
    assert line["finish_reason"] == want, line
    # the same reply as plain text is logged as the engine's stop
    engine.reply = "Sunny."
    caplog.clear()
    with TestClient(create_app(engine, ServerSettings(tool_parser="hermes"))) as c, \
            caplog.at_level(logging.INFO, logger="kvshare.server.requests"):
        assert c.post(path, json={"model": "m", "stream": stream, **body}).status_code == 200
    (line,) = _logged(caplog)
    assert line["finish_reason"] == "stop", line
