"""What a request shares with others: the routing key of `kvshare route`.

The router renders nothing (it has no tokenizer or chat template), so it cannot hash the
prompt's token blocks as a replica does. It hashes instead the request fields that the chat
template puts at the head of the prompt and that agents of one tenant send unchanged on every
turn: the model, the tools and the system prompt (or, for raw-prompt endpoints, the head of the
prompt). Requests with equal keys render equal leading tokens, so sending them to one replica
lets it compute that prefix once (policy.py decides which replica).

Field order inside the JSON does not matter (canonical JSON: sorted keys, compact
separators), the conversation after the system prompt does not either. A request with nothing
shared (e.g. a lone user message without tools) gets no key: it has nothing to find in any
replica's cache, so it goes to the least-loaded one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Raw prompts: how much of the head is hashed. Enough to tell tenants' preambles apart, short
# enough that a prompt differing only in its tail (the new question) keeps its key.
PROMPT_CHARS = 2048
PROMPT_IDS = 512

# Roles of the messages a chat template renders before the conversation.
SYSTEM_ROLES = frozenset({"system", "developer"})

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
MESSAGES_PATHS = frozenset({"/v1/messages", "/messages", "/v1/messages/count_tokens",
                            "/messages/count_tokens"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})
PROMPT_PATHS = frozenset({"/v1/completions", "/completions", "/completion"})
INFILL_PATHS = frozenset({"/infill"})


def canonical_json(value: Any) -> bytes:
    """One byte string per JSON value, whatever the key order or spacing it was sent with."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=True).encode("utf-8", "surrogatepass")


def strip_root(path: str, root_path: str) -> str:
    """`path` without the `--root-path` mount prefix (unchanged when it does not start with
    it, e.g. the proxy in front already stripped it)."""
    root = root_path.rstrip("/")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def _digest(api: str, parts: dict[str, Any]) -> bytes:
    # The API's name is hashed too: equal text under different APIs renders differently
    # (tool schemas, system blocks), so it is a different prefix.
    return hashlib.blake2b(canonical_json([api, parts]), digest_size=16).digest()


def _leading(messages: Any, role_key: str = "role") -> list[Any]:
    """The leading system/developer messages (those before the conversation)."""
    if not isinstance(messages, list):
        return []
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get(role_key) not in SYSTEM_ROLES:
            break
        out.append(m)
    return out


def _without_cache_control(value: Any) -> Any:
    """Anthropic's `cache_control` marks are hints about where to cache, not prompt text: two
    agents marking the same system prompt differently still share it."""
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    return value


def _prompt_head(prompt: Any) -> str | list[int] | None:
    """The hashed head of a raw prompt: a string's first PROMPT_CHARS characters, a token
    list's first PROMPT_IDS ids (the leading ids of a mixed list); a batch's first prompt."""
    if isinstance(prompt, str):
        return prompt[:PROMPT_CHARS] or None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, (str, list)):  # a batch: routed by its first prompt
            return _prompt_head(first)
        ids: list[int] = []
        for x in prompt[:PROMPT_IDS]:
            if isinstance(x, bool) or not isinstance(x, int):
                break
            ids.append(x)
        return ids or None
    return None


def _shared_parts(path: str, body: dict) -> tuple[str, dict[str, Any]] | None:
    """(API name, the shared fields present), or None for a path the router does not key."""
    if path in CHAT_PATHS:
        return "chat", {"tools": body.get("tools"), "system": _leading(body.get("messages"))}
    if path in MESSAGES_PATHS:
        return "messages", {"tools": _without_cache_control(body.get("tools")),
                            "system": _without_cache_control(body.get("system"))}
    if path in RESPONSES_PATHS:
        inp = body.get("input")
        return "responses", {"instructions": body.get("instructions"),
                             "tools": body.get("tools"),
                             "system": _leading(inp) if isinstance(inp, list) else None}
    if path in PROMPT_PATHS:
        return "prompt", {"prompt": _prompt_head(body.get("prompt"))}
    if path in INFILL_PATHS:
        # /infill renders its repository context (input_extra) first; its `prompt` comes after
        # the code prefix, so it is not part of the shared head.
        return "infill", {"extra": body.get("input_extra")}
    return None


def prefix_key(path: str, body: dict, root_path: str = "") -> bytes | None:
    """The routing key of a request to `path` (the `--root-path` prefix is stripped) with the
    JSON object `body`: a blake2b digest of the model and the shared leading fields, or None
    when the request shares nothing (or is not a generation endpoint)."""
    if not isinstance(body, dict):
        return None
    path = strip_root(path, root_path)
    path = path.rstrip("/") or "/"
    got = _shared_parts(path, body)
    if got is None:
        return None
    api, parts = got
    parts = {k: v for k, v in parts.items() if v not in (None, "", [], {})}
    if not parts:
        return None
    # The model and the cache salt do not make a prefix by themselves, but they separate
    # prefixes: another model's KV is useless, and kvshare never shares KV across salts.
    for name in ("model", "cache_salt"):
        v = body.get(name)
        if isinstance(v, str) and v:
            parts[name] = v
    return _digest(api, parts)
