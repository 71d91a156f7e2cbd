"""The output-constraint fields of a request: OpenAI's `response_format` (json_object,
json_schema) and llama-server's `json_schema` and `grammar`, at most one of them; and a JSON
schema as a constraint (`schema_constraint`, also for Anthropic's and Responses' formats)."""

from __future__ import annotations

import json
from typing import Any

from kvshare.server.errors import bad_request

from .base import OutputConstraint

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar; compiling it runs on a worker thread


def parse_output_constraint(body: dict, *, chat: bool) -> OutputConstraint | None:
    """`response_format` (OpenAI: json_object, json_schema) and llama-server's `json_schema`
    and `grammar` fields; at most one of them."""
    found: list[OutputConstraint] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad_request("'response_format' must be an object", "response_format")
        rtype = rf.get("type", "text")
        if rtype == "json_object":
            schema = rf.get("schema")  # llama-server also takes a schema here
            if schema is not None:
                found.append(schema_constraint(schema, "response_format.schema"))
            else:
                found.append(OutputConstraint("json_object", "", "response_format"))
        elif rtype == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad_request("'response_format.json_schema' must be an object with a "
                                  "'schema'", "response_format")
            schema = js.get("schema")
            if schema is None:
                schema = {}  # OpenAI: an absent schema means any JSON value
            found.append(schema_constraint(schema, "response_format.json_schema.schema"))
        elif rtype != "text":
            raise bad_request(f"response_format type {rtype!r} is not one of 'text', "
                              "'json_object', 'json_schema'", "response_format")
    if body.get("json_schema") is not None:
        found.append(schema_constraint(body["json_schema"], "json_schema"))
    g = body.get("grammar")
    if g is not None and g != "":
        if not isinstance(g, str):
            raise bad_request("'grammar' must be a string (a GBNF grammar)", "grammar")
        if len(g) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"'grammar' has {len(g)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS} are supported", "grammar")
        found.append(OutputConstraint("gbnf", g, "grammar"))
    if len(found) > 1:
        raise bad_request("give at most one of 'response_format' (json), 'json_schema' and "
                          "'grammar'", found[1].param.split(".")[0])
    return found[0] if found else None


def schema_constraint(schema: Any, param: str) -> OutputConstraint:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param.split(".")[0])
    text = json.dumps(schema, ensure_ascii=False, sort_keys=False)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} "
                          "are supported", param.split(".")[0])
    return OutputConstraint("json_schema", text, param)
