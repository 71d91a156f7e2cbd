"""The tools of a request as the formats need them: (name, parameters schema) pairs, the JSON
types a schema allows, and schemas made self-contained for an inline `%json { ... }`."""

from __future__ import annotations

import json
from typing import Any, Sequence

__all__ = ["dumps", "functions", "properties", "free_form", "types_of", "enum_values", "embed", "call_schema",
           "json_rule", "JSON_STYLE"]

# How every %json value is written: as `tojson` / json.dumps writes it (the chat templates'
# rendering of past calls, so what the models were trained on) and nothing else, so a forced
# model cannot wander into whitespace. `lenient: false`: a keyword llguidance does not
# implement fails the grammar (the server answers 400 naming it) instead of going unenforced.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": False}

# a function declared without parameters takes none (OpenAI: "an empty parameter list")
_EMPTY_PARAMS = {"type": "object", "properties": {}, "additionalProperties": False}


def functions(tools: Sequence[dict] | None) -> list[tuple[str, dict]]:
    """OpenAI `tools` (`{"type": "function", "function": {...}}`, or the inner object alone)
    -> [(name, parameters schema)] in order. Raises ValueError on a malformed tool or a name
    given twice."""
    out: list[tuple[str, dict]] = []
    seen: set[str] = set()
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError("a tool must be an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"unsupported tool type {tool.get('type')!r}")
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("a tool needs a function name")
        if name in seen:
            raise ValueError(f"tool {name!r} is declared twice")
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_PARAMS
        if not isinstance(params, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
        seen.add(name)
        out.append((name, params))
    return out


def free_form(params: dict) -> bool:
    """A parameters schema that declares no properties and does not forbid them: any
    arguments (MCP tools often say only `{"type": "object"}`)."""
    return (not isinstance(params.get("properties"), dict)
            and params.get("additionalProperties", True) is not False)


def properties(params: dict) -> tuple[list[tuple[str, dict]], set[str]]:
    """A parameters schema's (property name, schema) pairs in order, and its required names."""
    props = params.get("properties") or {}
    items = [(k, v if isinstance(v, dict) else {}) for k, v in props.items()]
    return items, set(params.get("required") or ())


# type names some tool definitions use instead of JSON schema's (vLLM reads them too)
_TYPE_ALIASES = {"int": "integer", "float": "number", "double": "number", "bool": "boolean",
                 "str": "string", "text": "string", "dict": "object", "list": "array"}


def types_of(schema: Any) -> set[str] | None:
    """The JSON types a schema allows, None when it does not say (any value)."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return {_TYPE_ALIASES.get(t, t)}
    if isinstance(t, list) and t:
        return {_TYPE_ALIASES.get(x, x) for x in t if isinstance(x, str)}
    values = enum_values(schema)
    if values:
        return {_json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            out: set[str] = set()
            for b in branches:
                bt = types_of(b)
                if bt is None:
                    return None
                out |= bt
            return out
    return None


def enum_values(schema: dict) -> list | None:
    """The values an `enum` or `const` allows, None if it has neither."""
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    return [schema["const"]] if "const" in schema else None


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _rebase(node: Any, base: str) -> Any:
    """A copy with local `$ref`s ("#..." JSON pointers) moved under `base`."""
    if isinstance(node, dict):
        out = {k: _rebase(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase(v, base) for v in node]
    return node


def embed(schema: dict, root: dict | None = None, key: str = "kvshare_root") -> dict:
    """`schema` (a part of `root`, or `root` itself) as a self-contained root schema: local
    `$ref`s point into a copy of `root` under `$defs[key]`. Adds `JSON_STYLE`."""
    out = dict(schema)
    if root is not None and _has_ref(schema):
        base = f"#/$defs/{key}"
        out = _rebase(schema, base)
        out["$defs"] = {**(out.get("$defs") or {}), key: _rebase(root, base)}
    out["x-guidance"] = JSON_STYLE
    return out


def dumps(value: Any) -> str:
    """JSON text of a value read from a reply, as json.dumps writes it, UTF-8 as is (lone
    surrogates, which a JSON `\\ud800` escape can produce, stay escaped so that the text
    encodes). Raises ValueError/TypeError for what JSON cannot hold (NaN, sets, bytes)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, allow_nan=False)
    return text


def json_rule(schema: dict) -> str:
    """The Lark `%json` item for a schema (ASCII, one line)."""
    return "%json " + json.dumps(schema, ensure_ascii=True, sort_keys=False)


def call_schema(fns: Sequence[tuple[str, dict]], args_key: str) -> dict:
    """The schema of one JSON call object `{"name": NAME, args_key: ARGS}` of any of `fns`,
    "name" first (so a reader can announce the call before its arguments end)."""
    branches, defs = [], {}
    for i, (name, params) in enumerate(fns):
        if _has_ref(params):
            key = f"kvshare_tool{i}"
            params = defs[key] = _rebase(params, f"#/$defs/{key}")
        branches.append({"type": "object",
                         "properties": {"name": {"const": name}, args_key: params},
                         "required": ["name", args_key], "additionalProperties": False})
    schema = dict(branches[0]) if len(branches) == 1 else {"anyOf": branches}
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = JSON_STYLE
    return schema
