"""server/responses.py without a server: the Responses request translated into the OpenAI chat
form (every input item kind, tools, tool_choice, text.format, previous_response_id through the
store, owners, expiry, cache points, the 400s and 404s), and the response object / stream built
from fake engine events, read back by the official `openai` SDK (its response models, its raw
event stream and its `responses.stream()` accumulator are what must accept our events)."""

from __future__ import annotations

import copy
import json
import random

import pytest

from kvshare.engine.api import FinishEvent, Timings, TokenEvent
from kvshare.apis import responses as R
from kvshare.apis.chat_output import OutputRules
from kvshare.server.errors import APIError
from kvshare.apis.base import CachePoint, PromptInfo, RequestContext
from kvshare.toolcalls import get_format

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport the openai SDK is built on

CTX = RequestContext(model_name="served-model", ctx_size=4096, vocab_size=None, max_n=8)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": WEATHER["parameters"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RULES = OutputRules(tool_format=get_format("hermes", tools=CHAT_TOOLS))


def api(store: R.ResponseStore | None = None) -> R.ResponsesApi:
    return R.ResponsesApi(store if store is not None else R.ResponseStore())


def body(**kw) -> dict:
    b = {"model": "gpt-4o-mini", "input": "Hello"}
    b.update(kw)
    return {k: v for k, v in b.items() if v is not None}


def parse(a: R.ResponsesApi | None = None, ctx: RequestContext = CTX, **kw):
    return (a or api()).parse(body(**kw), ctx)


def bad(*needles: str, status: int = 400, a=None, ctx=CTX, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        parse(a, ctx, **kw)
    err = e.value
    assert err.status == status, (err.status, err.message)
    for n in needles:
        assert n in err.message, (n, err.message)
    b = err.body()["error"]
    assert set(b) == {"message", "type", "param", "code"}
    return err


def fin(reason: str = "stop", prompt: int = 100, completion: int = 10, cached: int = 60,
        **kw) -> FinishEvent:
    return FinishEvent(reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                       timings=Timings(prompt - cached, cached, 5.0, completion, 10.0),
                       time_to_first_token_s=0.01, **kw)


# --------------------------------------------------------------------------- parse: basics

def test_minimal_request():
    r = parse()
    assert r.model == "gpt-4o-mini"
    assert r.chat.messages == [{"role": "user", "content": "Hello"}]
    assert r.chat.tools is None and r.chat.tool_choice == "none"
    assert r.opts.max_tokens is None and r.opts.n == 1 and not r.opts.stream
    assert r.opts.sampling.temperature == 1.0 and r.opts.sampling.top_p == 1.0
    assert r.output is None and r.opts.cache_salt is None
    assert r.store is True and r.echo["previous_response_id"] is None
    # stored by default: the whole prompt is pinned for the follow-up
    assert r.cache_point == CachePoint(0)
    e = r.echo
    assert e["tool_choice"] == "auto" and e["tools"] == [] and e["store"] is True
    assert e["text"] == {"format": {"type": "text"}} and e["metadata"] == {}


def test_model_defaults_to_served_name():
    assert api().parse({"input": "Hi"}, CTX).model == "served-model"


def test_options():
    r = parse(temperature=0, top_p=0.5, max_output_tokens=64, stream=True, store=False,
              metadata={"k": "v"}, user="u1", truncation="auto", include=["reasoning"],
              reasoning={"effort": "low"}, service_tier="auto", prompt_cache_key="x",
              unknown_field={"x": 1}, cache_salt="s3cret",
              chat_template_kwargs={"enable_thinking": False, "messages": []})
    s = r.opts.sampling
    assert (s.temperature, s.top_p) == (0.0, 0.5)
    assert r.opts.max_tokens == 64 and r.opts.stream
    assert r.store is False and r.cache_point is None
    assert r.opts.cache_salt == "s3cret"  # hashed into the cache keys by the pipeline
    assert r.chat.template_kwargs == {"enable_thinking": False}
    e = r.echo
    assert e["metadata"] == {"k": "v"} and e["user"] == "u1" and e["truncation"] == "auto"
    assert e["reasoning"] == {"effort": "low"} and e["max_output_tokens"] == 64
    # the owner the routes compute from the raw salt is the one parse stored under
    assert r.owner == R.owner_of(CTX, "s3cret") != R.owner_of(CTX, None)


def test_instructions_are_a_system_message_first():
    r = parse(instructions="Be brief.", input=[{"role": "user", "content": "Hi"}])
    assert r.chat.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}]
    assert r.cache_point == CachePoint(1)
    # the stored conversation leaves the instructions out
    assert r.conversation == [{"role": "user", "content": "Hi"}]


def test_message_items():
    r = parse(input=[
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "again"},
    ])
    assert r.chat.messages == [
        {"role": "system", "content": "dev"}, {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": "no"}, {"role": "user", "content": "again"}]


def test_function_calls_and_outputs():
    r = parse(tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rainy"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_3", "output": ""},
    ])
    m = r.chat.messages
    assert m[0] == {"role": "user", "content": "Weather in Paris and Oslo?"}
    # a reply of text + calls sent back is one assistant message again
    assert m[1]["role"] == "assistant" and m[1]["content"] == "Checking."
    assert m[1]["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert m[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert m[3] == {"role": "tool", "tool_call_id": "call_2", "content": "rainy"}
    # a call with no text before it: an assistant message of its own
    assert m[4]["role"] == "assistant" and m[4]["content"] == ""
    assert [c["id"] for c in m[4]["tool_calls"]] == ["call_3"]
    assert m[5] == {"role": "tool", "tool_call_id": "call_3", "content": ""}
    assert r.chat.tool_choice == "auto"


def test_function_call_output_needs_an_earlier_call():
    bad("call_x", input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}])
    # the call must come first
    bad("call_1", input=[
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}])


@pytest.mark.parametrize("items,needles", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
     ["input_image", "input[0].content[0]"]),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], ["input_file"]),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], ["input_audio"]),
    ([{"role": "user", "content": [{"type": "video"}]}], ["video"]),
    ([{"type": "item_reference", "id": "msg_1"}], ["item_reference"]),
    ([{"type": "web_search_call", "id": "ws_1"}], ["web_search_call"]),
    ([{"type": "computer_call_output", "call_id": "c"}], ["computer_call_output"]),
    ([{"role": "tool", "content": "x"}], ["role", "tool"]),
    ([{"role": "user"}], ["input[0].content"]),
    ([{"role": "user", "content": 3}], ["input[0].content"]),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], ["call_id"]),
    ([{"type": "function_call", "call_id": "c", "arguments": "{}"}], ["name"]),
    (["just a string"], ["input[0]"]),
    ([], ["empty"]),
    ([{"type": "reasoning", "summary": []}], ["no message"]),
    (3, ["input"]),
])
def test_bad_input_items(items, needles):
    bad(*needles, input=items)


def test_missing_input():
    with pytest.raises(APIError) as e:
        api().parse({"model": "m"}, CTX)
    assert e.value.status == 400 and e.value.param == "input"


# --------------------------------------------------------------------------- tools

def test_tools_and_tool_choice():
    r = parse(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert r.chat.tools == CHAT_TOOLS
    assert r.chat.tool_choice == "required" and r.chat.parallel_tool_calls is False
    assert r.echo["tools"] == [{**WEATHER, "strict": None}]
    assert r.echo["tool_choice"] == "required"
    r = parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert r.chat.tool_choice == "function:get_weather"
    assert r.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert parse(tools=[WEATHER]).chat.tool_choice == "auto"
    assert parse(tools=[WEATHER], tool_choice="none").chat.tool_choice == "none"
    # strict is kept (strict tools get the auto grammar); the chat-completions shape is taken
    r = parse(tools=[{**WEATHER, "strict": True}])
    assert r.chat.tools[0]["function"]["strict"] is True
    assert parse(tools=CHAT_TOOLS).chat.tools == CHAT_TOOLS
    # parameters default to an empty object schema
    r = parse(tools=[{"type": "function", "name": "ping"}])
    assert r.chat.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools,needles", [
    ([{"type": "web_search"}], ["web_search", "tools[0].type"]),
    ([{"type": "file_search", "vector_store_ids": ["v"]}], ["file_search"]),
    ([{"type": "mcp", "server_label": "x"}], ["mcp"]),
    ([{"name": "f"}], ["None"]),
    ([{"type": "function"}], ["tools[0].name"]),
    ([{"type": "function", "name": "bad name"}], ["bad name"]),
    ([WEATHER, WEATHER], ["twice"]),
    ("nope", ["tools"]),
])
def test_bad_tools(tools, needles):
    bad(*needles, tools=tools)


@pytest.mark.parametrize("tc,tools,needle", [
    ("required", None, "required"),
    ("sometimes", [WEATHER], "sometimes"),
    ({"type": "function", "name": "get_time"}, [WEATHER], "get_time"),
    ({"type": "function"}, [WEATHER], "name"),
    ({"type": "web_search_preview"}, [WEATHER], "web_search_preview"),
    ({"type": "allowed_tools", "mode": "auto", "tools": []}, [WEATHER], "allowed_tools"),
    (3, [WEATHER], "tool_choice"),
])
def test_bad_tool_choice(tc, tools, needle):
    assert bad(needle, tools=tools, tool_choice=tc).param.startswith("tool_choice")


# --------------------------------------------------------------------------- text.format

def test_text_format():
    assert parse(text={"format": {"type": "text"}}).output is None
    assert parse(text={"verbosity": "low"}).echo["text"] == {
        "verbosity": "low", "format": {"type": "text"}}
    r = parse(text={"format": {"type": "json_object"}})
    assert (r.output.kind, r.output.param) == ("json_object", "text.format")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = parse(text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                               "strict": True}})
    assert r.output.kind == "json_schema" and json.loads(r.output.source) == schema
    assert r.output.param == "text.format.schema"
    assert r.echo["text"]["format"] == {"type": "json_schema", "name": "thing",
                                                 "schema": schema, "strict": True}


@pytest.mark.parametrize("text,needle", [
    ("json", "text"),
    ({"format": "json"}, "text.format"),
    ({"format": {"type": "xml"}}, "xml"),
    ({"format": {"type": "json_schema", "name": "x", "schema": 3}}, "text.format.schema"),
    ({"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}},
     "strict"),
])
def test_bad_text_format(text, needle):
    bad(needle, text=text)


# --------------------------------------------------------------------------- other 400s

@pytest.mark.parametrize("kw,param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "16"}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"stream": "yes"}, "stream"),
    ({"store": 1}, "store"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"instructions": ["x"]}, "instructions"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"metadata": "x"}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"user": 5}, "user"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"reasoning": "high"}, "reasoning"),
    ({"include": "reasoning"}, "include"),
    ({"include": [1]}, "include"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"model": 3}, "model"),
])
def test_bad_options(kw, param):
    assert bad(**kw).param == param


def test_body_must_be_an_object():
    with pytest.raises(APIError) as e:
        api().parse([1], CTX)
    assert e.value.status == 400


# --------------------------------------------------------------------------- the store

class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def rec(n: int = 0) -> R.ResponseRecord:
    return R.ResponseRecord(response={"id": f"resp_{n}"}, messages=[{"role": "user",
                                                                     "content": str(n)}])


def test_store_owner_expiry_and_limit():
    clock = Clock()
    s = R.ResponseStore(ttl_s=10, max_items=3, clock=clock)
    s.put("a", "o1", rec(1))
    assert s.get("a", "o1").response == {"id": "resp_1"}
    assert s.get("a", "o2") is None and s.get("b", "o1") is None  # foreign == unknown
    assert s.delete("a", "o2") is False and s.get("a", "o1") is not None
    clock.t += 9.9
    assert s.get("a", "o1") is not None
    clock.t += 0.2
    assert s.get("a", "o1") is None and len(s) == 0  # expired
    for i in range(5):
        s.put(f"r{i}", "o", rec(i))
    assert len(s) == 3 and s.get("r0", "o") is None and s.get("r1", "o") is None
    assert s.get("r4", "o") is not None
    assert s.delete("r4", "o") is True and s.get("r4", "o") is None
    assert s.delete("r4", "o") is False
    # no ttl: never expires
    s = R.ResponseStore(ttl_s=0, clock=clock)
    s.put("x", "o", rec())
    clock.t += 1e9
    assert s.get("x", "o") is not None and s.max_items == R.DEFAULT_MAX_ITEMS


def test_store_is_thread_safe():
    import threading

    s = R.ResponseStore(max_items=50)

    def work(k):
        for i in range(300):
            s.put(f"{k}-{i}", "o", rec(i))
            s.get(f"{k}-{i - 1}", "o")
            s.delete(f"{k}-{i - 2}", "o")

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(s) <= 50


def test_get_and_delete_routes():
    a = api()
    a.store.put("resp_1", "t:", R.ResponseRecord(response={"id": "resp_1", "object": "response"},
                                                 messages=[]))
    got = a.get_response("resp_1", "t:")
    assert got == {"id": "resp_1", "object": "response"}
    got["id"] = "changed"  # a copy: the stored object is not the caller's
    assert a.get_response("resp_1", "t:")["id"] == "resp_1"
    for owner in ("u:", "t:abc"):
        with pytest.raises(APIError) as e:
            a.get_response("resp_1", owner)
        assert e.value.status == 404 and e.value.code == "not_found"
        assert e.value.body()["error"]["message"] == "Response with id 'resp_1' not found."
    assert a.delete_response("resp_1", "t:") == {"id": "resp_1", "object": "response.deleted",
                                                 "deleted": True}
    for fn in (a.get_response, a.delete_response):
        with pytest.raises(APIError) as e:
            fn("resp_1", "t:")
        assert e.value.status == 404
    assert R.ResponsesApi.endpoint == "responses" and R.ResponsesApi.id_prefix == "resp_"
    assert a.error_body(APIError(400, "x", param="p"))["error"]["param"] == "p"


# --------------------------------------------------------------------------- output helpers

def pieces(text: str, rng: random.Random | None) -> list[str]:
    if rng is None:
        return [text]
    out, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        out.append(text[i:j])
        i = j
    return out


def token_events(text: str, rng: random.Random | None = None) -> list[TokenEvent]:
    return [TokenEvent(token_id=1, text=p) for p in pieces(text, rng)]


PROMPT = PromptInfo(100, 64)


def make(req, rules: OutputRules | None = RULES, store=None, prompt=PROMPT):
    a = api(store)
    return a.make_format("resp_" + "0" * 24, req, rules, prompt)


def whole(req, text: str, f: FinishEvent | None = None, rules=RULES, store=None,
          rng=None) -> dict:
    f = f or fin()
    fmt = make(req, rules, store)
    return fmt.response({0: (text, token_events(text, rng), f)}, f)


def stream_bytes(req, text: str, f: FinishEvent | None = None, rules=RULES, store=None,
                 rng=None) -> bytes:
    f = f or fin()
    fmt = make(req, rules, store)
    out = list(fmt.stream_start())
    for ev in token_events(text, rng):
        out += fmt.stream_token(ev)
    out += fmt.stream_token(TokenEvent(token_id=-1, text=""))
    out += fmt.stream_finish(f)
    out += fmt.stream_end(f)
    return b"".join(out)


def events_of(data: bytes) -> list[dict]:
    out = []
    for chunk in data.decode().split("\n\n"):
        if not chunk:
            continue
        name, line = chunk.split("\n")
        assert name.startswith("event: ") and line.startswith("data: ")
        obj = json.loads(line[6:])
        assert obj["type"] == name[7:]
        out.append(obj)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def sdk_client(handler):
    return openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def sse_handler(data: bytes):
    def handler(request):
        assert request.url.path == "/v1/responses"
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=data)
    return handler


def sdk_events(data: bytes) -> list:
    """The raw typed events of `responses.create(stream=True)`."""
    client = sdk_client(sse_handler(data))
    with client.responses.create(model="m", input="x", stream=True) as s:
        return list(s)


def sdk_stream(data: bytes, **kw):
    """The SDK's `responses.stream()` helper over our bytes: (events, final response)."""
    client = sdk_client(sse_handler(data))
    with client.responses.stream(model="m", input="x", **kw) as s:
        events = list(s)
        return events, s.get_final_response()


def sdk_whole(obj: dict, parse_format=None):
    def handler(request):
        return httpx2.Response(200, json=obj)

    client = sdk_client(handler)
    if parse_format is not None:
        return client.responses.parse(model="m", input="x", text_format=parse_format)
    return client.responses.create(model="m", input="x")


def unparsed(obj):
    """An SDK object's dict without the SDK's own parse results."""
    if isinstance(obj, dict):
        return {k: unparsed(v) for k, v in obj.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(obj, list):
        return [unparsed(v) for v in obj]
    return obj


def strip_ids(output: list[dict]) -> list[dict]:
    out = copy.deepcopy(output)
    for it in out:
        it.pop("id", None)
        it.pop("call_id", None)
    return out


# --------------------------------------------------------------------------- the response

def test_text_response():
    req = parse(instructions="Be brief.", temperature=0.5, metadata={"a": "b"})
    r = whole(req, "Hello there!")
    assert r["id"].startswith("resp_") and r["object"] == "response"
    assert r["status"] == "completed" and r["incomplete_details"] is None
    assert r["error"] is None and r["model"] == "gpt-4o-mini"
    assert r["instructions"] == "Be brief." and r["temperature"] == 0.5
    assert r["metadata"] == {"a": "b"} and r["store"] is True
    assert isinstance(r["created_at"], int) and isinstance(r["completed_at"], int)
    [item] = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello there!",
                                "annotations": [], "logprobs": []}]
    assert r["usage"] == {"input_tokens": 100,
                          "input_tokens_details": {"cached_tokens": 60, "cache_write_tokens": 4},
                          "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 110}
    assert "output_text" not in r
    sdk = sdk_whole(r)
    assert sdk.output_text == "Hello there!" and sdk.status == "completed"
    assert sdk.usage.input_tokens_details.cached_tokens == 60
    assert sdk.output[0].content[0].text == "Hello there!"


def test_tool_call_response():
    req = parse(tools=[WEATHER], tool_choice="required")
    r = whole(req, CALL)
    [call] = r["output"]  # no text: no message item
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"] == "fc_" + call["call_id"][5:]
    assert r["tools"] == [{**WEATHER, "strict": None}] and r["tool_choice"] == "required"
    sdk = sdk_whole(r)
    assert sdk.output[0].type == "function_call" and sdk.output[0].call_id == call["call_id"]
    # text before and after calls, and blank text between them: items in order, none blank
    two = CALL + "\n\n" + CALL.replace("Paris", "Oslo")
    r = whole(req, "Let me check. " + two + "\nDone.")
    assert [i["type"] for i in r["output"]] == ["message", "function_call", "function_call",
                                               "message"]
    assert r["output"][0]["content"][0]["text"].strip() == "Let me check."
    assert r["output"][3]["content"][0]["text"].strip() == "Done."
    assert [json.loads(i["arguments"])["city"] for i in r["output"][1:3]] == ["Paris", "Oslo"]


def test_incomplete_response():
    r = whole(parse(max_output_tokens=5), "Once upon a", fin("length", completion=5))
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][-1]["status"] == "incomplete" and r["completed_at"] is None
    assert r["max_output_tokens"] == 5
    sdk = sdk_whole(r)
    assert sdk.incomplete_details.reason == "max_output_tokens"


def test_empty_reply_is_one_empty_message():
    for text in ("", "  \n"):
        r = whole(parse(), text)
        [item] = r["output"]
        assert item["type"] == "message" and item["content"][0]["text"] == text
        assert sdk_whole(r).output_text == text
        events = events_of(stream_bytes(parse(), text))
        assert events[-1]["response"]["output"] == [
            {**item, "id": events[-1]["response"]["output"][0]["id"]}]


def test_reasoning_items():
    rules = OutputRules(tool_format=RULES.tool_format, reasoning=True)
    req = parse(tools=[WEATHER])
    r = whole(req, "<think>the user wants weather</think>" + CALL, rules=rules)
    assert [i["type"] for i in r["output"]] == ["reasoning", "function_call"]
    rs = r["output"][0]
    assert rs["id"].startswith("rs_") and rs["summary"] == []
    assert rs["content"] == [{"type": "reasoning_text", "text": "the user wants weather"}]
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] >= 1
    sdk = sdk_whole(r)
    assert sdk.output[0].type == "reasoning"
    assert sdk.output[0].content[0].text == "the user wants weather"
    # blank reasoning (a template's empty think block) makes no item
    r = whole(req, "<think>\n\n</think>\n\nHi", rules=rules)
    assert [i["type"] for i in r["output"]] == ["message"]
    # streamed, the reasoning events parse too
    data = stream_bytes(req, "<think>hmm, weather</think>" + CALL, rules=rules,
                        rng=random.Random(1))
    types = [e["type"] for e in events_of(data)]
    assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
    events, final = sdk_stream(data)
    assert [o.type for o in final.output] == ["reasoning", "function_call"]


def test_parse_with_pydantic_model():
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        temperature_c: int

    text = json.dumps({"city": "Oslo", "temperature_c": 4})
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "temperature_c": {"type": "integer"}}}
    req = parse(text={"format": {"type": "json_schema", "name": "Weather", "schema": schema,
                                 "strict": True}})
    r = whole(req, text, rules=OutputRules())
    parsed = sdk_whole(r, parse_format=Weather)
    assert parsed.output_parsed == Weather(city="Oslo", temperature_c=4)
    data = stream_bytes(req, text, rules=OutputRules(), rng=random.Random(0))
    _events, final = sdk_stream(data, text_format=Weather)
    assert final.output_parsed == Weather(city="Oslo", temperature_c=4)


# --------------------------------------------------------------------------- the stream

def test_stream_event_sequence():
    req = parse(tools=[WEATHER])
    events = events_of(stream_bytes(req, "Let me check. " + CALL, rng=random.Random(3)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == events[-1]["response"]["id"]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.output_text.delta"]
    msg_id = events[2]["item"]["id"]
    assert events[2]["item"] == {"id": msg_id, "type": "message", "status": "in_progress",
                                 "role": "assistant", "content": []}
    assert events[3]["part"] == {"type": "output_text", "text": "", "annotations": []}
    i = types.index("response.output_text.done")
    assert types[i:i + 4] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.output_item.added"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(d["item_id"] == msg_id and d["output_index"] == 0 and d["content_index"] == 0
               and d["logprobs"] == [] for d in deltas)
    assert "".join(d["delta"] for d in deltas) == events[i]["text"] == "Let me check."
    call_added = events[i + 3]
    assert call_added["output_index"] == 1 and call_added["item"]["type"] == "function_call"
    assert call_added["item"]["status"] == "in_progress" and call_added["item"]["arguments"] == ""
    arg_deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    args_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert "".join(d["delta"] for d in arg_deltas) == args_done["arguments"]
    assert json.loads(args_done["arguments"]) == {"city": "Paris"}
    assert args_done["name"] == "get_weather"
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == 100
    assert [o["id"] for o in final["output"]] == [msg_id, call_added["item"]["id"]]
    assert final["output"][1] == events[-2]["item"]
    # the SDK reads every event as its typed class
    sdk = sdk_events(stream_bytes(req, "Let me check. " + CALL))
    assert [type(e).__name__ for e in sdk][:2] == ["ResponseCreatedEvent",
                                                   "ResponseInProgressEvent"]
    assert type(sdk[-1]).__name__ == "ResponseCompletedEvent"
    assert sdk[-1].response.output[1].arguments == args_done["arguments"]
    assert all(type(e).__name__ != "dict" for e in sdk)


@pytest.mark.parametrize("text", [
    "Just text.", CALL, "Let me check. " + CALL, CALL + "\n" + CALL.replace("Paris", "Oslo"),
    "Let me check. " + CALL + " and then some words", CALL[:40], "",
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_agrees_with_whole(text, seed):
    """The stream's final response (and the SDK's accumulated one) and the whole response have
    the same items, whatever the tokenization."""
    req = parse(tools=[WEATHER])
    rng = random.Random(seed)
    w = whole(req, text, rng=random.Random(seed))
    data = stream_bytes(req, text, rng=rng)
    events = events_of(data)
    final = events[-1]["response"]
    assert strip_ids(final["output"]) == strip_ids(w["output"])
    assert {k: v for k, v in final.items() if k not in ("id", "output", "created_at",
                                                        "completed_at")} == \
        {k: v for k, v in w.items() if k not in ("id", "output", "created_at", "completed_at")}
    # the items the stream announced are the final ones
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    _sdk_events, sdk_final = sdk_stream(data)
    assert [unparsed(o.to_dict()) for o in sdk_final.output] == final["output"]
    if text:
        # the deltas add up to the final text
        streamed = "".join(e["delta"] for e in events
                           if e["type"] == "response.output_text.delta")
        assert streamed == "".join(o["content"][0]["text"] for o in final["output"]
                                   if o["type"] == "message")


def test_whole_without_token_events_agrees():
    req = parse(tools=[WEATHER])
    f = fin()
    fmt = make(req)
    r = fmt.response({0: ("Let me check. " + CALL, [], f)}, f)
    assert strip_ids(r["output"]) == strip_ids(whole(req, "Let me check. " + CALL)["output"])


def test_stream_incomplete():
    data = stream_bytes(parse(max_output_tokens=3), "Once upon", fin("length", completion=3))
    events = events_of(data)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    sdk = sdk_events(data)
    assert type(sdk[-1]).__name__ == "ResponseIncompleteEvent"


def test_stream_error_event():
    fmt = make(parse())
    out = list(fmt.stream_start())
    out += fmt.stream_token(TokenEvent(token_id=1, text="Hel"))
    out += fmt.stream_error(APIError(503, "queue timeout", code="queue_timeout"))
    data = b"".join(out)
    events = events_of(data)
    err = events[-1]
    assert err == {"type": "error", "code": "queue_timeout", "message": "queue timeout",
                   "param": None, "sequence_number": len(events) - 1}
    sdk = sdk_events(data)
    assert type(sdk[-1]).__name__ == "ResponseErrorEvent"
    assert sdk[-1].code == "queue_timeout" and sdk[-1].message == "queue timeout"
    # no code: the error type stands in
    fmt = make(parse())
    ev = events_of(b"".join(fmt.stream_start() + fmt.stream_error(APIError(500, "boom"))))
    assert ev[-1]["code"] == "server_error"


def test_stream_ignores_other_choices_and_failed_finishes():
    fmt = make(parse())
    assert fmt.stream_token(TokenEvent(token_id=1, text="x", index=1)) == []
    assert fmt.stream_finish(fin("error", error="x")) == []


# --------------------------------------------------------------------------- store + chaining

@pytest.mark.parametrize("streamed", [False, True])
def test_store_and_continue_with_function_call_output(streamed):
    store = R.ResponseStore()
    a = api(store)
    req1 = a.parse(body(instructions="Sys one.", tools=[WEATHER], input="Weather in Paris?"),
                   CTX)
    assert req1.cache_point == CachePoint(1)
    fmt = a.make_format("resp_1", req1, RULES, PromptInfo(50, 32))
    f = fin(prompt=50)
    text = "Checking. " + CALL
    if streamed:
        out = list(fmt.stream_start())
        for ev in token_events(text, random.Random(5)):
            out += fmt.stream_token(ev)
        out += fmt.stream_finish(f) + fmt.stream_end(f)
        resp = events_of(b"".join(out))[-1]["response"]
    else:
        resp = fmt.response({0: (text, token_events(text), f)}, f)
    call_id = resp["output"][1]["call_id"]
    recd = store.get("resp_1", req1.owner)
    assert recd is not None and recd.response == resp
    assert recd.instructions == "Sys one." and recd.tools == [{**WEATHER, "strict": None}]
    # the conversation: input without the instructions, and the reply with the ids sent
    assert recd.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": resp["output"][0]["content"][0]["text"], "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": resp["output"][1]["arguments"]}}]}]
    assert a.get_response("resp_1", R.owner_of(CTX, None)) == resp

    # turn 2: only the tool result; new instructions replace the old ones
    req2 = a.parse(body(instructions="Sys two.", tools=[WEATHER], previous_response_id="resp_1",
                        input=[{"type": "function_call_output", "call_id": call_id,
                                "output": "sunny"}]), CTX)
    assert req2.chat.messages == [{"role": "system", "content": "Sys two."}, *recd.messages,
                                  {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    assert req2.cache_point == CachePoint(2)  # the end of the stored conversation
    assert req2.echo["previous_response_id"] == "resp_1"
    r2 = a.make_format("resp_2", req2, RULES, PromptInfo(80, 64)).response(
        {0: ("It is sunny.", token_events("It is sunny."), fin())}, fin())
    assert r2["previous_response_id"] == "resp_1" and r2["instructions"] == "Sys two."

    # turn 3: no instructions at all; the chain carries everything
    req3 = a.parse(body(previous_response_id="resp_2", input="Thanks!"), CTX)
    assert req3.chat.messages == [*recd.messages,
                                  {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
                                  {"role": "assistant", "content": "It is sunny."},
                                  {"role": "user", "content": "Thanks!"}]
    assert req3.cache_point == CachePoint(3)
    # a call id of the stored conversation is known; an unknown one is still a 400
    a.parse(body(previous_response_id="resp_1", input=[
        {"type": "function_call_output", "call_id": call_id, "output": "x"}]), CTX)
    bad(call_id[:-1] + "z", a=a, previous_response_id="resp_1", input=[
        {"type": "function_call_output", "call_id": call_id[:-1] + "z", "output": "x"}])


def test_store_false_is_not_stored():
    store = R.ResponseStore()
    a = api(store)
    req = a.parse(body(store=False), CTX)
    resp = a.make_format("resp_x", req, RULES, PromptInfo(10)).response(
        {0: ("hi", token_events("hi"), fin())}, fin())
    assert resp["store"] is False and len(store) == 0
    with pytest.raises(APIError) as e:
        a.get_response("resp_x", req.owner)
    assert e.value.status == 404


def test_stream_left_early_is_not_stored():
    store = R.ResponseStore()
    a = api(store)
    fmt = a.make_format("resp_x", a.parse(body(), CTX), RULES, PromptInfo(10))
    fmt.stream_start()
    fmt.stream_token(TokenEvent(token_id=1, text="Hi"))
    assert len(store) == 0


def _stored(a: R.ResponsesApi, rid: str, ctx: RequestContext = CTX, salt: str | None = None):
    req = a.parse(body(cache_salt=salt), ctx)
    a.make_format(rid, req, RULES, PromptInfo(10)).response(
        {0: ("hi", token_events("hi"), fin())}, fin())
    return req


def test_previous_response_of_another_owner_is_404():
    a = api()
    _stored(a, "resp_mine")
    other = RequestContext(model_name="m", ctx_size=4096, vocab_size=None, max_n=8,
                           tenant_id="ab12")
    for ctx, salt in ((other, None), (CTX, "salty")):
        err = bad("resp_mine", status=404, a=a, ctx=ctx, previous_response_id="resp_mine",
                  cache_salt=salt)
        assert err.code == "previous_response_not_found"
        assert err.param == "previous_response_id"
        assert err.message == "Previous response with id 'resp_mine' not found."
        with pytest.raises(APIError):
            a.get_response("resp_mine", R.owner_of(ctx, salt))
    # unknown looks the same
    err = bad(status=404, a=a, previous_response_id="resp_nope")
    assert err.code == "previous_response_not_found"
    # the right owner (and salt) finds it
    a.parse(body(previous_response_id="resp_mine"), CTX)
    _stored(a, "resp_salted", salt="salty")
    a.parse(body(previous_response_id="resp_salted", cache_salt="salty"), CTX)
    assert a.get_response("resp_salted", R.owner_of(CTX, "salty"))["id"] == "resp_salted"
    # tenants: same id space, own records
    _stored(a, "resp_t", ctx=other)
    a.parse(body(previous_response_id="resp_t"), other)
    bad(status=404, a=a, previous_response_id="resp_t")


def test_previous_response_expires():
    clock = Clock()
    a = api(R.ResponseStore(ttl_s=0.5, clock=clock))
    _stored(a, "resp_old")
    a.parse(body(previous_response_id="resp_old"), CTX)
    clock.t += 0.6
    bad("resp_old", status=404, a=a, previous_response_id="resp_old")
    with pytest.raises(APIError):
        a.get_response("resp_old", R.owner_of(CTX, None))


def test_real_clock_ttl():
    import time

    a = api(R.ResponseStore(ttl_s=0.05))
    _stored(a, "resp_fast")
    a.parse(body(previous_response_id="resp_fast"), CTX)
    time.sleep(0.1)
    bad(status=404, a=a, previous_response_id="resp_fast")


def test_reasoning_is_not_stored():
    store = R.ResponseStore()
    a = api(store)
    req = a.parse(body(), CTX)
    rules = OutputRules(reasoning=True)
    a.make_format("resp_r", req, rules, PromptInfo(10)).response(
        {0: ("<think>plan</think>Answer.", [], fin())}, fin())
    assert store.get("resp_r", req.owner).messages[-1] == {
        "role": "assistant", "content": "Answer."}


def test_stored_messages_are_shared_not_copied_nor_mutated():
    store = R.ResponseStore()
    a = api(store)
    req1 = _stored(a, "resp_1")
    rec1 = store.get("resp_1", req1.owner)
    snapshot = copy.deepcopy(rec1.messages)
    # a continuation starting with a call item makes a message of its own
    req2 = a.parse(body(previous_response_id="resp_1", input=[
        {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "ok"}]), CTX)
    assert rec1.messages == snapshot
    assert req2.chat.messages[:2] == snapshot and req2.chat.messages[0] is rec1.messages[0]
    assert req2.chat.messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    a.make_format("resp_2", req2, RULES, PromptInfo(10)).response(
        {0: ("done", token_events("done"), fin())}, fin())
    rec2 = store.get("resp_2", req2.owner)
    assert rec2.messages[0] is rec1.messages[0] and rec1.messages == snapshot
    assert len(rec2.messages) == len(rec1.messages) + 3
