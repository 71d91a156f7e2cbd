"""No tool-call markup reaches a client: a reply cut right after a complete call, inside the
next call's opener (max_tokens), keeps the call and drops the cut-off opener, however short
the piece of it, streamed and whole. Text that merely holds the opener's first character
elsewhere ("a < b") is still text."""

import pytest

from kvshare.apis.chat_output import ChoiceOutput, OutputRules
from kvshare.toolcalls import get_format

CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
    "qwen35": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "</function>\n</tool_call>\n"),
    "lfm2": '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_cut_opener_after_a_call_is_dropped(name):
    fmt = get_format(name)
    for opener in fmt.openers:
        for n in range(1, len(opener)):
            tail = opener[:n]
            rules = OutputRules(tool_format=fmt)
            out = ChoiceOutput(rules)
            deltas = out.feed(CALLS[name]) + out.feed(tail) + out.finish()
            assert not [d for d in deltas if d.get("content")], (tail, deltas)
            assert out.has_calls
            msg, has_calls = ChoiceOutput.message(rules, CALLS[name] + tail)
            assert has_calls and not msg["content"], (tail, msg)
            assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def test_text_with_the_first_character_stays():
    rules = OutputRules(tool_format=get_format("hermes"))
    out = ChoiceOutput(rules)
    text = "".join(d.get("content", "") for d in out.feed("if a < b") + out.finish())
    assert text == "if a < b"
    assert ChoiceOutput.message(rules, "x <")[0]["content"] == "x <"
