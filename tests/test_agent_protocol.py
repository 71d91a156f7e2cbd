"""Request parsing for agents (server/protocol.py, server/constraints.py): tools render the same
prompt whenever they are the same tools in the same order (so sessions keep sharing their
prefix), and the schema rules the server enforces keep every output valid."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import default_model_path
from kvshare.model.tokenizer import Tokenizer
from kvshare.apis import parsing as P
from kvshare.server.constraints import closed_objects
from kvshare.server.errors import APIError

TOOL = {"name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                       "required": ["q"]}}


@pytest.fixture(scope="module")
def gemma():
    path = default_model_path()
    tok = Tokenizer.from_gguf(path)
    return tok, ChatTemplate.from_gguf(path, tok)


def _tokens(gemma, body: dict) -> list[int]:
    tok, tmpl = gemma
    chat = P.parse_chat(body)
    return tok.encode(tmpl.render(chat.messages, tools=chat.tools))


def test_same_tools_render_the_same_tokens(gemma):
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "hi"}]
    a = _tokens(gemma, {"messages": msgs, "tools": [{"type": "function", "function": TOOL}]})
    # the same tool, `type` left to its default: the same prompt
    b = _tokens(gemma, {"messages": msgs, "tools": [{"function": TOOL}]})
    assert a == b
    # a tool without parameters renders as one with an empty parameter object
    bare = {"name": "now"}
    c = _tokens(gemma, {"messages": msgs, "tools": [{"type": "function", "function": bare}]})
    d = _tokens(gemma, {"messages": msgs, "tools": [{"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}]})
    assert c == d
    # a later turn of the same session extends the first turn's tokens (its prefix is shared)
    turn2 = _tokens(gemma, {"messages": msgs + [{"role": "assistant", "content": "hello"},
                                                {"role": "user", "content": "search cats"}],
                            "tools": [{"type": "function", "function": TOOL}]})
    first = _tokens(gemma, {"messages": msgs, "tools": [{"type": "function", "function": TOOL}]})
    common = next((i for i, (x, y) in enumerate(zip(first, turn2)) if x != y), len(first))
    assert common >= len(first) - 8  # all but the generation prompt's tail


def test_tool_choice_validation():
    tools = [{"type": "function", "function": TOOL}]
    chat = P.parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                         "tool_choice": {"type": "function", "function": {"name": "search"}}})
    assert chat.tool_choice == "function:search"
    assert P.parse_chat({"messages": [{"role": "user", "content": "x"}],
                         "tools": tools}).tool_choice == "auto"
    with pytest.raises(APIError, match="not in 'tools'"):
        P.parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                      "tool_choice": {"type": "function", "function": {"name": "other"}}})


def test_closed_objects_only_narrow_the_schema():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "object", "properties": {"c": {"type": "number"}}},
        "d": {"type": "array", "items": {"type": "object", "properties": {"e": {"type": "string"}}}},
        "f": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is False
    assert closed["properties"]["d"]["items"]["additionalProperties"] is False
    assert closed["properties"]["f"]["additionalProperties"] == {
        "type": "integer", "maximum": 10**16 - 1, "minimum": -(10**16 - 1)}
    assert closed["properties"]["a"]["maximum"] == 10**16 - 1
    assert closed["properties"]["b"]["properties"]["c"]["multipleOf"] == 1e-10
    assert "multipleOf" not in closed["properties"]["a"]  # an integer
    # anything the narrowed schema accepts, the original accepts
    ok = {"a": 5, "b": {"c": 1.5}, "d": [{"e": "x"}], "f": {"k": 3}}
    jsonschema.validate(ok, closed)
    jsonschema.validate(ok, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1, "zzz": 2}, closed)
    assert json.loads(json.dumps(closed)) == closed


def test_logit_bias_parsing():
    assert P.parse_logit_bias({"logit_bias": {"5": -100, "7": 2.5}}, 10) == ((5, -100.0),
                                                                           (7, 2.5))
    for bad in ({"x": 1}, {"5": 101}, {"11": 1}, {"5": "a"}, [1, 2]):
        with pytest.raises(APIError):
            P.parse_logit_bias({"logit_bias": bad}, 10)
