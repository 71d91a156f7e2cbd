"""server/anthropic.py without a server: the Messages request translated into the OpenAI chat
form (every block kind, tool_choice, cache breakpoints, the 400s), and the response / stream
built from fake engine events, read back by the official `anthropic` SDK (its stream
accumulator and response models are what must accept our events)."""

from __future__ import annotations

import json
import random

import pytest

from kvshare.engine.api import FinishEvent, Timings, TokenEvent
from kvshare.apis import anthropic as A
from kvshare.apis.chat_output import OutputRules
from kvshare.server.errors import APIError
from kvshare.apis.base import CachePoint, PromptInfo, RequestContext
from kvshare.toolcalls import get_format

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")  # the transport the anthropic SDK is built on

CTX = RequestContext(model_name="served-model", ctx_size=4096, vocab_size=None, max_n=8)
API = A.MessagesApi()
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                  "parameters": WEATHER["input_schema"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def body(**kw) -> dict:
    b = {"model": "claude-sonnet-4-5", "max_tokens": 32,
         "messages": [{"role": "user", "content": "Hello"}]}
    b.update(kw)
    return {k: v for k, v in b.items() if v is not None}


def parse(**kw):
    return API.parse(body(**kw), CTX)


def bad(**kw) -> APIError:
    with pytest.raises(APIError) as e:
        parse(**kw)
    assert e.value.status == 400
    return e.value


def cc(**extra) -> dict:
    return {"cache_control": {"type": "ephemeral", **extra}}


# --------------------------------------------------------------------------- parse: basics

def test_minimal_request():
    r = parse()
    assert r.model == "claude-sonnet-4-5"
    assert r.chat.messages == [{"role": "user", "content": "Hello"}]
    assert r.chat.tools is None and r.chat.tool_choice == "none"
    assert r.opts.max_tokens == 32 and r.opts.n == 1 and not r.opts.stream
    assert r.opts.sampling.temperature == 1.0  # Anthropic's default
    assert r.cache_point is None and r.output is None


def test_model_defaults_to_served_name():
    assert API.parse({k: v for k, v in body().items() if k != "model"}, CTX).model == \
        "served-model"


def test_options():
    r = parse(temperature=0, top_p=0.5, top_k=40, stop_sequences=["END", ""], stream=True,
              metadata={"user_id": "u1"}, thinking={"type": "enabled", "budget_tokens": 1024},
              unknown_field={"x": 1}, service_tier="auto")
    s = r.opts.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.5, 40)
    assert r.opts.stop == ["END"] and r.opts.stream
    assert r.chat.template_kwargs == {"enable_thinking": True}
    assert r.thinking is True
    assert parse(thinking={"type": "disabled"}).chat.template_kwargs == \
        {"enable_thinking": False}
    assert parse().chat.template_kwargs == {}


def test_system_string_and_blocks():
    r = parse(system="You are terse.")
    assert r.chat.messages[0] == {"role": "system", "content": "You are terse."}
    r = parse(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}])
    assert r.chat.messages[0] == {"role": "system", "content": "A\nB"}
    assert parse(system="").chat.messages[0]["role"] == "user"


def test_blocks_translate():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "call the tool", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
             "input": {"city": "Lyon"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "x"}]},
            {"type": "text", "text": "Summarize."}]},
    ]
    r = parse(messages=msgs, tools=[WEATHER])
    assert r.chat.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout\nx"},
        {"role": "user", "content": "Summarize."},
    ]
    assert r.chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": WEATHER["input_schema"]}}]
    assert r.chat.tool_choice == "auto" and r.chat.parallel_tool_calls
    assert [t["function"]["name"] for t in r.chat.tools] == ["get_weather"]


def test_consecutive_turns_merge():
    r = parse(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}])
    assert r.chat.messages == [{"role": "user", "content": "a\nb"},
                               {"role": "assistant", "content": "c"}]


def test_tool_only_assistant_turn_has_empty_content():
    r = parse(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
        tools=[WEATHER])
    assert r.chat.messages[1]["content"] == ""
    assert r.chat.messages[2] == {"role": "tool", "tool_call_id": "t", "content": ""}


@pytest.mark.parametrize("choice,want,parallel", [
    (None, "auto", True),
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "tool", "name": "get_weather"}, "function:get_weather", True),
    ({"type": "none"}, "none", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "auto", "disable_parallel_tool_use": False}, "auto", True),
])
def test_tool_choice(choice, want, parallel):
    r = parse(tools=[WEATHER], tool_choice=choice)
    assert (r.chat.tool_choice, r.chat.parallel_tool_calls) == (want, parallel)


def test_no_tools_tool_choice():
    assert parse(tool_choice={"type": "auto"}).chat.tool_choice == "none"
    bad(tool_choice={"type": "any"})


def test_strict_tool_kept():
    r = parse(tools=[{**WEATHER, "strict": True, "type": "custom"}])
    assert r.chat.tools[0]["function"]["strict"] is True


# --------------------------------------------------------------------------- parse: cache_control

def test_cache_point_on_system_and_tools():
    assert parse(system=[{"type": "text", "text": "S", **cc()}]).cache_point == CachePoint(-1)
    assert parse(tools=[{**WEATHER, **cc(ttl="1h")}]).cache_point == CachePoint(-1)
    assert parse(system="S").cache_point is None


def test_cache_point_on_messages():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "q1", **cc()}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "r1", **cc()},
            {"type": "text", "text": "more"}]},
    ]
    # system is messages[0]: user 1, assistant 2, tool 3, user 4
    r = parse(system=[{"type": "text", "text": "S", **cc()}], messages=msgs, tools=[WEATHER])
    assert r.cache_point == CachePoint(3)
    msgs[2]["content"][1].update(cc())
    assert parse(system="S", messages=msgs, tools=[WEATHER]).cache_point == CachePoint(4)
    # without a system message the indices shift by one
    msgs[2]["content"][1].pop("cache_control")
    assert parse(messages=msgs, tools=[WEATHER]).cache_point == CachePoint(2)
    # a breakpoint inside a tool_result's content marks that tool message
    msgs[2]["content"][0] = {"type": "tool_result", "tool_use_id": "t1",
                             "content": [{"type": "text", "text": "r", **cc()}]}
    assert parse(messages=msgs, tools=[WEATHER]).cache_point == CachePoint(2)


def test_cache_point_on_assistant_and_merged_turns():
    msgs = [{"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b", **cc()}]},
            {"role": "assistant", "content": [{"type": "text", "text": "c", **cc()}]},
            {"role": "user", "content": "d"}]
    assert parse(messages=msgs).cache_point == CachePoint(1)
    msgs[2]["content"][0].pop("cache_control")
    assert parse(messages=msgs).cache_point == CachePoint(0)


def test_top_level_cache_control_marks_the_last_message():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a", **cc()}]},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert parse(messages=msgs, system="S", **cc()).cache_point == CachePoint(3)
    blocks = [{"type": "text", "text": str(i), **cc()} for i in range(4)]
    e = bad(messages=[{"role": "user", "content": blocks}], **cc())
    assert "maximum of 4" in e.message
    e = bad(cache_control={"type": "forever"})
    assert e.message.startswith("cache_control.type:")


def test_output_config_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse(output_config={"format": {"type": "json_schema", "schema": schema},
                             "effort": "low"})
    assert r.output.kind == "json_schema" and json.loads(r.output.source) == schema
    assert parse(output_config={"effort": "low"}).output is None
    bad(output_config={"format": {"type": "text"}})
    bad(output_config={"format": {"type": "json_schema"}})
    bad(output_config="json")


def test_too_many_breakpoints():
    blocks = [{"type": "text", "text": str(i), **cc()} for i in range(4)]
    assert parse(messages=[{"role": "user", "content": blocks}]).cache_point == CachePoint(0)
    e = bad(messages=[{"role": "user", "content": blocks}], system=[
        {"type": "text", "text": "S", **cc()}])
    assert "maximum of 4" in e.message


@pytest.mark.parametrize("value", ["ephemeral", {"type": "persistent"}, {},
                                   {"type": "ephemeral", "ttl": "2h"}])
def test_invalid_cache_control(value):
    bad(messages=[{"role": "user", "content": [{"type": "text", "text": "x",
                                                "cache_control": value}]}])


# --------------------------------------------------------------------------- parse: errors

def test_missing_max_tokens():
    b = body()
    del b["max_tokens"]
    with pytest.raises(APIError) as e:
        API.parse(b, CTX)
    assert e.value.status == 400 and e.value.message == "max_tokens: Field required"
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("kw", [
    {"max_tokens": 0}, {"max_tokens": "16"}, {"max_tokens": True}, {"max_tokens": 1.5},
    {"temperature": 1.5}, {"temperature": -0.1}, {"temperature": "hot"}, {"top_p": 2},
    {"top_k": -1}, {"stream": "yes"}, {"metadata": "m"}, {"metadata": {"user_id": 3}},
    {"stop_sequences": "END"}, {"stop_sequences": [1]}, {"stop_sequences": ["x"] * 17},
    {"stop_sequences": ["x" * 300]}, {"model": 5}, {"thinking": {"type": "maybe"}},
    {"thinking": True}, {"system": 5}, {"system": [{"type": "image"}]},
    {"system": [{"type": "text"}]},
    {"messages": []}, {"messages": "hi"}, {"messages": None}, {"messages": [5]},
    {"messages": [{"role": "system", "content": "x"}]},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user"}]}, {"messages": [{"role": "user", "content": []}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "user", "content": ["bare string"]}]},
    {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
    {"tools": {"name": "x"}}, {"tools": [{"name": "x"}]},  # input_schema required
    {"tools": [{"name": "bad name", "input_schema": {}}]},
    {"tools": [{"name": "x", "input_schema": []}]},
    {"tools": [{"name": "x", "input_schema": {}, "description": 5}]},
    {"tools": [WEATHER, WEATHER]},
    {"tool_choice": "auto"}, {"tools": [WEATHER], "tool_choice": {"type": "sometimes"}},
    {"tools": [WEATHER], "tool_choice": {"type": "tool"}},
    {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
    {"cache_salt": ""},
])
def test_bad_requests(kw):
    bad(**kw)


def test_unknown_block_type():
    e = bad(messages=[{"role": "user", "content": [{"type": "hologram", "text": "x"}]}])
    assert "hologram" in e.message and "unknown" in e.message


@pytest.mark.parametrize("btype", ["image", "document", "search_result"])
def test_unsupported_block_type(btype):
    e = bad(messages=[{"role": "user", "content": [
        {"type": btype, "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}])
    assert repr(btype) in e.message and "not supported" in e.message


def test_image_in_tool_result():
    e = bad(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {}}]}]}], tools=[WEATHER])
    assert "'image'" in e.message


def test_tool_result_without_tool_use():
    e = bad(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_missing", "content": "x"}]}])
    assert "toolu_missing" in e.message
    # an id from a later assistant message does not count
    bad(messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": ""}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                           "input": {}}]}], tools=[WEATHER])


@pytest.mark.parametrize("msgs", [
    [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": ""}]}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": "{}"}]}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "n", "input": {}}]}],
    [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}],
])
def test_blocks_in_the_wrong_place(msgs):
    bad(messages=msgs)


@pytest.mark.parametrize("ttype", ["web_search_20250305", "bash_20250124",
                                   "text_editor_20250728", "computer_20250124"])
def test_server_tools_refused(ttype):
    e = bad(tools=[{"type": ttype, "name": "web_search"}])
    assert ttype in e.message and "not supported" in e.message


def test_tool_choice_names_unknown_tool():
    e = bad(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"})
    assert "get_time" in e.message


def test_count_tokens_request():
    b = body(tools=[WEATHER], system="S")
    del b["max_tokens"]
    r = A.count_tokens_request(b, CTX)
    assert r.opts.max_tokens is None and len(r.chat.messages) == 2 and r.chat.tools
    with pytest.raises(APIError):
        A.count_tokens_request({"messages": []}, CTX)


def test_error_body():
    for status, t in [(400, "invalid_request_error"), (401, "authentication_error"),
                      (403, "permission_error"), (404, "not_found_error"),
                      (413, "request_too_large"), (429, "rate_limit_error"),
                      (500, "api_error"), (503, "overloaded_error"),
                      (529, "overloaded_error"), (422, "invalid_request_error"),
                      (502, "api_error")]:
        assert API.error_body(APIError(status, "boom")) == {
            "type": "error", "error": {"type": t, "message": "boom"}}


# --------------------------------------------------------------------------- the output

def finish(reason="stop", prompt=100, completion=7, cache_n=0, stop_string=None):
    return FinishEvent(reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                       timings=Timings(prompt_n=prompt - cache_n, cache_n=cache_n,
                                       prompt_ms=1.0, predicted_n=completion,
                                       predicted_ms=1.0),
                       time_to_first_token_s=0.01, stop_string=stop_string)


PROMPT = PromptInfo(100)


def make_format(rules=None, prompt=PROMPT, **kw):
    req = API.parse(body(**kw), CTX)
    return API.make_format("msg_test123", req, rules, prompt)


def tool_rules(**kw) -> OutputRules:
    return OutputRules(tool_format=get_format("hermes", OPENAI_TOOLS), **kw)


def pieces(text: str, rng: random.Random | None) -> list[str]:
    if rng is None:
        return [text]
    out, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        out.append(text[i:j])
        i = j
    return out


def stream_bytes(fmt, text: str, fin: FinishEvent, rng: random.Random | None = None) -> bytes:
    out = list(fmt.stream_start())
    for p in pieces(text, rng):
        out += fmt.stream_token(TokenEvent(token_id=1, text=p))
    out += fmt.stream_token(TokenEvent(token_id=-1, text=""))
    out += fmt.stream_finish(fin)
    out += fmt.stream_end(fin)
    return b"".join(out)


def events_of(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in data.decode().split("\n\n"):
        if not chunk:
            continue
        name, line = chunk.split("\n")
        assert name.startswith("event: ") and line.startswith("data: ")
        obj = json.loads(line[6:])
        assert obj["type"] == name[7:]
        out.append((name[7:], obj))
    return out


def sdk_client(handler):
    return anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def sdk_stream(data: bytes):
    """The SDK's own stream helper over our bytes: (final message, its text stream)."""
    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=data)

    client = sdk_client(handler)
    with client.messages.stream(model="m", max_tokens=8,
                                messages=[{"role": "user", "content": "x"}]) as s:
        texts = list(s.text_stream)
        return s.get_final_message(), texts


def sdk_whole(obj: dict):
    def handler(request):
        return httpx2.Response(200, json=obj)

    return sdk_client(handler).messages.create(model="m", max_tokens=8,
                                               messages=[{"role": "user", "content": "x"}])


def blocks_of(message) -> list[dict]:
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if d["type"] == "tool_use":
            assert d["id"].startswith("toolu_") and len(d["id"]) == 30
            d.pop("id")
        out.append(d)
    return out


def test_stream_event_sequence():
    fmt = make_format()
    evs = events_of(stream_bytes(fmt, "Hello there", finish(completion=3)))
    names = [n for n, _ in evs]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]
    start = evs[0][1]["message"]
    assert start["id"] == "msg_test123" and start["model"] == "claude-sonnet-4-5"
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 100
    assert evs[2][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    text = "".join(o["delta"]["text"] for n, o in evs if n == "content_block_delta")
    assert text == "Hello there"
    assert evs[-2][1] == {"type": "message_delta",
                          "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"input_tokens": 100, "output_tokens": 3,
                                    "cache_creation_input_tokens": 0,
                                    "cache_read_input_tokens": 0}}


def test_stream_text_accepted_by_sdk():
    msg, texts = sdk_stream(stream_bytes(make_format(), "Hi, Paris is nice.",
                                         finish(completion=5), random.Random(1)))
    assert "".join(texts) == "Hi, Paris is nice."
    assert blocks_of(msg) == [{"type": "text", "text": "Hi, Paris is nice."}]
    assert msg.stop_reason == "end_turn" and msg.id == "msg_test123"
    assert msg.usage.output_tokens == 5 and msg.usage.input_tokens == 100


def test_stream_tool_use_accepted_by_sdk():
    fmt = make_format(tool_rules(), tools=[WEATHER])
    data = stream_bytes(fmt, "Let me check. " + CALL, finish(completion=20), random.Random(3))
    evs = events_of(data)
    starts = [o["content_block"] for n, o in evs if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    assert [o["index"] for n, o in evs if n == "content_block_stop"] == [0, 1]
    msg, texts = sdk_stream(data)
    assert blocks_of(msg) == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]
    assert msg.stop_reason == "tool_use"


def test_whole_response_accepted_by_sdk():
    fmt = make_format(tool_rules(), tools=[WEATHER])
    fin = finish(completion=20)
    obj = fmt.response({0: ("Let me check. " + CALL, [], fin)}, fin)
    assert obj["type"] == "message" and obj["role"] == "assistant"
    assert obj["content"][1]["id"].startswith("toolu_")
    msg = sdk_whole(obj)
    assert blocks_of(msg) == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert msg.usage.input_tokens == 100 and msg.usage.output_tokens == 20


REPLIES = [
    "Just text.",
    CALL,
    "Let me check. " + CALL,
    CALL + "\n" + CALL.replace("Paris", "Oslo"),
    "\n\n  " + CALL,
    "",
    "  \n",
    "Unicode: Zürich — 東京 ✓",
]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("text", REPLIES)
def test_stream_and_whole_agree(text, parallel):
    """The SDK reads the same blocks from the stream (any chunking) and the whole response."""
    kw = {"tools": [WEATHER]}
    if not parallel:
        kw["tool_choice"] = {"type": "auto", "disable_parallel_tool_use": True}
    fin = finish()
    rules = tool_rules(parallel_tool_calls=parallel)
    whole = sdk_whole(make_format(rules, **kw).response({0: (text, [], fin)}, fin))
    for seed in [None, 0, 1, 2]:
        rng = random.Random(seed) if seed is not None else None
        streamed, _ = sdk_stream(stream_bytes(make_format(rules, **kw), text, fin, rng))
        assert blocks_of(streamed) == blocks_of(whole), seed
        assert streamed.stop_reason == whole.stop_reason
    n_calls = sum(b.type == "tool_use" for b in whole.content)
    assert n_calls == (min(text.count("<tool_call>"), 1 if not parallel else 9))
    assert all(b.text.strip() for b in whole.content if b.type == "text")


@pytest.mark.parametrize("parallel", [True, False])
def test_text_after_a_call_is_a_block_after_it(parallel):
    """Blocks keep the order the model wrote them, streamed or whole: text after a call is a
    text block after the call; a second call cut off by max_tokens is dropped (stop_reason
    max_tokens)."""
    rules = tool_rules(parallel_tool_calls=parallel)
    for text, fin, last, reason in [("A " + CALL + " B", finish(), ["tool_use", "text"], "tool_use"),
                                    (CALL + "\n" + CALL[:30], finish("length"), ["tool_use"],
                                     "max_tokens")]:
        whole = sdk_whole(make_format(rules, tools=[WEATHER]).response({0: (text, [], fin)},
                                                                       fin))
        assert [b.type for b in whole.content][-len(last):] == last
        assert whole.stop_reason == reason
        for seed in [None, 1]:
            rng = random.Random(seed) if seed is not None else None
            streamed, _ = sdk_stream(stream_bytes(make_format(rules, tools=[WEATHER]), text,
                                                  fin, rng))
            assert blocks_of(streamed) == blocks_of(whole)


def test_call_cut_off_inside_its_arguments():
    """The one difference: a stream has announced the call before it breaks (partial input);
    the whole reply leaves it out. Neither carries its markup; stop_reason max_tokens."""
    text = "Sure. " + CALL[:60]
    fin = finish("length")
    whole = sdk_whole(make_format(tool_rules(), tools=[WEATHER]).response({0: (text, [], fin)},
                                                                          fin))
    assert blocks_of(whole) == [{"type": "text", "text": "Sure."}]
    assert whole.stop_reason == "max_tokens"
    streamed, _ = sdk_stream(stream_bytes(make_format(tool_rules(), tools=[WEATHER]), text, fin,
                                          random.Random(2)))
    assert streamed.stop_reason == "max_tokens"
    uses = [b for b in streamed.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].input in ({}, {"city": "P"})  # jiter partial mode


def test_stop_reasons():
    fmt = make_format(stop_sequences=["END"])
    assert fmt.stop(finish("length"), False) == ("max_tokens", None)
    assert fmt.stop(finish(stop_string="END"), False) == ("stop_sequence", "END")
    assert fmt.stop(finish(), False) == ("end_turn", None)
    assert fmt.stop(finish(stop_string="</s>"), False) == ("end_turn", None)  # not the client's
    assert fmt.stop(finish("length"), True) == ("max_tokens", None)  # a call was cut off
    fin = finish(stop_string="END")
    msg = sdk_whole(fmt.response({0: ("abc", [], fin)}, fin))
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END")
    streamed, _ = sdk_stream(stream_bytes(make_format(stop_sequences=["END"]), "abc", fin))
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "END")
    streamed, _ = sdk_stream(stream_bytes(make_format(), "abc", finish("length")))
    assert streamed.stop_reason == "max_tokens"


def test_usage_cache_figures():
    p = PromptInfo(n_tokens=100, cache_point_tokens=64)
    assert A.usage(finish(prompt=100, cache_n=0), p) == {
        "input_tokens": 36, "output_tokens": 7, "cache_creation_input_tokens": 64,
        "cache_read_input_tokens": 0}
    assert A.usage(finish(prompt=100, cache_n=64), p)["cache_creation_input_tokens"] == 0
    u = A.usage(finish(prompt=100, cache_n=80), p)
    assert (u["input_tokens"], u["cache_creation_input_tokens"],
            u["cache_read_input_tokens"]) == (20, 0, 80)
    u = A.usage(finish(prompt=100, cache_n=48), p)  # part read, the rest created
    assert (u["input_tokens"], u["cache_creation_input_tokens"],
            u["cache_read_input_tokens"]) == (36, 16, 48)
    for cache_n in range(0, 101, 7):
        u = A.usage(finish(prompt=100, cache_n=cache_n), p)
        assert min(u.values()) >= 0
        assert u["input_tokens"] + u["cache_creation_input_tokens"] + \
            u["cache_read_input_tokens"] == 100
    # the SDK takes the final usage from message_delta over message_start's
    fin = finish(prompt=100, cache_n=64)
    streamed, _ = sdk_stream(stream_bytes(make_format(prompt=p), "x", fin))
    assert streamed.usage.cache_read_input_tokens == 64
    assert streamed.usage.cache_creation_input_tokens == 0
    assert streamed.usage.input_tokens == 36


@pytest.mark.parametrize("enabled", [True, False])
def test_thinking_blocks(enabled):
    kw = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if enabled else {}
    rules = OutputRules(reasoning=True)
    text = "<think>the user greets</think>Hello!"
    fin = finish()
    whole = sdk_whole(make_format(rules, **kw).response({0: (text, [], fin)}, fin))
    streamed, _ = sdk_stream(stream_bytes(make_format(rules, **kw), text, fin,
                                          random.Random(5)))
    want = [{"type": "text", "text": "Hello!"}]
    if enabled:
        want.insert(0, {"type": "thinking", "thinking": "the user greets", "signature": ""})
    assert blocks_of(whole) == want
    assert blocks_of(streamed) == want


def test_stream_error_event():
    fmt = make_format()
    data = b"".join(fmt.stream_start() + fmt.stream_token(TokenEvent(1, "Hel"))
                    + fmt.stream_error(APIError(503, "the request was cancelled")))
    evs = events_of(data)
    assert evs[-1] == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "the request was cancelled"}})
    with pytest.raises(anthropic.APIStatusError) as e:
        sdk_stream(data)
    assert "cancelled" in str(e.value)


def test_error_status_read_by_sdk():
    def handler(request):
        return httpx2.Response(400, json=API.error_body(APIError(400, "max_tokens: Field "
                                                                      "required")))

    with pytest.raises(anthropic.BadRequestError) as e:
        sdk_client(handler).messages.create(model="m", max_tokens=1,
                                            messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_tool_input_fallbacks():
    assert A.tool_input('{"a": 1}') == {"a": 1}
    assert A.tool_input("") == {}
    assert A.tool_input('"{\\"a\\": 1}"') == {"a": 1}  # double-encoded
    assert A.tool_input("[1, 2]") == {"_raw": "[1, 2]"}
    assert A.tool_input("{broken") == {"_raw": "{broken"}
    assert A.tool_use_id("call_0123456789abcdef01234567") == "toolu_0123456789abcdef01234567"
    assert A.tool_use_id(None).startswith("toolu_")


def test_final_assistant_text_is_a_prefill_but_a_tool_use_turn_is_not():
    r = parse(messages=[{"role": "user", "content": "Name a colour."},
                        {"role": "assistant", "content": "The colour is"}])
    assert r.chat.continue_final and r.chat.template_kwargs["add_generation_prompt"] is False
    r = parse(messages=[{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": [
                            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}]}],
              tools=[{"name": "w", "input_schema": {"type": "object"}}])
    assert not r.chat.continue_final and "add_generation_prompt" not in r.chat.template_kwargs
    assert not parse().chat.continue_final
