"""kvshare.router.prefix: which requests share a routing key (model, tools, system prompt),
per API, whatever the JSON key order; requests that share nothing get no key."""

from __future__ import annotations

import json

import pytest

from kvshare.router.prefix import PROMPT_CHARS, PROMPT_IDS, prefix_key, strip_root

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def reordered(value):
    """The same JSON value with every object's keys in reverse order (a different byte
    string when serialised)."""
    if isinstance(value, dict):
        return {k: reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reordered(v) for v in value]
    return value


def chat(system="You are a coding agent.", user="hi", tools=TOOLS, model="m", **kw):
    msgs = ([{"role": "system", "content": system}] if system is not None else [])
    msgs.append({"role": "user", "content": user})
    body = {"model": model, "messages": msgs, **kw}
    if tools is not None:
        body["tools"] = tools
    return body


# --------------------------------------------------------------------------- OpenAI chat

def test_chat_key_ignores_key_order_spacing_and_the_conversation():
    a = chat(user="first question")
    b = reordered(chat(user="a different question", temperature=0.3, stream=True))
    assert json.dumps(a) != json.dumps(reordered(a))  # reordering changed the bytes
    ka = prefix_key("/v1/chat/completions", a)
    assert ka is not None and len(ka) == 16
    assert prefix_key("/v1/chat/completions", b) == ka
    # later turns of the same conversation keep the key
    c = chat()
    c["messages"] += [{"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "more"}]
    assert prefix_key("/v1/chat/completions", c) == ka
    # /chat/completions (no /v1) and a trailing slash are the same endpoint
    assert prefix_key("/chat/completions", a) == ka
    assert prefix_key("/v1/chat/completions/", a) == ka


def test_chat_key_changes_with_system_tools_or_model():
    base = prefix_key("/v1/chat/completions", chat())
    assert prefix_key("/v1/chat/completions", chat(system="You are a reviewer.")) != base
    other_tools = [dict(TOOLS[0], function=dict(TOOLS[0]["function"], name="write_file"))]
    assert prefix_key("/v1/chat/completions", chat(tools=other_tools)) != base
    assert prefix_key("/v1/chat/completions", chat(tools=None)) != base
    assert prefix_key("/v1/chat/completions", chat(model="other")) != base
    # a cache salt separates prefixes (kvshare never shares KV across salts)
    assert prefix_key("/v1/chat/completions", chat(cache_salt="s1")) != base


def test_chat_leading_developer_messages_count_and_later_system_ones_do_not():
    dev = chat(tools=None)
    dev["messages"].insert(1, {"role": "developer", "content": "Be terse."})
    k_dev = prefix_key("/v1/chat/completions", dev)
    assert k_dev != prefix_key("/v1/chat/completions", chat(tools=None))
    late = chat(tools=None)
    late["messages"].append({"role": "system", "content": "a late note"})
    assert prefix_key("/v1/chat/completions", late) == prefix_key(
        "/v1/chat/completions", chat(tools=None))


def test_chat_with_nothing_shared_has_no_key():
    assert prefix_key("/v1/chat/completions", chat(system=None, tools=None)) is None
    assert prefix_key("/v1/chat/completions", chat(system=None, tools=[])) is None
    assert prefix_key("/v1/chat/completions", {"model": "m"}) is None
    # tools alone are shared
    assert prefix_key("/v1/chat/completions", chat(system=None)) is not None


def test_not_an_object_or_not_a_generation_path():
    assert prefix_key("/v1/chat/completions", [1, 2]) is None  # type: ignore[arg-type]
    assert prefix_key("/v1/embeddings", chat()) is None
    assert prefix_key("/tokenize", {"content": "x" * 100}) is None
    assert prefix_key("/v1/chat/completions", {"messages": "not a list",
                                               "model": "m"}) is None


def test_root_path_is_stripped():
    k = prefix_key("/v1/chat/completions", chat())
    assert prefix_key("/kv/v1/chat/completions", chat(), root_path="/kv") == k
    assert prefix_key("/kv/v1/chat/completions", chat(), root_path="/kv/") == k
    # not a prefix of the path at a segment boundary: left alone
    assert prefix_key("/kvx/v1/chat/completions", chat(), root_path="/kv") is None
    assert strip_root("/kv", "/kv") == "/"
    assert strip_root("/v1/models", "/kv") == "/v1/models"


# --------------------------------------------------------------------------- Anthropic

def messages(system="You are Claude Code.", tools=None, model="claude", user="hi"):
    body = {"model": model, "max_tokens": 100,
            "messages": [{"role": "user", "content": user}]}
    if system is not None:
        body["system"] = system
    if tools is not None:
        body["tools"] = tools
    return body


ATOOLS = [{"name": "Bash", "description": "Run a command",
           "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def test_messages_key():
    k = prefix_key("/v1/messages", messages(tools=ATOOLS))
    assert k is not None
    assert prefix_key("/v1/messages", reordered(messages(tools=ATOOLS, user="other"))) == k
    # count_tokens shares the key (same prefix), /messages without /v1 too
    assert prefix_key("/v1/messages/count_tokens", messages(tools=ATOOLS)) == k
    assert prefix_key("/messages", messages(tools=ATOOLS)) == k
    assert prefix_key("/v1/messages", messages(system="Another agent.", tools=ATOOLS)) != k
    assert prefix_key("/v1/messages", messages(tools=None)) != k
    assert prefix_key("/v1/messages", messages(system=None, tools=None)) is None


def test_messages_system_blocks_and_cache_control():
    blocks = [{"type": "text", "text": "You are Claude Code."}]
    marked = [{"type": "text", "text": "You are Claude Code.",
               "cache_control": {"type": "ephemeral"}}]
    k = prefix_key("/v1/messages", messages(system=blocks))
    assert k is not None
    assert prefix_key("/v1/messages", messages(system=marked)) == k
    other = [{"type": "text", "text": "You are someone else."}]
    assert prefix_key("/v1/messages", messages(system=other)) != k


# --------------------------------------------------------------------------- Responses

def test_responses_key():
    body = {"model": "m", "instructions": "You are an agent.", "tools": TOOLS,
            "input": "do the thing"}
    k = prefix_key("/v1/responses", body)
    assert k is not None
    assert prefix_key("/v1/responses", reordered(dict(body, input="another thing"))) == k
    assert prefix_key("/v1/responses", dict(body, instructions="Other.")) != k
    # leading system/developer items of a list input count, the conversation does not
    items = {"model": "m", "input": [
        {"role": "system", "content": "You are an agent."},
        {"type": "message", "role": "user", "content": "q1"}]}
    ki = prefix_key("/v1/responses", items)
    assert ki is not None
    items2 = json.loads(json.dumps(items))
    items2["input"][1]["content"] = "q2"
    assert prefix_key("/v1/responses", items2) == ki
    items2["input"][0]["content"] = "You are another agent."
    assert prefix_key("/v1/responses", items2) != ki
    assert prefix_key("/v1/responses", {"model": "m", "input": "just a question"}) is None


# --------------------------------------------------------------------------- raw prompts

@pytest.mark.parametrize("path", ["/v1/completions", "/completions", "/completion"])
def test_prompt_head(path):
    head = "P" * PROMPT_CHARS
    k = prefix_key(path, {"prompt": head + " question one"})
    assert k is not None
    assert prefix_key(path, {"prompt": head + " question two"}) == k
    assert prefix_key(path, {"prompt": "Q" + head[1:] + " question one"}) != k
    assert prefix_key(path, {"prompt": ""}) is None
    assert prefix_key(path, {}) is None


def test_prompt_token_ids_and_batches():
    ids = list(range(PROMPT_IDS))
    k = prefix_key("/completion", {"prompt": ids + [7, 8]})
    assert k == prefix_key("/completion", {"prompt": ids + [9]})
    assert k != prefix_key("/completion", {"prompt": [1] + ids[1:]})
    # the text of the ids is not the text: a string prompt is another key
    assert prefix_key("/completion", {"prompt": "0 1 2"}) != prefix_key(
        "/completion", {"prompt": [0, 1, 2]})
    # a batch routes by its first prompt
    assert prefix_key("/v1/completions", {"prompt": ["abc", "xyz"]}) == prefix_key(
        "/v1/completions", {"prompt": "abc"})
    assert prefix_key("/completion", {"prompt": [True, False]}) is None


def test_infill_keys_on_its_repository_context():
    extra = [{"filename": "a.py", "text": "def f(): pass"}]
    k = prefix_key("/infill", {"input_extra": extra, "input_prefix": "x", "input_suffix": "y"})
    assert k is not None
    assert prefix_key("/infill", {"input_extra": extra, "input_prefix": "other",
                                  "input_suffix": "z", "prompt": "p"}) == k
    assert prefix_key("/infill", {"input_prefix": "x", "input_suffix": "y"}) is None
