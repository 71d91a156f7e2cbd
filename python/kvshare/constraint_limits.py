"""What a request's output constraint may be, checked before the request is queued: sizes that
would make llguidance's parser fail mid-generation (an Earley row has at most 2,000 items) or
the server's own passes recurse too deep, and JSON schemas that describe no value at all
(`$ref` cycles without a base case). Each refusal is a 400 that names the limit.

The engine also runs a compiled grammar's first steps once (`constrain.compile_grammar`), which
catches what llguidance itself reports only when it computes a mask (`NoExtensionBias`, a row
over its limit at the first token)."""

from __future__ import annotations

from typing import Any

# GBNF rules (named ones; groups inside a rule count as theirs). A grammar of thousands takes
# seconds to convert, and llguidance predicts every rule reachable at a position into one
# Earley row of at most 2,000 items (a chain of 8,000 rules that each start with the next
# fills it ~8 times over; shorter such chains are caught by the probe). A deep right-recursive
# chain is fine, and llama.cpp's JSON-schema grammars of large tool sets have a few hundred.
MAX_GBNF_RULES = 1000
# Earley items predicted where one GBNF rule starts (gbnf/earley.py: its alternatives and those
# of every parser rule on its left corner, transitively): llguidance's row limit, checked on
# the parsed grammar before the lexeme passes (seconds on such grammars). On chains of
# left-recursive alternatives the estimate is 3-5 items over llguidance's count (420 rules of
# 5: 2,101 against 2,098), so only a grammar within a few items of the row limit could be
# refused here and accepted there; llama.cpp's grammars predict at most 11 items.
MAX_PREDICTED_ITEMS = 2000
# nesting of a JSON schema (objects and arrays) and of a GBNF rule's groups: the passes over
# them recurse, and nothing real nests deeper than a few dozen levels
MAX_NESTING = 64
# JSON values in one schema (a large tool set's schemas are a few thousand)
MAX_SCHEMA_NODES = 50_000


class ConstraintLimitError(ValueError):
    """A constraint over a limit, or a schema that no value satisfies; the message says
    which."""


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/name", a JSON pointer) names; None when it
    names nothing here (llguidance reports those)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# keywords whose values are maps of schemas, and those whose values are data, not schemas
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties",
                          "dependentSchemas"})
_DATA = frozenset({"enum", "const", "default", "examples", "required", "x-guidance"})


def _schema_nodes(schema: Any) -> list[dict]:
    """Every dict in a schema position (not the maps of `properties`, not `enum` data)."""
    out: list[dict] = []
    stack = [(schema, "schema")]
    while stack:
        node, kind = stack.pop()
        if isinstance(node, list):
            stack.extend((v, kind) for v in node)
        elif isinstance(node, dict) and kind == "map":
            stack.extend((v, "schema") for v in node.values())
        elif isinstance(node, dict) and kind == "schema":
            out.append(node)
            stack.extend((v, "map" if k in _SCHEMA_MAPS else "data" if k in _DATA
                          else "schema") for k, v in node.items())
    return out


def check_schema_shape(schema: Any, param: str) -> None:
    """Nesting, size and the value types of the keywords the server reads itself (`type`,
    `$ref`), without recursion."""
    stack = [(schema, 1, "schema")]
    nodes = 0
    while stack:
        node, depth, kind = stack.pop()
        nodes += 1
        if depth > MAX_NESTING:
            raise ConstraintLimitError(f"the JSON schema in '{param}' nests deeper than "
                                       f"{MAX_NESTING} levels (the limit)")
        if nodes > MAX_SCHEMA_NODES:
            raise ConstraintLimitError(f"the JSON schema in '{param}' has more than "
                                       f"{MAX_SCHEMA_NODES} values (the limit)")
        if isinstance(node, list):
            stack.extend((v, depth + 1, kind) for v in node)
        elif isinstance(node, dict) and kind != "schema":
            child = "data" if kind == "data" else "schema"
            stack.extend((v, depth + 1, child) for v in node.values())
        elif isinstance(node, dict):
            _check_keywords(node, param)
            stack.extend((v, depth + 1, "map" if k in _SCHEMA_MAPS else
                          "data" if k in _DATA else "schema") for k, v in node.items())


def _check_keywords(node: dict, param: str) -> None:
    t = node.get("type")
    if t is not None and not isinstance(t, str) and not (
            isinstance(t, list) and all(isinstance(x, str) for x in t)):
        raise ConstraintLimitError(f"invalid JSON schema in '{param}': 'type' must be a "
                                   "string or an array of strings")
    if "$ref" in node and not isinstance(node["$ref"], str):
        raise ConstraintLimitError(f"invalid JSON schema in '{param}': '$ref' must be a "
                                   "string")


def _required_subschemas(node: dict) -> list[Any] | None:
    """The subschemas every value of `node` must contain a value of (None: `node` is no
    object or array that must hold something)."""
    out: list[Any] = []
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if types is not None and not isinstance(types, list):
        return None
    p, r = node.get("properties"), node.get("required")
    props: dict = p if isinstance(p, dict) else {}
    required: list = r if isinstance(r, list) else []
    if types is None or "object" in types:
        out += [props[k] for k in required if isinstance(k, str) and k in props]
    if types is None or "array" in types:
        n = node.get("minItems")
        if isinstance(n, int) and n > 0 and isinstance(node.get("items"), dict):
            out.append(node["items"])
    return out if types is None or len(types) == 1 else None


def _productive(root: Any, node: Any, done: dict[int, bool]) -> bool:
    """Whether some finite value satisfies `node`, as far as its `$ref`s, `required`
    properties, non-empty arrays and `anyOf`/`oneOf`/`allOf` say (`done`: schemas known
    productive so far, by id; one pass of the fixpoint in `check_ref_cycles`)."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    if "$ref" in node and isinstance(node["$ref"], str):
        target = _resolve(root, node["$ref"])
        if target is not None and not done.get(id(target), False):
            return False
    for key in ("anyOf", "oneOf"):
        alts = node.get(key)
        if isinstance(alts, list) and alts and not any(done.get(id(a), False) or (
                not isinstance(a, dict) and a is not False) for a in alts):
            return False
    alls = node.get("allOf")
    if isinstance(alls, list) and not all(done.get(id(a), a is True) for a in alls):
        return False
    needed = _required_subschemas(node)
    return needed is None or all(done.get(id(s), s is True) for s in needed)


def check_ref_cycles(schema: Any, param: str) -> None:
    """Refuse a schema no finite value satisfies because its `$ref`s (or required properties
    and non-empty arrays) only lead back to themselves: `{"$ref": "#"}`, an object that
    requires a property of its own type. Computed as a least fixpoint over the schema's
    subschemas (call after `check_schema_shape`)."""
    subs = _schema_nodes(schema)
    if not any("$ref" in s for s in subs):
        return
    done: dict[int, bool] = {}
    changed = True
    while changed:
        changed = False
        for s in subs:
            if not done.get(id(s)) and _productive(schema, s, done):
                done[id(s)] = True
                changed = True
    if isinstance(schema, dict) and not done.get(id(schema)):
        raise ConstraintLimitError(f"the JSON schema in '{param}' has a `$ref` cycle without "
                                   "a base case: no finite value satisfies it")


def check_schema(schema: Any, param: str) -> None:
    """All the checks of a JSON schema a request forces its output into."""
    check_schema_shape(schema, param)
    check_ref_cycles(schema, param)
