"""kvshare's built-in chat templates: for models whose GGUF carries none, Gemma 3's (for
`gemma*` architectures) and ChatML (any other), both extended for tools in the hermes
`<tool_call>` format (`kvshare.toolcalls.hermes`); and every template `--chat-template NAME`
names (`BUILTIN_TEMPLATES`: llama.cpp's names, those two plus kvshare.model.llama_templates)."""

from kvshare.model.llama_templates import LLAMA_TEMPLATES

_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more of the following tools to help with the request."
    "\\n\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nTo call a tool, reply with a JSON object holding the tool name and its "
    "arguments inside <tool_call></tool_call> tags, one pair of tags per call:\\n<tool_call>\\n"
    '{"name": <tool name>, "arguments": <arguments object>}\\n</tool_call>'
)

# The official Gemma 3 template (HF tokenizer_config.json of google/gemma-3-*-it), extended
# for agents: tools are described in the first user turn after the system prompt; assistant
# tool calls are rendered as <tool_call>{json}</tool_call> blocks in the model turn; tool results
# as <tool_response> blocks in a user turn (consecutive results share one turn); a system
# message after the first is rendered as a user turn; roles need not alternate; a conversation
# with only a system prompt (and/or tools) renders it as a user turn. Plain system / user /
# assistant conversations render exactly as the official template does, save that the system
# prompt is trimmed, as llama.cpp's built-in `gemma` does.
GEMMA3_TEMPLATE = (
    """{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = (messages[0]['content'] | trim) + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
    {%- set ns = namespace(text='"""
    + _TOOLS_INTRO
    + """') -%}
    {%- for tool in tools -%}
        {%- set ns.text = ns.text + '\\n' + (tool | tojson) -%}
    {%- endfor -%}
    {%- set first_user_prefix = first_user_prefix + ns.text + '"""
    + _TOOLS_OUTRO
    + """\\n\\n' -%}
{%- endif -%}
{%- if not loop_messages and first_user_prefix -%}
    {{- '<start_of_turn>user\\n' + first_user_prefix | trim + '<end_of_turn>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- set is_tool = message['role'] == 'tool' -%}
    {%- set prev_tool = not loop.first and loop.previtem['role'] == 'tool' -%}
    {%- set next_tool = not loop.last and loop.nextitem['role'] == 'tool' -%}
    {%- if not (is_tool and prev_tool) -%}
        {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' + (first_user_prefix if loop.first else '') -}}
    {%- endif -%}
    {%- if is_tool -%}
        {{- '<tool_response>\\n' + message['content'] | trim + '\\n</tool_response>' -}}
        {%- if next_tool -%}{{- '\\n' -}}{%- endif -%}
    {%- else -%}
        {{- message['content'] | trim -}}
        {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
            {%- for tool_call in message['tool_calls'] -%}
                {%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}
                {%- if not loop.first or message['content'] | trim -%}{{- '\\n' -}}{%- endif -%}
                {{- '<tool_call>\\n' + ({'name': call['name'], 'arguments': call['arguments']} | tojson) + '\\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
    {%- endif -%}
    {%- if not (is_tool and next_tool) -%}
        {{- '<end_of_turn>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""
)

# ChatML (<|im_start|>role\n...<|im_end|>\n), with Qwen2.5-style tools: a system turn lists the
# tools, tool calls are <tool_call> blocks, tool results <tool_response> blocks in a user turn.
CHATML_TEMPLATE = (
    """{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages and messages[0]['role'] == 'system' -%}
        {{- messages[0]['content'] + '\\n\\n' -}}
        {%- set loop_messages = messages[1:] -%}
    {%- else -%}
        {%- set loop_messages = messages -%}
    {%- endif -%}
    {{- '"""
    + _TOOLS_INTRO
    + """' -}}
    {%- for tool in tools -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '"""
    + _TOOLS_OUTRO
    + """<|im_end|>\\n' -}}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'tool' -%}
        {%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}
        {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
            {%- for tool_call in message['tool_calls'] -%}
                {%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}
                {%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}
                {{- '<tool_call>\\n' + ({'name': call['name'], 'arguments': call['arguments']} | tojson) + '\\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""
)


# `--chat-template NAME`: llama.cpp's names (src/llama-chat.cpp) for the templates above and
# kvshare.model.llama_templates.
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML_TEMPLATE, "gemma": GEMMA3_TEMPLATE,
                                     "gemma3": GEMMA3_TEMPLATE, **LLAMA_TEMPLATES}
