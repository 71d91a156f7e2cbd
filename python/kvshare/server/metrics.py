"""Prometheus metrics. Each app owns its `CollectorRegistry` (several apps in one process, e.g.
in tests, never collide). Request counters and histograms are updated by the server; the KV pool
and token counters are read from `engine.snapshot()` at scrape time by `EngineCollector`."""

from __future__ import annotations

from typing import Any

import logging
from collections import Counter as _Tally

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvshare.server")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EngineCollector(Collector):
    """Gauges and counters read from `engine.snapshot()` when /metrics is scraped."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # dynamic: no pre-registration checks

    def collect(self):
        try:
            snap = self.engine.snapshot()
        except Exception:  # a scrape must never fail because the engine is busy or stopping
            log.debug("engine.snapshot() failed during a scrape", exc_info=True)
            return
        pool = snap.get("pool", {}) or {}
        counters = snap.get("counters", {}) or {}

        blocks = GaugeMetricFamily("kvshare_kv_blocks", "KV pool blocks by state",
                                   labels=["state"])
        for state in ("used", "free", "cached"):
            if state in pool:
                blocks.add_metric([state], pool[state])
        yield blocks
        for key, name, doc in (
            ("total", "kvshare_kv_blocks_capacity", "KV pool size in blocks"),
            ("shared", "kvshare_kv_blocks_shared", "KV blocks referenced by more than one "
                                                  "sequence"),
            ("tokens_used", "kvshare_kv_tokens_used", "Tokens held in used KV blocks"),
            ("block_size", "kvshare_kv_block_size_tokens", "Tokens per KV block"),
        ):
            if key in pool:
                yield GaugeMetricFamily(name, doc, value=pool[key])

        for key, name, doc in (
            ("prompt_tokens_total", "kvshare_prompt_tokens",
             "Prompt tokens of admitted requests (computed + reused)"),
            ("prompt_tokens_cached_total", "kvshare_prompt_tokens_cached",
             "Prompt tokens reused from the cache instead of computed"),
            ("generated_tokens_total", "kvshare_generated_tokens", "Tokens generated"),
        ):
            if key in counters:
                yield CounterMetricFamily(name, doc, value=counters[key])

        slots = snap.get("slots")
        if isinstance(slots, list):
            seqs = GaugeMetricFamily("kvshare_sequences", "Sequences in the engine by state",
                                     labels=["state"])
            for state, n in sorted(_Tally(str(s.get("state", "unknown")) for s in slots
                                          if isinstance(s, dict)).items()):
                seqs.add_metric([state], n)
            yield seqs

        faults = snap.get("faults") or {}
        if faults:
            yield GaugeMetricFamily("kvshare_requests_queued",
                                    "Requests waiting to be admitted", value=faults["queued"])
            failed = CounterMetricFamily("kvshare_requests_failed",
                                         "Requests ended by an engine-side error, by cause",
                                         labels=["cause"])
            for cause, n in sorted(faults["failed"].items()):
                failed.add_metric([cause], n)
            yield failed
            recovered = CounterMetricFamily("kvshare_faults_recovered",
                                            "Faults absorbed without failing a request "
                                            "(recomputed, retried or skipped), by kind",
                                            labels=["kind"])
            for kind, n in sorted(faults["recovered"].items()):
                recovered.add_metric([kind], n)
            yield recovered

        yield from _tier_metrics(snap.get("tiers") or {})
        ckpt = snap.get("checkpoints")
        if ckpt:
            yield GaugeMetricFamily("kvshare_checkpoints", "Recurrent-state checkpoints stored",
                                    value=ckpt["count"])
            yield GaugeMetricFamily("kvshare_checkpoint_bytes",
                                    "Bytes of distinct live checkpoints (each counted once, "
                                    "however many sequences and tiers hold it)",
                                    value=ckpt["live_bytes"])


# (snapshot key, metric suffix, kind, help) for each cache tier (RAM, disk).
_TIER_FIELDS = [
    ("entries", "entries", "gauge", "Entries held"),
    ("bytes", "bytes", "gauge", "Bytes held"),
    ("bytes_on_disk", "bytes", "gauge", "Bytes held"),
    ("pinned_bytes", "pinned_bytes", "gauge", "Bytes of prefix entries pinned in the tier"),
    ("pin_budget", "pin_budget_bytes", "gauge", "Most bytes the tier lets prefix entries pin"),
    ("demotions", "pin_demotions", "counter",
     "Pinned prefix entries moved back to the LRU to keep the pin budget"),
    ("hits", "hits", "counter", "Lookups that found something"),
    ("misses", "misses", "counter", "Lookups that found nothing"),
    ("restores", "restores", "counter", "Admissions that restored blocks from the tier"),
    ("tokens_served", "tokens_served", "counter", "Prompt tokens restored from the tier"),
    ("restore_seconds", "restore_seconds", "counter",
     "Time spent restoring blocks from the tier into the KV pool"),
    ("bytes_read", "read_bytes", "counter", "Bytes read"),
    ("bytes_written", "written_bytes", "counter", "Bytes written"),
    ("dropped_writes", "dropped_writes", "counter", "Writes dropped because the queue was full"),
]
_EVICTIONS = {"evictions": "budget", "evictions_ttl": "ttl", "evictions_budget": "budget",
              "evictions_corrupt": "corrupt"}


def _tier_metrics(tiers: dict):
    families: dict[str, Any] = {}
    evictions = CounterMetricFamily("kvshare_cache_tier_evictions", "Tier evictions by reason",
                                    labels=["tier", "reason"])
    for tier, stats in sorted(tiers.items()):
        for key, suffix, kind, doc in _TIER_FIELDS:
            if key not in stats:
                continue
            name = f"kvshare_cache_tier_{suffix}"
            fam = families.get(name)
            if fam is None:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                fam = families[name] = cls(name, doc, labels=["tier"])
            fam.add_metric([tier], stats[key])
        for key, reason in _EVICTIONS.items():
            if key in stats:
                evictions.add_metric([tier, reason], stats[key])
    yield from families.values()
    if tiers:
        yield evictions


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvshare_requests", "Completion requests by endpoint and HTTP status (499: the "
            "client disconnected)", ["endpoint", "status"], registry=r)
        self.finish = Counter("kvshare_request_finish", "Finished generations by reason",
                              ["reason"], registry=r)
        self.ttft = Histogram("kvshare_time_to_first_token_seconds",
                              "Time from admission to the first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.duration = Histogram("kvshare_request_duration_seconds",
                                  "Completion request duration, end to end",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.in_flight = Gauge("kvshare_requests_in_flight", "Completion requests in progress",
                               registry=r)
        r.register(EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
