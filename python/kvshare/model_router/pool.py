"""The router's models and their children (server-models.cpp server_models): each model's
status (`unloaded`, `loading`, `loaded`; a failed load or a crash leaves it `unloaded` with
its exit code), loading on demand, unloading, and `--models-max`: loading one more model than
that unloads the least recently used loaded model with no request in progress; while every
loaded model is busy the load waits for one to finish (llama-server queues it the same way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .child import Child
from .listing import ModelEntry
from .preset import DEFAULT_STOP_TIMEOUT

log = logging.getLogger("kvshare.model_router")

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
EVICT_POLL_S = 0.05


class LoadFailed(Exception):
    def __init__(self, name: str, exit_code: int, reason: str):
        super().__init__(f"model '{name}' failed to load (exit code {exit_code}): {reason}")
        self.exit_code = exit_code


@dataclass
class ModelState:
    entry: ModelEntry
    argv: list[str]  # the child's command line
    status: str = UNLOADED
    exit_code: int = 0
    url: str | None = None
    child: Child | None = None
    inflight: int = 0
    last_used: float = 0.0
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set: not loading

    @property
    def running(self) -> bool:
        return self.status in (LOADING, LOADED)

    @property
    def failed(self) -> bool:
        return self.status == UNLOADED and self.exit_code != 0


class ModelPool:
    """`child_argv(entry)` is a model's `kvshare serve` command line; `env` its environment.
    Runs on one event loop."""

    def __init__(self, entries: Sequence[ModelEntry], child_argv: Callable[[ModelEntry], list[str]],
                 env: dict[str, str], models_max: int):
        self.models: dict[str, ModelState] = {
            e.name: ModelState(e, child_argv(e)) for e in entries}
        self.names: dict[str, str] = {}  # a model's name or alias -> its name
        for e in entries:
            for alias in e.aliases:
                self.names.setdefault(alias, e.name)
        for e in entries:
            self.names[e.name] = e.name
        self.env = env
        self.models_max = models_max
        self.closing = False

    def find(self, name: str) -> ModelState | None:
        canon = self.names.get(name)
        return self.models[canon] if canon is not None else None

    def running(self) -> list[ModelState]:
        return [s for s in self.models.values() if s.running]

    # ---- requests
    def begin(self, s: ModelState) -> None:
        s.inflight += 1
        s.last_used = time.monotonic()

    def end(self, s: ModelState) -> None:
        s.inflight -= 1
        s.last_used = time.monotonic()

    async def ensure_loaded(self, s: ModelState) -> None:
        """Loads `s` unless it is running, and waits until it serves. Raises LoadFailed."""
        if not s.running:
            await self.load(s)
        await s.settled.wait()
        if s.status != LOADED:
            reason = s.child.failure() if s.child is not None else "not started"
            raise LoadFailed(s.entry.name, s.exit_code, reason)

    # ---- load / unload
    async def load(self, s: ModelState) -> None:
        """Starts `s`'s child (returns as it starts; `settled` tells when it serves or
        failed)."""
        if s.running or self.closing:
            return
        s.status, s.exit_code, s.url = LOADING, 0, None
        s.settled.clear()
        await self._make_room(s)
        if self.closing:
            self._set_unloaded(s, 0)
            return
        child = Child(s.entry.name, s.argv, self.env,
                      on_ready=lambda url: self._on_ready(s, child, url),
                      on_exit=lambda code: self._on_exit(s, child, code))
        s.child = child
        log.info("loading model %s: %s", s.entry.name, " ".join(s.argv))
        try:
            child.start()
        except OSError as e:
            log.error("cannot start the server of model %s: %s", s.entry.name, e)
            child.tail.append(f"kvshare: error: cannot start: {e.strerror or e}")
            self._set_unloaded(s, 1)

    async def _make_room(self, s: ModelState) -> None:
        """Unloads least recently used idle models until `s` fits under --models-max."""
        while self.models_max > 0 and not self.closing:
            others = [o for o in self.running() if o is not s]
            if len(others) < self.models_max:
                return
            idle = [o for o in others if o.status == LOADED and o.inflight == 0]
            if idle:
                victim = min(idle, key=lambda o: o.last_used)
                log.info("--models-max %d reached: unloading %s (least recently used)",
                         self.models_max, victim.entry.name)
                await self.unload(victim)
            else:  # every loaded model is busy, or still loading: wait for one
                await asyncio.sleep(EVICT_POLL_S)

    async def unload(self, s: ModelState) -> None:
        child = s.child
        if child is None or not s.running:
            return
        timeout = s.entry.stop_timeout
        await child.stop(DEFAULT_STOP_TIMEOUT if timeout is None else timeout)

    async def stop_all(self) -> None:
        self.closing = True
        await asyncio.gather(*(self.unload(s) for s in self.models.values()))

    # ---- child events
    def _on_ready(self, s: ModelState, child: Child, url: str) -> None:
        if s.child is not child or s.status != LOADING:
            return
        s.status, s.url = LOADED, url
        s.last_used = time.monotonic()
        s.settled.set()
        log.info("model %s loaded at %s", s.entry.name, url)

    def _on_exit(self, s: ModelState, child: Child, code: int) -> None:
        if s.child is not child:
            return
        asked = self.closing or child.stop_requested
        if code != 0 and not asked:
            log.error("the server of model %s exited with status %d: %s", s.entry.name, code,
                      child.failure())
        # a stop the router asked for is no failure, whatever status it ended with
        self._set_unloaded(s, 0 if asked else (code or 0))

    def _set_unloaded(self, s: ModelState, code: int) -> None:
        s.status, s.url, s.exit_code = UNLOADED, None, code
        s.settled.set()
