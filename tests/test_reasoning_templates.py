"""Thinking models' templates render as llama-server renders them under `--reasoning off`,
`on` and `auto` (the default: `enable_thinking` is whether llama.cpp's analysis counts the
template as one that thinks), and their replies split into `reasoning_content` as
llama-server splits them: `tests/data/reasoning_reference.json`, made by llama.cpp's own
`common_chat_templates_apply` and `common_chat_parse` (scripts/make_reasoning_reference.py)
for every template in tests/data/templates that reads `enable_thinking` (Qwen3, QwQ,
DeepSeek-R1-Distill and the rest of llama.cpp's models/templates that read it); the split for
the Qwen3, QwQ and DeepSeek-R1-Distill ones. Also: `--reasoning off` on a real server, and the other
llama-server template variables (`functions`, `date_string`, `strftime_now`)."""

import json
from datetime import datetime
from pathlib import Path

import pytest

from kvshare.apis.chat_output import ChoiceOutput, OutputRules
from kvshare.apis.parsing import parse_chat
from kvshare.model.chat_template import ChatTemplate
from kvshare.server.errors import APIError
from kvshare.toolcalls import prompt_opens_reasoning, template_has_thinking

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "templates"
REF = json.loads((DATA / "reasoning_reference.json").read_text(encoding="utf-8"))
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
MODES = ("off", "on", "auto")
CASES = [(f, mode) for f in REF["templates"] for mode in MODES]
# the templates whose <think> replies kvshare splits as llama-server (toolcalls/reasoning.py)
SPLIT = ["Qwen-Qwen3-0.6B.jinja", "thinking/Qwen-QwQ-32B.jinja",
         "thinking/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"]


def _template(file: str) -> ChatTemplate:
    case = REF["templates"][file]
    return ChatTemplate((TEMPLATES / file).read_text(encoding="utf-8"),
                        bos_token=case["bos_token"], eos_token=case["eos_token"])


def _reply_split(source: str, prompt: str, reply: str) -> tuple[str, str]:
    rules = OutputRules(reasoning=template_has_thinking(source),
                        starts_in_reasoning=prompt_opens_reasoning(prompt))
    msg, _ = ChoiceOutput.message(rules, reply)
    return msg.get("reasoning_content") or "", msg["content"] or ""


def test_every_template_reading_enable_thinking_is_in_the_reference():
    readers = {str(f.relative_to(TEMPLATES)) for f in TEMPLATES.rglob("*.jinja")
               if "enable_thinking" in f.read_text(encoding="utf-8")}
    assert readers == set(REF["templates"]) and len(readers) == 26


@pytest.mark.parametrize("file,mode", CASES)
def test_renders_as_llama_server(file, mode):
    """off / on: `--reasoning off` / `on` (the template variable set by the server, as
    llama-server's default chat_template_kwargs); auto: nothing set, kvshare's default."""
    ref = REF["templates"][file]["enable_thinking"][mode]
    t = _template(file)
    if mode == "auto":
        assert t.thinking_by_default is ref["enable_thinking"] is ref["supports_thinking"]
        assert t.render(REF["conversation"]) == ref["prompt"]
    else:
        server = ChatTemplate(t.source, bos_token=t.bos_token, eos_token=t.eos_token,
                              extra_context={"enable_thinking": mode == "on"})
        assert server.render(REF["conversation"]) == ref["prompt"]
        assert t.render(REF["conversation"], enable_thinking=mode == "on") == ref["prompt"]


@pytest.mark.parametrize("file,mode", [(f, m) for f in SPLIT for m in ("on", "off")])
def test_reasoning_content_is_split_as_llama_server(file, mode):
    """The reply each template leads to (a <think> block, or the rest of one the prompt
    opened; with thinking off, the answer alone) and a plain answer: reasoning_content and
    content as llama-server's (whitespace around each aside)."""
    ref = REF["templates"][file]["enable_thinking"][mode]
    t = _template(file)
    prompt = t.render(REF["conversation"], enable_thinking=mode == "on")
    opened = prompt_opens_reasoning(prompt)
    replies = ["plain"] + ([] if mode == "off" else ["opened" if opened else "thinking"])
    for name in replies:
        want = ref["parsed"][name]
        got = _reply_split(t.source, prompt, REF["replies"][name])
        assert (got[0].strip(), got[1].strip()) == (want["reasoning_content"].strip(),
                                                    want["content"].strip()), name
    if mode == "on":
        assert ref["parsed"]["opened" if opened else "thinking"]["reasoning_content"].strip()
        assert ref["supports_thinking"] and template_has_thinking(t.source)


def test_request_kwargs_win_over_the_server_setting():
    src = (TEMPLATES / QWEN3).read_text(encoding="utf-8")
    off = ChatTemplate(src, extra_context={"enable_thinking": False})
    msgs = REF["conversation"]
    assert off.render(msgs).endswith("<think>\n\n</think>\n\n")
    assert off.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_enable_thinking_must_be_a_boolean():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False}}) \
        .template_kwargs == {"enable_thinking": False}
    with pytest.raises(APIError, match='invalid type for "enable_thinking"'):
        parse_chat({**body, "chat_template_kwargs": {"enable_thinking": "false"}})


# --------------------------------------------------------------------------- CLI flags

@pytest.mark.parametrize("flags,context", [
    ([], None),
    (["--reasoning", "off"], {"enable_thinking": False}),
    (["-rea", "on"], {"enable_thinking": True}),
    (["--reasoning", "auto"], None),
    (["--reasoning-budget", "0"], None),  # llama-server: the budget renders nothing
    (["--reasoning-budget", "256"], None),
    (["--reasoning-budget", "-1"], None),
])
def test_reasoning_flags(flags, context):
    from kvshare.server import cli

    a = cli.parse_args(["serve", "-m", "m.gguf", *flags], {})
    choice = cli.chat_template_override(a)
    assert (choice.context if choice is not None else None) == context


# --------------------------------------------------------------------------- other variables

def test_a_template_using_functions_renders():
    """FireFunction v2's template (llama.cpp's test_date_inside_prompt) adds `functions` to a
    string: the tools as JSON text, "" without tools, and prints `datetime`."""
    t = ChatTemplate((DATA / "llama_server_templates" /
                      "fireworks-ai-llama-3-firefunction-v2.jinja").read_text())
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = t.render(msgs, tools=tools)
    assert ('Available functions as JSON spec:\n[\n  {\n    "type": "function",\n'
            '    "function": {\n      "name": "get_weather",') in with_tools
    assert f"Today is {datetime.now().strftime('%b %d %Y')}." in with_tools
    bare = t.render(msgs)
    assert "Available functions as JSON spec:\n\nToday is" in bare and "get_weather" not in bare
    assert "tools" not in t.polyfills  # it shows the tools itself


def test_llama3_templates_print_today():
    today = datetime.now().strftime("%d %b %Y")
    msgs = [{"role": "user", "content": "hi"}]
    t32 = ChatTemplate((TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text())
    assert f"Today Date: {today}\n" in t32.render(msgs)  # via strftime_now
    # Llama 3.1's line: date_string or its fixed fallback
    t31 = ChatTemplate('{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" '
                       '%}{%- endif %}Today Date: {{ date_string }}')
    assert t31.render(msgs) == f"Today Date: {today}"


# --------------------------------------------------------------------------- a real server

def test_reasoning_off_changes_the_served_prompt(launcher):
    """`--reasoning off` with the Qwen3 template: /apply-template renders the empty thinking
    block (enable_thinking false), a request's chat_template_kwargs turns it back on, and a
    chat reply's text is all content."""
    from tier_helpers import Server

    msgs = [{"role": "user", "content": "What is 2+2?"}]
    base = ["--chat-template-file", str(TEMPLATES / QWEN3), "--cache-ram", "0", "-c", "512",
            "-np", "1"]
    on = Server(launcher, *base)
    try:
        assert on.post("/apply-template", {"messages": msgs})["prompt"].endswith(
            "<|im_start|>assistant\n")
    finally:
        on.kill9()
    off = Server(launcher, *base, "--reasoning", "off")
    try:
        prompt = off.post("/apply-template", {"messages": msgs})["prompt"]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        again = off.post("/apply-template", {"messages": msgs,
                                             "chat_template_kwargs": {"enable_thinking": True}})
        assert again["prompt"].endswith("<|im_start|>assistant\n")
        r = off.chat(msgs, max_tokens=4)
        assert r["choices"][0]["message"].get("reasoning_content") in (None, "")
    finally:
        off.kill9()
