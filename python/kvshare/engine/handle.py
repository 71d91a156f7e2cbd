"""RequestHandle: the server's end of one request — an event stream fed by the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from typing import AsyncIterator, Callable, Iterator, Union

from kvshare.engine.api import FinishEvent, TokenEvent

Event = Union[TokenEvent, FinishEvent]


class RequestHandle:
    """Created by `Engine.submit`. Iterate it (async inside an event loop, or `events()` from a
    plain thread) to get TokenEvents followed by exactly one FinishEvent per choice (`n`, each
    event's `index` says which); the stream ends after the last one, or at the first that
    ends in an error or a cancellation (cancel the handle then: the other choices stop).

    `cancel` asks the engine to stop this request; it is all the handle knows of the engine,
    so that this module sits below `kvshare.engine.engine` and the engine alone feeds it."""

    def __init__(self, request_id: str, cancel: Callable[[], None], n: int = 1):
        self.request_id = request_id
        self._request_cancel = cancel
        self._open = n  # choices without their FinishEvent yet
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._async: asyncio.Queue[Event] | None = asyncio.Queue()
        except RuntimeError:
            self._loop = None
            self._async = None
        self.finished = False

    def put(self, event: Event) -> None:
        """Deliver one event; called on the engine thread."""
        if self._loop is not None:
            assert self._async is not None  # made with the loop, in __init__
            # a closed loop raises RuntimeError: nobody is listening any more
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
        else:
            self._sync.put(event)

    def cancel(self) -> None:
        """Stop generating; a FinishEvent(reason="cancelled") follows. Safe from any thread."""
        self._request_cancel()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        if self._loop is not None:
            raise RuntimeError("this handle was created inside an event loop: iterate it with `async for`")
        while not self.finished:
            event = self._sync.get(timeout=timeout)
            self._note(event)
            yield event

    def _note(self, event: Event) -> None:
        if isinstance(event, FinishEvent):
            self._open -= 1
            if self._open <= 0 or event.reason in ("error", "cancelled"):
                self.finished = True

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Event]:
        if self._async is None:
            raise RuntimeError("this handle was created outside an event loop: use events()")
        while not self.finished:
            event = await self._async.get()
            self._note(event)
            yield event

    def result(self, timeout: float | None = None) -> tuple[list[TokenEvent], FinishEvent]:
        """Collect the whole stream (sync handles only)."""
        tokens: list[TokenEvent] = []
        for event in self.events(timeout):
            if isinstance(event, FinishEvent):
                return tokens, event
            tokens.append(event)
        raise RuntimeError("stream ended without a FinishEvent")
