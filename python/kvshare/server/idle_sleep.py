"""llama-server's sleeping on idle (`--sleep-idle-seconds N`): after N seconds in which no
request used the model, the engine is shut down and dropped (the weights, the tokenizer and
the KV pool freed), and the next request that needs the model loads it again first.

`SleepingEngine` is the `EngineClient` the server gets instead of the engine. Every request
that needs the model holds a lease on it for its whole life (`IdleSleepMiddleware`, streams
included), so the engine is released only when no request is running; a lease taken while it
sleeps waits for it to wake (on the event loop without blocking it: /health and /props answer
during the reload), and every request waiting then goes on once it is loaded, none fails.

What needs no model does not wake it, as in llama-server (tools/server/README.md, "Sleeping on
idle"): `GET /health`, `/props`, `/models` and `/metrics`, and kvshare's own `/cache`, the web
page and its `/webui/state`. Everything else does, `/tokenize` and `GET /slots` included (as
llama-server's do). While asleep those read the engine snapshot taken as it fell asleep.

What survives a sleep (`Reloader` decides, see `server.cli.model_load.ModelReload`): the disk
tier, on disk (its writes are drained as the engine shuts down and the store is opened again
on waking), the Redis tier (reconnected) and the RAM tier, whose store object is handed to the
new engine: it holds only what `--cache-ram` budgets and is what lets a conversation go on
after a wake without recomputing. The engine's counters carry over too (`_Totals`): /metrics'
counters never go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar, runtime_checkable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvshare.engine.api import (EngineClient, EngineHandle, GenerationRequest, ModelInfo,
                                RenderedChat)

from .errors import APIError
from .middleware import error_json, route_path

if TYPE_CHECKING:
    from kvshare._core import Grammar

log = logging.getLogger("kvshare.server")

# Requests that need no model (llama-server's exempt endpoints and kvshare's read-only ones):
# they neither wake the engine nor count as activity.
NO_WAKE_PATHS = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models",
                           "/metrics", "/cache", "/webui/state"})

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling asleep", "asleep", "waking"

T = TypeVar("T")


class WakeError(Exception):
    """The model could not be loaded again; the request that waited for it gets a 503."""


class Reloader(Protocol):
    """How the engine is rebuilt: `keep` what should outlive the sleep of the engine about to
    be released, `load` a new engine (not started) with what was kept."""

    def keep(self, engine: EngineClient) -> Any: ...

    def load(self, kept: Any) -> EngineClient: ...


@runtime_checkable
class Sleeps(Protocol):
    """An engine client that may be asleep (`SleepingEngine`): /props' `is_sleeping`."""

    @property
    def sleeping(self) -> bool: ...


# the per-tier counters (engine.cache.tiers.TierCounters) of a tier's snapshot
_TIER_COUNTERS = ("restores", "blocks_served", "tokens_served", "errors", "checkpoints_served",
                  "restore_seconds")


class _Totals:
    """The counters of the engines released so far, added to the live engine's snapshot: a
    new engine counts from zero, and Prometheus counters must not go back."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.faults: dict[str, dict[str, int]] = {"failed": {}, "recovered": {}}
        self.tiers: dict[str, dict[str, float]] = {}

    def add(self, snap: dict) -> None:
        """Fold in the final snapshot of an engine about to be released (totals included)."""
        self.counters = dict(snap.get("counters") or {})
        faults = snap.get("faults") or {}
        self.faults = {k: dict(faults.get(k) or {}) for k in ("failed", "recovered")}
        self.tiers = {name: {k: t[k] for k in _TIER_COUNTERS if k in t}
                      for name, t in (snap.get("tiers") or {}).items()}

    def apply(self, snap: dict) -> dict:
        """A live engine's snapshot with the released engines' counts added."""
        if not self.counters and not self.tiers:
            return snap
        out = dict(snap)
        counters = dict(snap.get("counters") or {})
        for k, v in self.counters.items():
            cur = counters.get(k, 0)
            counters[k] = max(cur, v) if k.endswith("_max") else cur + v
        out["counters"] = counters
        faults = dict(snap.get("faults") or {})
        for k, base in self.faults.items():
            merged = dict(faults.get(k) or {})
            for cause, n in base.items():
                merged[cause] = merged.get(cause, 0) + n
            faults[k] = merged
        out["faults"] = faults
        tiers = {name: dict(t) for name, t in (snap.get("tiers") or {}).items()}
        for name, counts in self.tiers.items():
            if name in tiers:
                for k, v in counts.items():
                    tiers[name][k] = tiers[name].get(k, 0) + v
        out["tiers"] = tiers
        return out


def _release_memory() -> None:
    """Return what the released engine held to the OS. `kvshare serve` froze the objects built
    at startup out of the collector's passes (commands.serve): those cycles are collected only
    once unfrozen; glibc keeps freed heap unless trimmed."""
    gc.unfreeze()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class SleepingEngine:
    """The engine behind a sleep after `idle_s` seconds without a request that uses it."""

    def __init__(self, engine: EngineClient, reloader: Reloader, idle_s: float,
                 shutdown_timeout_s: float = 10.0):
        self.info: ModelInfo = engine.info  # the same file under the same settings each load
        self.idle_s = float(idle_s)
        self._engine: EngineClient | None = engine
        self._reloader = reloader
        self._shutdown_timeout_s = shutdown_timeout_s
        self._cond = threading.Condition()
        self._state = AWAKE
        self._leases = 0
        self._last_used = time.monotonic()
        self._asleep_snapshot: dict = {}
        self._totals = _Totals()
        self._wake_error: BaseException | None = None
        self._wake_failed_at = 0.0
        self._kept: Any = None  # what the reloader kept while asleep
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._frozen = False  # startup's objects were frozen out of the collector: do so again
        self.sleeps = 0  # times it fell asleep (tests, logs)
        self.wakes = 0

    # ---- state --------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        """Asleep as llama-server reports it: from releasing the model until it is loaded
        again (waking included)."""
        return self._state != AWAKE

    @property
    def state(self) -> str:
        return self._state

    # ---- leases -------------------------------------------------------------------------
    def _take_if_awake(self, since: float) -> bool:
        """Under the lock: take a lease if awake; start waking if asleep. True: taken.
        `since`: when the caller began to wait; a wake that failed after it fails the caller
        (a later caller tries again)."""
        if self._state == AWAKE:
            self._leases += 1
            self._last_used = time.monotonic()
            return True
        err = self._wake_error
        if err is not None and self._state == ASLEEP and self._wake_failed_at >= since:
            raise WakeError(f"the model could not be loaded again: {err}") from err
        if self._state == ASLEEP:
            self._state = WAKING
            threading.Thread(target=self._wake, name="kvshare-wake", daemon=True).start()
        return False

    def _give_back(self) -> None:
        with self._cond:
            self._leases -= 1
            self._last_used = time.monotonic()

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[None]:
        """Hold the engine awake for one request, waking it first if it sleeps (the reload
        runs on a thread of its own; this waits on the event loop without blocking it)."""
        since = time.monotonic()
        while True:
            with self._cond:
                if self._take_if_awake(since):
                    break
            await asyncio.sleep(0.01)
        try:
            yield
        finally:
            self._give_back()

    @contextlib.contextmanager
    def _using(self) -> Iterator[EngineClient]:
        """The awake engine for one call (a caller outside any request lease blocks while it
        wakes)."""
        since = time.monotonic()
        with self._cond:
            while not self._take_if_awake(since):
                self._cond.wait(0.1)
            engine = self._engine
        assert engine is not None  # awake
        try:
            yield engine
        finally:
            self._give_back()

    def _call(self, fn: Callable[[EngineClient], T]) -> T:
        with self._using() as engine:
            return fn(engine)

    # ---- sleeping and waking ------------------------------------------------------------
    def _should_sleep(self, now: float) -> bool:
        return (self._state == AWAKE and self._leases == 0
                and now - self._last_used >= self.idle_s)

    def _watch(self) -> None:
        step = min(0.25, self.idle_s / 4)
        while not self._stop.wait(step):
            with self._cond:
                if not self._should_sleep(time.monotonic()) or self._engine is None:
                    continue
                if self._engine.snapshot().get("sequences", 0):
                    continue  # a cancelled request's sequence still ending
                self._state = FALLING_ASLEEP
            try:
                self._fall_asleep()
            except Exception:  # noqa: BLE001 - the monitor must go on; the engine stays up
                log.exception("idle sleep: releasing the model failed; it stays loaded")
                with self._cond:
                    self._state = AWAKE
                    self._cond.notify_all()

    def _fall_asleep(self) -> None:
        """Shut the engine down and drop the last reference to it (this frame holds the only
        other one while it runs), keeping what the reloader keeps."""
        t0 = time.monotonic()
        engine = self._engine
        assert engine is not None
        engine.shutdown(self._shutdown_timeout_s)  # drains the tier writers
        final = self._totals.apply(engine.snapshot())
        kept = self._reloader.keep(engine)
        self._totals.add(final)
        with self._cond:
            self._asleep_snapshot = dict(final, slots=[], sequences=0, sleeping=True)
            self._engine = None
        del engine
        self._frozen = self._frozen or gc.get_freeze_count() > 0
        _release_memory()
        with self._cond:
            self._kept = kept
            self._state = ASLEEP
            self.sleeps += 1
            self._cond.notify_all()
        log.info("idle for %.0f s: model released (%.2f s); the next request loads it again",
                 self.idle_s, time.monotonic() - t0)

    def _wake(self) -> None:
        t0 = time.monotonic()
        try:
            engine = self._reloader.load(self._kept)
            engine.start()
        except BaseException as e:  # noqa: BLE001 - reported to the requests that wait
            log.exception("idle sleep: loading the model again failed")
            with self._cond:
                self._wake_error, self._wake_failed_at = e, time.monotonic()
                self._state = ASLEEP
                self._cond.notify_all()
            return
        gc.collect()
        if self._frozen:  # as commands.serve does after startup
            gc.freeze()
        with self._cond:
            self._engine = engine
            self._kept = None
            self._state = AWAKE
            self._last_used = time.monotonic()
            self.wakes += 1
            self._cond.notify_all()
        log.info("model loaded again after idle sleep (%.2f s)", time.monotonic() - t0)

    # ---- lifecycle (engine.api.EngineClient) --------------------------------------------
    def start(self) -> None:
        engine = self._engine
        if engine is not None:
            engine.start()
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="kvshare-idle-sleep",
                                             daemon=True)
            self._monitor.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=30.0)
            self._monitor = None
        with self._cond:
            while self._state == WAKING:  # a load in progress: let it end, then stop it
                self._cond.wait(0.1)
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown(timeout)

    # ---- what needs no model ------------------------------------------------------------
    def snapshot(self) -> dict:
        engine = self._engine
        if engine is None:
            return dict(self._asleep_snapshot)
        return dict(self._totals.apply(engine.snapshot()), sleeping=False)

    def stalled_for(self) -> float:
        engine = self._engine
        return 0.0 if engine is None else engine.stalled_for()

    def warming_up(self) -> bool:
        engine = self._engine
        return engine is not None and engine.warming_up()

    # ---- what needs the model -----------------------------------------------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._call(lambda e: e.tokenize(text, add_special, parse_special))

    def detokenize(self, ids: list[int]) -> str:
        return self._call(lambda e: e.detokenize(ids))

    def token_piece(self, token_id: int) -> str:
        return self._call(lambda e: e.token_piece(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        return self._call(lambda e: e.token_bytes(token_id))

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None, *,
                    add_generation_prompt: bool, template_kwargs: dict,
                    cache_after: int | None, continue_final: bool) -> RenderedChat:
        return self._call(lambda e: e.chat_prompt(
            messages, tools, add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs, cache_after=cache_after,
            continue_final=continue_final))

    def render_chat(self, messages: list[dict], tools: list[dict] | None, *,
                    add_generation_prompt: bool, template_kwargs: dict,
                    continue_final: bool) -> str:
        return self._call(lambda e: e.render_chat(
            messages, tools, add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs, continue_final=continue_final))

    def compile_grammar(self, kind: str, source: str) -> Grammar:
        return self._call(lambda e: e.compile_grammar(kind, source))

    def submit(self, req: GenerationRequest) -> EngineHandle:
        # the request's lease (IdleSleepMiddleware) keeps the engine up while it streams
        return self._call(lambda e: e.submit(req))


class IdleSleepMiddleware:
    """Holds a lease on the engine (`SleepingEngine.lease`) for each request that needs the
    model (any but NO_WAKE_PATHS and CORS preflights): it wakes the engine and keeps it up
    until the response has been sent. Innermost: a request the auth refuses wakes nothing."""

    def __init__(self, app: ASGIApp, engine: SleepingEngine):
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") in ("OPTIONS", "HEAD")
                or route_path(scope).rstrip("/") in NO_WAKE_PATHS
                or route_path(scope) == "/"):
            return await self.app(scope, receive, send)
        try:
            async with self.engine.lease():
                await self.app(scope, receive, send)
        except WakeError as e:
            path = route_path(scope)
            err = APIError(503, str(e), code="model_unavailable",
                           headers={"Retry-After": "5"})
            await JSONResponse(error_json(path, err), status_code=503,
                               headers=err.headers)(scope, receive, send)
