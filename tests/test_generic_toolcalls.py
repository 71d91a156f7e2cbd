"""The `generic` tool-call format (kvshare.toolcalls.generic: the reply is one JSON object,
for templates whose tools are polyfilled), forced grammars that end after their last call,
and replies cut inside a call: the complete calls stand and no markup is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.constrain import TokenVocab, compile_grammar
from kvshare.model.tokenizer import Tokenizer
from kvshare.toolcalls import FORMATS, collect, get_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

ONE = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
TWO = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
       '{"name": "get_time", "arguments": {}}]}')
ANSWER = '{"response": "Hi \\"you\\"\\n\\u00e9 \\ud83d\\ude00"}'
BOTH = ('{"response": "Let me check.", "tool_calls": [{"name": "get_time", '
        '"arguments": "{}"}]}')

CASES = [
    (ONE, "", [("get_weather", {"city": "Paris"})]),
    (TWO, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (ANSWER, 'Hi "you"\né 😀', []),
    (BOTH, "Let me check.", [("get_time", {})]),
    ("  " + ONE + "\n", "", [("get_weather", {"city": "Paris"})]),
    # cut by max_tokens: complete calls stand, the cut one and its markup are gone
    (TWO[:-30], "", [("get_weather", {"city": "Paris"})]),
    (ONE[:-5], "", []),
    ('{"response": "cut he', "cut he", []),
    ('{"tool_', "", []),
    # not the format: content as written
    ("plain text", "plain text", []),
    ('{"other": 1}', '{"other": 1}', []),
]


def _calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse(text, content, calls):
    out = get_format("generic").parse(text)
    assert (out.content, _calls(out)) == (content, calls)


@pytest.mark.parametrize("text,content,calls", CASES)
@pytest.mark.parametrize("step", [1, 2, 7])
def test_stream_adds_up_to_parse(text, content, calls, step):
    s = get_format("generic").stream()
    deltas = []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i:i + step])
    deltas += s.finish()
    out = collect(deltas)
    assert (out.content, _calls(out)) == (content, calls)
    assert s.has_calls == bool(calls)


def test_response_text_streams_as_it_arrives():
    s = get_format("generic").stream()
    assert s.feed('{"response": "Hel') == [{"content": "Hel"}]
    assert s.feed('lo\\') == [{"content": "lo"}]  # an escape waits for its end
    assert s.feed('n"}') == [{"content": "\n"}]
    assert s.finish() == []


@pytest.fixture(scope="module")
def vocab():
    tok = Tokenizer.from_gguf(Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf")
    return tok, TokenVocab.from_tokenizer(tok, len(tok), [tok.token_to_id("<|im_end|>")])


def _run(vocab, grammar: str, text: str) -> tuple[bool, bool]:
    """(accepted, stopped): whether the grammar takes `text`, and whether it must end there."""
    tok, v = vocab
    m = compile_grammar(v, "lark", grammar).matcher()
    try:
        for t in tok.encode(text, add_special=False, parse_special=False):
            m.consume(t)
    except Exception:  # noqa: BLE001 - a token the grammar refuses
        return False, False
    return m.accepting, m.stopped


def test_generic_grammars(vocab):
    fmt = get_format("generic")
    forced, auto = fmt.grammar(TOOLS), fmt.auto_grammar(TOOLS)
    assert _run(vocab, forced, ONE) == (True, True)  # one call, then the turn must end
    assert _run(vocab, forced, TWO) == (True, True)
    assert _run(vocab, forced, '{"response": "hi"}')[0] is False
    assert _run(vocab, auto, '{"response": "hi"}') == (True, True)
    assert _run(vocab, auto, ONE) == (True, True)
    assert _run(vocab, fmt.grammar(TOOLS, parallel=False), TWO)[0] is False
    assert _run(vocab, fmt.grammar(TOOLS, "get_time"), ONE)[0] is False
    assert _run(vocab, fmt.response_grammar(), ONE)[0] is False
    three = TWO[:-2] + ', {"name": "get_time", "arguments": {}}]}'
    assert _run(vocab, fmt.grammar(TOOLS, max_calls=2), three)[0] is False
    assert _run(vocab, fmt.grammar(TOOLS, max_calls=3), three) == (True, True)


HERMES = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("most", [1, 2, 3])
def test_forced_grammars_end_after_max_calls(vocab, most):
    grammar = get_format("hermes").grammar(TOOLS, None, True, most)
    for n in range(1, most + 2):
        accepted, stopped = _run(vocab, grammar, "\n".join([HERMES] * n))
        assert accepted == (n <= most)
        assert stopped == (n == most)  # after the last call allowed, only the end is


@pytest.mark.parametrize("name", [f for f in FORMATS if f != "generic"])
def test_every_format_bounds_forced_calls(name):
    assert "{0,2}" in get_format(name).grammar(TOOLS, None, True, 3)
    assert "{0," not in get_format(name).grammar(TOOLS, None, False, 3)
