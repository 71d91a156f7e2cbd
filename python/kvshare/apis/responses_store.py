"""Stored Responses API responses (`store`, `previous_response_id`): in memory, by id, each
visible only to its owner (the tenant and the request's `cache_salt`)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .base import RequestContext

DEFAULT_MAX_ITEMS = 10000


# --------------------------------------------------------------------------- ownership

def owner_of(ctx: RequestContext, cache_salt: str | None) -> str:
    """Who a stored response belongs to: the tenant (API key) and the request's `cache_salt`
    (its SHA-256, as the KV cache derives it). A response is only visible to the same pair."""
    salt = hashlib.sha256(cache_salt.encode("utf-8")).hexdigest() if cache_salt else ""
    return f"{ctx.tenant_id}:{salt}"


# --------------------------------------------------------------------------- the store

@dataclass
class ResponseRecord:
    """One stored response: the object as returned to the client, and its conversation as
    OpenAI chat messages (the input without the instructions, plus this response's output as
    an assistant message), with the instructions and tools (Responses shape) it used.

    The message dicts are shared with the records of the responses that continue this one
    (a chain of N turns holds each message once, not N times) and are never mutated."""

    response: dict
    messages: list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None


class ResponseStore:
    """Stored responses in memory, by id. A record is visible only to its owner (`owner_of`):
    an id of another owner reads exactly as an unknown one. Records expire `ttl_s` seconds
    after they were stored (None or 0: never); at most `max_items` are kept (the oldest go
    first). Thread-safe."""

    def __init__(self, ttl_s: float | None = None, max_items: int = DEFAULT_MAX_ITEMS, *,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s if ttl_s else None
        self.max_items = max(1, int(max_items))
        self._clock = clock
        self._lock = threading.Lock()
        # id -> (owner, stored at, record); insertion order = age
        self._items: OrderedDict[str, tuple[str, float, ResponseRecord]] = OrderedDict()

    def _expired(self, stored_at: float, now: float) -> bool:
        return self.ttl_s is not None and now - stored_at >= self.ttl_s

    def _prune(self, now: float) -> None:
        while self._items:
            _owner_, at, _rec = next(iter(self._items.values()))
            if not self._expired(at, now):
                break
            self._items.popitem(last=False)

    def put(self, resp_id: str, owner: str, record: ResponseRecord) -> None:
        with self._lock:
            now = self._clock()
            self._items.pop(resp_id, None)
            self._items[resp_id] = (owner, now, record)
            self._prune(now)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, resp_id: str, owner: str) -> ResponseRecord | None:
        with self._lock:
            hit = self._items.get(resp_id)
            if hit is None or hit[0] != owner:
                return None
            if self._expired(hit[1], self._clock()):
                del self._items[resp_id]
                return None
            return hit[2]

    def delete(self, resp_id: str, owner: str) -> bool:
        with self._lock:
            hit = self._items.get(resp_id)
            if hit is None or hit[0] != owner:
                return False
            del self._items[resp_id]
            return not self._expired(hit[1], self._clock())

    def __len__(self) -> int:
        with self._lock:
            self._prune(self._clock())
            return len(self._items)
