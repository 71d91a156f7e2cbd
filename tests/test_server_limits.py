"""Bounded resources at the edge (issue 15, part 3; server/edge.py, body.py, prompt_bounds.py).

Unit tests of the pieces (JSON value count, lone surrogates, the no-tokenization context bound
against the real tokenizers, the heavy-work slots), endpoint limits through the fake engine,
then a real `kvshare serve` (tiny model, `--body-timeout 2`) on loopback: twenty ~16 MiB bodies
at once, 500 silent half-bodies, the connection limit, Hypercorn's own errors, fuzz-ish bodies
and start-up errors. Timing assertions only bound from below what cannot happen early (a
timeout) or use generous ceilings; bench/edge_load.py measures the numbers.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import math
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvshare.engine.engine import max_token_chars
from kvshare.server import body as body_limits
from kvshare.server import edge
from kvshare.server import prompt_bounds
from kvshare.apis import parsing as P
from kvshare.server.app import create_app
from kvshare.server.errors import APIError
from kvshare.server.settings import ServerSettings

from test_server_http import CHAT, FakeEngine, assert_error
from tier_helpers import TINY_MODEL, Server, SubprocessLauncher

MiB = 1024 * 1024


# =========================================================================== units

def _reference_count(data: bytes) -> int:
    """1 + structural characters outside strings, by a plain state machine."""
    n, in_str, esc = 1, False, False
    for ch in data.decode("utf-8"):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in ",:[{":
            n += 1
    return n


def _true_values(obj) -> int:
    if isinstance(obj, dict):
        return 1 + sum(1 + _true_values(v) for v in obj.values())
    if isinstance(obj, list):
        return 1 + sum(_true_values(v) for v in obj)
    return 1


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab,:[]{}"\\\n\u00e9\U0001f600'), max_size=12),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(alphabet=st.sampled_from('k,:"\\{'), max_size=4), inner,
                      max_size=5),
    max_leaves=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json)
def test_json_value_count_bounds_the_values_json_loads_creates(obj):
    data = json.dumps(obj, ensure_ascii=False).encode()
    exact = body_limits.count_outside_strings(data, cap=10**9)
    assert exact == _reference_count(data)
    # never fewer than the objects json.loads makes, never many more (empty containers)
    true = _true_values(obj)
    assert true <= exact <= 2 * true + 1
    # the fast bound counts inside strings too: an upper bound of the exact count
    assert body_limits.json_value_count(data, cap=10**9) >= exact
    assert body_limits.json_value_count(data, cap=0) >= 1


def test_json_value_count_is_exact_for_text_with_commas():
    body = json.dumps({"prompt": "a, b: [c] {d}, " * 100_000, "x": [1, 2, 3]}).encode()
    # the fast bound is fooled by the text; the string-aware count is not
    assert body_limits.json_value_count(body, cap=10**9) > 400_000
    assert body_limits.json_value_count(body, cap=1000) == body_limits.count_outside_strings(body, 10**9)
    assert body_limits.count_outside_strings(body, 10**9) == 1 + 7  # { : , : [ , ,


def test_parse_json_body_rejects_too_many_values_and_bad_unicode():
    big = b'{"prompt": [' + b",".join([b"1"] * (body_limits.MAX_JSON_VALUES + 10)) + b"]}"
    with pytest.raises(APIError) as e:
        body_limits.parse_json_body(bytearray(big))
    assert e.value.status == 413 and e.value.code == "request_too_large"
    # many values inside one string are fine
    ok = json.dumps({"prompt": "1," * (body_limits.MAX_JSON_VALUES + 10)}).encode()
    assert body_limits.parse_json_body(bytearray(ok))["prompt"].startswith("1,1,")
    for raw, param in [(b'{"model": "\\ud800"}', "model"),
                       (b'{"cache_salt": "x\\uDFFFy"}', "cache_salt"),
                       (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
                       (b'{"stop": ["ok", "\\udc00"]}', "stop"),
                       (b'{"chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs"),
                       (b'{"\\ud800": 1}', "<key>")]:
        with pytest.raises(APIError) as e:
            body_limits.parse_json_body(bytearray(raw))
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_json"), raw
        assert "\ud800" not in e.value.message and "surrogate" in e.value.message
        e.value.response()  # renders (a surrogate in the message would raise)
    # a surrogate pair is one valid character; an escaped backslash before "ud800" is text
    assert body_limits.parse_json_body(bytearray(b'{"a": "\\ud83d\\ude00"}')) == {"a": "\U0001f600"}
    assert body_limits.parse_json_body(bytearray(b'{"a": "\\\\ud800"}')) == {"a": "\\ud800"}
    # raw surrogate bytes (CESU-8) are not UTF-8
    with pytest.raises(APIError) as e:
        body_limits.parse_json_body(bytearray(b'{"a": "\xed\xa0\x80"}'))
    assert e.value.status == 400 and e.value.code == "invalid_json"
    for bad in (b"[1]", b'"x"', b"{", b"\xff{}"):
        with pytest.raises(APIError) as e:
            body_limits.parse_json_body(bytearray(bad))
        assert e.value.status == 400


def test_slots_fifo_weights_and_timeout():
    async def main():
        s = edge.Slots(10)
        assert await s.acquire(6)
        order = []

        async def take(name, n, timeout=None):
            ok = await s.acquire(n, timeout)
            order.append((name, ok))

        t1 = asyncio.ensure_future(take("a", 5))
        await asyncio.sleep(0)
        t2 = asyncio.ensure_future(take("b", 1))  # would fit, but waits behind "a" (FIFO)
        await asyncio.sleep(0.01)
        assert order == [] and s.used == 6
        s.release(6)
        await asyncio.gather(t1, t2)
        assert order == [("a", True), ("b", True)] and s.used == 6
        assert not await s.acquire(5, timeout=0.05)  # times out; takes nothing
        assert s.used == 6
        t3 = asyncio.ensure_future(take("c", 5))
        await asyncio.sleep(0.01)
        t3.cancel()  # a cancelled waiter takes nothing either
        await asyncio.gather(t3, return_exceptions=True)
        s.release(6)
        assert s.used == 0
        assert await s.acquire(100)  # clamped to the capacity
        assert s.used == 10

    asyncio.run(main())


# --------------------------------------------------------------------------- the token bound

@pytest.fixture(scope="module")
def tokenizers():
    from kvshare.model.loader import default_model_path
    from kvshare.model.tokenizer import Tokenizer

    return [Tokenizer.from_gguf(TINY_MODEL), Tokenizer.from_gguf(default_model_path())]


def _adversarial_texts(tok) -> list[str]:
    longest = max(tok._texts, key=len)
    specials = [tok.token_text(i) for i in range(tok.vocab_size) if tok.is_special(i)][:20]
    return ["", "a", " " * 5000, "\u2581" * 3000, "\n" * 999, longest * 200,
            "".join(specials) * 20, "a\ud800b" * 100, "x" * 10_000,
            " ".join(["hello"] * 2000), "日本語のテキスト" * 300]


def test_prompt_bound_never_exceeds_the_real_token_count(tokenizers):
    """The no-tokenization check rejects a prompt of C characters when C > (ctx-1) * L: that
    is only right if every text has at least ceil(C / L) tokens."""
    import random

    rng = random.Random(7)
    for tok in tokenizers:
        per = max_token_chars(tok)
        assert per == max(len(t) for t in tok._texts)
        texts = _adversarial_texts(tok)
        alphabet = [" ", "  ", "\n", "\t", "a", "é", "日", "\U0001f600", "<", ">", "|", "_",
                    "\u2581", "0", "123"] + [tok.token_text(rng.randrange(tok.vocab_size))
                                             for _ in range(300)]
        for _ in range(200):
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400))))
        for text in texts:
            for add_special, parse_special in ((True, True), (False, False)):
                n = len(tok.encode(text, add_special=add_special, parse_special=parse_special))
                assert n >= math.ceil(len(text) / per), (text[:50], n, per)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_prompt_bound_holds_for_any_text(text):
    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(TINY_MODEL)
    per = max_token_chars(tok)
    assert len(tok.encode(text)) >= math.ceil(len(text) / per)


def test_long_fragments_tokenize_the_same_without_holding_the_gil(tokenizers, monkeypatch):
    import kvshare.model.tokenizer.core as T

    rng = __import__("random").Random(3)
    texts = ["".join(rng.choice("abcdefgh ij\n") for _ in range(20_000)),
             "word " * 5000, "x" * 9000]
    for tok in tokenizers:
        tok.clear_cache()
        new = [tok.encode(t) for t in texts]
        tok.clear_cache()
        monkeypatch.setattr(T, "GIL_FREE_CHARS", 10**9)  # the single-call path, as before
        old = [tok.encode(t) for t in texts]
        monkeypatch.undo()
        tok.clear_cache()
        assert new == old


# --------------------------------------------------------------------------- fake engine

def test_stop_string_limits():
    with TestClient(create_app(FakeEngine())) as c:
        def stop(s):
            return c.post("/v1/chat/completions", json=dict(CHAT, stop=s))

        assert stop(["x" * P.MAX_STOP_CHARS]).status_code == 200
        assert stop(["y" * 64] * 16).status_code == 200  # 1,024 characters together
        assert_error(stop(["x" * (P.MAX_STOP_CHARS + 1)]), 400, param="stop")
        assert_error(stop("x" * MiB), 400, param="stop")
        assert_error(stop(["x" * MiB] * 12), 400, param="stop")
        assert_error(stop(["y" * 65] * 16), 400, param="stop")  # 1,040 together
        assert_error(stop(["z"] * 17), 400, param="stop")


def test_tokenize_and_detokenize_limits(monkeypatch):
    engine = FakeEngine()  # byte-level: one token per character
    with TestClient(create_app(engine, ServerSettings(max_body_bytes=64 * MiB))) as c:
        n = prompt_bounds.TOKENIZE_MAX_PIECES
        r = c.post("/tokenize", json={"content": "a" * n, "with_pieces": True})
        assert r.status_code == 200 and len(r.json()["tokens"]) == n
        err = assert_error(c.post("/tokenize", json={"content": "a" * (n + 1),
                                                     "with_pieces": True}),
                           400, param="with_pieces", code="response_too_large")
        assert str(n) in err["message"]
        big = prompt_bounds.tokenize_max_chars(engine.ctx_size)
        r = c.post("/tokenize", json={"content": "a" * big})
        assert r.status_code == 200 and len(r.json()["tokens"]) == big
        assert_error(c.post("/tokenize", json={"content": "a" * (big + 1)}), 413,
                     param="content", code="request_too_large")
        m = prompt_bounds.DETOKENIZE_MAX_TOKENS
        assert c.post("/detokenize", json={"tokens": [97] * m}).json()["content"] == "a" * m
        assert_error(c.post("/detokenize", json={"tokens": [97] * (m + 1)}), 413,
                     param="tokens", code="request_too_large")
        monkeypatch.setattr("kvshare.apis.llama_info.DETOKENIZE_MAX_CHARS", 100)
        assert_error(c.post("/detokenize", json={"tokens": [97] * 101}), 400, param="tokens",
                     code="response_too_large")


def test_fake_engine_surrogates_are_400_everywhere():
    with TestClient(create_app(FakeEngine())) as c:
        for path, raw in [
            ("/v1/chat/completions", b'{"model": "\\ud800", "messages": []}'),
            ("/v1/chat/completions",
             b'{"cache_salt": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
            ("/v1/completions", b'{"prompt": "\\udfff"}'),
            ("/tokenize", b'{"content": "a\\ud800"}'),
            ("/detokenize", b'{"tokens": [], "x": "\\ud800"}'),
        ]:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert_error(r, 400, code="invalid_json")


# =========================================================================== real server

CTX = 256
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def launcher():
    lt = SubprocessLauncher()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def server(launcher):
    s = Server(launcher, "--ctx-size", str(CTX), "--parallel", "2",
               "--body-timeout", str(BODY_TIMEOUT))
    yield s
    s.kill9()


def _chat_ok(server: Server, client: httpx.Client | None = None) -> int:
    c = client or server.client
    r = c.post("/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    return r.status_code


# /health is polled from its own process (see the script)
_POLLER = Path(__file__).resolve().parents[1] / "bench" / "health_poller.py"


class _Probes:
    """RSS of the server (sampled, and the kernel's VmHWM reset first where allowed) and
    /health latencies, while a block runs."""

    def __init__(self, server: Server):
        self.server, self.proc = server, psutil.Process(server.pid)
        self.rss: list[int] = []
        self.health: list[float] = []
        self.health_failed = 0
        self.stop = threading.Event()

    def _hwm(self) -> int:
        for line in Path(f"/proc/{self.server.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        self.idle = self.proc.memory_info().rss
        try:
            Path(f"/proc/{self.server.pid}/clear_refs").write_text("5")
            self.hwm_ok = self._hwm() <= self.idle * 1.05 + 8 * MiB
        except OSError:
            self.hwm_ok = False

        def sample():
            while not self.stop.is_set():
                self.rss.append(self.proc.memory_info().rss)
                time.sleep(0.01)

        self.poller = subprocess.Popen([sys.executable, str(_POLLER), self.server.url],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.threads = [threading.Thread(target=sample, daemon=True)]
        for t in self.threads:
            t.start()
        time.sleep(0.3)  # the poller's first requests
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)
        out, _ = self.poller.communicate("", timeout=120)
        for sec, ok in json.loads(out or "[]"):
            self.health.append(sec)
            self.health_failed += not ok
        peak = max(self.rss + [self.idle])
        if self.hwm_ok:
            peak = max(peak, self._hwm())
        self.peak_above_idle = peak - self.idle
        h = sorted(self.health)
        self.p99 = h[min(len(h) - 1, int(len(h) * 0.99))] if h else 0.0


def _post_all(url: str, path: str, bodies: list[bytes]) -> list[httpx.Response | Exception]:
    def one(body):
        try:
            with httpx.Client(timeout=300) as c:
                return c.post(url + path, content=body,
                              headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            return e

    with ThreadPoolExecutor(len(bodies)) as ex:
        return list(ex.map(one, bodies))


def test_twenty_16mib_bodies_at_once(server):
    """No 5xx, peak RSS <= 1 GiB above idle, /health keeps answering (the p99 ceiling here is
    generous for a loaded CI machine; bench/edge_load.py measures it against 200 ms)."""
    assert _chat_ok(server) == 200  # warm
    limit = 16 * MiB
    words = ("alpha beta gamma delta epsilon zeta eta theta " * (limit // 40))
    chat = json.dumps({"messages": [{"role": "user", "content": ""}], "max_tokens": 2}).encode()
    chat = chat.replace(b'"content": ""', b'"content": "' + words[:limit - len(chat) - 64]
                        .encode() + b'"')
    assert limit - 1024 < len(chat) <= limit
    letters = (b'{"prompt": "' + b"qwertyuiopasdfghjklzxcvbnm" * ((limit - 64) // 26) + b'"}')
    assert len(letters) <= limit
    with _Probes(server) as p:
        res = _post_all(server.url, "/v1/chat/completions", [chat] * 15)
        res += _post_all(server.url, "/v1/completions", [letters] * 5)
    for r in res:
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert "prompt has at least" in r.json()["error"]["message"]
    print(f"20 x 16 MiB: peak RSS +{p.peak_above_idle / MiB:.0f} MiB over idle, /health p99 "
          f"{p.p99 * 1e3:.0f} ms over {len(p.health)} polls")
    assert p.peak_above_idle <= 1024 * MiB, p.peak_above_idle / MiB
    assert p.health and p.health_failed == 0
    assert p.p99 < 1.0, sorted(p.health)[-5:]
    assert _chat_ok(server) == 200


def test_prompts_that_fit_are_tokenized_as_before(server):
    c = server.client
    text = "The quick brown fox jumps over the lazy dog. " * 3
    n_tok = len(c.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"])
    r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n_tok
    per = max_token_chars(__import__("kvshare.model.tokenizer", fromlist=["x"])
                                 .Tokenizer.from_gguf(TINY_MODEL))
    bound = (CTX - 1) * per
    # just over the bound: rejected without tokenizing ("at least")
    r = c.post("/v1/completions", json={"prompt": "a" * (bound + 1)})
    err = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert "prompt has at least" in err["message"]
    # at the bound: tokenized, and the exact count reported
    r = c.post("/v1/completions", json={"prompt": "a" * bound})
    err = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert "prompt has at least" not in err["message"] and "tokens" in err["message"]


def _half_body(server: Server, body: bytes = b'{"messages": [{"role": "user", "co') -> socket.socket:
    host, port = server.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: 1000\r\n\r\n" + body)
    return s


def _wait_closed(socks: list[socket.socket], t0: float, limit_s: float
                 ) -> tuple[list[float | None], list[bytes]]:
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    when: list[float | None] = [None] * len(socks)
    data = [b""] * len(socks)
    left = len(socks)
    while left and time.monotonic() - t0 < limit_s:
        for key, _ in sel.select(0.2):
            try:
                chunk = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                data[key.data] += chunk
            else:
                when[key.data] = time.monotonic() - t0
                sel.unregister(key.fileobj)
                left -= 1
    sel.close()
    return when, data


def test_500_silent_half_bodies_are_closed_and_chat_keeps_answering(server):
    t0 = time.monotonic()
    socks = [_half_body(server) for _ in range(500)]
    chat_codes: list[int] = []
    stop = threading.Event()

    def chatter():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while not stop.is_set():
                chat_codes.append(_chat_ok(server, c))
                time.sleep(0.1)

    th = threading.Thread(target=chatter, daemon=True)
    th.start()
    try:
        when, data = _wait_closed(socks, t0, BODY_TIMEOUT + 90)
    finally:
        stop.set()
        th.join(120)
        for s in socks:
            s.close()
    assert all(w is not None for w in when), sum(w is None for w in when)
    assert min(when) >= BODY_TIMEOUT * 0.95  # not before the timeout
    for d in data:
        assert d.startswith(b"HTTP/1.1 408"), d[:100]
        err = json.loads(d.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_timeout"
    assert chat_codes and set(chat_codes) == {200}, chat_codes
    assert _chat_ok(server) == 200
    m = server.client.get("/metrics").text
    assert 'kvshare_requests_total{endpoint="chat",status="408"}' in m
    n = [ln for ln in m.splitlines() if ln.startswith('kvshare_edge_rejected_total{reason="body_timeout"}')]
    assert n and float(n[0].split()[-1]) >= 500


def test_declared_oversize_body_never_sent_gets_413_and_partial_headers_are_dropped(server):
    host, port = server.url.split("//")[1].split(":")
    big = socket.create_connection((host, int(port)))
    big.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                + str(17 * MiB).encode() + b"\r\n\r\n")
    head = socket.create_connection((host, int(port)))
    head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
    idle = socket.create_connection((host, int(port)))
    t0 = time.monotonic()
    when, data = _wait_closed([big, head, idle], t0, BODY_TIMEOUT + 60)
    assert all(w is not None and w >= BODY_TIMEOUT * 0.95 for w in when), when
    assert data[0].startswith(b"HTTP/1.1 413"), data[0][:200]
    assert json.loads(data[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    assert data[1] == b"" and data[2] == b""  # no request: closed without a response
    for s in (big, head, idle):
        s.close()


def test_hypercorn_errors_have_openai_json_bodies(server):
    host, port = server.url.split("//")[1].split(":")

    def raw(req: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(req)
            out = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return out
                out += chunk

    for req, status in [(b"GARBAGE\r\n\r\n", 400),
                        (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n", 400),
                        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000
                         + b"\r\n\r\n", 431)]:
        out = raw(req)
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d" % status), head
        assert b"content-type: application/json" in head.lower()
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_fuzzish_bodies_get_4xx(server):
    """Every string that is later encoded (model, cache_salt, stop, roles, tools, template
    kwargs, prompts, /tokenize content) with a lone surrogate, and other odd values: 4xx."""
    msgs = [{"role": "user", "content": "hi"}]
    s = "\ud800"
    chat_cases = [
        {"model": s, "messages": msgs}, {"model": "x" + s, "messages": msgs},
        {"cache_salt": s, "messages": msgs}, {"cache_salt": "ab\udfff", "messages": msgs},
        {"stop": s, "messages": msgs}, {"stop": ["ok", s], "messages": msgs},
        {"messages": [{"role": s, "content": "hi"}]},
        {"messages": [{"role": "user", "content": s}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]},
        {"messages": [{"role": "user", "content": "hi", "name": s}]},
        {"messages": msgs, "tools": [{"type": "function", "function": {"name": s}}]},
        {"messages": msgs, "tool_choice": {"type": "function", "function": {"name": s}}},
        {"messages": msgs, "chat_template_kwargs": {s: True}},
        {"messages": msgs, "chat_template_kwargs": {"enable_thinking": s}},
        {"messages": msgs, "response_format": {"type": s}},
        {"messages": msgs, "user": s}, {"messages": msgs, s: 1},
        {"messages": msgs, "max_tokens": -10**30}, {"messages": msgs, "temperature": 1e308},
        {"messages": msgs, "logit_bias": {s: 5}}, {"messages": msgs, "logit_bias": {"1": 1e30}},
        {"messages": msgs, "n": 10**6}, {"messages": msgs, "top_logprobs": 10**6, "logprobs": True},
        {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "format": s}}}},
        {"messages": msgs, "grammar": "root ::= " + s},
        {"messages": msgs, "stream_options": {"include_usage": s}},
    ]
    comp_cases = [{"prompt": s}, {"prompt": [s]}, {"prompt": "a" + s + "b", "echo": True},
                  {"prompt": [1, 2, 10**30]}, {"prompt": [[1], [2, 10**30]]}, {"prompt": "x", "suffix": s}]
    raw_cases = [b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
                 b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1' + b"0" * 5000 + b"}",
                 b'{"messages": NaN}', b'{"model": "\\ud800\\ud800"}', b"\xff\xfe{\x00}\x00"]
    c = server.client

    def enc(obj) -> bytes:
        return json.dumps(obj).encode()  # ensure_ascii: the surrogate travels as \ud800

    sent = ([("/v1/chat/completions", enc(b)) for b in chat_cases]
            + [("/v1/completions", enc(b)) for b in comp_cases]
            + [("/v1/chat/completions", b) for b in raw_cases]
            + [("/tokenize", enc({"content": s})), ("/tokenize", enc({"content": "a", s: 1})),
               ("/detokenize", enc({"tokens": [1], "x": [s]}))])
    for path, body in sent:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body[:120], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
    # odd but valid values: answered (or refused), never a 5xx
    for extra in ({"seed": 10**30}, {"seed": -10**30}, {"top_k": 10**30}, {"seed": 2**64},
                  {"repeat_last_n": 10**30}, {"max_tokens": CTX - 1, "stop": ["\u00e9" * 200]}):
        r = c.post("/v1/chat/completions", json=dict(messages=msgs, max_tokens=2) | extra)
        assert r.status_code < 500, (extra, r.status_code, r.text[:300])
    assert _chat_ok(server) == 200


def test_max_connections_answers_503_beyond_the_limit(launcher):
    s = Server(launcher, "--ctx-size", str(CTX), "--max-connections", "3",
               "--body-timeout", "30")
    try:
        held = [_half_body(s) for _ in range(3)]

        def in_progress() -> float:  # /metrics is not counted against the limit
            for line in s.client.get("/metrics").text.splitlines():
                if line.startswith("kvshare_http_requests_in_progress "):
                    return float(line.split()[1])
            return -1.0

        deadline = time.monotonic() + 60
        while in_progress() < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_progress() == 3, s.log()
        r = s.client.post("/v1/chat/completions", json=CHAT)
        err = assert_error(r, 503, code="service_unavailable")
        assert "3 requests" in err["message"] and r.headers["retry-after"] == "1"
        assert s.client.get("/health").status_code == 200  # not counted
        m = s.client.get("/metrics").text
        assert 'kvshare_edge_rejected_total{reason="busy"}' in m
        for sock in held:  # the held requests end: room again
            sock.close()
        while in_progress() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _chat_ok(s) == 200
    finally:
        s.kill9()


# --------------------------------------------------------------------------- start-up errors

def _serve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHARE_")}
    return subprocess.run([sys.executable, "-m", "kvshare.server.cli", "serve", "--port", "0",
                           "--model", str(TINY_MODEL), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _assert_one_line_exit_2(p: subprocess.CompletedProcess, *words: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvshare: error: "), p.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in p.stderr + p.stdout


def _unwritable_dir(tmp: Path) -> Path | None:
    d = tmp / "ro"
    d.mkdir()
    d.chmod(0o555)
    for cand in (d, Path("/sys/fs")):
        try:
            with tempfile.NamedTemporaryFile(dir=cand):
                pass
        except OSError:
            return cand
    return None  # root on a system where both are writable


def test_cache_dir_startup_errors_are_one_line_exit_2(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    _assert_one_line_exit_2(_serve("--cache-dir", str(f)), "--cache-dir", "not a directory")
    _assert_one_line_exit_2(_serve("--cache-dir", str(f / "sub")), "--cache-dir")
    locked = tmp_path / "locked"
    locked.mkdir()
    with open(locked / ".lock", "w") as lf:  # what a running kvshare on that dir holds
        fcntl.flock(lf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _assert_one_line_exit_2(_serve("--cache-dir", str(locked)), "in use")
    ro = _unwritable_dir(tmp_path)
    if ro is not None:
        _assert_one_line_exit_2(_serve("--cache-dir", str(ro)), "not writable")
    (tmp_path / "ro").chmod(0o755)


def test_cuda_without_a_device_is_one_line_exit_2():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present")
    except Exception:
        pass
    _assert_one_line_exit_2(_serve("--device", "cuda"), "--device cuda")


def test_cli_edge_flags():
    from kvshare.server.cli import parse_args

    a = parse_args(["serve"], environ={})
    assert (a.body_timeout, a.max_connections) == (30.0, 1024)
    a = parse_args(["serve", "--body-timeout", "2.5"],
                   environ={"KVSHARE_MAX_CONNECTIONS": "64", "KVSHARE_BODY_TIMEOUT": "9"})
    assert (a.body_timeout, a.max_connections) == (2.5, 64)
    for bad in (["--body-timeout", "0"], ["--body-timeout", "-1"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["serve", *bad], environ={})
        assert e.value.code == 2


def test_health_stays_fast_while_a_big_body_is_parsed_ratio(server):
    """/health while 4 x 16 MiB chat bodies are parsed and checked: its median latency stays
    within a small multiple of its idle median (a ratio, not a wall-clock window)."""
    for window in (1.0, 4.0, 16.0):  # a loaded machine starts the poller process slowly
        with _Probes(server) as p0:
            time.sleep(window)
        if len(p0.health) >= 5:
            break
    idle = statistics.median(p0.health)
    body = b'{"messages": [{"role": "user", "content": "' + b"abc " * (4 * MiB - 32) + b'"}]}'
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_post_all, server.url, "/v1/chat/completions", [body] * 4)
        with _Probes(server) as p:
            while not fut.done():
                time.sleep(0.05)
    assert all(r.status_code == 400 for r in fut.result())
    busy = statistics.median(p.health) if p.health else 0.0
    assert busy < max(20 * idle, 0.25), (idle, busy)


@pytest.mark.parametrize("flag", ["--queue-timeout", "--cache-ttl", "--graceful-timeout"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_time_flags_refuse_negative_and_non_finite_values(flag, value):
    from kvshare.server import cli

    with pytest.raises(SystemExit) as e:
        cli.parse_args(["serve", flag, value], {})
    assert e.value.code == 2
    assert cli.parse_args(["serve", flag, "0"], {}) is not None
