"""Chat templates: OpenAI-style messages -> the prompt text a model was trained on.

`ChatTemplate` renders a Jinja chat template the way HuggingFace `apply_chat_template` does
(`ImmutableSandboxedEnvironment` with `trim_blocks`/`lstrip_blocks`, `raise_exception`,
`tojson`, `strftime_now`, the `loopcontrols` extension and a no-op `{% generation %}` tag),
and post-processes like llama.cpp: a leading BOS text is removed when the tokenizer adds BOS
itself (and a trailing EOS text when it adds EOS), so `tokenizer.encode(prompt)` gives exactly
one BOS. Besides the messages, templates see llama-server's variables (`enable_thinking`,
`date_string`, `functions`, ...: kvshare.model.template_context).

Template choice (`ChatTemplate.from_metadata`): the GGUF's `tokenizer.chat_template`; else the
built-in Gemma 3 template for `gemma*` architectures; else a built-in ChatML template
(`--chat-template NAME` picks any of kvshare.model.builtin_templates).

Messages are normalised before rendering: `content` may be a string, None (-> ""), or a list of
`{"type": "text", "text": ...}` parts (joined with "\\n", as llama.cpp does for templates that
take string content); a tool call's JSON-string `arguments` are parsed into an object (HF
convention) whose `str()` is its JSON, so templates that print it without `tojson` still print
JSON. For gpt-oss's harmony template an assistant's `reasoning_content` becomes its `thinking`
(`harmony_messages`). Anything a template raises, including sandbox violations, becomes
`ChatTemplateError`.

What the template renders by itself is probed once (`caps`, kvshare.model.template_caps);
where it lacks a system role or tool support, every render rewrites the conversation first
(`polyfills`, kvshare.model.tool_polyfill): tools in the system message, past calls and
results as text in the generic JSON call format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvshare.model import template_context, tool_polyfill
from kvshare.model.builtin_templates import CHATML_TEMPLATE, GEMMA3_TEMPLATE
from kvshare.model.template_caps import TemplateCaps, detect_caps, polyfills
from kvshare.model.tokenizer import Tokenizer, prefix_token_count

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ChatPrompt",
    "GEMMA3_TEMPLATE",
    "CHATML_TEMPLATE",
]


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered for these messages."""


_MAX_SEQUENCE = 10_000_000  # largest str/list a template may build with `*`
_MAX_EXPONENT = 4096


class _RaisedByTemplate(TemplateError):
    pass


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training
    masks); rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, made strict: touching an unsafe attribute (`__class__`, `__globals__`,
    `mro`, ...) raises at once instead of yielding a silent undefined, and `*` / `**` cannot
    build huge values."""

    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and len(seq) * k > _MAX_SEQUENCE:
                    raise SecurityError("template tried to build a value that is too large")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            raise SecurityError("template tried to compute a power that is too large")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: Any) -> None:
    raise _RaisedByTemplate(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _make_env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = template_context.strftime_now
    return env


class _JsonDict(dict):
    """A tool call's parsed arguments: a mapping for templates that iterate or `tojson` it,
    printed as JSON by templates that print it directly."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ChatTemplateError(f"{where}.content[{j}] is not an object")
            kind = part.get("type", "text")
            if kind not in ("text", "input_text"):
                raise ChatTemplateError(f"{where}.content[{j}]: unsupported content part type {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"{where}.content[{j}].text must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string, a list of text parts, or null")


def _tool_call(tc: Any, where: str) -> Any:
    if not isinstance(tc, Mapping):
        raise ChatTemplateError(f"{where} is not an object")
    tc = dict(tc)
    fn = tc.get("function")
    target = dict(fn) if isinstance(fn, Mapping) else tc
    args = target.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            target["arguments"] = _JsonDict(parsed)
    elif isinstance(args, Mapping):
        target["arguments"] = _JsonDict(args)
    if isinstance(fn, Mapping):
        tc["function"] = target
    return tc


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates get them (see the module docstring). Raises ChatTemplateError."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where} is not an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role must be a non-empty string")
        msg = dict(m)
        msg["content"] = _text_content(m.get("content"), where)
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, (list, tuple)):
                raise ChatTemplateError(f"{where}.tool_calls must be a list")
            msg["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(calls)]
        out.append(msg)
    return out


def harmony_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as gpt-oss's (harmony) template expects them, prepared as llama.cpp does
    (common/chat.cpp, `common_chat_params_init_gpt_oss`): an assistant's `reasoning_content`
    goes in `thinking`, and a message with tool calls that has reasoning loses its content (the
    template renders one analysis message before a call, and refuses both)."""
    out = []
    for m in msgs:
        if isinstance(m.get("reasoning_content"), str):
            m = {**m, "thinking": m["reasoning_content"]}
            if m.get("tool_calls"):
                m["content"] = ""
        out.append(m)
    return out


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered and tokenized chat prompt.

    `first_user_char` / `first_user_token`: the first-user-message boundary (see
    `ChatTemplate.first_user_boundary`) as a character offset in `text` and as a token
    position in `ids` (None when the conversation has no user message or the template's output
    before it depends on the message itself).
    """

    text: str
    ids: list[int]
    first_user_char: int | None
    first_user_token: int | None
    cache_point: int | None = None  # `apply(cache_after=...)`: the breakpoint's token position


_SENTINEL = "\ue000kvshare-first-user-message\ue001"


class ChatTemplate:
    """A compiled chat template. Thread-safe; build once per model."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 add_bos: bool = False, add_eos: bool = False, name: str = "custom",
                 extra_context: Mapping[str, Any] | None = None):
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("empty chat template")
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.extra_context = dict(extra_context or {})
        self._harmony = "<|channel|>" in source  # gpt-oss (llama.cpp's test for its handler)
        self._caps: TemplateCaps | None = None
        self._thinks: bool | None = None  # thinking_by_default, once known
        try:
            self._template = _make_env().from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        except (RecursionError, MemoryError, ValueError, TypeError) as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc!r}") from exc

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], tokenizer: Tokenizer | None = None) -> "ChatTemplate":
        """The GGUF's template, else the built-in Gemma 3 one for gemma* architectures, else
        ChatML. BOS/EOS texts and add-BOS/EOS flags come from `tokenizer` (or the metadata)."""
        source = meta.get("tokenizer.chat_template")
        arch = str(meta.get("general.architecture", ""))
        if isinstance(source, str) and source.strip():
            name = "gguf"
        elif arch.startswith("gemma"):
            source, name = GEMMA3_TEMPLATE, "gemma3"
        else:
            source, name = CHATML_TEMPLATE, "chatml"
        if tokenizer is not None:
            bos, eos = tokenizer.bos_token, tokenizer.eos_token
            add_bos, add_eos = tokenizer.add_bos, tokenizer.add_eos
        else:
            toks = meta.get("tokenizer.ggml.tokens") or []

            def text(key: str) -> str:
                i = meta.get(key)
                return toks[i] if isinstance(i, int) and 0 <= i < len(toks) else ""

            bos, eos = text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")
            default_bos = meta.get("tokenizer.ggml.model") == "llama"
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
            add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        return cls(source, bos_token=bos, eos_token=eos, add_bos=add_bos, add_eos=add_eos, name=name)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, source: str | None = None) -> "ChatTemplate":
        """A template for `tokenizer`'s model: `source` if given, else the GGUF's template the
        tokenizer was built from, else the built-in one for its architecture."""
        meta = {"general.architecture": tokenizer.architecture,
                "tokenizer.chat_template": source or tokenizer.chat_template_source}
        return cls.from_metadata(meta, tokenizer)

    @classmethod
    def from_gguf(cls, path: Any, tokenizer: Tokenizer | None = None) -> "ChatTemplate":
        """The chat template for a GGUF file (uses the process-wide cached tokenizer of that
        file, or `tokenizer`, for the template source and BOS/EOS handling)."""
        return cls.for_tokenizer(tokenizer if tokenizer is not None else Tokenizer.from_gguf(path))

    @property
    def caps(self) -> TemplateCaps:
        """What the template renders by itself (render probes, computed on first use)."""
        if self._caps is None:
            self._caps = detect_caps(lambda msgs, tools, agp: self._render(
                normalize_messages(msgs), tools, agp, None, {}, polyfill=False))
        return self._caps

    @property
    def polyfills(self) -> tuple[str, ...]:
        """What every render rewrites for this template (`template_caps.polyfills`)."""
        return polyfills(self.caps)

    # ---- rendering ----------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
               add_generation_prompt: bool = True, strip_bos: bool | None = None,
               continue_final: bool = False, **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI chat format) and `tools` (OpenAI tool
        definitions). Extra keyword arguments (e.g. `enable_thinking`) are template variables.
        With `strip_bos` (default: the tokenizer adds BOS) a leading BOS text is removed, and a
        trailing EOS text when the tokenizer adds EOS, as llama.cpp does. `continue_final`:
        the prompt continues the last message (an assistant prefill, see `_continued`);
        `add_generation_prompt` is then ignored."""
        msgs = normalize_messages(messages)
        if continue_final:
            return self._continued(msgs, tools, strip_bos, kwargs)
        return self._render(msgs, tools, add_generation_prompt, strip_bos, kwargs)

    def _continued(self, msgs: list[dict[str, Any]], tools: Any, strip_bos: bool | None,
                   kwargs: Mapping[str, Any]) -> str:
        """The prompt that continues the last message (llama-server's assistant prefill, vLLM's
        `continue_final_message`): the conversation rendered without a generation prompt, cut
        right after the last message's content (found with a sentinel, `_message_end`), so the
        reply goes on from its text inside its still-open turn. Whitespace a template trims off
        the content's end is put back (the reply continues after it). When the template does
        not print the content verbatim: the conversation before it with a generation prompt,
        then the content (llama.cpp's own construction)."""
        if not msgs:
            raise ChatTemplateError("there is no final message to continue")
        k = len(msgs) - 1
        content = msgs[k]["content"]
        text = self._render(msgs, tools, False, strip_bos, kwargs)
        end = self._message_end(msgs, k, text, tools, False, kwargs, strip_bos)
        core = content.strip()
        if end is not None:
            head = text[:end]
            body = content.rstrip()
            if not head.endswith(content) and body and head.endswith(body):
                head += content[len(body):]
            if not core or head.rstrip().endswith(core):
                return head
        before = self._render(msgs[:k], tools, True, strip_bos, kwargs) if k else ""
        return before + content

    def _render(self, msgs: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
                strip_bos: bool | None, kwargs: Mapping[str, Any], polyfill: bool = True) -> str:
        fills = self.polyfills if polyfill else ()
        if self._harmony:
            msgs = harmony_messages(msgs)
        if fills:
            msgs, tools = tool_polyfill.apply(msgs, tools, fills)
        ctx = template_context.defaults()
        ctx.update(bos_token=self.bos_token, eos_token=self.eos_token)
        ctx.update(self.extra_context)
        ctx.update(kwargs)
        if "enable_thinking" not in self.extra_context and "enable_thinking" not in kwargs:
            ctx["enable_thinking"] = self.thinking_by_default
        ctx["messages"] = msgs
        ctx["tools"] = list(tools) if tools else None
        ctx.setdefault("functions", template_context.functions_text(tools))
        ctx["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            out = self._template.render(**ctx)
        except _RaisedByTemplate as exc:
            raise ChatTemplateError(f"chat template rejected the request: {exc}") from exc
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template blocked by the sandbox: {exc}") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if strip_bos is None:
            strip_bos = self.add_bos
        if strip_bos and self.bos_token and out.startswith(self.bos_token):
            out = out[len(self.bos_token):]
        if self.add_eos and self.eos_token and out.endswith(self.eos_token):
            out = out[: -len(self.eos_token)]
        return out

    @property
    def thinking_by_default(self) -> bool:
        """`enable_thinking` when neither `--reasoning` nor the request sets it: llama-server's
        `--reasoning auto`, true when it counts the template as one that thinks
        (template_context.supports_thinking; a template that never reads the variable: true,
        it changes nothing)."""
        if self._thinks is None:
            self._thinks = ("enable_thinking" not in self.source
                            or template_context.supports_thinking(self.source, self._probe))
        return self._thinks

    def _probe(self, messages: list, add_generation_prompt: bool, enable_thinking: bool,
               tools: list | None) -> str | None:
        """The template's own output for `messages` (llama.cpp's analysis renders), or None
        when it fails."""
        try:
            return self._render(list(messages), tools, add_generation_prompt, False,
                                {"enable_thinking": enable_thinking}, polyfill=False)
        except ChatTemplateError:
            return None

    def first_user_boundary(self, messages: Sequence[Mapping[str, Any]], *,
                            tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
                            strip_bos: bool | None = None, **kwargs: Any) -> int | None:
        """Character offset in `render(...)` where the first user message's own text starts.

        Everything before it (BOS, system prompt, tool definitions, the user turn's header, and
        for Gemma the system prompt folded into that turn) is the part of the prompt that
        sessions sharing a system prompt and tools have in common. Found by rendering again
        with the first user message's content replaced by a sentinel: the offset is where the
        sentinel appears, provided the real prompt has the same text before it and shows the
        message's (possibly trimmed) text there. None when there is no user message, the
        template does not print it, or the text before it depends on the message.
        """
        msgs = normalize_messages(messages)
        u = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if u is None:
            return None
        prompt = self._render(msgs, tools, add_generation_prompt, strip_bos, kwargs)
        return self._boundary(msgs, u, prompt, tools, add_generation_prompt, strip_bos, kwargs)

    def _boundary(self, msgs, u, prompt, tools, add_generation_prompt, strip_bos, kwargs):
        sentinel = _SENTINEL
        while any(sentinel in m["content"] for m in msgs):
            sentinel += "\ue001"
        probe = [dict(m) for m in msgs]
        probe[u]["content"] = sentinel
        marked = self._render(probe, tools, add_generation_prompt, strip_bos, kwargs)
        b = marked.find(sentinel)
        if b < 0 or prompt[:b] != marked[:b]:
            return None
        # the real prompt must show the message itself there (possibly trimmed); otherwise the
        # template printed something message-dependent before it
        content = msgs[u]["content"]
        core = content.strip()
        if core and not (prompt.startswith(core[:32], b) or prompt.startswith(content[:32], b)):
            return None
        return b

    def first_user_boundary_tokens(self, messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                                   *, tools: Sequence[Any] | None = None,
                                   add_generation_prompt: bool = True, **kwargs: Any) -> int | None:
        """The first-user-message boundary as a token position in
        `tokenizer.encode(render(...))` (see `apply`), or None. Cheap when the boundary is a
        special-token split point (Gemma): only the prefix is tokenized, and that is memoised."""
        msgs = normalize_messages(messages)
        u = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if u is None:
            return None
        text = self._render(msgs, tools, add_generation_prompt, None, kwargs)
        char = self._boundary(msgs, u, text, tools, add_generation_prompt, None, kwargs)
        return None if char is None else prefix_token_count(tokenizer, text, char)

    def apply(self, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
              tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
              boundary: bool = True, cache_after: int | None = None,
              continue_final: bool = False, **kwargs: Any) -> ChatPrompt:
        """Render, tokenize (BOS per the model, special tokens parsed, as llama-server does)
        and, with `boundary`, locate the first-user-message boundary as a token position:
        the token count of the prompt up to that character, checked to be a prefix of the
        prompt's tokens (if a token spans the boundary, the largest position where the two
        tokenizations agree). `cache_after`: also locate a cache breakpoint, the end of
        messages[cache_after]'s content (-1: the first-user boundary), as `cache_point`.

        This is the one place BOS is settled: the template's own BOS text is stripped when
        the tokenizer adds one (`_render`), and a template whose BOS text does not match the
        tokenizer's spelling still yields a single BOS id. `continue_final`: the prompt
        continues the last message (`_continued`; no generation prompt)."""
        msgs = normalize_messages(messages)
        if continue_final:
            add_generation_prompt = False
            text = self._continued(msgs, tools, None, kwargs)
        else:
            text = self._render(msgs, tools, add_generation_prompt, None, kwargs)
        encoded = tokenizer.encode(text, add_special=True, parse_special=True)
        bos = tokenizer.bos_id
        shift = int(bos is not None and encoded[:2] == [bos, bos])
        ids = encoded[shift:]

        def tokens_at(char: int | None) -> int | None:
            if char is None:
                return None
            return max(0, prefix_token_count(tokenizer, text, char, encoded) - shift)

        char = tok = None
        u = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if boundary or cache_after == -1:
            if u is not None:
                char = self._boundary(msgs, u, text, tools, add_generation_prompt, None, kwargs)
            tok = tokens_at(char)
        point = None
        if cache_after == -1:
            point = tok
        elif cache_after is not None and 0 <= cache_after < len(msgs):
            point = tokens_at(self._message_end(msgs, cache_after, text, tools,
                                                add_generation_prompt, kwargs))
        if not boundary:
            char = tok = None
        return ChatPrompt(text, ids, char, tok, point)

    def _message_end(self, msgs, k, prompt, tools, add_generation_prompt, kwargs,
                     strip_bos: bool | None = None) -> int | None:
        """Character offset in `prompt` just after messages[k]'s content: a sentinel appended
        to the content shows where it lands; None when the template prints something
        message-dependent before it, or does not print the content verbatim."""
        sentinel = _SENTINEL
        while any(sentinel in m["content"] for m in msgs):
            sentinel += "\ue001"
        probe = [dict(m) for m in msgs]
        probe[k]["content"] = msgs[k]["content"] + sentinel
        try:
            marked = self._render(probe, tools, add_generation_prompt, strip_bos, kwargs)
        except ChatTemplateError:
            return None
        b = marked.find(sentinel)
        if b < 0:
            return None
        # where the two renders part (a template that trims the content parts before its
        # end): everything before that is this prompt's own text either way
        n = 0
        while n < b and n < len(prompt) and prompt[n] == marked[n]:
            n += 1
        return n
