"""kvshare.toolcalls: each format's markup read whole (`parse`) and streamed (`stream`) from
recorded model outputs (llama.cpp's and vLLM's test fixtures, cited per case) and our own in the
exact format; every output streamed in many chunkings must add up to its `parse`; reasoning
split the same way; formats told from chat templates; and every format's grammar compiled with
kvshare's llguidance binding over a byte vocabulary, accepting valid calls and rejecting
invalid ones, and driving a random "model" whose output must parse into calls that follow the
schemas."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest

from kvshare.model.chat_template import CHATML_TEMPLATE, GEMMA3_TEMPLATE
from kvshare.toolcalls import (
    FORMATS,
    ReasoningSplitter,
    ToolFormat,
    allow_reasoning,
    collect,
    detect_format,
    get_format,
    prompt_opens_reasoning,
    template_has_thinking,
)

LLAMA_CPP = "llama.cpp tests/test-chat.cpp"
LLAMA_CPP_LFM2 = "llama.cpp tests/chat-parsers/test-lfm2.cpp"
VLLM_QWEN3CODER = "vLLM tests/tool_use/test_qwen3coder_tool_parser.py"
VLLM_PYTHONIC = "vLLM tests/entrypoints/openai/tool_parsers/test_pythonic_tool_parser.py"
OWN = "written here in the format"
QWEN_CODER = "Qwen2.5-Coder-0.5B-Instruct under kvshare, tool_choice auto"


def fn(name: str, params: dict | None = None) -> dict:
    out: dict = {"type": "function", "function": {"name": name}}
    if params is not None:
        out["function"]["parameters"] = params
    return out


def obj(props: dict, required=()) -> dict:
    return {"type": "object", "properties": props, "required": list(required)}


# ---- recorded outputs ---------------------------------------------------------------------


@dataclass
class Case:
    fmt: str
    name: str
    source: str
    text: str
    content: str
    calls: list = field(default_factory=list)  # (name, arguments as a Python value)
    tools: list | None = None
    # an incremental stream announces a call before the block turns out broken
    breaks: bool = False

    @property
    def id(self) -> str:
        return f"{self.fmt}-{self.name}"


WEATHER_FN = fn("get_weather", obj({"city": {"type": "string"}}, ["city"]))
SPECIAL = [fn("special_function", obj({"arg1": {"type": "integer"}}, ["arg1"]))]
HERMES_CALL = '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>'
NESTED_ARGS = {"code": 'if x: print("}</tool_call>{")', "nested": {"a": [1, {"b": "}"}], "c": "\\"}}
UNICODE_ARGS = {"city": "Zürich", "note": "晴れ ☀️ naïve \u2028 end"}

TRUNCATED = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'

HERMES = [
    Case("hermes", "single", LLAMA_CPP, HERMES_CALL, "", [("special_function", {"arg1": 1})]),
    Case("hermes", "text-before", LLAMA_CPP,
         "Hello, world!\nWhat's up?" + HERMES_CALL, "Hello, world!\nWhat's up?",
         [("special_function", {"arg1": 1})]),
    Case("hermes", "parallel", LLAMA_CPP,
         HERMES_CALL + '\n<tool_call>\n{"name": "python", "arguments": '
         '{"code":"print(\'hello\')"}}\n</tool_call>', "",
         [("special_function", {"arg1": 1}), ("python", {"code": "print('hello')"})]),
    Case("hermes", "escaped-newline", LLAMA_CPP,
         '<tool_call>\n{"name": "python", "arguments": '
         '{"code":"# This is a program:\\nprint(\'hey\')"}}\n</tool_call>', "",
         [("python", {"code": "# This is a program:\nprint('hey')"})]),
    Case("hermes", "no-newlines", LLAMA_CPP,
         '<tool_call>{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', "",
         [("special_function", {"arg1": 1})]),
    Case("hermes", "text-after", OWN,
         "Checking.\n\n" + HERMES_CALL + "\n\nIt is sunny.", "Checking.\n\nIt is sunny.",
         [("special_function", {"arg1": 1})]),
    Case("hermes", "call-then-text", OWN, HERMES_CALL + "\n\nIt is sunny.\n", "It is sunny.\n",
         [("special_function", {"arg1": 1})]),
    Case("hermes", "nested-json", OWN,
         "<tool_call>\n" + json.dumps({"name": "run", "arguments": NESTED_ARGS}) + "\n</tool_call>",
         "", [("run", NESTED_ARGS)]),
    Case("hermes", "unicode", OWN,
         "Voilà :\n<tool_call>\n" + json.dumps({"name": "météo", "arguments": UNICODE_ARGS},
                                               ensure_ascii=False) + "\n</tool_call>",
         "Voilà :", [("météo", UNICODE_ARGS)]),
    Case("hermes", "arguments-string", OWN,
         '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>', "",
         [("f", {"a": [1, 2]})]),
    Case("hermes", "keys-reversed", OWN,
         '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', "", [("f", {"a": 1})]),
    Case("hermes", "no-arguments", OWN, '<tool_call>\n{"name": "ping"}\n</tool_call>', "",
         [("ping", {})]),
    Case("hermes", "truncated", OWN, TRUNCATED, "Let me look.", breaks=True),
    Case("hermes", "truncated-before-name", OWN, '<tool_call>\n{"na', ""),
    Case("hermes", "invalid-json", OWN,
         '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>', breaks=True),
    Case("hermes", "not-json", OWN, "<tool_call>\nnot json\n</tool_call> ok",
         "<tool_call>\nnot json\n</tool_call> ok"),
    Case("hermes", "valid-then-truncated", OWN, HERMES_CALL + '\n<tool_call>\n{"name": "b"',
         "", [("special_function", {"arg1": 1})]),
    Case("hermes", "unknown-markup", OWN,
         "<tool_calls>[x]</tool_calls> a <tool_response>1</tool_response> <tool <",
         "<tool_calls>[x]</tool_calls> a <tool_response>1</tool_response> <tool <"),
    Case("hermes", "plain", LLAMA_CPP, "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?"),
    Case("hermes", "whitespace-only", OWN, "  \n", "  \n"),
    # calls without <tool_call> tags, as small Qwen models write them (Qwen2.5-Coder 0.5B's
    # replies under tool_choice auto) and as llama.cpp's Hermes 2 Pro parser reads them
    Case("hermes", "bare", QWEN_CODER, '{"name": "get_weather", "arguments": {"city": "Paris"}}',
         "", [("get_weather", {"city": "Paris"})]),
    Case("hermes", "fenced-pretty", QWEN_CODER,
         '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
         "", [("get_weather", {"city": "Paris"})]),
    Case("hermes", "text-then-fence", QWEN_CODER,
         'Here is the JSON object response:\n```json\n{\n  "name": "get_weather",\n  '
         '"arguments": {"city": "Paris"}\n}\n```', "Here is the JSON object response:",
         [("get_weather", {"city": "Paris"})]),
    # (an unfinished block right after a call goes with the reply's end, as a cut-off call)
    Case("hermes", "bare-then-cut-block", QWEN_CODER,
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n<tools>\n{"type": "f"',
         "", [("get_weather", {"city": "Paris"})]),
    Case("hermes", "bare-then-text", QWEN_CODER,
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n<tools> are done',
         "<tools> are done", [("get_weather", {"city": "Paris"})]),
    Case("hermes", "in-tags", LLAMA_CPP,
         '<function_call>{"name": "special_function", "arguments": {"arg1": 1}}</function_call>'
         ' <JSON>\n{"name": "python", "arguments": {}}\n</JSON> done', "done",
         [("special_function", {"arg1": 1}), ("python", {})]),
    Case("hermes", "fence-around-tags", LLAMA_CPP, "```xml\n" + HERMES_CALL + "\n```", "",
         [("special_function", {"arg1": 1})]),
    Case("hermes", "named-object-in-text", OWN,
         'Calling {"name": "f", "parameters": {"a": 1}} now', "Calling now", [("f", {"a": 1})]),
    Case("hermes", "bare-undeclared-tool", QWEN_CODER,
         '{"name": "get_weather_info", "arguments": {"city": "Paris"}}',
         '{"name": "get_weather_info", "arguments": {"city": "Paris"}}',
         tools=[fn("get_weather", obj({"city": {"type": "string"}}, ["city"]))]),
    Case("hermes", "fenced-json-answer", OWN, '```json\n{"name": "Bob", "age": 3}\n```',
         '```json\n{"name": "Bob", "age": 3}\n```'),
    Case("hermes", "code-fences", OWN, "Use this:\n```\nx = {1: 2}\n```\nand ```python\ny=1\n```",
         "Use this:\n```\nx = {1: 2}\n```\nand ```python\ny=1\n```"),
    Case("hermes", "json-object-answer", OWN, '{"answer": 42}', '{"answer": 42}'),
    Case("hermes", "fence-cut-at-name", OWN, 'Sure.\n```json\n{"na', "Sure."),
    # cut off inside arguments given as a string: still a call's markup, dropped
    Case("hermes", "bare-cut-in-string-arguments", QWEN_CODER,
         '{"name": "get_weather", "arguments": "city', "", tools=[WEATHER_FN]),
    # (a block that breaks before the cut is content as written, as any malformed block)
    Case("hermes", "bare-broken-then-cut", QWEN_CODER,
         '{"name": "get_weather", "arguments": `"Paris',
         '{"name": "get_weather", "arguments": `"Paris', tools=[WEATHER_FN]),
    Case("hermes", "named-cut-in-string-arguments", OWN,
         'Sure. {"name": "f", "arguments": "{\\"a\\": ', "Sure."),
    Case("hermes", "undeclared-cut-in-string-arguments", OWN,
         '{"name": "Bob", "arguments": "x', '{"name": "Bob", "arguments": "x',
         tools=[WEATHER_FN]),
    # a tag that nothing follows may still open a call: at the reply's end it goes
    Case("hermes", "tag-as-text", OWN, "x <tools> y <json>", "x <tools> y"),
]


def q35_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER_TOOLS = [
    fn("get_current_weather", obj({"city": {"type": "string"}, "state": {"type": "string"},
                                   "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}},
                                  ["city", "state"])),
    fn("calculate_area", obj({"shape": {"type": "string"}, "dimensions": {"type": "object"},
                              "precision": {"type": "integer"}})),
]
TYPES_TOOLS = [fn("test_types", obj({
    "int_param": {"type": "integer"}, "float_param": {"type": "float"},
    "bool_param": {"type": "boolean"}, "str_param": {"type": "string"},
    "obj_param": {"type": "object"}}))]
CODER_TOOLS = [
    fn("special_function", obj({"arg1": {"type": "integer"}}, ["arg1"])),
    fn("special_function_with_opt", obj({"arg1": {"type": "integer"}, "arg2": {"type": "integer"}},
                                        ["arg1"])),
    fn("python", obj({"code": {"type": "string"}}, ["code"])),
    fn("html", obj({"markup": {"type": "string"}}, ["markup"])),
    fn("todo_list", obj({"todos": {"type": "array", "items": {"type": "object"}}}, ["todos"])),
]
DALLAS = q35_call("get_current_weather", ("city", "Dallas"), ("state", "TX"),
                  ("unit", "fahrenheit"))
DALLAS_ARGS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
SPECIAL1 = q35_call("special_function", ("arg1", "1"))
HTML = "<html>\n <head>\n  <title>Hello!</title>\n </head>\n</html>"
TODOS = '[{"item": "Check stuff", "selected": false}, {"item": "Prepare stuff", "selected": true}]'

Q35_TRUNCATED = "Ok.\n<tool_call>\n<function=python>\n<parameter=code>\nprint("

QWEN35 = [
    Case("qwen35", "single", VLLM_QWEN3CODER, DALLAS, "", [("get_current_weather", DALLAS_ARGS)],
         WEATHER_TOOLS),
    Case("qwen35", "text-before", VLLM_QWEN3CODER,
         "Sure! Let me check the weather for you." + DALLAS,
         "Sure! Let me check the weather for you.",
         [("get_current_weather", DALLAS_ARGS)],
         WEATHER_TOOLS),
    Case("qwen35", "multiline-object", VLLM_QWEN3CODER,
         q35_call("calculate_area", ("shape", "rectangle"),
                  ("dimensions", '{"width": 10, \n "height": 20}'), ("precision", "2")), "",
         [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20},
                              "precision": 2})], WEATHER_TOOLS),
    Case("qwen35", "parallel", VLLM_QWEN3CODER,
         DALLAS + "\n" + q35_call("get_current_weather", ("city", "Orlando"), ("state", "FL"),
                                  ("unit", "fahrenheit")), "",
         [("get_current_weather", DALLAS_ARGS),
          ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})],
         WEATHER_TOOLS),
    Case("qwen35", "typed", VLLM_QWEN3CODER,
         q35_call("test_types", ("int_param", "42"), ("float_param", "3.14"),
                  ("bool_param", "true"), ("str_param", "hello world"),
                  ("obj_param", '{"key": "value"}')), "",
         [("test_types", {"int_param": 42, "float_param": 3.14, "bool_param": True,
                          "str_param": "hello world", "obj_param": {"key": "value"}})],
         TYPES_TOOLS),
    Case("qwen35", "no-tool-call-tag", VLLM_QWEN3CODER,
         "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
         "<parameter=state>\nTX\n</parameter>\n</function>", "",
         [("get_current_weather", {"city": "Dallas", "state": "TX"})], WEATHER_TOOLS),
    Case("qwen35", "integer", LLAMA_CPP, SPECIAL1, "", [("special_function", {"arg1": 1})],
         CODER_TOOLS),
    Case("qwen35", "stray-close", LLAMA_CPP,
         "<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
         "</tool_call>", "", [("special_function", {"arg1": 1})], CODER_TOOLS),
    Case("qwen35", "stray-close-text", LLAMA_CPP,
         "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n"
         "</function>\n</tool_call>", "Let me call it.", [("special_function", {"arg1": 1})],
         CODER_TOOLS),
    Case("qwen35", "parallel-opt", LLAMA_CPP,
         SPECIAL1 + "\n" + q35_call("special_function_with_opt", ("arg1", "1"), ("arg2", "2")), "",
         [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})],
         CODER_TOOLS),
    Case("qwen35", "unicode", LLAMA_CPP, q35_call("python", ("code", "格")), "",
         [("python", {"code": "格"})], CODER_TOOLS),
    Case("qwen35", "html-value", LLAMA_CPP, q35_call("html", ("markup", HTML)), "",
         [("html", {"markup": HTML})], CODER_TOOLS),
    Case("qwen35", "array-of-objects", LLAMA_CPP, q35_call("todo_list", ("todos", TODOS)), "",
         [("todo_list", {"todos": json.loads(TODOS)})], CODER_TOOLS),
    Case("qwen35", "markup-in-value", OWN,
         q35_call("python", ("code", "print('</function></tool_call><parameter=x>')\n  indented")),
         "", [("python", {"code": "print('</function></tool_call><parameter=x>')\n  indented"})],
         CODER_TOOLS),
    Case("qwen35", "no-params", OWN, "<tool_call>\n<function=ping>\n</function>\n</tool_call>", "",
         [("ping", {})]),
    Case("qwen35", "untyped-without-tools", OWN, q35_call("f", ("n", "42"), ("s", " x ")), "",
         [("f", {"n": "42", "s": " x "})]),
    Case("qwen35", "one-line", OWN,
         "<tool_call><function=get_weather><parameter=city>Beijing</parameter></function>"
         "</tool_call>", "", [("get_weather", {"city": "Beijing"})]),
    Case("qwen35", "two-functions-one-block", OWN,
         "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n"
         "<function=b>\n</function>\n</tool_call>", "", [("a", {"x": "1"}), ("b", {})]),
    Case("qwen35", "text-after", OWN, DALLAS + "\n\nDone.", "Done.",
         [("get_current_weather", DALLAS_ARGS)], WEATHER_TOOLS),
    Case("qwen35", "truncated", OWN, Q35_TRUNCATED, "Ok.", tools=CODER_TOOLS, breaks=True),
    Case("qwen35", "no-function", OWN, "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
         "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>"),
    Case("qwen35", "bad-typed-value", OWN, q35_call("special_function", ("arg1", "one")), "",
         [("special_function", {"arg1": "one"})], CODER_TOOLS),
    Case("qwen35", "plain", OWN, "Hi <b>x</b> <function <tool", "Hi <b>x</b> <function"),
]

SIMPLE = "get_weather(city='San Francisco', metric='celsius')"
SIMPLE_ARGS = {"city": "San Francisco", "metric": "celsius"}
MORE_TYPES = ("register_user(name='John Doe', age=37, "
              "address={'city': 'San Francisco', 'state': 'CA'}, "
              "role=None, passed_test=True, aliases=['John', 'Johnny'])")
MORE_TYPES_ARGS = {"name": "John Doe", "age": 37,
                   "address": {"city": "San Francisco", "state": "CA"},
                   "role": None, "passed_test": True, "aliases": ["John", "Johnny"]}


def lfm(body: str) -> str:
    return f"<|tool_call_start|>[{body}]<|tool_call_end|>"


LFM2 = [
    Case("lfm2", "json-single", LLAMA_CPP_LFM2,
         lfm('{"name": "special_function", "arguments": {"arg1": 1}}'), "",
         [("special_function", {"arg1": 1})]),
    Case("lfm2", "json-parallel", LLAMA_CPP_LFM2,
         lfm('{"name": "get_weather", "arguments": {"location": "Paris"}}, '
             '{"name": "get_time", "arguments": {"timezone": "UTC"}}'), "",
         [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "UTC"})]),
    Case("lfm2", "json-text-before", LLAMA_CPP_LFM2,
         "Let me check the weather for you."
         + lfm('{"name": "get_weather", "arguments": {"location": "Paris"}}'),
         "Let me check the weather for you.", [("get_weather", {"location": "Paris"})]),
    Case("lfm2", "json-text-after", LLAMA_CPP_LFM2,
         lfm('{"name": "get_weather", "arguments": {"location": "Paris"}}') + "Here's the result.",
         "Here's the result.", [("get_weather", {"location": "Paris"})]),
    Case("lfm2", "json-newlines", LLAMA_CPP_LFM2,
         lfm('{\n    "name": "get_current_time",\n    "arguments": {\n        "location": "Paris"\n'
             '    }\n}'), "", [("get_current_time", {"location": "Paris"})]),
    Case("lfm2", "simple", VLLM_PYTHONIC, lfm(SIMPLE), "", [("get_weather", SIMPLE_ARGS)]),
    Case("lfm2", "more-types", VLLM_PYTHONIC, lfm(MORE_TYPES), "",
         [("register_user", MORE_TYPES_ARGS)]),
    Case("lfm2", "parameterless", VLLM_PYTHONIC, lfm("get_weather()"), "", [("get_weather", {})]),
    Case("lfm2", "empty-dict", VLLM_PYTHONIC, lfm("do_something_cool(additional_data={})"), "",
         [("do_something_cool", {"additional_data": {}})]),
    Case("lfm2", "empty-list", VLLM_PYTHONIC, lfm("do_something_cool(steps=[])"), "",
         [("do_something_cool", {"steps": []})]),
    Case("lfm2", "escaped-string", VLLM_PYTHONIC,
         lfm(r"get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')"), "",
         [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    Case("lfm2", "parallel", VLLM_PYTHONIC, lfm(f"{SIMPLE}, {MORE_TYPES}"), "",
         [("get_weather", SIMPLE_ARGS), ("register_user", MORE_TYPES_ARGS)]),
    Case("lfm2", "docs-example", "Liquid AI LFM2.5 model card (tool use)",
         lfm('get_candidate_status(candidate_id="12345")') + "Checking the candidate now.",
         "Checking the candidate now.", [("get_candidate_status", {"candidate_id": "12345"})]),
    Case("lfm2", "raw-newline-in-string", OWN, lfm("write(path='a.txt', text='line1\nline2')"), "",
         [("write", {"path": "a.txt", "text": "line1\nline2"})]),
    Case("lfm2", "json-dict-value", OWN, lfm('update(opts={"dry_run": true, "n": null}, k=1.5)'),
         "", [("update", {"opts": {"dry_run": True, "n": None}, "k": 1.5})]),
    Case("lfm2", "tricky-strings", OWN,
         lfm("search(q='a, b) c]', n=-2, m=[[1, 2], {'k': (3, 4)}])"), "",
         [("search", {"q": "a, b) c]", "n": -2, "m": [[1, 2], {"k": [3, 4]}]})]),
    Case("lfm2", "unicode", OWN,
         lfm("traduire(texte='naïve 晴れ ☀️', langue=\"日本語\")") + "\nVoilà.", "Voilà.",
         [("traduire", {"texte": "naïve 晴れ ☀️", "langue": "日本語"})]),
    Case("lfm2", "spaces", OWN,
         "<|tool_call_start|> [ f( a = 1 , b = 'x' , ) , g() ] <|tool_call_end|>", "",
         [("f", {"a": 1, "b": "x"}), ("g", {})]),
    Case("lfm2", "empty-list-of-calls", OWN, lfm(""), ""),
    Case("lfm2", "truncated", OWN, "Sure." + "<|tool_call_start|>[get_weather(city='Par",
         "Sure.", breaks=True),
    Case("lfm2", "positional", OWN, lfm('f("x")'), lfm('f("x")'), breaks=True),
    Case("lfm2", "set-literal", OWN, lfm("f(x={1, 2})"), lfm("f(x={1, 2})"), breaks=True),
    Case("lfm2", "no-list", OWN, "<|tool_call_start|>f()<|tool_call_end|>",
         "<|tool_call_start|>f()<|tool_call_end|>"),
    Case("lfm2", "unknown-markup", OWN, "<|tool_list_start|>[]<|tool_list_end|> <|tool",
         "<|tool_list_start|>[]<|tool_list_end|>"),
]

LLAMA3_CALL = '{"name": "special_function", "parameters": {"arg1": 1}}'
LLAMA3 = [
    Case("llama3", "single", LLAMA_CPP, LLAMA3_CALL, "", [("special_function", {"arg1": 1})]),
    Case("llama3", "plain", LLAMA_CPP, "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?"),
    Case("llama3", "python-tag", OWN,
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
         [("get_weather", {"city": "Paris"})]),
    Case("llama3", "text-then-python-tag", OWN,
         'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
         "Let me check.", [("get_weather", {"city": "Paris"})]),
    Case("llama3", "type-function", OWN,
         '{"type": "function", "name": "f", "parameters": {"a": [1, {"b": "}"}]}}', "",
         [("f", {"a": [1, {"b": "}"}]})]),
    Case("llama3", "parallel", OWN, LLAMA3_CALL + '; {"name": "g", "parameters": {}}', "",
         [("special_function", {"arg1": 1}), ("g", {})]),
    Case("llama3", "parallel-newline", OWN,
         "\n" + LLAMA3_CALL + '\n{"name": "g", "arguments": {"x": "é"}}', "",
         [("special_function", {"arg1": 1}), ("g", {"x": "é"})]),
    Case("llama3", "call-then-text", OWN, LLAMA3_CALL + "\nDone.", "Done.",
         [("special_function", {"arg1": 1})]),
    Case("llama3", "json-answer", OWN, '{"answer": 42}', '{"answer": 42}'),
    Case("llama3", "name-only", OWN, '{"name": "Bob"}', '{"name": "Bob"}'),
    Case("llama3", "braces-in-text", OWN, "Use {name} here {", "Use {name} here {"),
    Case("llama3", "brace-prose", OWN, "{name} is a placeholder", "{name} is a placeholder"),
    Case("llama3", "truncated", OWN, '{"name": "get_weather", "parameters": {"city": "Pa',
         "", breaks=True),
    Case("llama3", "truncated-string-parameters", OWN,
         '{"name": "get_weather", "parameters": "{\\"city', ""),
    Case("llama3", "invalid-json", OWN, '{"name": "f", "parameters": {"a": 1,}}',
         '{"name": "f", "parameters": {"a": 1,}}', breaks=True),
    Case("llama3", "python-tag-builtin", OWN, "<|python_tag|>brave_search.call(query=\"x\")",
         "<|python_tag|>brave_search.call(query=\"x\")"),
    Case("llama3", "unicode", OWN,
         json.dumps({"name": "météo", "parameters": UNICODE_ARGS}, ensure_ascii=False), "",
         [("météo", UNICODE_ARGS)]),
]

CASES = HERMES + QWEN35 + LFM2 + LLAMA3


def _calls(parsed) -> list:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _fmt(case: Case) -> ToolFormat:
    return get_format(case.fmt, case.tools)


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)]
    for _ in range(12):
        pieces, i = [], 0
        while i < len(text):
            k = rng.choice((1, 2, 3, 4, 7, 16))
            pieces.append(text[i:i + k])
            i += k
        out.append(pieces)
    for cut in range(1, len(text), max(1, len(text) // 12)):  # every two-piece split, sampled
        out.append([text[:cut], text[cut:]])
    return out


def _stream(fmt: ToolFormat, pieces: list[str], incremental: bool):
    s = fmt.stream(incremental=incremental)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    return s, deltas


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parse(case: Case):
    out = _fmt(case).parse(case.text)
    assert out.content == case.content
    assert _calls(out) == case.calls
    for call in out.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


def _check_deltas(deltas: list[dict]) -> None:
    seen: set[int] = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"})
        if "content" in d:
            assert d["content"]
            continue
        (tc,) = d["tool_calls"]
        if tc["index"] not in seen:
            assert tc["index"] == len(seen)
            assert tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["name"] and tc["function"]["arguments"] == ""
            seen.add(tc["index"])
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["function"]["arguments"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_stream_adds_up_to_parse(case: Case):
    fmt = _fmt(case)
    want = fmt.parse(case.text)
    rng = random.Random(case.id)
    broke = False
    for pieces in _chunkings(case.text, rng):
        for incremental in (False, True):
            s, deltas = _stream(fmt, pieces, incremental)
            _check_deltas(deltas)
            got = collect(deltas)
            assert got.content == want.content
            kept = [c for i, c in enumerate(got.tool_calls) if i not in s.broken_calls]
            assert [(c.name, c.arguments) for c in kept] == [
                (c.name, c.arguments) for c in want.tool_calls]
            assert s.has_calls == bool(want.tool_calls)
            if s.broken_calls:
                assert incremental
                broke = True
    assert broke == case.breaks


# the formats models are trained on; the polyfill's JSON format (generic) has its own tests
# (test_generic_toolcalls.py): it has no markup and its auto grammar allows no free text
MARKUP_FORMATS = tuple(f for f in FORMATS if f != "generic")

# pieces of markup, JSON and text each format's random outputs are made of
FUZZ_PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "\n", " ", '{"name": "f", "arguments": ', '{"a": 1}',
               "}", '"x}"', "<tool", "_call>", "abc", '{"arguments": {}, "name": "g"}', '"', "\\",
               "[", "]", ",", ":", "é", "<", "{"],
    "qwen35": ["<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>",
               "<parameter=a>", "<parameter=n>", "</parameter>", "\n", " ", "1", "x", "<", "/",
               "é", '{"k": 1}', "</para", "meter>"],
    "lfm2": ["<|tool_call_start|>", "<|tool_call_end|>", "[", "]", "f(", "g()", ")", "a=", "1",
             "'x'", '"y"', ",", " ", "\n", "{", "}", "'", "<|tool", "True", "x=[1, (2, 3)]", "\\"],
    "llama3": ["<|python_tag|>", '{"name": "f", "parameters": ', '{"a": 1}', "}", "; ", "\n", " ",
               "{", "text", '"', ":", '{"type": "function", ', '"name": "g", ', '"parameters": {}}'],
    "harmony": ["<|channel|>", "analysis", "final", "commentary", " to=functions.f", " to=python",
                " to=assistant", " <|constrain|>json", " json", "<|message|>", "<|end|>",
                "<|call|>", "<|return|>", "<|start|>", "assistant", '{"a": 1}', "{", "}", "x",
                "\n", " ", "<|", "<|chan", "<", "é"],
}


@pytest.mark.parametrize("fmt", MARKUP_FORMATS)
def test_stream_adds_up_to_parse_on_random_markup(fmt):
    """Random mixes of markup pieces, valid and broken: never an exception, and every chunking
    of every text adds up to its parse (broken announced calls aside)."""
    rng = random.Random(fmt)
    f = get_format(fmt, [fn("f", obj({"a": {"type": "string"}, "n": {"type": "integer"}}))])
    for _ in range(150):
        text = "".join(rng.choice(FUZZ_PIECES[fmt]) for _ in range(rng.randint(1, 24)))
        want = f.parse(text)
        for c in want.tool_calls:
            assert isinstance(json.loads(c.arguments), dict)
        for _ in range(3):
            pieces, i = [], 0
            while i < len(text):
                k = rng.choice((1, 1, 2, 5, 30))
                pieces.append(text[i:i + k])
                i += k
            for incremental in (False, True):
                s, deltas = _stream(f, pieces, incremental)
                got = collect(deltas)
                assert got.content == want.content, text
                kept = [(c.name, c.arguments) for i, c in enumerate(got.tool_calls)
                        if i not in s.broken_calls]
                assert kept == [(c.name, c.arguments) for c in want.tool_calls], text


def test_reasoning_then_calls():
    """The server's pipeline: the splitter's content goes to the tool-call stream."""
    text = "<think>\nI could call <tool_call> here.\n</think>\n\nSure.\n" + HERMES_CALL
    rng = random.Random(0)
    for pieces in _chunkings(text, rng):
        split, calls = ReasoningSplitter(), get_format("hermes").stream()
        reasoning, deltas = [], []
        for p in pieces + [None]:
            r, c = split.feed(p) if p is not None else split.finish()
            reasoning.append(r)
            deltas += calls.feed(c) if p is not None else calls.feed(c) + calls.finish()
        out = collect(deltas)
        assert "".join(reasoning) == "I could call <tool_call> here."
        assert out.content == "Sure." and _calls(out) == [("special_function", {"arg1": 1})]


def test_stream_holds_back_openers():
    s = get_format("hermes").stream()
    assert s.feed("Hi there <tool") == [{"content": "Hi there"}]
    assert s.feed("_ca") == []
    out = s.feed('ll>\n{"name": "f", "arguments": {"a": ')
    assert out[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert out[1]["tool_calls"][0]["function"] == {"arguments": '{"a": '}  # as it comes
    assert s.feed('"x"}}\n</tool_') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}]
    assert s.feed("call>  ") == []
    assert s.feed(" ok") == [{"content": "   ok"}]  # content was sent before: spaces stay
    assert s.finish() == [] and s.has_calls

    s = get_format("hermes").stream()
    assert s.feed("a <tool") == [{"content": "a"}]
    assert s.feed("box>") == [{"content": " <toolbox>"}]
    s = get_format("hermes").stream()  # a lenient opener: text unless a call follows
    assert s.feed("a <tools>") == [{"content": "a"}]
    assert s.feed("x") == [{"content": " <tools>x"}]

    s = get_format("lfm2").stream()
    assert s.feed("x<|tool_call_") == [{"content": "x"}]
    assert s.finish() == []  # an opener cut off at the end is dropped

    s = get_format("llama3").stream()
    assert s.feed("  ") == []  # could still be a call
    assert s.feed("{") == []
    assert s.feed('"answer": 1}') == [{"content": '  {"answer": 1}'}]


def test_qwen35_string_values_stream_as_they_arrive():
    s = get_format("qwen35", CODER_TOOLS).stream()
    out = collect(s.feed("<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n"))
    assert out.tool_calls[0].arguments == '{"code": "print(1)'  # the newline may still be the last
    out = collect(s.feed("x\n</param"))
    assert out.tool_calls[0].arguments == "\\nx"
    out = collect(s.feed("eter>\n</function>\n</tool_call>") + s.finish())
    assert out.tool_calls[0].arguments == '"}'


def test_unknown_format():
    with pytest.raises(ValueError, match="hermes.*qwen35.*lfm2.*llama3.*harmony"):
        get_format("nope")
    assert FORMATS == ("hermes", "qwen35", "lfm2", "llama3", "harmony", "generic")
    qwen = get_format("qwen35").with_tools(CODER_TOOLS)
    assert qwen.param_schema("python", "code") == {"type": "string"}


# ---- reasoning ----------------------------------------------------------------------------

REASONING = [
    # (text, in_reasoning, reasoning, content); the first five from llama.cpp tests/test-chat.cpp
    ("<think>I'm\nthinking</think>Hello, world!\nWhat's up?", False, "I'm\nthinking",
     "Hello, world!\nWhat's up?"),
    ("I'm\nthinking</think>Hello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?"),
    ("<think><tool_call>nah uhg</tool_call>", False, "<tool_call>nah uhg</tool_call>", ""),
    ("Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?"),
    ("I'm\nthinking</think>\n" + HERMES_CALL, True, "I'm\nthinking", HERMES_CALL),
    ("\n<think>\n\n  a </thinking> b\n\n</think>\n\n  answer ", False, "a </thinking> b",
     "answer "),
    ("<think>abc </th", False, "abc </th", ""),
    ("<thinking>no</thinking>", False, "", "<thinking>no</thinking>"),
    ("  <thi", False, "", "  <thi"),
    ("", True, "", ""),
    ("x <think>y</think>", False, "", "x <think>y</think>"),
]


@pytest.mark.parametrize("text,opened,reasoning,content", REASONING)
def test_reasoning_splitter(text, opened, reasoning, content):
    assert ReasoningSplitter(in_reasoning=opened).split(text) == (reasoning, content)
    rng = random.Random(text)
    for pieces in _chunkings(text, rng):
        s = ReasoningSplitter(in_reasoning=opened)
        parts = [s.feed(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)


def test_reasoning_helpers():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert template_has_thinking("{%- if enable_thinking is defined and not enable_thinking %}")
    assert not template_has_thinking(CHATML_TEMPLATE)
    assert not template_has_thinking(None)


# ---- format detection ---------------------------------------------------------------------

# the snippets that decide, from the real templates (Qwen3-Coder / Qwen3.5 chat_template.jinja,
# llama.cpp models/templates/LFM2.5-8B-A1B.jinja and llama-cpp-lfm2.jinja, Qwen2.5's template,
# Llama 3.1's template)
QWEN35_TEMPLATE = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                   "{%- for args_name, args_value in tool_call.arguments|items %}"
                   "{{- '<parameter=' + args_name + '>\\n' }}")
LFM25_TEMPLATE = ('{{- "<|tool_call_start|>[" + (tool_calls_ns.tool_calls | join(", ")) + '
                  '"]<|tool_call_end|>" -}}')
LFM2_TEMPLATE = ('{%- set ns.system_prompt = ns.system_prompt + '
                 '"List of tools: <|tool_list_start|>[" -%}')
QWEN25_TEMPLATE = ('{{- "\\n</tools>\\n\\nFor each function call, return a json object with '
                   'function name and arguments within <tool_call></tool_call> XML tags:'
                   '\\n<tool_call>" }}')
LLAMA31_TEMPLATE = ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
                    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
                    "{{- '<|python_tag|>' }}")


@pytest.mark.parametrize("source,expected", [
    (QWEN35_TEMPLATE, "qwen35"), (LFM25_TEMPLATE, "lfm2"), (LFM2_TEMPLATE, "lfm2"),
    (QWEN25_TEMPLATE, "hermes"), (LLAMA31_TEMPLATE, "llama3"), (GEMMA3_TEMPLATE, "hermes"),
    (CHATML_TEMPLATE, "hermes"), (None, "hermes"), ("{{ messages }}", "hermes"),
    ("<|start_header_id|>{{ m }}", "hermes"),
])
def test_detect_format(source, expected):
    assert detect_format(source) == expected


# ---- grammars -----------------------------------------------------------------------------

constrain = pytest.importorskip("kvshare.constrain",
                                reason="the kvshare._core binding is not built")
np = pytest.importorskip("numpy")


class ByteVocab:
    """A vocabulary of the 256 bytes, LFM2's and Llama's special tokens, and a few tags as
    plain-text tokens as Qwen has them (so a literal may be produced by one token or by bytes)."""

    SPECIALS = ["<|eos|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|python_tag|>",
                "<|think|>", "<|/think|>"]
    # (gpt-oss's markers are user-defined tokens, plain text, as kvshare's tokenizer makes them)
    WORDS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "</parameter>", "<|start|>",
             "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"]

    def __init__(self):
        self.pieces = [bytes([i]) for i in range(256)]
        self.pieces += [s.encode() for s in self.SPECIALS + self.WORDS]
        self.eos = 256
        self._split = re.compile("(" + "|".join(map(re.escape, self.SPECIALS + self.WORDS)) + ")")

    def __len__(self) -> int:
        return len(self.pieces)

    def token_to_bytes(self, i: int, special: bool = True) -> bytes:
        return self.pieces[i]

    def is_special(self, i: int) -> bool:
        return 256 <= i < 256 + len(self.SPECIALS)

    def encode(self, text: str, rng: random.Random | None = None) -> list[int]:
        out: list[int] = []
        for part in self._split.split(text):
            if part in self.SPECIALS:
                out.append(256 + self.SPECIALS.index(part))
            elif part in self.WORDS and (rng is None or rng.random() < 0.5):
                out.append(256 + len(self.SPECIALS) + self.WORDS.index(part))
            else:
                out.extend(part.encode())
        return out

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids if i != self.eos).decode()


BYTES = ByteVocab()


@pytest.fixture(scope="module")
def vocab():
    return constrain.TokenVocab.from_tokenizer(BYTES, len(BYTES), BYTES.eos)


def accepts(vocab, grammar: str, text: str, seed: int = 0) -> bool:
    m = constrain.compile_grammar(vocab, "lark", grammar).matcher()
    for t in BYTES.encode(text, random.Random(seed)):
        try:
            m.consume(t)
        except constrain.GrammarError:
            return False
    return m.accepting


def render(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls written the way each format's template writes them."""
    if fmt == "hermes":
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a},
                                                      ensure_ascii=False) + "\n</tool_call>"
                         for n, a in calls)
    if fmt == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)
    if fmt == "harmony":  # gpt-oss's own form (the template renders the recipient first)
        return "<|end|><|start|>assistant".join(
            f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
            + json.dumps(a, ensure_ascii=False) for n, a in calls)
    if fmt == "qwen35":
        def value(v):
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        return "\n".join(q35_call(n, *[(k, value(v)) for k, v in a.items()]) for n, a in calls)

    def py(v):
        if isinstance(v, str):
            return "'" + v + "'"
        if isinstance(v, (dict, list)):
            return json.dumps(v, ensure_ascii=False)
        return repr(v)
    return lfm(", ".join(f"{n}(" + ", ".join(f"{k}={py(v)}" for k, v in a.items()) + ")"
                         for n, a in calls))


NODE = obj({"v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, ["v"])
GRAMMAR_TOOLS = [
    fn("get_weather", obj({"city": {"type": "string"},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          ["city"])),
    fn("create_event", obj({
        "title": {"type": "string"},
        "attendees": {"type": "array", "items": obj({"name": {"type": "string"},
                                                     "email": {"type": "string"}}, ["name"])},
        "location": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                         "lon": {"type": "number"}}, ["lat", "lon"]),
        "public": {"type": "boolean"},
        "note": {"type": ["string", "null"]}}, ["title", "location"])),
    fn("ping"),
    fn("anything", {"type": "object"}),
    fn("tree", {**obj({"root": {"$ref": "#/$defs/node"}}, ["root"]), "$defs": {"node": NODE}}),
]
EVENT = {"title": "Lunch", "attendees": [{"name": "Ann", "email": "a@x.org"}, {"name": "Bo"}],
         "location": {"lat": 48.85, "lon": 2.35}, "public": True}
VALID = [
    [("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"})],
    [("get_weather", {"city": "Zürich 晴れ"})],
    [("create_event", EVENT)],
    [("create_event", {"title": "x", "location": {"lat": -90, "lon": 0}, "note": None})],
    [("ping", {})],
    [("tree", {"root": {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}})],
    [("ping", {}), ("get_weather", {"city": "Oslo"})],
    [("anything", {"x": "1", "y_2": "two words"})],
    [("anything", {})],
]
INVALID = [
    [("get_wether", {"city": "Paris"})],  # wrong name
    [("get_weather", {"days": 3})],  # required field missing
    [("get_weather", {"city": "Paris", "days": 9})],  # integer out of range
    [("get_weather", {"city": "Paris", "days": 2.5})],  # not an integer
    [("get_weather", {"city": "Paris", "unit": "kelvin"})],  # not in the enum
    [("create_event", {"title": "x", "location": {"lat": 91, "lon": 0}})],  # number out of range
    [("create_event", {"title": "x", "location": {"lat": 1}})],  # nested required field missing
    [("create_event", {"title": "x", "location": {"lat": 1, "lon": 2}, "public": "yes"})],  # type
    [("tree", {"root": {"kids": [{"v": 2}]}})],  # required field missing through $ref
    [("ping", {"x": "1"})],  # declared without parameters: takes none
]


@pytest.mark.parametrize("fmt", MARKUP_FORMATS)
def test_grammar_accepts_valid_calls(vocab, fmt):
    f = get_format(fmt, GRAMMAR_TOOLS)
    required = f.grammar(GRAMMAR_TOOLS)
    single = f.grammar(GRAMMAR_TOOLS, parallel=False)
    auto = f.auto_grammar(GRAMMAR_TOOLS)
    for calls in VALID:
        text = render(fmt, calls)
        assert _calls(f.parse(text)) == calls, text
        for seed in range(2):
            assert accepts(vocab, required, text, seed), text
            if auto is not None:
                assert accepts(vocab, auto, text, seed), text
        assert accepts(vocab, single, text) == (len(calls) == 1)
        name = calls[0][0]
        assert accepts(vocab, f.grammar(GRAMMAR_TOOLS, choice=name), text) == (len(calls) == 1)
        other = "ping" if name != "ping" else "get_weather"
        assert not accepts(vocab, f.grammar(GRAMMAR_TOOLS, choice=other), text)


@pytest.mark.parametrize("fmt", MARKUP_FORMATS)
def test_grammar_rejects_invalid_calls(vocab, fmt):
    f = get_format(fmt, GRAMMAR_TOOLS)
    required, auto = f.grammar(GRAMMAR_TOOLS), f.auto_grammar(GRAMMAR_TOOLS)
    for calls in INVALID:
        text = render(fmt, calls)
        assert not accepts(vocab, required, text), text
        if auto is not None:
            assert not accepts(vocab, auto, "Sure.\n" + text if fmt != "llama3" else text), text
    valid = render(fmt, VALID[0])
    assert not accepts(vocab, required, "Sure! " + valid)  # nothing but calls
    assert not accepts(vocab, required, "")
    assert not accepts(vocab, required, valid[:-3])


@pytest.mark.parametrize("fmt", MARKUP_FORMATS)
def test_auto_grammar_allows_text(vocab, fmt):
    f = get_format(fmt, GRAMMAR_TOOLS)
    auto = f.auto_grammar(GRAMMAR_TOOLS)
    assert auto is not None
    # harmony: the text is the final channel's, and a call follows a preamble message
    final = "<|channel|>final<|message|>" if fmt == "harmony" else ""
    for text in ("", "Hello, world!\nWhat's up? Use {braces} and <b>tags</b>.", "Paris: 12 °C"):
        assert accepts(vocab, auto, final + text), text
    if fmt == "harmony":
        assert accepts(vocab, auto, "<|channel|>commentary<|message|>Let me check.<|end|>"
                       "<|start|>assistant" + render(fmt, VALID[0]))
        assert not accepts(vocab, auto, "Hello")
    elif fmt != "llama3":  # llama3: a call is the whole reply
        assert accepts(vocab, auto, "Let me check.\n" + render(fmt, VALID[0]) + "\nDone.")


@pytest.mark.parametrize("fmt", MARKUP_FORMATS)
def test_grammar_with_reasoning(vocab, fmt):
    f = get_format(fmt, GRAMMAR_TOOLS)
    call = render(fmt, VALID[0])
    opened = allow_reasoning(f.grammar(GRAMMAR_TOOLS), opened=True)
    optional = allow_reasoning(f.grammar(GRAMMAR_TOOLS))
    assert accepts(vocab, opened, "I should call it.\n</think>\n\n" + call)
    assert not accepts(vocab, opened, call)
    assert accepts(vocab, optional, call)
    assert accepts(vocab, optional, "<think>\nhmm <tool_call> no\n</think>\n\n" + call)
    assert not accepts(vocab, optional, "<think>\nhmm\n</think>\n\nSure. " + call)
    special = allow_reasoning(f.grammar(GRAMMAR_TOOLS), start="<|think|>", end="<|/think|>",
                              special=True)
    assert accepts(vocab, special, "<|think|>hmm </think><|/think|>\n" + call)
    assert accepts(vocab, special, call)
    assert not accepts(vocab, special, "<think>hmm</think>" + call)


def test_grammar_errors():
    f = get_format("hermes")
    with pytest.raises(ValueError, match="not among the tools"):
        f.grammar(GRAMMAR_TOOLS, choice="nope")
    with pytest.raises(ValueError, match="at least one tool"):
        f.grammar([])
    with pytest.raises(ValueError, match="twice"):
        f.grammar([fn("a"), fn("a")])


@pytest.mark.parametrize("fmt", MARKUP_FORMATS)
def test_grammar_drives_a_random_model(vocab, fmt):
    """Sample under each grammar with random choices among the allowed tokens: every output
    must parse (one chunk and streamed) into calls whose arguments follow the schemas."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in GRAMMAR_TOOLS}
    f = get_format(fmt, GRAMMAR_TOOLS)
    words = np.zeros(vocab.mask_words, np.uint32)
    # closing characters get a high weight so that strings and arrays end
    weight = np.ones(len(BYTES))
    for c in b"\"'}])>":
        weight[c] = 40.0
    weight[[c for c in range(256) if chr(c).isspace()]] = 0.2
    weight[128:256] = 0.05
    weight[BYTES.encode("</parameter>")] = 40.0  # (the random model's only way out of a text value)
    weight[BYTES.encode("<|end|>")] = 40.0  # (and out of a harmony message)
    for seed in range(6):
        rng = np.random.default_rng(seed)
        choice = None if seed % 3 else ["get_weather", "create_event", "tree"][seed // 3 % 3]
        grammar = f.grammar(GRAMMAR_TOOLS, choice=choice)
        m = constrain.compile_grammar(vocab, "lark", grammar).matcher()
        ids: list[int] = []
        for _ in range(4000):
            m.fill_mask(words)
            allowed = constrain.allowed_tokens(words, len(BYTES))
            if allowed[BYTES.eos]:
                break
            p = np.where(allowed, weight, 0.0)
            t = int(rng.choice(len(BYTES), p=p / p.sum()))
            m.consume(t)
            ids.append(t)
        else:
            pytest.fail("no end after 4000 tokens")
        text = BYTES.decode(ids)
        out = f.parse(text)
        # (harmony: a preamble, commentary without a recipient, may come before the call)
        assert (out.content == "" or fmt == "harmony") and out.tool_calls, text
        for call in out.tool_calls:
            assert choice in (None, call.name)
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        s, deltas = _stream(f, list(text), True)
        assert _calls(collect(deltas)) == _calls(out) and not s.broken_calls


def test_grammars_with_a_real_tokenizer():
    """tiny-qwen3-chat's SentencePiece vocabulary (multi-character pieces, byte fallback for
    the non-ASCII): its tokenization of each valid call is accepted, of each invalid one not
    (lfm2 needs special tokens this vocabulary lacks)."""
    from pathlib import Path

    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf")
    vocab = constrain.TokenVocab.from_tokenizer(tok, len(tok), tok.token_to_id("<|im_end|>"))

    def accepted(grammar, text: str) -> bool:
        ids = tok.encode(text, add_special=False)
        assert tok.concat_pieces(ids).decode() == text
        m = constrain.compile_grammar(vocab, "lark", grammar).matcher()
        for t in ids:
            try:
                m.consume(t)
            except constrain.GrammarError:
                return False
        return m.accepting

    for fmt in ("hermes", "qwen35", "llama3"):
        grammar = get_format(fmt).grammar(GRAMMAR_TOOLS)
        assert all(accepted(grammar, render(fmt, calls)) for calls in VALID), fmt
        assert not any(accepted(grammar, render(fmt, calls)) for calls in INVALID), fmt


def test_hermes_auto_grammar_forces_a_reply_that_opens_like_a_call(vocab):
    """Under strict tools, a hermes reply that begins like a bare or fenced call object is one
    (valid against the schemas); text, code fences and <tool_call> blocks after text stay free."""
    auto = get_format("hermes").auto_grammar(GRAMMAR_TOOLS)
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    for text in (call, " \n" + call, "```json\n" + call + "\n```", "```\n" + call + "\n```",
                 call + "\n" + render("hermes", VALID[1]), "Sure.\n" + render("hermes", VALID[0]),
                 "```python\nx = {1: 2}\n```", "Hello {braces}", ""):
        assert accepts(vocab, auto, text), text
    for text in ('{"name": "get_wether", "arguments": {"city": "Paris"}}',  # no such tool
                 '{"name": "get_weather", "arguments": {}}',  # required field missing
                 '```json\n{"name": "nope", "arguments": {}}\n```',
                 '{"answer": 42}'):  # a reply that opens with an object is a call
        assert not accepts(vocab, auto, text), text
