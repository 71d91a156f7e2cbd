"""The replicas behind the router: their health and the requests in flight at each.

Health comes from two sources:
- a background check, GET {url}/health every `interval` seconds: a backend is down after
  `DOWN_AFTER` failures in a row (one slow answer is not an outage) and up again after one
  success (a replica that answers /health with 200 is serving);
- the proxy itself: a connection error while proxying marks the backend down at once (it is
  not listening, so every request sent there until the next check would fail too).

In-flight counts are what `PrefixPolicy.choose` balances on: a request counts from the moment
it is sent until its response (a whole stream) has been passed on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger("kvshare.router")

DOWN_AFTER = 2  # failed health checks in a row


@dataclass
class Backend:
    url: str
    # Up until the startup check says otherwise (BackendSet.check_all(first=True)).
    healthy: bool = True
    failures: int = 0  # failed health checks in a row
    inflight: int = 0
    last_error: str | None = None
    changed_at: float = 0.0  # time.monotonic() of the last up/down change


class BackendSet:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, interval: float = 2.0,
                 check_timeout: float | None = None,
                 on_change: Callable[[Backend], None] | None = None):
        if not urls:
            raise ValueError("the router needs at least one backend")
        self.backends = {u: Backend(u) for u in dict.fromkeys(urls)}
        self.client = client
        self.interval = interval
        # a health answer later than this is a failure: short, so a hung replica is noticed
        self.check_timeout = check_timeout or min(2.0, max(0.5, interval))
        self.on_change = on_change

    @property
    def urls(self) -> list[str]:
        return list(self.backends)

    def healthy(self) -> list[str]:
        return [u for u, b in self.backends.items() if b.healthy]

    def inflight(self) -> dict[str, int]:
        return {u: b.inflight for u, b in self.backends.items()}

    def is_healthy(self, url: str) -> bool:
        b = self.backends.get(url)
        return b is not None and b.healthy

    # ---- in-flight accounting (the proxy calls these around each forwarded request)
    def begin(self, url: str) -> None:
        self.backends[url].inflight += 1

    def end(self, url: str) -> None:
        b = self.backends[url]
        b.inflight = max(0, b.inflight - 1)

    # ---- health
    def _set(self, b: Backend, healthy: bool, reason: str | None) -> None:
        b.last_error = None if healthy else reason
        if b.healthy == healthy:
            return
        b.healthy = healthy
        b.changed_at = time.monotonic()
        if healthy:
            log.info("backend %s is up", b.url)
        else:
            log.warning("backend %s is down: %s", b.url, reason)
        if self.on_change is not None:
            self.on_change(b)

    def mark_down(self, url: str, reason: str) -> None:
        """Down at once (a connection error seen while proxying); the next successful health
        check brings it back."""
        b = self.backends[url]
        b.failures = max(b.failures, DOWN_AFTER)
        self._set(b, False, reason)

    def record_check(self, url: str, ok: bool, reason: str | None = None) -> None:
        b = self.backends[url]
        if ok:
            b.failures = 0
            self._set(b, True, None)
            return
        b.failures += 1
        if b.failures >= DOWN_AFTER:
            self._set(b, False, reason or "health check failed")
        else:
            b.last_error = reason

    async def check(self, url: str, first: bool = False) -> bool:
        """One health check of `url` (recorded); True when it answered 200. `first`: the
        check at startup, where a failure means down at once (there is no record of it ever
        serving, e.g. a replica still loading its model)."""
        try:
            r = await self.client.get(f"{url}/health", timeout=self.check_timeout)
            await r.aclose()
        except httpx.HTTPError as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            ok = False
        else:
            ok = r.status_code == 200
            reason = None if ok else f"/health answered {r.status_code}"
        if first and not ok:
            self.mark_down(url, reason or "health check failed")
        else:
            self.record_check(url, ok, reason)
        return ok

    async def check_all(self, first: bool = False) -> None:
        await asyncio.gather(*(self.check(u, first) for u in self.backends))

    async def run(self) -> None:
        """Check every backend every `interval` seconds, until cancelled."""
        while True:
            t0 = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                log.exception("health check round failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))
