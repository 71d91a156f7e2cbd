"""The harmony format (gpt-oss) read whole and streamed: llama.cpp's recorded replies
(tests/test-chat.cpp, "GPT-OSS format tests"), each streamed in many chunkings adding up to its
parse (reasoning included), and no partial markup at any cut of a reply."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvshare.apis.chat_output import ChoiceOutput, OutputRules
from kvshare.model.chat_template import ChatTemplate
from kvshare.toolcalls import collect, detect_format, get_format

LLAMA_CPP = "llama.cpp tests/test-chat.cpp (GPT-OSS format tests)"
SPECIAL = [{"type": "function", "function": {"name": "special_function", "parameters": {
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]}}}]
EDIT_ARGS = {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {",
             "replaceAll": False}
THINKING = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
HELLO = "Hello, world!\nWhat's up?"

# (text, content, reasoning, calls); all but the last four from llama.cpp
CASES = [
    ("<|channel|>final<|message|>" + HELLO, HELLO, "", []),
    ("<|channel|>commentary<|message|>" + HELLO, HELLO, "", []),
    (THINKING + "<|start|>assistant<|channel|>final<|message|>" + HELLO, HELLO, "I'm\nthinking",
     []),
    ("<|channel|>analysis<|message|>I'm\nthinking", "", "I'm\nthinking", []),
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "",
     [("special_function", {"arg1": 1})]),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "",
     [("special_function", {"arg1": 1})]),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
     "", "", [("special_function", {"arg1": 1})]),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "",
     [("special_function", {"arg1": 1})]),
    (THINKING + '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>'
     '{"arg1": 1}', "", "I'm\nthinking", [("special_function", {"arg1": 1})]),
    ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.edit <|constrain|>json<|message|>" + json.dumps(EDIT_ARGS), "",
     "Thinking about edit...", [("edit", EDIT_ARGS)]),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
     " to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'", "",
     "I will execute python to say hello", []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
     "<|channel|>commentary to=python <|constrain|>code<|message|>print(\"hello\")", "",
     "I will execute python to say hello", []),
    ("<|channel|>commentary to=assistant" + THINKING + "<|start|>assistant<|channel|>final"
     "<|message|>" + HELLO, HELLO, "I'm\nthinking", []),
    (THINKING + "<|start|>assistant<|channel|>commentary to=assistant<|channel|>final<|message|>"
     + HELLO, HELLO, "I'm\nthinking", []),
    # written here in the format: a call ended by <|call|> with text after it, two calls, a
    # plain reply, and invalid arguments (content as written)
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
     '<|start|>assistant<|channel|>commentary to=functions.g<|message|>{}', "", "",
     [("f", {"a": 1}), ("g", {})]),
    ("if a < b then", "if a < b then", "", []),
    ('<|channel|>commentary to=functions.f<|message|>{"a": 1,}<|end|>',
     '<|channel|>commentary to=functions.f<|message|>{"a": 1,}', "", []),
    ("<|channel|>final<|message|>x<|return|>", "x", "", []),
]


def _calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def _pieces(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)]
    for _ in range(10):
        pieces, i = [], 0
        while i < len(text):
            k = rng.choice((1, 2, 3, 5, 9))
            pieces.append(text[i:i + k])
            i += k
        out.append(pieces)
    return out


@pytest.mark.parametrize("text,content,reasoning,calls", CASES)
def test_parse_and_stream(text, content, reasoning, calls):
    fmt = get_format("harmony", SPECIAL)
    out = fmt.parse(text)
    assert (out.content, out.reasoning, _calls(out)) == (content, reasoning, calls)
    for pieces in _pieces(text, random.Random(text)):
        for incremental in (False, True):
            s = fmt.stream(incremental=incremental)
            deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
            got = collect(deltas)
            kept = [c for i, c in enumerate(got.tool_calls) if i not in s.broken_calls]
            assert got.content == content and _calls(got.__class__(got.content, kept)) == calls
            assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
            assert s.has_calls == bool(calls)


CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
MARKUP = ("<|", "|>", "to=functions", "commentary", "analysis<")


def test_no_partial_markup_at_any_cut():
    """Every prefix of a reply with reasoning and a call, and of the same reply followed by a
    second message: no markup in content or reasoning, and the call once its arguments are
    whole."""
    fmt = get_format("harmony")
    text = CALL + "<|end|><|start|>assistant<|channel|>final<|message|>Done."
    for n in range(len(text) + 1):
        cut = text[:n]
        out = fmt.parse(cut)
        assert not any(m in out.content + out.reasoning for m in MARKUP), cut
        s = fmt.stream()
        deltas = [d for ch in cut for d in s.feed(ch)] + s.finish()
        streamed = "".join(d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
        assert not any(m in streamed for m in MARKUP), cut
        if n >= len(CALL):
            assert _calls(out) == [("get_weather", {"city": "Paris"})], cut
        rules = OutputRules(tool_format=fmt)
        co = ChoiceOutput(rules)
        deltas = co.feed(cut) + co.finish()
        assert not any(m in d.get("content", "") for d in deltas for m in MARKUP)


def test_detect_and_render():
    src = (Path(__file__).parent / "data" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    assert detect_format(src) == "harmony"
    t = ChatTemplate(src)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = t.render(msgs, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "Weather.", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}}}}])
    assert out.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>'
        'commentary<|message|>"sunny"<|end|><|start|>assistant')
    # the rendered call reads back as the call
    call = out[out.rindex("<|start|>assistant to=") + len("<|start|>assistant"):
               out.rindex("<|call|>")]
    assert _calls(get_format("harmony").parse(call)) == [("get_weather", {"city": "Paris"})]
