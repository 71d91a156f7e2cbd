"""Prometheus metrics. Each app owns its `CollectorRegistry` (several apps in one process, e.g.
in tests, never collide). Request counters and histograms are updated by the server; the KV pool
and token counters are read from `engine.snapshot()` at scrape time by `EngineCollector`.

/metrics also carries llama-server's `llamacpp:*` metrics (same names, types and help texts as
llama.cpp's tools/server/server-task.cpp), computed from the same snapshot as their `kvshare_*`
twins, so dashboards built for llama-server work unchanged (`LlamaCppMetrics`)."""

from __future__ import annotations

from typing import Any

import logging
import threading
from collections import Counter as _Tally

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvshare.server")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _num(v: Any) -> float:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _slots(snap: dict) -> list[dict]:
    slots = snap.get("slots")
    return [s for s in slots if isinstance(s, dict)] if isinstance(slots, list) else []


def processing_slots(snap: dict) -> int:
    """Sequences being computed (prefill or decode): llama-server's busy slots."""
    return sum(1 for s in _slots(snap) if str(s.get("state", "")) not in ("waiting", "finished"))


def queued_requests(snap: dict) -> int:
    """Sequences waiting to be admitted: llama-server's deferred requests."""
    faults = snap.get("faults") or {}
    if "queued" in faults:
        return int(faults["queued"])
    return sum(1 for s in _slots(snap) if str(s.get("state", "")) == "waiting")


class EngineCollector(Collector):
    """Gauges and counters read from `engine.snapshot()` when /metrics is scraped."""

    def __init__(self, engine):
        self.engine = engine
        # the snapshot `ServerMetrics.render` took for the scrape in progress (the kvshare_*
        # and llamacpp:* figures of one scrape come from one snapshot)
        self.pinned: dict | None = None
        self._max_lock = threading.Lock()
        self._tokens_max = 0

    def describe(self):
        return []  # dynamic: no pre-registration checks

    def snapshot(self) -> dict | None:
        if self.pinned is not None:
            return self.pinned
        try:
            return self.engine.snapshot()
        except Exception:  # a scrape must never fail because the engine is busy or stopping
            log.debug("engine.snapshot() failed during a scrape", exc_info=True)
            return None

    def tokens_max(self, snap: dict) -> int:
        """Longest sequence seen (prompt + generated tokens): the engine's `seq_tokens_max`
        counter when it keeps one, and the live sequences of every scrape (never decreases)."""
        counters = snap.get("counters", {}) or {}
        live = max((int(_num(s.get("n_prompt"))) + int(_num(s.get("n_generated")))
                    for s in _slots(snap)), default=0)
        with self._max_lock:
            self._tokens_max = max(self._tokens_max, live,
                                   int(_num(counters.get("seq_tokens_max"))))
            return self._tokens_max

    def collect(self):
        snap = self.snapshot()
        if snap is None:
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
        if "prompt_tokens_total" in counters:
            yield CounterMetricFamily(
                "kvshare_prompt_tokens_computed", "Prompt tokens computed (not reused from the "
                "cache): kvshare_prompt_tokens - kvshare_prompt_tokens_cached",
                value=computed_prompt_tokens(counters))
        for key, name, doc in (
            ("steps", "kvshare_forward_steps", "Model forward steps (batches computed)"),
            ("steps_ahead", "kvshare_forward_steps_ahead",
             "Forward steps launched before the previous step's tokens reached the host "
             "(async scheduling, GPU)"),
            ("busy_slots_total", "kvshare_step_sequences",
             "Sequences busy (prefill or decode) at each forward step, summed over steps; "
             "divided by kvshare_forward_steps: the mean batch"),
            ("prompt_seconds_total", "kvshare_prompt_seconds",
             "Time spent computing prompts, summed over requests"),
            ("generation_seconds_total", "kvshare_generation_seconds",
             "Time spent generating tokens, summed over requests"),
        ):
            if key in counters:
                yield CounterMetricFamily(name, doc, value=counters[key])
        yield GaugeMetricFamily("kvshare_sequence_tokens_max",
                                "Longest sequence seen (prompt + generated tokens)",
                                value=self.tokens_max(snap))

        yield from _sequence_metrics(snap.get("slots"))
        yield from _fault_metrics(snap.get("faults") or {})
        yield from _tier_metrics(snap.get("tiers") or {})
        ckpt = snap.get("checkpoints")
        if ckpt:
            yield GaugeMetricFamily("kvshare_checkpoints", "Recurrent-state checkpoints stored",
                                    value=ckpt["count"])
            yield GaugeMetricFamily("kvshare_checkpoint_bytes",
                                    "Bytes of distinct live checkpoints (each counted once, "
                                    "however many sequences and tiers hold it)",
                                    value=ckpt["live_bytes"])


def _sequence_metrics(slots: Any):
    if isinstance(slots, list):
        seqs = GaugeMetricFamily("kvshare_sequences", "Sequences in the engine by state",
                                 labels=["state"])
        for state, n in sorted(_Tally(str(s.get("state", "unknown")) for s in slots
                                      if isinstance(s, dict)).items()):
            seqs.add_metric([state], n)
        yield seqs


def _fault_metrics(faults: dict):
    if not faults:
        return
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


# (snapshot key, metric suffix, kind, help) for each cache tier (RAM, disk, remote).
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
    ("dropped_writes", "dropped_writes", "counter",
     "Writes dropped (queue full; the shared tier: also while its breaker is open)"),
    # the shared (Redis) tier
    ("failures", "failures", "counter", "Commands to the tier's server that failed or timed out"),
    ("corrupt", "corrupt_values", "counter", "Values that failed their checks (deleted)"),
    ("breaker_open", "breaker_open", "gauge",
     "1 while the circuit breaker keeps the tier off after repeated failures"),
    ("breaker_trips", "breaker_trips", "counter", "Times the circuit breaker opened"),
    ("blocks_written", "blocks_written", "counter", "KV blocks written to the tier"),
    ("blocks_skipped", "blocks_skipped", "counter",
     "KV blocks not written because the tier already held them"),
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
    fetch = (tiers.get("remote") or {}).get("fetch_ahead")
    if fetch:
        yield from _fetch_ahead_metrics(fetch)


# (fetch_ahead key, metric name, kind, help): the shared tier's reads ahead of admission
# (engine/cache/prefetch.py)
_FETCH_FIELDS = [
    ("started", "fetches", "counter", "Fetches from the shared tier run before a request was queued"),
    ("busy", "fetches_skipped_busy", "counter",
     "Requests queued without a fetch because every fetch thread was busy (a miss)"),
    ("over_budget", "fetches_over_budget", "counter",
     "Fetches cut short because the bytes held ahead were at their bound"),
    ("late", "fetches_late", "counter", "Fetches that ran past their deadline"),
    ("seconds", "fetch_seconds", "counter", "Time spent fetching ahead, over all fetches"),
    ("held_bytes", "fetch_held_bytes", "gauge",
     "Bytes fetched ahead and held for requests not yet admitted"),
]


def _fetch_ahead_metrics(fetch: dict):
    for key, name, kind, doc in _FETCH_FIELDS:
        if key in fetch:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fam = cls(f"kvshare_cache_remote_{name}", doc)
            fam.add_metric([], fetch[key])
            yield fam


def computed_prompt_tokens(counters: dict) -> int:
    return max(0, int(_num(counters.get("prompt_tokens_total")))
               - int(_num(counters.get("prompt_tokens_cached_total"))))


# llama-server's /metrics, in its order: name (after "llamacpp:"), type, help text. Copied from
# llama.cpp tools/server/server-task.cpp, server_task_result_metrics::to_metrics() (the
# labelled spec_decode_num_accepted_tokens_per_pos_total is left out, as llama-server does
# when speculative decoding is off).
LLAMACPP_METRICS: tuple[tuple[str, str, str], ...] = (
    ("prompt_tokens_total", "counter",
     "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    ("n_decode_total", "counter",
     "Total number of llama_decode() calls, excluding speculative decoding and multimodal "
     "decoding"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter",
     "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "counter",
     "Speculative: Total speculative decoding verification steps"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
)


class LlamaCppMetrics:
    """llama-server's `llamacpp:*` metrics from an engine snapshot, each equal to its kvshare
    figure:

    prompt_tokens_total             kvshare_prompt_tokens_computed_total
    prompt_tokens_cached_total      kvshare_prompt_tokens_cached_total
    prompt_seconds_total            kvshare_prompt_seconds_total (0 until the engine counts it)
    tokens_predicted_total          kvshare_generated_tokens_total
    tokens_predicted_seconds_total  kvshare_generation_seconds_total (0 until the engine counts it)
    n_decode_total                  kvshare_forward_steps_total
    n_tokens_max                    kvshare_sequence_tokens_max
    spec_decode_*                   0 (kvshare does not decode speculatively)
    prompt_tokens_seconds           computed prompt tokens / prompt seconds since the last scrape
    predicted_tokens_seconds        generated tokens / generation seconds since the last scrape
    requests_processing             kvshare_sequences{state="prefill"|"decode"}, summed
    requests_deferred               kvshare_requests_queued
    n_busy_slots_per_decode         kvshare_step_sequences_total / kvshare_forward_steps_total

    The two throughput gauges are averaged over the window between two scrapes, as
    llama-server's (which resets its buckets at each /metrics)."""

    def __init__(self, collector: EngineCollector):
        self.collector = collector
        self._lock = threading.Lock()
        self._last: tuple[float, float, float, float] | None = None

    def values(self, snap: dict) -> dict[str, float]:
        c = snap.get("counters", {}) or {}
        prompt_n, prompt_s = computed_prompt_tokens(c), float(_num(c.get("prompt_seconds_total")))
        gen_n = int(_num(c.get("generated_tokens_total")))
        gen_s = float(_num(c.get("generation_seconds_total")))
        with self._lock:  # the rate window: since the previous scrape
            last = self._last or (0, 0.0, 0, 0.0)
            self._last = (prompt_n, prompt_s, gen_n, gen_s)

        def rate(n: float, s: float, n0: float, s0: float) -> float:
            return (n - n0) / (s - s0) if s - s0 > 0 and n >= n0 else 0.0

        steps = int(_num(c.get("steps")))
        return {
            "prompt_tokens_total": prompt_n,
            "prompt_tokens_cached_total": int(_num(c.get("prompt_tokens_cached_total"))),
            "prompt_seconds_total": prompt_s,
            "tokens_predicted_total": gen_n,
            "tokens_predicted_seconds_total": gen_s,
            "n_decode_total": steps,
            "n_tokens_max": self.collector.tokens_max(snap),
            "spec_decode_num_draft_tokens_total": 0,
            "spec_decode_num_accepted_tokens_total": 0,
            "spec_decode_num_drafts_total": 0,
            "prompt_tokens_seconds": rate(prompt_n, prompt_s, last[0], last[1]),
            "predicted_tokens_seconds": rate(gen_n, gen_s, last[2], last[3]),
            "requests_processing": processing_slots(snap),
            "requests_deferred": queued_requests(snap),
            "n_busy_slots_per_decode": _num(c.get("busy_slots_total")) / max(steps, 1),
        }

    def render(self, snap: dict) -> bytes:
        vals = self.values(snap)
        out = []
        for name, kind, doc in LLAMACPP_METRICS:
            out.append(f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\n"
                       f"llamacpp:{name} {_fmt(vals[name])}\n")
        return "".join(out).encode()


def _fmt(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


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
        self.engine_collector = EngineCollector(engine)
        r.register(self.engine_collector)
        self.llamacpp = LlamaCppMetrics(self.engine_collector)
        self._render_lock = threading.Lock()

    def render(self) -> bytes:
        """The Prometheus text: kvshare's metrics, then llama-server's `llamacpp:*` ones, both
        from one engine snapshot."""
        with self._render_lock:
            ec = self.engine_collector
            ec.pinned = None
            snap = ec.snapshot()
            ec.pinned = snap
            try:
                text = generate_latest(self.registry)
            finally:
                ec.pinned = None
            if snap is not None:
                text += self.llamacpp.render(snap)
            return text
