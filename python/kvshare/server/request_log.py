"""What each generation request did: one `RequestRecord` per request, logged as one JSON line
(logger `kvshare.server.requests`) and counted in the server's and the tenants' metrics when
the request ends, however it ends."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvshare.engine.api import FinishEvent, GenerationRequest, TokenEvent

from .metrics import ServerMetrics
from .tenancy import TenantMetrics

request_log = logging.getLogger("kvshare.server.requests")


@dataclass
class RequestRecord:
    """What one completion request did."""

    id: str
    endpoint: str
    t0: float = field(default_factory=time.perf_counter)
    # when the prepared request reached the engine (perf_counter): t0 to it is the server's
    # own time before the engine (body, parse, render, tokenize, grammar)
    submitted_at: float | None = None
    stream: bool = False
    status: int = 200
    prompt_tokens: int | None = None
    finish: FinishEvent | None = None
    # The finish reason the client was told ("tool_calls" where the API reported calls);
    # None: the engine's own reason.
    client_finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    tenant: str | None = None  # tenancy.Tenant.name (never the key)

    def as_log(self) -> dict:
        d: dict[str, Any] = {"id": self.id, "endpoint": self.endpoint, "status": self.status,
                             "stream": self.stream, "prompt_tokens": self.prompt_tokens}
        if self.tenant is not None:
            d["tenant"] = self.tenant
        f = self.finish
        if f is not None:
            d.update(prompt_tokens=f.prompt_tokens, cache_n=f.timings.cache_n,
                     prompt_n=f.timings.prompt_n, completion_tokens=f.completion_tokens,
                     finish_reason=self.client_finish_reason or f.reason,
                     ttft_ms=round(f.time_to_first_token_s * 1e3, 2),
                     prompt_ms=round(f.timings.prompt_ms, 2),
                     restore_ms=round(f.timings.restore_ms, 2),
                     predicted_ms=round(f.timings.predicted_ms, 2))
        if self.submitted_at is not None:
            d["prepare_ms"] = round((self.submitted_at - self.t0) * 1e3, 2)
        d["duration_ms"] = round((time.perf_counter() - self.t0) * 1e3, 2)
        if self.error:
            d["error"] = self.error
        return d


class RequestObserver(Protocol):
    """Follows every submitted request (llama-server's slot view, `apis.llama_slots`)."""

    def acquire(self, rid: str, req: GenerationRequest, params: dict | None = None,
                want: int = -1, tenant: Any = None) -> int: ...

    def feed(self, rid: str, ev: TokenEvent) -> None: ...

    def release(self, rid: str, fin: FinishEvent | None) -> None: ...

    def slot_of(self, rid: str) -> int: ...


class RequestLog:
    """Counts and logs each request once, when it ends."""

    def __init__(self, metrics: ServerMetrics, tenants: TenantMetrics,
                 observer: RequestObserver):
        self.metrics, self.tenants, self.observer = metrics, tenants, observer

    def start(self, rec: RequestRecord) -> None:
        self.metrics.in_flight.inc()

    def finish(self, rec: RequestRecord) -> None:
        if rec.done:
            return
        rec.done = True
        self.observer.release(rec.id, rec.finish)
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(rec.endpoint, str(rec.status)).inc()
        m.duration.observe(time.perf_counter() - rec.t0)
        fin = rec.finish
        self.tenants.count(rec.tenant, fin)
        if fin is not None:
            m.finish.labels(fin.reason).inc()
            if fin.completion_tokens > 0:
                m.ttft.observe(fin.time_to_first_token_s)
        request_log.info(json.dumps(rec.as_log(), separators=(",", ":")))
