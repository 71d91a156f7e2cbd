"""The router's Prometheus metrics (GET /metrics), in a registry of its own so that a router
and a replica in one process (tests) never mix their series.

- `kvshare_router_requests_total{backend,reason}`: requests forwarded, by where they went and
  why (policy.Choice.reason: affinity, ring, spill, least_loaded; `response`: a Responses API
  request following its previous_response_id to the replica that stored it);
- `kvshare_router_errors_total{backend,kind}`: `connect` (not reachable; marked down),
  `upstream` (failed after the request was sent, before its answer), `header_timeout` (its
  response headers did not come within the router's --timeout), `stream` (failed while
  the answer was passed on), `status_5xx` (the replica answered 5xx), `no_backend`
  (backend="none": nothing healthy to send to);
- `kvshare_router_request_seconds{backend}`: time from forwarding to the replica's response
  headers (for a stream: until it starts);
- `kvshare_router_backend_up{backend}`, `kvshare_router_inflight{backend}`;
- `kvshare_router_home_routed_ratio`: of the requests with a prefix key, the fraction routed
  to their prefix's home (Choice.at_home: the replica likely holds their prefix), and the two
  counters it is computed from (`kvshare_router_keyed_requests_total{home}`), which sum across
  routers where a ratio does not.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)


class RouterMetrics:
    def __init__(self, backends: list[str]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvshare_router_requests", "Requests forwarded to a backend",
                                ["backend", "reason"], registry=r)
        self.errors = Counter("kvshare_router_errors", "Failed forwards, by backend and kind",
                              ["backend", "kind"], registry=r)
        self.latency = Histogram("kvshare_router_request_seconds",
                                 "Seconds from forwarding to the backend's response headers",
                                 ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.up = Gauge("kvshare_router_backend_up", "1 while the backend is healthy",
                        ["backend"], registry=r)
        self.inflight = Gauge("kvshare_router_inflight", "Requests in flight at the backend",
                              ["backend"], registry=r)
        self.keyed = Counter("kvshare_router_keyed_requests",
                             "Requests with a prefix key, by whether they went to its home",
                             ["home"], registry=r)
        self.home_ratio = Gauge("kvshare_router_home_routed_ratio",
                                "Fraction of keyed requests routed to their prefix's home",
                                registry=r)
        self._keyed = [0, 0]  # [not home, home]
        for b in backends:  # every series exists from the start (0), not from its first event
            self.up.labels(b).set(1)
            self.inflight.labels(b).set(0)
            self.latency.labels(b)

    def routed(self, backend: str, reason: str, keyed: bool, at_home: bool) -> None:
        self.requests.labels(backend, reason).inc()
        if keyed:
            self._keyed[at_home] += 1
            self.keyed.labels("true" if at_home else "false").inc()
            self.home_ratio.set(self._keyed[1] / (self._keyed[0] + self._keyed[1]))

    def error(self, backend: str, kind: str) -> None:
        self.errors.labels(backend, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
