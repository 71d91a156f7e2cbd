"""Seeded random JSON schemas, OpenAI tool sets and requests for the agent-API acceptance tests
(tests/test_agent_api.py) and bench (bench/tool_acceptance.py, which imports this file by path).

Every schema is an object schema built from the shapes tools use: nested objects, arrays of
scalars or objects, enums, required and optional fields, integers and numbers with
minimum/maximum, strings. Output sizes are bounded (strings by maxLength, arrays by maxItems,
nesting depth) so that a forced call fits a small max_tokens: the model, not the schema, decides
whether a reply is short. Only the standard library is used; the same seed gives the same
schemas on every Python version (random.Random's sequence functions are stable).
"""

from __future__ import annotations

import random
from typing import Any

NOUNS = ["city", "query", "unit", "limit", "date", "name", "email", "tags", "count", "price",
         "color", "size", "level", "title", "owner", "path", "mode", "lang", "score", "region",
         "item", "user", "note", "kind", "rating", "width", "height", "days", "topic", "label"]
VERBS = ["get", "search", "create", "update", "list", "book", "convert", "send", "find",
         "check", "schedule", "compute", "translate", "lookup", "order", "cancel"]
OBJECTS = ["weather", "flights", "events", "invoice", "contact", "files", "recipe", "stock",
           "hotel", "ticket", "message", "timer", "route", "report", "playlist", "order"]
ENUM_WORDS = ["low", "medium", "high", "red", "green", "blue", "celsius", "fahrenheit", "asc",
              "desc", "daily", "weekly", "small", "large", "en", "fr", "de", "open", "closed"]
TASKS = ["Find me something useful for a trip to Lisbon next week.",
         "I need to sort out my schedule for Tuesday.",
         "Look this up for me: the cheapest option for two people.",
         "Please help me with my order from yesterday.",
         "What is the weather like in Paris?",
         "Send a short note to Alice about the meeting.",
         "Convert 12 units for me and list the results.",
         "Book something nice for the weekend, blue if possible."]


def _names(rng: random.Random, pool: list[str], k: int) -> list[str]:
    return rng.sample(pool, k)


def scalar_schema(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 12, 16, 24])}
    if kind == "integer":
        lo = rng.choice([0, 1, -10, 100])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([5, 10, 99, 1000])}
    if kind == "number":
        lo = rng.choice([0, -1, 10])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 50, 500])}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"type": "string", "enum": _names(rng, ENUM_WORDS, rng.randint(2, 4))}


def value_schema(rng: random.Random, depth: int, max_depth: int) -> dict[str, Any]:
    r = rng.random()
    if depth < max_depth and r < 0.18:
        return object_schema(rng, depth + 1, max_depth, max_props=2)
    if r < 0.32:
        items = (object_schema(rng, depth + 1, max_depth, max_props=2)
                 if depth < max_depth and rng.random() < 0.3 else scalar_schema(rng))
        return {"type": "array", "items": items, "minItems": rng.choice([0, 1]),
                "maxItems": rng.choice([2, 3])}
    return scalar_schema(rng)


def object_schema(rng: random.Random, depth: int = 0, max_depth: int = 2,
                  max_props: int = 4) -> dict[str, Any]:
    """An object with 1..max_props properties, some required (at least one), no extras."""
    names = _names(rng, NOUNS, rng.randint(1, max_props))
    props = {}
    for name in names:
        s = value_schema(rng, depth, max_depth)
        if rng.random() < 0.2:
            s["description"] = f"the {name}"
        props[name] = s
    required = [n for n in names if rng.random() < 0.6] or [names[0]]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def tool_set(rng: random.Random, n_tools: int | None = None) -> list[dict[str, Any]]:
    """1-6 OpenAI function tools with distinct names and random parameter schemas."""
    n = n_tools if n_tools is not None else rng.randint(1, 6)
    names: list[str] = []
    while len(names) < n:
        name = f"{rng.choice(VERBS)}_{rng.choice(OBJECTS)}"
        if name not in names:
            names.append(name)
    return [{"type": "function",
             "function": {"name": name,
                          "description": f"{name.replace('_', ' ').capitalize()}.",
                          "parameters": object_schema(rng, max_props=3)}}
            for name in names]


def tool_case(seed: int, n_tools: int | None = None, parallel: bool = False) -> dict[str, Any]:
    """A chat request body (no model/max_tokens) with random tools and a forcing tool_choice:
    "required" or a named function, alternating by seed.

    "required" comes with parallel_tool_calls false unless `parallel`: a small model allowed
    one or more calls rarely chooses to stop after one, and keeps calling until max_tokens."""
    rng = random.Random(f"tools-{seed}")
    tools = tool_set(rng, n_tools)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": rng.choice(TASKS)}],
                            "tools": tools}
    if seed % 2 == 0:
        body["tool_choice"] = "required"
        body["parallel_tool_calls"] = parallel
    else:
        body["tool_choice"] = {"type": "function",
                               "function": {"name": rng.choice(tools)["function"]["name"]}}
    return body


def schema_case(seed: int) -> dict[str, Any]:
    """A chat request body (no model/max_tokens) with a strict json_schema response_format."""
    rng = random.Random(f"schema-{seed}")
    schema = object_schema(rng, max_props=4)
    name = f"{rng.choice(OBJECTS)}_{seed}"
    return {"messages": [{"role": "user",
                          "content": f"{rng.choice(TASKS)} Answer as a JSON {name} object."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": name, "schema": schema,
                                                "strict": True}}}


def tool_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"]["parameters"]
    return None


def check_tool_calls(case: dict[str, Any], calls: list[tuple[str, str]]) -> list[str]:
    """Problems with (name, arguments JSON) calls answering `case` (empty: all valid): at least
    one call, each name declared (the named one when tool_choice names one), arguments JSON
    valid against that tool's parameters schema."""
    import json

    import jsonschema

    problems = []
    if not calls:
        return ["no tool calls"]
    forced = case["tool_choice"]
    for name, args in calls:
        schema = tool_schema(case["tools"], name)
        if schema is None:
            problems.append(f"undeclared tool {name!r}")
            continue
        if isinstance(forced, dict) and name != forced["function"]["name"]:
            problems.append(f"called {name!r}, forced {forced['function']['name']!r}")
        try:
            value = json.loads(args)
        except ValueError as e:
            problems.append(f"{name}: arguments are not JSON ({e}): {args!r}")
            continue
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            problems.append(f"{name}: arguments {args!r} fail the schema: {e.message}")
    return problems


def check_json(schema: dict[str, Any], text: str | None) -> list[str]:
    import json

    import jsonschema

    try:
        value = json.loads(text or "")
    except ValueError as e:
        return [f"not JSON ({e}): {text!r}"]
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return [f"{text!r} fails the schema: {e.message}"]
    return []


if __name__ == "__main__":  # print a few cases
    import json
    import sys

    for s in range(int(sys.argv[1]) if sys.argv[1:] else 2):
        print(json.dumps(tool_case(s), indent=1))
        print(json.dumps(schema_case(s), indent=1))
