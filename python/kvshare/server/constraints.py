"""What a chat or completion request forces its output to be, as a compiled grammar for the
engine: `tool_choice` "required" or a named function (the reply is valid calls of the declared
tools, in the model's own markup, each call's arguments valid against that tool's schema),
strict tools under "auto", `response_format` json_object / json_schema, and llama-server's
`json_schema` and `grammar` fields.

Grammars are compiled by the engine (kvshare.constrain, llguidance in the Rust core) on a
worker thread and cached by source, so an agent's every turn with the same tools reuses one.
A schema or grammar llguidance cannot enforce is a 400 naming the problem.
"""

from __future__ import annotations

import json

from kvshare.apis.base import ChatInput, OutputConstraint
from kvshare.apis.chat_output import OutputRules
from .errors import APIError, bad_request


class ToolCalls:
    """The served model's tool-call format (`--tool-parser`, else `generic` when the chat
    template's tools are polyfilled, else detected from the template) and how a request's
    tools turn into grammars and parsers; forced calls end after `max_calls`."""

    def __init__(self, template_source: str | None, override: str | None = None,
                 polyfills: tuple[str, ...] = (), max_calls: int = 8):
        from kvshare import toolcalls

        self._toolcalls = toolcalls
        self.max_calls = max_calls
        self.name = override or ("generic" if "tools" in polyfills
                                 else toolcalls.detect_format(template_source))
        self.thinking = toolcalls.template_has_thinking(template_source or "")
        toolcalls.get_format(self.name)  # unknown names fail at startup

    def format(self, tools: list[dict] | None):
        return self._toolcalls.get_format(self.name, tools=tools)

    # formats whose call markers are control tokens: the reply keeps their text
    SPECIAL_MARKERS = frozenset({"lfm2", "llama3"})

    def rules(self, chat: ChatInput, starts_in_reasoning: bool) -> OutputRules:
        forced = self._toolcalls.get_format(self.name).forced_auto
        # harmony's channels are the reply's structure, tools or not: always read
        parse_tools = (bool(chat.tools) and (chat.tool_choice != "none" or forced)
                       or self.name == "harmony")
        return OutputRules(
            tool_format=self.format(chat.tools) if parse_tools else None,
            reasoning=self.thinking and chat.reasoning_format != "none",
            starts_in_reasoning=starts_in_reasoning,
            parallel_tool_calls=chat.parallel_tool_calls)

    def constraint(self, chat: ChatInput) -> OutputConstraint | None:
        """The grammar the tool choice asks for: required / named, or strict tools under
        auto; None when the reply is free."""
        tools = chat.tools or []
        if not tools:
            return None
        for i, t in enumerate(tools):
            check_limits(t["function"].get("parameters"), f"tools[{i}].function.parameters")
        tools = closed_tools(tools)
        fmt = self.format(tools)
        if fmt.forced_auto:
            return self._forced_auto(fmt, chat, tools)
        if chat.tool_choice == "none":
            return None
        if chat.tool_choice == "required":
            return OutputConstraint("lark", fmt.grammar(tools, None, chat.parallel_tool_calls,
                                                        self.max_calls), "tool_choice")
        if chat.tool_choice.startswith("function:"):
            name = chat.tool_choice.split(":", 1)[1]
            return OutputConstraint("lark", fmt.grammar(tools, name, False), "tool_choice")
        if any(t["function"].get("strict") for t in tools):
            g = fmt.auto_grammar(tools)
            if g is not None:
                return OutputConstraint("lark", g, "tools")
        return None

    def _forced_auto(self, fmt, chat: ChatInput, tools: list[dict]) -> OutputConstraint:
        """A format whose every reply is its JSON object (`generic`): "auto" is a call or a
        response, "none" a response, "required" / a name calls."""
        choice = chat.tool_choice
        if choice == "required":
            most = self.max_calls if chat.parallel_tool_calls else 1
            return OutputConstraint("lark", fmt.grammar(tools, None, True, most), "tool_choice")
        if choice.startswith("function:"):
            return OutputConstraint("lark", fmt.grammar(tools, choice.split(":", 1)[1], False),
                                    "tool_choice")
        if choice == "none":
            return OutputConstraint("lark", fmt.response_grammar(), "tools")
        most = self.max_calls if chat.parallel_tool_calls else 1
        return OutputConstraint("lark", fmt.auto_grammar(tools, most), "tools")


def template_caps(info, tool_calls: ToolCalls | None) -> dict[str, bool]:
    """What the served chat template supports, itself or polyfilled (`/props`'s
    `chat_template_caps`): tools count only where requests' calls are read."""
    caps = dict(info.template_caps)
    fills = set(info.template_polyfills)
    for cap in ("system_role", "tools", "tool_calls", "tool_responses"):
        if cap in fills:
            caps[f"supports_{cap}"] = True
    if "tools" in fills:
        caps["supports_parallel_tool_calls"] = True
    if tool_calls is None:
        for cap in ("tools", "tool_calls", "parallel_tool_calls"):
            caps[f"supports_{cap}"] = False
    return caps


def describe_template(info, tool_calls: ToolCalls | None) -> str:
    """The startup log's line about the chat template: what it renders itself, what is
    polyfilled, and the tool-call format."""
    own = [k.removeprefix("supports_").replace("_", " ")
           for k, v in info.template_caps.items() if v]
    fills = ", ".join(info.template_polyfills) or "none"
    fmt = tool_calls.name if tool_calls is not None else "none"
    return f"supports {', '.join(own) or 'nothing probed'}; polyfills: {fills}; tool calls: {fmt}"


def request_constraint(chat: ChatInput | None, output: OutputConstraint | None,
                       tool_calls: ToolCalls | None) -> OutputConstraint | None:
    tool_c = tool_calls.constraint(chat) if chat is not None and tool_calls else None
    if (tool_c is not None and output is not None and chat is not None
            and tool_c.param == "tool_choice"):
        raise bad_request(f"'tool_choice' {chat.tool_choice.replace('function:', '')!r} "
                          f"forces tool calls; it cannot be combined with '{output.param}'",
                          output.param.split(".")[0])
    return output or tool_c


def compile_constraint(engine, c: OutputConstraint, rules: OutputRules | None = None):
    """The engine's compiled grammar for `c`; 400 naming the field when it does not compile.
    For a model that thinks (`rules.reasoning`), the grammar starts with an optional
    reasoning block (a required rest of one when the prompt opened it): forced output comes
    after the thinking, never inside it."""
    from kvshare.constrain import GrammarError
    from kvshare.toolcalls import allow_reasoning

    kind, source = c.kind, c.source
    if kind == "json_schema":
        schema = json.loads(source)
        check_limits(schema, c.param)
        source = output_schema_text(schema)
    elif kind == "json_object":
        kind, source = "json_schema", output_schema_text({"type": "object"})
    elif kind == "gbnf":  # llama-server's grammar field: llguidance reads Lark
        from kvshare.gbnf import gbnf_to_lark

        try:
            kind, source = "lark", gbnf_to_lark(source)
        except ValueError as e:
            raise APIError(400, f"invalid GBNF grammar in '{c.param}': {_short(e)}",
                           param=c.param, code="invalid_grammar") from None
    if rules is not None and rules.reasoning and kind in ("json_schema", "lark"):
        if kind == "json_schema":
            kind, source = "lark", "start: %json " + source
        source = allow_reasoning(source, opened=rules.starts_in_reasoning)
    try:
        return engine.compile_grammar(kind, source)
    except GrammarError as e:
        what = {"json_schema": "JSON schema", "lark": "grammar", "gbnf": "GBNF grammar",
                "json_object": "JSON"}.get(c.kind, c.kind)
        if c.param in ("tool_choice", "tools"):
            what = "tool parameters schema"
        raise APIError(400, f"invalid or unsupported {what} in '{c.param}': {_short(e)}",
                       param=c.param.split(".")[0], code="invalid_schema") from None


def check_limits(schema, param: str) -> None:
    """A forced JSON schema within `constraint_limits` (nesting, size, `$ref` cycles without a
    base case), else a 400 naming the limit."""
    from kvshare.constraint_limits import ConstraintLimitError, check_schema

    try:
        check_schema(schema, param)
    except ConstraintLimitError as e:
        raise APIError(400, str(e), param=param.split(".")[0].split("[")[0],
                       code="invalid_schema") from None


def _short(e: Exception) -> str:
    msg = str(e).strip()
    return msg if len(msg) <= 2000 else msg[:2000] + " ..."


# How a forced JSON value is written: as json.dumps / the chat templates' `tojson` write it
# (what models saw in training), with no free whitespace a small model could wander into.
# `lenient: false`: a keyword llguidance cannot enforce is an error (a 400 naming it), never
# silently unenforced.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": False}

MAX_ABS_NUMBER = 10**16 - 1
NUMBER_STEP = 1e-10

# keywords whose values are schemas / maps of schemas / lists of schemas
_SUB = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems")
_SUB_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_objects(schema):  # noqa: C901 - one walk over the schema keywords
    """A copy of `schema` as it is enforced: an object schema that lists `properties` and says
    nothing about `additionalProperties` allows no others, and numbers without bounds get
    16 integral digits at most (as llama.cpp's json-schema-to-grammar reads them) and 10
    fractional ones. Whatever this allows
    is valid under the original schema; without it a small model forced into a call pads the
    arguments with keys it made up (it copied the tool's schema keys into them)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUB:
        if isinstance(out.get(k), (dict, list)):
            out[k] = closed_objects(out[k])
    for k in _SUB_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: closed_objects(v) for n, v in out[k].items()}
    for k in _SUB_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(v) for v in out[k]]
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") in ("integer", "number") or (
            isinstance(out.get("type"), list) and {"integer", "number"} & set(out["type"])):
        # at most 16 integral digits, as llama.cpp's grammars allow: a forced small model
        # otherwise writes "age": 1800000000... until max_tokens cuts the JSON short
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_ABS_NUMBER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_ABS_NUMBER
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        if "number" in types and "multipleOf" not in out and "enum" not in out \
                and "const" not in out:
            # at most 10 fractional digits (llguidance's finest multipleOf): the forced model
            # otherwise writes "price": 1.000000... until max_tokens (2 of 200 random tool
            # sets did in bench/tool_acceptance.py)
            out["multipleOf"] = NUMBER_STEP
    return out


def output_schema_text(schema: dict) -> str:
    """A response_format / json_schema schema as the JSON text compiled for it."""
    out = closed_objects(schema)
    out["x-guidance"] = JSON_STYLE
    return json.dumps(out, ensure_ascii=False)


def closed_tools(tools: list[dict]) -> list[dict]:
    """Tools whose parameter schemas are `closed_objects`."""
    return [{**t, "function": {**t["function"],
                               "parameters": closed_objects(t["function"]["parameters"])}}
            for t in tools]
