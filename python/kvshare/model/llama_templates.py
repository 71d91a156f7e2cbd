"""llama.cpp's built-in chat templates as Jinja, by llama.cpp's names for them
(`--chat-template NAME`).

Each renders the text llama.cpp's C++ `llm_chat_apply_template` (src/llama-chat.cpp) renders
for the same system / user / assistant messages, which is what llama-server sends the model
for `--chat-template NAME` without Jinja. That includes their quirks, kept on purpose: some
never add a generation prompt (`minicpm`, `orion`, `hunyuan-*`, the `llama2` and `mistral`
families end the prompt inside the turn instead), `rwkv-world` opens the assistant turn after
a final user message either way, some trim contents and others do not.
`tests/test_builtin_templates.py` checks every one against llama.cpp's own output
(`tests/data/chat_templates_reference.json`). Tools and roles beyond system / user / assistant
are what kvshare's polyfills make of them (kvshare.model.tool_polyfill).

`chatml`, `gemma` and `gemma3` are kvshare's tool-aware templates (kvshare.model
.builtin_templates), not in this table.
"""

from __future__ import annotations


def _gen(text: str) -> str:
    return "{%- if add_generation_prompt -%}{{- " + repr(text) + " -}}{%- endif -%}"


def _each(body: str, gen: str | None = None, head: str = "") -> str:
    """A template that prints `head`, then `body` for every message `m`, then `gen` as the
    generation prompt."""
    out = "{{- " + repr(head) + " -}}" if head else ""
    out += "{%- for m in messages -%}" + body + "{%- endfor -%}"
    return out + (_gen(gen) if gen is not None else "")


def _llama2(system: bool, bos_in_history: bool, strip: bool) -> str:
    c = "(m.content | trim)" if strip else "m.content"
    sys = ("'<<SYS>>\\n' + " + c + " + '\\n<</SYS>>\\n\\n'") if system else (c + " + '\\n'")
    again = "<s>[INST] " if bos_in_history else "[INST] "
    return ("{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}{%- for m in messages -%}"
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- " + repr(again) + " -}}{%- endif -%}"
            "{%- if m.role == 'system' -%}{{- " + sys + " -}}"
            "{%- elif m.role == 'user' -%}{{- " + c + " + ' [/INST]' -}}"
            "{%- else -%}{{- " + c + " + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
            "{%- endfor -%}")


def _mistral(lead: str, trail: str, trim_assistant: bool) -> str:
    reply = "(m.content | trim)" if trim_assistant else "m.content"
    return ("{%- set ns = namespace(inside=false) -%}{%- for m in messages -%}"
            "{%- if not ns.inside -%}{{- " + repr(lead + "[INST]" + trail) + " -}}"
            "{%- set ns.inside = true -%}{%- endif -%}"
            "{%- if m.role == 'system' -%}{{- m.content + '\\n\\n' -}}"
            "{%- elif m.role == 'user' -%}{{- m.content + " + repr(lead + "[/INST]") + " -}}"
            "{%- else -%}{{- " + repr(trail) + " + " + reply + " + '</s>' -}}"
            "{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}")


def _mistral_v7(space: str) -> str:
    s = repr(space)
    return _each("{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT]' + " + s
                 + " + m.content + '[/SYSTEM_PROMPT]' -}}"
                 "{%- elif m.role == 'user' -%}{{- '[INST]' + " + s + " + m.content + '[/INST]' -}}"
                 "{%- else -%}{{- " + s + " + m.content + '</s>' -}}{%- endif -%}")


def _by_role(cases: dict[str, str], gen: str | None = None, head: str = "",
             other: str | None = None) -> str:
    """`_each` with a Jinja expression per role (`other`: every other role; none: nothing)."""
    body = ""
    for i, (role, expr) in enumerate(cases.items()):
        body += ("{%- if " if i == 0 else "{%- elif ") + f"m.role == {role!r} -%}}{{{{- {expr} -}}}}"
    if other is not None:
        body += "{%- else -%}{{- " + other + " -}}"
    return _each(body + "{%- endif -%}", gen, head)


def _exaone(tool: bool) -> str:
    cases = {"system": "'[|system|]' + (m.content | trim) + '[|endofturn|]\\n'",
             "user": "'[|user|]' + (m.content | trim) + '\\n'",
             "assistant": "'[|assistant|]' + (m.content | trim) + '[|endofturn|]\\n'"}
    if tool:
        cases["tool"] = "'[|tool|]' + (m.content | trim) + '[|endofturn|]\\n'"
    return _by_role(cases, "[|assistant|]")


def _granite(v4: bool) -> str:
    open_ = ("('<|start_of_role|>assistant<|end_of_role|><|tool_call|>' if m.role == "
             "'assistant_tool_call' else '<|start_of_role|>' + m.role + '<|end_of_role|>')"
             if v4 else "'<|start_of_role|>' + m.role + '<|end_of_role|>' + ('<|tool_call|>' "
             "if m.role == 'assistant_tool_call' else '')")
    return _each("{{- " + open_ + " + m.content + '<|end_of_text|>\\n' -}}",
                 "<|start_of_role|>assistant<|end_of_role|>")


_BAILING_ROLE = "('HUMAN' if m.role == 'user' else m.role | upper)"


def _vicuna(orca: bool) -> str:
    sys = "'SYSTEM: ' + m.content + '\\n'" if orca else "m.content + '\\n\\n'"
    return _by_role({"system": sys, "user": "'USER: ' + m.content + '\\n'",
                     "assistant": "'ASSISTANT: ' + m.content + '</s>\\n'"}, "ASSISTANT:")


_HY = {"a": "<｜hy_Assistant｜>", "u": "<｜hy_User｜>", "p2": "<｜hy_place▁holder▁no▁2｜>",
       "p3": "<｜hy_place▁holder▁no▁3｜>", "bos": "<｜hy_begin▁of▁sentence｜>"}

_PANGU = {"system": "系统", "user": "用户", "assistant": "助手", "tool": "工具", "function": "方法"}

LLAMA_TEMPLATES: dict[str, str] = {
    "llama2": _llama2(False, False, False),
    "llama2-sys": _llama2(True, False, False),
    "llama2-sys-bos": _llama2(True, True, False),
    "llama2-sys-strip": _llama2(True, False, True),
    "mistral-v1": _mistral(" ", " ", False),
    "mistral-v3": _mistral("", " ", True),
    "mistral-v3-tekken": _mistral("", "", False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each("{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' -}}", "<|assistant|>\n"),
    "phi4": _each("{{- '<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>' -}}",
                  "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each("{{- '<|' + m.role + '|>\\n' + m.content + '\\n' -}}", "<|assistant|>\n"),
    "zephyr": _each("{{- '<|' + m.role + '|>\\n' + m.content + '<|endoftext|>\\n' -}}",
                    "<|assistant|>\n"),
    "monarch": _each("{{- ('' if loop.first else '<s>') + m.role + '\\n' + m.content + '</s>\\n' -}}",
                     "<s>assistant\n"),
    "orion": ("{%- set ns = namespace(sys='') -%}{%- for m in messages -%}"
              "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + m.content -%}"
              "{%- elif m.role == 'user' -%}{{- 'Human: ' + (ns.sys + '\\n\\n' if ns.sys else '') "
              "+ m.content + '\\n\\nAssistant: </s>' -}}{%- set ns.sys = '' -%}"
              "{%- else -%}{{- m.content + '</s>' -}}{%- endif -%}{%- endfor -%}"),
    "openchat": _by_role({"system": "m.content + '<|end_of_turn|>'"}, "GPT4 Correct Assistant:",
                         other="'GPT4 Correct ' + (m.role[:1] | upper) + m.role[1:] + ': ' "
                               "+ m.content + '<|end_of_turn|>'"),
    "vicuna": _vicuna(False),
    "vicuna-orca": _vicuna(True),
    "deepseek": _by_role({"system": "m.content",
                          "user": "'### Instruction:\\n' + m.content + '\\n'",
                          "assistant": "'### Response:\\n' + m.content + '\\n<|EOT|>\\n'"},
                         "### Response:\n"),
    "deepseek2": _by_role({"system": "m.content + '\\n\\n'",
                           "user": "'User: ' + m.content + '\\n\\n'",
                           "assistant": "'Assistant: ' + m.content + '<｜end▁of▁sentence｜>'"},
                          "Assistant:"),
    "deepseek3": _by_role({"system": "m.content + '\\n\\n'", "user": "'<｜User｜>' + m.content",
                           "assistant": "'<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>'"},
                          "<｜Assistant｜>"),
    "deepseek-ocr": _each("{{- m.content -}}"),
    "command-r": _by_role({r: f"'<|START_OF_TURN_TOKEN|><|{t}_TOKEN|>' + (m.content | trim) + "
                              "'<|END_OF_TURN_TOKEN|>'"
                           for r, t in (("system", "SYSTEM"), ("user", "USER"),
                                        ("assistant", "CHATBOT"))},
                          "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _each("{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' "
                    "+ (m.content | trim) + '<|eot_id|>' -}}",
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "chatglm3": _each("{{- '<|' + m.role + '|>\\n ' + m.content -}}", "<|assistant|>",
                      head="[gMASK]sop"),
    "chatglm4": _each("{{- '<|' + m.role + '|>\\n' + m.content -}}", "<|assistant|>\n",
                      head="[gMASK]<sop>"),
    "glmedge": _each("{{- '<|' + m.role + '|>\\n' + m.content -}}", "<|assistant|>"),
    "minicpm": _each("{{- ('<用户>' + (m.content | trim) + '<AI>') if m.role == 'user' "
                     "else (m.content | trim) -}}"),
    "exaone3": _exaone(False),
    "exaone4": _exaone(True),
    "exaone-moe": _by_role({r: f"'<|{r}|>\\n' + (m.content | trim) + '<|endofturn|>\\n'"
                            for r in ("system", "user", "assistant", "tool")}, "<|assistant|>\n"),
    "rwkv-world": _by_role({"system": "'System: ' + (m.content | trim) + '\\n\\n'",
                            "user": "'User: ' + (m.content | trim) + '\\n\\n' "
                                    "+ ('Assistant:' if loop.last else '')",
                            "assistant": "'Assistant: ' + (m.content | trim) + '\\n\\n'"}),
    "granite": _granite(False),
    "granite-4.0": _granite(True),
    "granite-4.1": _granite(True),
    "gigachat": ("{%- set sys = messages and messages[0].role == 'system' -%}"
                 "{{- '<s>' + (messages[0].content + '<|message_sep|>' if sys else '') -}}"
                 "{%- for m in (messages[1:] if sys else messages) -%}"
                 "{%- if m.role == 'user' -%}{{- 'user<|role_sep|>' + m.content + '<|message_sep|>"
                 "available functions<|role_sep|>[]<|message_sep|>' -}}"
                 "{%- elif m.role == 'assistant' -%}{{- 'assistant<|role_sep|>' + m.content "
                 "+ '<|message_sep|>' -}}{%- endif -%}{%- endfor -%}" + _gen("assistant<|role_sep|>")),
    "megrez": _each("{{- '<|role_start|>' + m.role + '<|role_end|>' + m.content + '<|turn_end|>' -}}",
                    "<|role_start|>assistant<|role_end|>"),
    "yandex": _by_role({"user": "' Пользователь: ' + m.content + '\\n\\n'",
                        "assistant": "' Ассистент: ' + m.content + '\\n\\n'"}, " Ассистент:[SEP]"),
    "bailing": _each("{{- '<role>' + " + _BAILING_ROLE + " + '</role>' + m.content -}}",
                     "<role>ASSISTANT</role>"),
    "bailing-think": _each("{{- '<role>' + " + _BAILING_ROLE + " + '</role>' + m.content -}}",
                           "<role>ASSISTANT</role><think>"),
    "bailing2": ("{%- if not (messages and messages[0].role == 'system') -%}"
                 "{{- '<role>SYSTEM</role>detailed thinking off<|role_end|>' -}}{%- endif -%}"
                 + _each("{{- '<role>' + " + _BAILING_ROLE + " + '</role>' + m.content "
                         "+ '<|role_end|>' -}}", "<role>ASSISTANT</role>")),
    "llama4": _each("{{- '<|header_start|>' + m.role + '<|header_end|>\\n\\n' + (m.content | trim) "
                    "+ '<|eot|>' -}}", "<|header_start|>assistant<|header_end|>\n\n"),
    "smolvlm": _by_role({"system": "m.content + '\\n\\n'",
                         "user": "'User: ' + m.content + '<end_of_utterance>\\n'"}, "Assistant:",
                        head="<|im_start|>",
                        other="'Assistant: ' + m.content + '<end_of_utterance>\\n'"),
    "hunyuan-moe": _by_role({"system": "'<|startoftext|>' + m.content + '<|extra_4|>'",
                             "assistant": "m.content + '<|eos|>'"},
                            other="'<|startoftext|>' + m.content + '<|extra_0|>'"),
    "gpt-oss": _each("{{- '<|start|>' + m.role + '<|message|>' + m.content + ('<|return|>' "
                     "if m.role == 'assistant' else '<|end|>') -}}", "<|start|>assistant"),
    "hunyuan-dense": _each(
        "{%- if loop.first and m.role == 'system' -%}{{- m.content + " + repr(_HY["p3"]) + " -}}"
        "{%- endif -%}{%- if m.role == 'assistant' -%}{{- " + repr(_HY["a"]) + " + m.content + "
        + repr(_HY["p2"]) + " -}}{%- elif m.role == 'user' -%}{{- " + repr(_HY["u"])
        + " + m.content + " + repr(_HY["a"]) + " -}}{%- endif -%}"),
    "hunyuan-vl": _each(
        "{%- if loop.first and m.role == 'system' -%}{{- m.content + " + repr(_HY["p3"]) + " -}}"
        "{%- elif m.role == 'user' -%}{{- m.content + " + repr(_HY["u"]) + " -}}"
        "{%- elif m.role == 'assistant' -%}{{- m.content + " + repr(_HY["a"]) + " -}}{%- endif -%}",
        head=_HY["bos"]),
    "kimi-k2": _each("{{- {'system': '<|im_system|>system<|im_middle|>', 'user': "
                     "'<|im_user|>user<|im_middle|>', 'assistant': "
                     "'<|im_assistant|>assistant<|im_middle|>', 'tool': "
                     "'<|im_system|>tool<|im_middle|>'}.get(m.role, '') + m.content + '<|im_end|>' -}}",
                     "<|im_assistant|>assistant<|im_middle|>"),
    "seed_oss": _each("{{- '<seed:bos>' + m.role + '\\n' + ((m.content | trim) if m.role == "
                      "'assistant' else m.content) + '<seed:eos>' -}}", "<seed:bos>assistant\n"),
    "grok-2": _by_role({"system": "'System: ' + (m.content | trim) + '<|separator|>\\n\\n'",
                        "user": "'Human: ' + (m.content | trim) + '<|separator|>\\n\\n'",
                        "assistant": "'Assistant: ' + m.content + '<|separator|>\\n\\n'"},
                       "Assistant:"),
    "pangu-embedded": _each(
        "{%- if loop.first and m.role != 'system' -%}{{- '[unused9]系统：[unused10]' -}}{%- endif -%}"
        "{%- if m.role in " + repr(_PANGU) + " -%}{{- '[unused9]' + " + repr(_PANGU)
        + "[m.role] + '：' + m.content + '[unused10]' -}}{%- endif -%}", "[unused9]助手："),
    "solar-open": _each("{{- '<|begin|>' + m.role + '<|content|>' + m.content + '<|end|>' -}}",
                        "<|begin|>assistant"),
}
