"""Every `--chat-template NAME` renders what llama.cpp's C++ `llm_chat_apply_template` renders
for the same messages: `tests/data/chat_templates_reference.json`, made by llama.cpp's own code
(scripts/make_chat_template_reference.py).

One deliberate difference: llama.cpp's `yandex` drops system messages; kvshare's polyfill for
templates without a system role keeps the system prompt in the first user turn instead (the
template itself renders as llama.cpp's, checked with the polyfill off)."""

import json
from pathlib import Path

import pytest

from kvshare.model.builtin_templates import BUILTIN_TEMPLATES
from kvshare.model.chat_template import ChatTemplate, normalize_messages

REF = json.loads((Path(__file__).parent / "data" / "chat_templates_reference.json")
                 .read_text(encoding="utf-8"))
CASES = [(name, conv, agp) for name in sorted(REF["templates"]) for conv in REF["conversations"]
         for agp in (True, False)]


def test_every_llama_cpp_name_is_built_in():
    assert set(REF["templates"]) <= set(BUILTIN_TEMPLATES)


@pytest.mark.parametrize("name,conv,agp", CASES)
def test_renders_as_llama_cpp(name, conv, agp):
    want = REF["templates"][name][conv]["add_generation_prompt" if agp else "no_generation_prompt"]
    t = ChatTemplate(BUILTIN_TEMPLATES[name], name=name)
    msgs = REF["conversations"][conv]
    own = t._render(normalize_messages(msgs), None, agp, None, {}, polyfill=False)
    assert own == want
    if name == "yandex" and msgs[0]["role"] == "system":
        assert "system_role" in t.polyfills
        served = t.render(msgs, add_generation_prompt=agp)
        assert msgs[0]["content"] in served and msgs[1]["content"] in served
    else:
        assert t.render(msgs, add_generation_prompt=agp) == want


def test_chat_template_flag_takes_every_name():
    import argparse

    from kvshare.server.cli.chat_template_flags import TemplateError, chat_template_override

    def choose(value):
        return chat_template_override(argparse.Namespace(chat_template=value,
                                                         chat_template_file=None))

    for name in REF["templates"]:
        source, label = choose(name)
        assert source == BUILTIN_TEMPLATES[name] and label == ("gemma3" if name == "gemma" else name)
    with pytest.raises(TemplateError, match="llama3.*mistral-v7"):
        choose("llama-9")
