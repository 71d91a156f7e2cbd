"""Which replica stored which Responses API response.

A replica keeps the responses it produced (`store`), and a follow-up request names one with
`previous_response_id` (or reads it with GET /v1/responses/{id}): that request must go to the
replica that has it, wherever its prefix would route it. The router learns the owner from the
answers it passes on: the top-level `"id": "resp_..."` of a JSON response, or the first event
of a stream (response.created carries the response object). It peeks at the bytes as they pass,
keeping only a short tail across chunk boundaries; it never holds the stream back.
"""

from __future__ import annotations

import re
from collections import OrderedDict

# `"id"` right after a quote, so `"previous_response_id"` does not match; the top-level id of a
# response object and of the response in response.created is the first one in the bytes.
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,200})"')
_TAIL = 256  # bytes kept across chunks: a match split between two chunks is still found
PEEK_LIMIT = 64 * 1024  # the id comes first; after this many bytes, stop looking


class ResponseOwners:
    """A bounded LRU map response id -> backend URL."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def get(self, response_id: str) -> str | None:
        url = self._owners.get(response_id)
        if url is not None:
            self._owners.move_to_end(response_id)
        return url

    def put(self, response_id: str, backend: str) -> None:
        self._owners[response_id] = backend
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)


class IdPeeker:
    """Finds the first response id in a byte stream fed chunk by chunk."""

    def __init__(self, limit: int = PEEK_LIMIT):
        self.limit = limit
        self.found: str | None = None
        self._seen = 0
        self._tail = b""

    @property
    def done(self) -> bool:
        return self.found is not None or self._seen > self.limit

    def feed(self, chunk: bytes) -> str | None:
        """The id once found in the bytes so far (None until then, and after giving up)."""
        if self.done:
            return self.found
        window = self._tail + chunk[: self.limit]
        self._seen += len(chunk)
        m = _ID.search(window)
        if m is not None:
            self.found = m.group(1).decode("ascii")
        else:
            self._tail = window[-_TAIL:]
        return self.found


def response_id_in_path(path: str) -> str | None:
    """The id in /v1/responses/{id}[/...] (GET, DELETE, input_items, cancel), or None."""
    for prefix in ("/v1/responses/", "/responses/"):
        if path.startswith(prefix):
            rid = path[len(prefix):].split("/", 1)[0]
            return rid or None
    return None
