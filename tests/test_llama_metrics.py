"""llama-server's `llamacpp:*` metrics on /metrics (server/metrics.py): every one llama-server
exposes, with its name, type and help text, each equal to its `kvshare_*` twin in the same
scrape. In-process against a fake engine whose snapshot carries every counter, and against a
real `kvshare serve` (tiny model)."""

from __future__ import annotations

import re
import time

import pytest

from kvshare.server.metrics import LLAMACPP_METRICS
from test_server_http import FakeEngine, make_client
from tier_helpers import Server

# llama-server's metrics, copied from llama.cpp tools/server/server-task.cpp
# (server_task_result_metrics::to_metrics, the `counters` then the `gauges` list; the labelled
# spec_decode_num_accepted_tokens_per_pos_total is only there with speculative decoding).
LLAMA_SERVER = [
    ("prompt_tokens_total", "counter",
     "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    ("n_decode_total", "counter", "Total number of llama_decode() calls, excluding speculative "
                                  "decoding and multimodal decoding"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "counter",
     "Speculative: Total speculative decoding verification steps"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse(text: str):
    """(samples {name{labels}: value}, types {name: type}, helps {name: help}, llamacpp sample
    names in order) of Prometheus text, read literally (no suffix rewriting)."""
    samples, types, helps, order = {}, {}, {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("# HELP "):
            _, _, name, doc = line.split(" ", 3)
            helps[name] = doc
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            if m.group(1).startswith("llamacpp:"):
                order.append(m.group(1))
    return samples, types, helps, order


def check_llamacpp_shape(text: str) -> dict[str, float]:
    samples, types, helps, order = parse(text)
    assert order == [f"llamacpp:{n}" for n, _, _ in LLAMA_SERVER]
    for name, kind, doc in LLAMA_SERVER:
        assert types[f"llamacpp:{name}"] == kind, name
        assert helps[f"llamacpp:{name}"] == doc, name
    return samples


def twins_equal(s: dict[str, float]) -> None:
    """Each llamacpp:* value equals its kvshare_* figure (same scrape)."""
    L = lambda n: s[f"llamacpp:{n}"]  # noqa: E731
    assert L("prompt_tokens_total") == s["kvshare_prompt_tokens_computed_total"] == \
        s["kvshare_prompt_tokens_total"] - s["kvshare_prompt_tokens_cached_total"]
    assert L("prompt_tokens_cached_total") == s["kvshare_prompt_tokens_cached_total"]
    assert L("tokens_predicted_total") == s["kvshare_generated_tokens_total"]
    assert L("n_decode_total") == s.get("kvshare_forward_steps_total", 0)
    assert L("n_tokens_max") == s["kvshare_sequence_tokens_max"]
    assert L("prompt_seconds_total") == s.get("kvshare_prompt_seconds_total", 0)
    assert L("tokens_predicted_seconds_total") == s.get("kvshare_generation_seconds_total", 0)
    busy = s.get("kvshare_step_sequences_total", 0)
    assert L("n_busy_slots_per_decode") == pytest.approx(
        busy / max(s.get("kvshare_forward_steps_total", 0), 1))
    processing = sum(v for k, v in s.items() if k.startswith("kvshare_sequences{")
                     and 'state="waiting"' not in k)
    assert L("requests_processing") == processing
    assert L("requests_deferred") == s.get("kvshare_requests_queued", 0)
    for n in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
              "spec_decode_num_drafts_total"):
        assert L(n) == 0


def test_the_module_list_is_llama_servers():
    assert list(LLAMACPP_METRICS) == LLAMA_SERVER


# --------------------------------------------------------------------------- fake engine

class CountingEngine(FakeEngine):
    """A fake whose snapshot has every counter the real engine may report, advanced by each
    request, and a settable list of sequences."""

    def __init__(self):
        super().__init__()
        self.c = {"prompt_tokens_total": 0, "prompt_tokens_cached_total": 0,
                  "generated_tokens_total": 0, "steps": 0, "preemptions": 0,
                  "prompt_seconds_total": 0.0, "generation_seconds_total": 0.0,
                  "busy_slots_total": 0, "seq_tokens_max": 0}
        self.seqs: list[dict] = []

    def submit(self, req):
        h = super().submit(req)
        p = len(req.prompt_tokens)
        self.c["prompt_tokens_total"] += p
        self.c["prompt_tokens_cached_total"] += h.cache_n
        n = min(len(self.reply), req.max_tokens)
        self.c["generated_tokens_total"] += n
        self.c["steps"] += n + 1
        self.c["busy_slots_total"] += 2 * (n + 1)
        self.c["prompt_seconds_total"] += 0.25
        self.c["generation_seconds_total"] += 0.5
        self.c["seq_tokens_max"] = max(self.c["seq_tokens_max"], p + n)
        return h

    def snapshot(self) -> dict:
        snap = super().snapshot()
        snap["counters"] = dict(self.c)
        snap["slots"] = list(self.seqs)
        snap["faults"] = {"queued": sum(1 for s in self.seqs if s["state"] == "waiting"),
                          "failed": {}, "recovered": {}}
        return snap


CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}


def test_llamacpp_metrics_equal_their_kvshare_twins():
    eng = CountingEngine()
    with make_client(eng) as c:
        first = check_llamacpp_shape(c.get("/metrics").text)
        twins_equal(first)
        assert first["llamacpp:prompt_tokens_total"] == 0
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4}
                      ).status_code == 200
        eng.seqs = [
            {"id": 1, "state": "prefill", "n_prompt": 40, "n_generated": 0},
            {"id": 2, "state": "decode", "n_prompt": 500, "n_generated": 7},
            {"id": 3, "state": "waiting", "n_prompt": 9, "n_generated": 0},
            {"id": 4, "state": "waiting", "n_prompt": 9, "n_generated": 0},
        ]
        s = check_llamacpp_shape(c.get("/metrics").text)
    twins_equal(s)
    assert s["llamacpp:prompt_tokens_total"] > 0
    assert s["llamacpp:tokens_predicted_total"] == 3 * 6 + 4
    assert s["llamacpp:n_decode_total"] == 3 * 7 + 5
    assert s["llamacpp:n_busy_slots_per_decode"] == 2
    assert s["llamacpp:prompt_seconds_total"] == pytest.approx(1.0)
    assert s["llamacpp:tokens_predicted_seconds_total"] == pytest.approx(2.0)
    assert s["llamacpp:requests_processing"] == 2
    assert s["llamacpp:requests_deferred"] == 2
    assert s["llamacpp:n_tokens_max"] == 507  # a live sequence longer than any finished one
    # throughput: the tokens over the seconds since the previous scrape
    assert s["llamacpp:prompt_tokens_seconds"] == pytest.approx(
        s["llamacpp:prompt_tokens_total"] / 1.0)
    assert s["llamacpp:predicted_tokens_seconds"] == pytest.approx(22 / 2.0)


def test_throughput_gauges_cover_the_window_since_the_last_scrape():
    eng = CountingEngine()
    with make_client(eng) as c:
        c.post("/v1/chat/completions", json=CHAT)
        a = check_llamacpp_shape(c.get("/metrics").text)
        assert a["llamacpp:predicted_tokens_seconds"] == pytest.approx(6 / 0.5)
        b = check_llamacpp_shape(c.get("/metrics").text)  # nothing happened since: 0
        assert b["llamacpp:predicted_tokens_seconds"] == 0
        assert b["llamacpp:prompt_tokens_seconds"] == 0
        c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        d = check_llamacpp_shape(c.get("/metrics").text)
    assert d["llamacpp:predicted_tokens_seconds"] == pytest.approx(4 / 1.0)
    computed = d["llamacpp:prompt_tokens_total"] - b["llamacpp:prompt_tokens_total"]
    assert d["llamacpp:prompt_tokens_seconds"] == pytest.approx(computed / 0.5)
    twins_equal(d)


def test_n_tokens_max_never_decreases():
    eng = CountingEngine()
    with make_client(eng) as c:
        eng.seqs = [{"id": 1, "state": "decode", "n_prompt": 900, "n_generated": 100}]
        assert check_llamacpp_shape(c.get("/metrics").text)["llamacpp:n_tokens_max"] == 1000
        eng.seqs = []
        s = check_llamacpp_shape(c.get("/metrics").text)
    assert s["llamacpp:n_tokens_max"] == 1000 == s["kvshare_sequence_tokens_max"]


def test_engine_without_the_timing_counters():
    """The plain fake reports only token counters: the llamacpp metrics are all there, the
    ones without a source are 0."""
    with make_client(FakeEngine()) as c:
        c.post("/v1/chat/completions", json=CHAT)
        s = check_llamacpp_shape(c.get("/metrics").text)
    twins_equal(s)
    assert s["llamacpp:prompt_tokens_total"] == 60  # the fake's fixed counters: 100 - 40
    assert s["llamacpp:n_decode_total"] == 0 and s["llamacpp:prompt_seconds_total"] == 0


# --------------------------------------------------------------------------- real server

def test_real_server_metrics(launcher):
    s = Server(launcher, "--parallel", "2", "--kv-unified-per-slot", "1024")
    try:
        msgs = [{"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": "Count to five."}]
        for _ in range(3):  # the same prompt: the later ones reuse the cached prefix
            r = s.chat(msgs, max_tokens=5)
            assert r["usage"]["completion_tokens"] >= 1
        deadline = time.monotonic() + 30
        # each scrape starts a new throughput window: the first one after the replies covers
        # their generation, a later one (taken while the last sequence is still being
        # released) may cover none
        rates = []
        while True:  # the last sequence is released just after its reply
            resp = s.client.get("/metrics")
            assert resp.status_code == 200
            m = check_llamacpp_shape(resp.text)
            rates.append(m["llamacpp:predicted_tokens_seconds"])
            if m["llamacpp:requests_processing"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        s.terminate()
    twins_equal(m)
    assert m["llamacpp:prompt_tokens_cached_total"] > 0
    assert m["llamacpp:tokens_predicted_total"] >= 3
    assert m["llamacpp:n_decode_total"] >= 3
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0
    if "kvshare_prompt_seconds_total" in m:  # the engine counts the times and lengths
        assert m["llamacpp:n_tokens_max"] >= r["usage"]["prompt_tokens"]
        assert m["llamacpp:prompt_seconds_total"] > 0
        assert m["llamacpp:tokens_predicted_seconds_total"] > 0
        assert rates[0] > 0
        assert m["llamacpp:n_busy_slots_per_decode"] >= 1
