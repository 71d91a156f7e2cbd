"""server/chat_output.py: a reply's text read as an OpenAI message, whole and streamed (the
streamed deltas add up to the whole message), with reasoning split out and tool calls parsed."""

from __future__ import annotations

import json
import random

import pytest

from kvshare.apis.chat_output import ChoiceOutput, OutputRules
from kvshare.toolcalls import get_format

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
REPLIES = [
    "Just text, no calls.",
    CALL,
    "Let me check. " + CALL,
    CALL + "\n" + CALL.replace("Oslo", "Bergen"),
    "<think>the user wants weather</think>" + CALL,
    "<think>hmm</think>plain answer",
    CALL[:40],  # cut by max_tokens: stays text
]


def stream(rules: OutputRules, text: str, rng: random.Random) -> tuple[dict, bool]:
    out = ChoiceOutput(rules)
    deltas, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 7)
        deltas += out.feed(text[i:j])
        i = j
    deltas += out.finish()
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            acc = msg["tool_calls"].setdefault(c["index"], {"name": "", "arguments": ""})
            fn = c.get("function", {})
            acc["name"] += fn.get("name", "") or ""
            acc["arguments"] += fn.get("arguments", "") or ""
    return msg, out.has_calls


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("text", REPLIES)
def test_stream_adds_up_to_the_message(text, parallel):
    rules = OutputRules(tool_format=get_format("hermes", TOOLS), reasoning=True,
                        parallel_tool_calls=parallel)
    whole, calls = ChoiceOutput.message(rules, text)
    for seed in range(5):
        got, has_calls = stream(rules, text, random.Random(seed))
        assert has_calls == calls
        assert got["content"].strip() == (whole["content"] or "").strip()
        assert got["reasoning_content"] == (whole["reasoning_content"] or "")
        want = [(c["function"]["name"], c["function"]["arguments"])
                for c in whole.get("tool_calls", [])]
        assert [(c["name"], c["arguments"]) for _, c in sorted(got["tool_calls"].items())] == want
    if calls:
        assert whole["content"] in (None, "Let me check.")
        assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
        assert len(whole["tool_calls"]) == (1 if not parallel or text.count("<tool_call>") == 1
                                            else 2)
    assert "<tool_call>" not in (whole["content"] or "") or not calls


def test_no_tools_no_parsing():
    msg, calls = ChoiceOutput.message(OutputRules(), CALL)
    assert not calls and msg["content"] == CALL and "reasoning_content" not in msg
