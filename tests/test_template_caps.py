"""Chat template capabilities (kvshare.model.template_caps) found by render probes, and the
tool polyfill (kvshare.model.tool_polyfill) for templates without tool support: on the
templates of the test models, SmolLM2's, kvshare's built-in ones and public templates copied
into tests/data/templates/ (Qwen3, Llama 3.2, Gemma 3, Mistral, gpt-oss, a base model's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.model.chat_template import CHATML_TEMPLATE, GEMMA3_TEMPLATE, ChatTemplate
from kvshare.model.template_caps import TemplateCaps
from kvshare.model.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
T = DATA / "templates"


def _source(name: str) -> str:
    if name == "builtin-chatml":
        return CHATML_TEMPLATE
    if name == "builtin-gemma3":
        return GEMMA3_TEMPLATE
    if name.endswith(".gguf"):
        return Tokenizer.from_gguf(DATA / "models" / name).chat_template_source
    return (T / name).read_text()


# system role, tools, tool calls, object arguments, parallel calls, tool responses,
# generation prompt
EXPECTED = {
    "Qwen-Qwen3-0.6B.jinja": (1, 1, 1, 1, 1, 1, 1),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": (1, 1, 1, 1, 0, 1, 1),  # raises on 2 calls
    "google-gemma-3-it.jinja": (1, 0, 0, 0, 0, 0, 1),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": (1, 1, 1, 1, 1, 1, 0),
    "mistralai-Mistral-7B-Instruct-v0.1.jinja": (0, 0, 0, 0, 0, 0, 0),
    "openai-gpt-oss-120b.jinja": (1, 1, 1, 1, 0, 1, 1),  # renders the first call only
    "base-model.jinja": (1, 0, 0, 0, 0, 0, 0),
    "smollm2-135m-instruct.jinja": (1, 0, 0, 0, 0, 0, 1),
    "tiny-qwen3-chat.gguf": (1, 0, 0, 0, 0, 0, 1),
    "tiny-qwen35.gguf": (1, 0, 0, 0, 0, 0, 1),
    "tiny-lfm2.gguf": (1, 0, 0, 0, 0, 0, 1),
    "builtin-chatml": (1, 1, 1, 1, 1, 1, 1),
    "builtin-gemma3": (1, 1, 1, 1, 1, 1, 1),
}


def _template(name: str) -> ChatTemplate:
    return ChatTemplate(_source(name), bos_token="<s>", eos_token="</s>")


def test_every_public_template_is_covered():
    assert {p.name for p in T.glob("*.jinja")} <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_caps(name):
    caps = _template(name).caps
    assert caps == TemplateCaps(*map(bool, EXPECTED[name]))
    assert set(caps.as_dict()) == {
        "supports_system_role", "supports_tools", "supports_tool_calls",
        "supports_object_arguments", "supports_parallel_tool_calls",
        "supports_tool_responses", "supports_generation_prompt"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_polyfills_follow_the_caps(name):
    t = _template(name)
    expected = set()
    if not t.caps.system_role:
        expected.add("system_role")
    if not t.caps.tools:
        expected.add("tools")
    if not t.caps.tool_calls:
        expected |= {"tool_calls", "tool_responses"}
    if not t.caps.tool_responses:
        expected.add("tool_responses")
    assert set(t.polyfills) == expected


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Full-text search of the manual.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]
CALL_ID = "call9abcd"  # 9 characters, as Mistral's templates want
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "-3 C and snowing"},
]
NO_TOOLS = sorted(n for n, caps in EXPECTED.items() if not caps[1])


@pytest.mark.parametrize("name", NO_TOOLS)
def test_polyfilled_prompt_holds_the_tools_and_the_history(name):
    t = _template(name)
    prompt = t.render(HISTORY, tools=TOOLS)
    for tool in TOOLS:
        fn = tool["function"]
        assert json.dumps(fn["name"]) in prompt
        assert fn["description"] in prompt
        assert json.dumps(fn["parameters"]) in prompt
    assert "You are terse." in prompt and "Weather in Oslo?" in prompt
    # the call, in the generic format the model writes, and its result tied to it
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    result = json.dumps({"tool_response": {"name": "get_weather", "tool_call_id": CALL_ID,
                                           "content": "-3 C and snowing"}})
    assert prompt.index("Weather in Oslo?") < prompt.index(call) < prompt.index(result)


@pytest.mark.parametrize("name", NO_TOOLS)
def test_polyfilled_history_without_tools_still_shows_calls(name):
    prompt = _template(name).render(HISTORY)
    assert '"arguments": {"city": "Oslo"}' in prompt and "-3 C and snowing" in prompt
    assert "# Tools" not in prompt


def test_native_templates_render_tools_themselves():
    t = _template("Qwen-Qwen3-0.6B.jinja")
    assert t.polyfills == ()
    prompt = t.render(HISTORY, tools=TOOLS)
    assert "<tools>" in prompt and "<tool_call>" in prompt and "<tool_response>" in prompt
    assert "tool_response\": {" not in prompt


def test_system_role_polyfill_folds_it_into_the_first_user_turn():
    t = _template("mistralai-Mistral-7B-Instruct-v0.1.jinja")
    prompt = t.render([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == "<s>[INST] Be brief.\n\nHi [/INST]"


def test_parallel_calls_and_consecutive_results_in_one_user_turn():
    t = _template("google-gemma-3-it.jinja")  # roles must alternate: results share a turn
    msgs = [{"role": "user", "content": "Oslo and Rome?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                {"id": "b", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "cold"},
            {"role": "tool", "tool_call_id": "b", "content": "warm"}]
    prompt = t.render(msgs, tools=TOOLS)
    assert ('{"response": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]}'
            ) in prompt
    assert prompt.count("<start_of_turn>user") == 2  # the question, then both results
