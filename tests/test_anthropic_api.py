"""The Anthropic Messages API against a real server (`kvshare serve` on a loopback port, the
default Gemma 3 270M model), driven by the official `anthropic` SDK:

- `messages.create` with and without tools, `messages.stream` (text, and a forced tool use),
  streamed and whole replies agreeing, a tool round trip (tool_use -> tool_result -> answer),
  `messages.count_tokens` equal to the usage of the same request;
- errors as the SDK's typed exceptions (400s for a missing max_tokens, an unknown block type, a
  tool_result without its tool_use; 401 for a wrong x-api-key), the server serving on after each;
- prompt caching: a `cache_control`-marked long system prompt is created once and read after,
  also by a new server on the same `--cache-dir` after a graceful restart;
- a stream the client closes after its first text delta ends cleanly and the server serves on.

Greedy decoding (temperature 0) and small max_tokens throughout (the CI machine has 2 cores).
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tier_helpers import Server

anthropic = pytest.importorskip("anthropic")

KEY = "sk-ant-kvshare-test"
MODEL = "claude-kvshare-test"  # any name is served and echoed
TIMEOUT = 300.0
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _default_model() -> str:
    from kvshare.model.loader import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def server(launcher):
    s = Server(launcher, "--parallel", "2", "--kv-unified-per-slot", "2048", "--api-key", KEY,
               model=_default_model())
    yield s
    s.terminate()


def client(server, key: str = KEY):
    return anthropic.Anthropic(base_url=server.url, api_key=key, timeout=TIMEOUT, max_retries=0)


def nonce() -> str:
    return uuid.uuid4().hex[:8]


# The SDK dropped `temperature` from its signatures (newer Claude models take no sampling
# parameters); the API still takes it, and greedy decoding keeps these tests deterministic.
GREEDY = {"extra_body": {"temperature": 0}}


def create(c, **kw):
    args = {"model": MODEL, "max_tokens": 16, "messages": ASK, **GREEDY}
    args.update(kw)
    return c.messages.create(**args)


def assert_serves(c) -> None:
    r = create(c, max_tokens=4, messages=[{"role": "user", "content": f"Say hi. {nonce()}"}])
    assert r.type == "message" and r.usage.output_tokens >= 1


def blocks(message) -> list[dict]:
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if d["type"] == "tool_use":
            assert d.pop("id").startswith("toolu_")
        out.append(d)
    return out


def long_system(seed: str) -> str:
    """~700 tokens of varied prose, unique per seed (no other request shares its prefix)."""
    topics = ["harbour", "glacier", "orchard", "library", "volcano", "market", "observatory",
              "lighthouse", "vineyard", "monastery", "canyon", "railway", "meadow", "bazaar"]
    verbs = ["describes", "remembers", "questions", "celebrates", "measures", "sketches"]
    lines = [f"Session {seed}. You are a careful assistant for a travel guide."]
    for i in range(60):
        t, v = topics[(i * 5) % len(topics)], verbs[(i * 7) % len(verbs)]
        lines.append(f"Note {i}: the guide {v} the {t} number {i * 37 % 101} near the river.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- create / stream

def test_create_text(server):
    r = create(client(server), max_tokens=12)
    assert r.id.startswith("msg_") and r.model == MODEL and r.role == "assistant"
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.content and all(b.type == "text" and b.text.strip() for b in r.content)
    u = r.usage
    assert u.output_tokens >= 1 and u.input_tokens > 0
    assert u.cache_read_input_tokens is not None and u.cache_creation_input_tokens == 0


def test_create_with_forced_tool(server):
    # one call allowed: the grammar ends the turn after it
    r = create(client(server), max_tokens=64, tools=[WEATHER],
               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input.get("city"), str)
    # several allowed (this base model keeps calling): max_tokens cuts the reply; the complete
    # calls stay, and nothing of the cut-off one reaches the client
    r = create(client(server), max_tokens=32, tools=[WEATHER], tool_choice={"type": "any"})
    assert r.stop_reason in ("tool_use", "max_tokens")
    assert [b.type for b in r.content] and all(b.type == "tool_use" for b in r.content)
    named = create(client(server), max_tokens=48, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather",
                                "disable_parallel_tool_use": True})
    assert [b.type for b in named.content if b.type == "tool_use"] == ["tool_use"]


def test_stream_text_agrees_with_create(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = create(c, max_tokens=16, messages=msgs)
    with c.messages.stream(model=MODEL, max_tokens=16, messages=msgs, **GREEDY) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == "".join(b.text for b in final.content if b.type == "text")
    assert blocks(final) == blocks(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id.startswith("msg_") and final.model == MODEL


def test_stream_forced_tool_use(server):
    c = client(server)
    # one call: with parallel calls the small model starts another one until cut off (a call
    # cut off inside its arguments is the one place a stream and the whole reply differ)
    kw = dict(model=MODEL, max_tokens=48, messages=ASK, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "content_block_start" in kinds and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str)
    assert blocks(final) == blocks(whole)


def test_tool_round_trip(server):
    c = client(server)
    first = create(c, max_tokens=48, tools=[WEATHER],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    use = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK,
               {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                 for b in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id,
                    "content": "18 degrees Celsius and sunny"}]}]
    final = create(c, max_tokens=24, tools=[WEATHER], messages=history,
                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in final.content)
    assert final.usage.output_tokens >= 1
    # the history's prefix (up to the tool call) was reused from the first request
    assert final.usage.cache_read_input_tokens > 0
    # an error result and text after it in the same user turn
    history[-1]["content"] = [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                               "content": [{"type": "text", "text": "service unavailable"}]},
                              {"type": "text", "text": "Answer without the tool."}]
    again = create(c, max_tokens=8, tools=[WEATHER], messages=history)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens_matches_usage(server):
    c = client(server)
    system = f"You answer in one word. {nonce()}"
    n = c.messages.count_tokens(model=MODEL, system=system, messages=ASK, tools=[WEATHER])
    r = create(c, max_tokens=4, system=system, tools=[WEATHER])
    u = r.usage
    assert n.input_tokens == u.input_tokens + u.cache_read_input_tokens + \
        u.cache_creation_input_tokens
    plain = c.messages.count_tokens(model=MODEL, messages=ASK)
    assert 0 < plain.input_tokens < n.input_tokens


def test_stop_sequence(server):
    """A word of a greedy reply, given as a stop sequence, ends the same reply right before it
    (stop_reason "stop_sequence", the word not included)."""
    c = client(server)
    msgs = [{"role": "user", "content": "Describe a sunny day at the beach."}]
    probe = create(c, max_tokens=24, messages=msgs)
    text = "".join(b.text for b in probe.content if b.type == "text")
    words = [w for w in text.split() if len(w) >= 4 and text.index(w) > 0]
    assert words, text
    stop = words[len(words) // 2]
    r = create(c, max_tokens=24, messages=msgs, stop_sequences=["@@never@@", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    got = "".join(b.text for b in r.content if b.type == "text")
    assert got == text[:text.index(stop)].strip() or got == text[:text.index(stop)]
    with c.messages.stream(model=MODEL, max_tokens=24, messages=msgs, stop_sequences=[stop],
                           **GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert blocks(final) == blocks(r)


def test_structured_output(server):
    """`output_config.format` (json_schema) constrains the reply; the SDK's `parse` with a
    Pydantic model reads it back."""
    import pydantic

    class Weather(pydantic.BaseModel):
        city: str
        degrees: int

    c = client(server)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "degrees": {"type": "integer"}},
              "required": ["city", "degrees"], "additionalProperties": False}
    r = create(c, max_tokens=40, output_config={"format": {"type": "json_schema",
                                                           "schema": schema}})
    value = json.loads("".join(b.text for b in r.content if b.type == "text"))
    assert set(value) == {"city", "degrees"} and isinstance(value["degrees"], int)
    parsed = c.messages.parse(model=MODEL, max_tokens=40, messages=ASK, output_format=Weather,
                              **GREEDY)
    assert isinstance(parsed.parsed_output, Weather)


# --------------------------------------------------------------------------- errors

def test_missing_max_tokens(server):
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.post("/v1/messages", cast_to=anthropic.types.Message,
               body={"model": MODEL, "messages": ASK})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    assert_serves(c)


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "user", "content": [{"type": "hologram", "text": "hi"}]}], "hologram"),
    ([{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}], "image"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                    "content": "x"}]}], "toolu_nope"),
    ([{"role": "system", "content": "x"}], "role"),
])
def test_bad_requests(server, messages, needle):
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        create(c, messages=messages)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert needle in e.value.body["error"]["message"]
    assert_serves(c)


def test_bad_request_while_streaming(server):
    c = client(server)
    with (pytest.raises(anthropic.BadRequestError),
          c.messages.stream(model=MODEL, max_tokens=8, messages=ASK,
                            tools=[{"type": "web_search_20250305", "name": "web_search"}])):
        pass
    assert_serves(c)


def test_auth(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(client(server, key="sk-wrong"), max_tokens=4)
    assert e.value.status_code == 401
    assert isinstance(e.value.body, dict) and e.value.body.get("type") == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                      "messages": ASK}, timeout=TIMEOUT)
    assert r.status_code == 401
    assert_serves(client(server))  # the right x-api-key works


# --------------------------------------------------------------------------- prompt caching

def _cached_request(c, system: str):
    return create(c, max_tokens=4, system=[
        {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Which note mentions the glacier?"}])


def test_cache_control_prefix_is_read_back(server):
    c = client(server)
    system = long_system(nonce())
    first = _cached_request(c, system)
    u1 = first.usage
    prefix = u1.cache_creation_input_tokens + u1.cache_read_input_tokens
    total = u1.input_tokens + prefix
    assert total > 600
    assert u1.cache_creation_input_tokens > 0
    assert u1.cache_creation_input_tokens >= 0.8 * total  # the system prompt is most of it
    second = _cached_request(c, system)
    u2 = second.usage
    assert u2.cache_read_input_tokens >= 0.95 * prefix
    assert u2.cache_creation_input_tokens == 0
    assert u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens == total
    # a different question after the same system prompt reads the prefix too
    third = create(c, max_tokens=4, system=[
        {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": f"Which note mentions a canyon? {nonce()}"}])
    assert third.usage.cache_read_input_tokens >= 0.95 * prefix


def test_cache_survives_restart(launcher, tmp_path):
    system = long_system(nonce())
    args = ("--parallel", "1", "--ctx-size", "2048", "--cache-dir", str(tmp_path / "cache"))
    first_server = Server(launcher, *args, model=_default_model())
    try:
        u1 = _cached_request(client(first_server, key="unused"), system).usage
        prefix = u1.cache_creation_input_tokens + u1.cache_read_input_tokens
        assert u1.cache_creation_input_tokens > 0
    finally:
        assert first_server.terminate() == 0  # graceful: the disk writer drains
    second_server = Server(launcher, *args, model=_default_model())
    try:
        u2 = _cached_request(client(second_server, key="unused"), system).usage
        assert u2.cache_read_input_tokens >= 0.95 * prefix, (u1, u2)
    finally:
        second_server.terminate()


# --------------------------------------------------------------------------- interrupted stream

def test_interrupted_stream(server):
    c = client(server)
    stream = c.messages.create(model=MODEL, max_tokens=48, stream=True,
                               messages=[{"role": "user", "content": "Tell me a long story."}],
                               **GREEDY)
    seen = []
    for ev in stream:
        seen.append(ev.type)
        if ev.type == "content_block_delta":
            break
    stream.close()
    assert seen[0] == "message_start" and seen[-1] == "content_block_delta"
    # the server cancels the generation and frees its slot
    deadline = time.monotonic() + 60
    while True:
        cache = httpx.get(server.url + "/cache", headers={"x-api-key": KEY}, timeout=30).json()
        if cache["sequences"] == 0:
            break
        assert time.monotonic() < deadline, cache
        time.sleep(0.1)
    assert_serves(c)
