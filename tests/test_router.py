"""`kvshare route` end to end: the router under Hypercorn on a loopback port in front of two
tiny Starlette backends (each under Hypercorn too) that record what they get and answer
/health, /v1/models, chat (JSON and SSE), Messages, raw prompts and Responses.

Covered: one prefix stays on one backend and tenants spread evenly; SSE passes through
incrementally; a stream cut by the backend is cut for the client too, a client that leaves
cancels the backend's stream; a dead backend is failed over (and /health says so), health
checks take a backend down and up; nothing healthy is a 503 in each API's error shape;
/v1/models is the union; /metrics counts; auth (401 shapes, headers passed through);
previous_response_id follows its response; 413; --root-path; the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvshare.router.app import RouterSettings, create_app
from kvshare.router.cli import add_route_parser, route
from kvshare.server.launcher import bind_socket, serve_app, socket_url

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


# --------------------------------------------------------------------------- backends

class BackendState:
    def __init__(self, name: str):
        self.name = name
        self.requests: list[dict] = []
        self.healthy = True
        self.gate = threading.Event()  # the gated SSE stream waits for it after event 1
        self.last_event_sent_at: float | None = None
        self.cancelled = 0  # streams whose client went away
        self.stored: set[str] = set()


def backend_app(state: BackendState) -> Starlette:
    """A stand-in replica: records each request, answers as `state.name`."""
    hdr = {"x-backend": state.name}

    async def record(request: Request) -> dict:
        body = await request.body()
        rec = {"method": request.method, "path": request.url.path,
               "query": request.url.query, "headers": dict(request.headers),
               "raw_headers": list(request.headers.raw), "body": body}
        state.requests.append(rec)
        try:
            return json.loads(body) if body else {}
        except ValueError:
            return {}

    async def health(request: Request) -> Response:
        if state.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "sick"}, status_code=503)

    async def models(request: Request) -> Response:
        await record(request)
        return JSONResponse({"object": "list", "data": [
            {"id": "shared", "object": "model", "owned_by": state.name},
            {"id": f"{state.name}-only", "object": "model", "owned_by": state.name}]},
            headers=hdr)

    def sse(obj: dict) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    async def chat(request: Request) -> Response:
        body = await record(request)
        if not body.get("stream"):
            return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion",
                                 "backend": state.name}, headers={**hdr, "x-extra": "1"})

        async def events():
            try:
                yield sse({"n": 1, "backend": state.name})
                if body.get("cut"):
                    raise RuntimeError("the replica died mid-stream")
                if body.get("gated"):  # set by the test thread (or 3 s pass)
                    await asyncio.to_thread(state.gate.wait, 3.0)
                for n in range(2, int(body.get("events", 3)) + 1):
                    await asyncio.sleep(float(body.get("delay", 0.02)))
                    state.last_event_sent_at = time.monotonic()
                    yield sse({"n": n, "backend": state.name})
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                state.cancelled += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**hdr, "Cache-Control": "no-cache"})

    async def echo(request: Request) -> Response:
        await record(request)
        return JSONResponse({"backend": state.name}, headers=hdr)

    async def responses(request: Request) -> Response:
        body = await record(request)
        rid = f"resp_{state.name}{len(state.requests)}"
        state.stored.add(rid)
        prev = body.get("previous_response_id")
        if prev is not None and prev not in state.stored:
            return JSONResponse({"error": {"message": f"no response {prev}"}},
                                status_code=404, headers=hdr)
        obj = {"id": rid, "object": "response", "backend": state.name,
               "previous_response_id": prev,
               "output": [{"id": "msg_1", "type": "message"}]}
        if not body.get("stream"):
            return JSONResponse(obj, headers=hdr)

        async def events():
            yield (b"event: response.created\ndata: "
                   + json.dumps({"type": "response.created", "response": obj}).encode()
                   + b"\n\n")
            await asyncio.sleep(0.01)
            yield b'event: response.completed\ndata: {"type": "response.completed"}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream", headers=hdr)

    async def get_response(request: Request) -> Response:
        await record(request)
        rid = request.path_params["rid"]
        if rid not in state.stored:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404,
                                headers=hdr)
        return JSONResponse({"id": rid, "backend": state.name}, headers=hdr)

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/messages", echo, methods=["POST"]),
        Route("/v1/completions", echo, methods=["POST"]),
        Route("/completion", echo, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{rid}", get_response, methods=["GET"]),
        Route("/echo/{rest:path}", echo, methods=["GET", "POST", "PUT", "DELETE"]),
    ])


# --------------------------------------------------------------------------- servers

class Served:
    """An ASGI app under Hypercorn in a background thread."""

    def __init__(self, app, root_path: str = "", port: int = 0):
        self.app = app
        sock = bind_socket("127.0.0.1", port)
        self.port = sock.getsockname()[1]
        self.url = socket_url(sock)
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        ready = threading.Event()

        async def main():
            self.stop_event = asyncio.Event()
            ready.set()
            await serve_app(app, sock, root_path=root_path, graceful_timeout=1.0,
                            log_level="WARNING", stop=self.stop_event,
                            install_signal_handlers=False)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       daemon=True)
        self.thread.start()
        ready.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}{root_path}/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.02)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
            self.thread.join(10)
            assert not self.thread.is_alive()


class Cluster:
    def __init__(self):
        self.servers: list[Served] = []
        self.states: dict[str, BackendState] = {}  # backend URL -> state
        self.by_name: dict[str, str] = {}  # backend name -> URL

    def backend(self, name: str) -> str:
        state = BackendState(name)
        s = Served(backend_app(state))
        self.servers.append(s)
        self.states[s.url] = state
        self.by_name[name] = s.url
        return s.url

    def router(self, backends: list[str], root_path: str = "", **kw) -> Served:
        kw.setdefault("health_interval", 0.2)
        app = create_app(RouterSettings(backends=backends, root_path=root_path, **kw))
        s = Served(app, root_path=root_path)
        s.router = app.state.router
        self.servers.append(s)
        return s

    def kill(self, name: str) -> None:
        url = self.by_name[name]
        next(s for s in self.servers if s.url == url).stop()

    def close(self) -> None:
        for s in reversed(self.servers):
            s.stop()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


@pytest.fixture
def two(cluster):
    """Backends a and b behind a router; returns (router, httpx client to it)."""
    a, b = cluster.backend("a"), cluster.backend("b")
    r = cluster.router([a, b])
    with httpx.Client(base_url=r.url, timeout=10) as client:
        yield r, client


def chat_body(system: str, user: str = "hi", **kw) -> dict:
    return {"model": "m", "tools": TOOLS, **kw,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    return 0.0


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


# --------------------------------------------------------------------------- routing

def test_prefix_affinity_and_tenants_spread(two, cluster):
    r, client = two
    where: dict[str, set[str]] = {}
    counts = {"a": 0, "b": 0}
    for turn in range(4):
        for t in range(8):
            resp = client.post("/v1/chat/completions",
                               json=chat_body(f"You are agent {t}.", user=f"turn {turn}"))
            assert resp.status_code == 200, resp.text
            name = resp.headers["x-backend"]
            assert resp.json()["backend"] == name
            where.setdefault(f"t{t}", set()).add(name)
            counts[name] += 1
    assert all(len(v) == 1 for v in where.values()), where  # a prefix stays on one backend
    assert min(counts.values()) > 0
    assert max(counts.values()) <= 1.5 * min(counts.values()), counts
    text = client.get("/metrics").text
    assert metric(text, "kvshare_router_home_routed_ratio") == 1.0
    total = sum(metric(text, "kvshare_router_requests_total", backend=u, reason=why)
                for u in cluster.states for why in ("ring", "affinity"))
    assert total == 32
    assert sum(metric(text, "kvshare_router_requests_total", backend=u, reason="ring")
               for u in cluster.states) == 8  # each tenant placed once, then affinity


def test_request_and_response_pass_through_unchanged(two, cluster):
    r, client = two
    raw = b'{"model": "m",   "messages": [{"role": "user", "content": "hi"}]}'
    resp = client.post("/v1/chat/completions?x=1&y=%2F", content=raw, headers={
        "Content-Type": "application/json", "Authorization": "Bearer anything",
        "anthropic-version": "2023-06-01", "X-Custom": "v", "Connection": "keep-alive, X-Hop",
        "X-Hop": "dropped", "Keep-Alive": "timeout=5", "Proxy-Authorization": "secret",
        "X-Forwarded-For": "10.1.2.3"})
    assert resp.status_code == 200
    assert resp.headers["x-extra"] == "1"  # the backend's own header comes back
    assert resp.headers["content-type"] == "application/json"
    rec = cluster.states[cluster.by_name[resp.headers["x-backend"]]].requests[-1]
    assert rec["body"] == raw  # byte for byte
    assert rec["path"] == "/v1/chat/completions" and rec["query"] == "x=1&y=%2F"
    h = rec["headers"]
    assert h["authorization"] == "Bearer anything"
    assert h["anthropic-version"] == "2023-06-01" and h["x-custom"] == "v"
    for hop in ("x-hop", "keep-alive", "proxy-authorization"):
        assert hop not in h
    assert h["x-forwarded-for"] == "10.1.2.3, 127.0.0.1"
    assert h["x-forwarded-proto"] == "http"
    assert h["accept-encoding"] == "gzip, deflate"  # the test client's, unchanged
    # the router's own HTTP client adds no Accept-Encoding (a backend must not compress for
    # a client that did not ask), nor Accept or User-Agent
    with httpx.Client(base_url=r.url, timeout=10) as bare:
        for name in ("accept", "accept-encoding", "user-agent"):
            bare.headers.pop(name)
        resp = bare.post("/v1/chat/completions", content=raw)
    h = cluster.states[cluster.by_name[resp.headers["x-backend"]]].requests[-1]["headers"]
    assert not {"accept", "accept-encoding", "user-agent"} & set(h), h
    # a user-only request has no prefix key: least-loaded
    text = client.get("/metrics").text
    assert sum(metric(text, "kvshare_router_requests_total", backend=u, reason="least_loaded")
               for u in cluster.states) == 2
    # any other method and path is proxied too
    resp = client.request("DELETE", "/echo/some/where")
    assert resp.status_code == 200 and resp.json()["backend"] in ("a", "b")


def test_sse_passes_through_incrementally(two, cluster):
    r, client = two
    body = chat_body("You are a streamer.", stream=True, gated=True, events=3)
    got: list[dict] = []
    first_at = None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        state = cluster.states[cluster.by_name[resp.headers["x-backend"]]]
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            got.append(json.loads(line[6:]))
            if first_at is None:
                first_at = time.monotonic()
                # the backend waits for this before sending the rest: a router that buffers
                # delivers the first event only after the gate times out and the rest is sent
                assert state.last_event_sent_at is None
                state.gate.set()
    assert [e["n"] for e in got] == [1, 2, 3]
    assert first_at < state.last_event_sent_at
    # in flight until the stream ended (the router's bookkeeping runs just after the client
    # got the last byte)
    wait_for(lambda: r.router.backends.inflight() == {u: 0 for u in cluster.states})


def test_an_overloaded_home_spills_without_moving_the_prefix(cluster):
    a, b = cluster.backend("a"), cluster.backend("b")
    # overload factor 1: a backend with more than its even share in flight is overloaded
    r = cluster.router([a, b], overload_factor=1.0, spill_min=1)
    with httpx.Client(base_url=r.url, timeout=10) as client:
        body = chat_body("You are popular.", stream=True, gated=True, events=2)
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            home = resp.headers["x-backend"]
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")  # in flight at its home now
            other = client.post("/v1/chat/completions", json=chat_body("You are popular."))
            assert other.headers["x-backend"] != home
            cluster.states[cluster.by_name[home]].gate.set()
            assert "data: [DONE]" in list(lines)
        wait_for(lambda: r.router.backends.inflight() == {u: 0 for u in cluster.states})
        again = client.post("/v1/chat/completions", json=chat_body("You are popular."))
        assert again.headers["x-backend"] == home  # the prefix stayed where it was
        text = client.get("/metrics").text
        assert metric(text, "kvshare_router_requests_total", backend=cluster.by_name[
            "b" if home == "a" else "a"], reason="spill") == 1
        assert metric(text, "kvshare_router_home_routed_ratio") == pytest.approx(2 / 3)


def test_stream_cut_by_the_backend_is_cut_for_the_client(two, cluster):
    r, client = two
    with (pytest.raises(httpx.RemoteProtocolError),
          client.stream("POST", "/v1/chat/completions",
                        json=chat_body("Cut me.", stream=True, cut=True)) as resp):
        assert resp.status_code == 200
        for _ in resp.iter_lines():
            pass
    wait_for(lambda: sum(metric(client.get("/metrics").text, "kvshare_router_errors_total",
                                backend=u, kind="stream") for u in cluster.states) == 1)
    wait_for(lambda: r.router.backends.inflight() == {u: 0 for u in cluster.states})


def test_client_disconnect_cancels_the_backend_stream(two, cluster):
    r, client = two
    body = chat_body("Talk forever.", stream=True, events=200, delay=0.02)
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        state = cluster.states[cluster.by_name[resp.headers["x-backend"]]]
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    # leaving the block closed the connection
    wait_for(lambda: state.cancelled == 1)
    wait_for(lambda: r.router.backends.inflight() == {u: 0 for u in cluster.states})


# --------------------------------------------------------------------------- health

def test_dead_backend_fails_over_and_health_reports_it(cluster):
    a, b = cluster.backend("a"), cluster.backend("b")
    # health checks far apart: the proxy itself must notice the dead backend
    r = cluster.router([a, b], health_interval=30)
    with httpx.Client(base_url=r.url, timeout=10) as client:
        homes = {}
        for t in range(6):
            resp = client.post("/v1/chat/completions", json=chat_body(f"agent {t}"))
            homes[t] = resp.headers["x-backend"]
        on_a = [t for t, n in homes.items() if n == "a"]
        assert on_a, homes
        cluster.kill("a")
        for t in on_a:
            resp = client.post("/v1/chat/completions", json=chat_body(f"agent {t}"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-backend"] == "b"
        health = client.get("/health")
        assert health.status_code == 200
        by_url = {x["url"]: x for x in health.json()["backends"]}
        assert by_url[a]["healthy"] is False and by_url[b]["healthy"] is True
        text = client.get("/metrics").text
        assert metric(text, "kvshare_router_errors_total", backend=a, kind="connect") == 1
        assert metric(text, "kvshare_router_backend_up", backend=a) == 0
        assert metric(text, "kvshare_router_backend_up", backend=b) == 1
        # b's prefixes never moved
        for t, n in homes.items():
            if n == "b":
                assert client.post("/v1/chat/completions", json=chat_body(
                    f"agent {t}")).headers["x-backend"] == "b"


def test_health_checks_take_a_backend_down_and_up(cluster):
    a, b = cluster.backend("a"), cluster.backend("b")
    r = cluster.router([a, b], health_interval=0.05)
    backends = r.router.backends
    cluster.states[a].healthy = False  # /health answers 503
    wait_for(lambda: not backends.is_healthy(a))
    with httpx.Client(base_url=r.url, timeout=10) as client:
        for t in range(4):  # everything goes to b meanwhile
            resp = client.post("/v1/chat/completions", json=chat_body(f"agent {t}"))
            assert resp.headers["x-backend"] == "b"
        cluster.states[a].healthy = True
        wait_for(lambda: backends.is_healthy(a))
        assert client.get("/health").json()["backends"][0]["healthy"] is True


def test_one_failed_check_is_not_down():
    from kvshare.router.backends import BackendSet

    bs = BackendSet(["http://x", "http://y"], client=None)  # type: ignore[arg-type]
    bs.record_check("http://x", False, "slow")
    assert bs.is_healthy("http://x")
    bs.record_check("http://x", False, "slow")
    assert not bs.is_healthy("http://x") and bs.healthy() == ["http://y"]
    bs.record_check("http://x", True)
    assert bs.is_healthy("http://x")
    bs.mark_down("http://y", "ConnectError")  # at once
    assert bs.healthy() == ["http://x"]


def test_a_backend_down_at_startup_is_down_until_it_answers(cluster):
    a = cluster.backend("a")
    cluster.states[a].healthy = False
    b = "http://127.0.0.1:9"  # nothing listens (discard port)
    r = cluster.router([a, b], health_interval=0.05)
    with httpx.Client(base_url=r.url, timeout=10) as client:
        health = client.get("/health")
        assert health.status_code == 503  # at once, no request needed to find out
        assert client.post("/v1/chat/completions", json=chat_body("x")).status_code == 503
        cluster.states[a].healthy = True
        wait_for(lambda: client.get("/health").status_code == 200)
        assert client.post("/v1/chat/completions",
                           json=chat_body("x")).headers["x-backend"] == "a"


def test_all_down_is_503_in_each_apis_shape(cluster):
    a, b = cluster.backend("a"), cluster.backend("b")
    r = cluster.router([a, b], health_interval=30)
    cluster.kill("a")
    cluster.kill("b")
    with httpx.Client(base_url=r.url, timeout=10) as client:
        # the first request finds both dead itself (connect errors), then nothing is healthy
        resp = client.post("/v1/chat/completions", json=chat_body("x"))
        assert resp.status_code == 503
        err = resp.json()["error"]
        assert err["code"] == "service_unavailable" and err["type"] == "server_error"
        assert "healthy" in err["message"]
        assert resp.headers["retry-after"]
        resp = client.post("/v1/messages", json={"model": "m", "max_tokens": 5,
                                                 "messages": [{"role": "user",
                                                               "content": "hi"}]})
        assert resp.status_code == 503
        assert resp.json()["type"] == "error"
        assert resp.json()["error"]["type"] == "overloaded_error"
        resp = client.post("/completion", json={"prompt": "hi"})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == 503  # llama-server's shape
        health = client.get("/health")
        assert health.status_code == 503
        assert [x["healthy"] for x in health.json()["backends"]] == [False, False]
        assert client.get("/v1/models").status_code == 503
        text = client.get("/metrics").text
        assert metric(text, "kvshare_router_errors_total", backend="none",
                      kind="no_backend") == 4


# --------------------------------------------------------------------------- own endpoints

def test_models_are_aggregated(two, cluster):
    r, client = two
    resp = client.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    ids = [m["id"] for m in body["data"]]
    assert sorted(ids) == ["a-only", "b-only", "shared"]
    assert len(ids) == len(set(ids))
    for state in cluster.states.values():  # each was asked, with the client's headers
        assert state.requests[-1]["headers"]["authorization"] == "Bearer k"


def test_auth(cluster):
    a = cluster.backend("a")
    r = cluster.router([a], api_keys=("k1", "k2"))
    with httpx.Client(base_url=r.url, timeout=10) as client:
        resp = client.post("/v1/chat/completions", json=chat_body("x"))
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"] == "Bearer"
        resp = client.post("/v1/messages", json={"model": "m", "messages": []},
                           headers={"x-api-key": "wrong"})
        assert resp.status_code == 401
        assert resp.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "Invalid API key"}}
        assert client.get("/metrics").status_code == 401
        assert client.get("/v1/models").status_code == 401
        assert cluster.states[a].requests == []  # nothing reached the backend
        assert client.get("/health").status_code == 200  # open, as on a replica
        resp = client.post("/v1/chat/completions", json=chat_body("x"),
                           headers={"Authorization": "Bearer k2"})
        assert resp.status_code == 200
        assert cluster.states[a].requests[-1]["headers"]["authorization"] == "Bearer k2"
        resp = client.post("/v1/messages", json={"model": "m", "messages": []},
                           headers={"x-api-key": "k1", "anthropic-version": "2023-06-01"})
        assert resp.status_code == 200
        assert cluster.states[a].requests[-1]["headers"]["x-api-key"] == "k1"


def test_previous_response_id_sticks_to_its_backend(two, cluster):
    r, client = two

    def post(instr: str, **kw) -> httpx.Response:
        resp = client.post("/v1/responses", json={"model": "m", "instructions": instr,
                                                  "input": "go", **kw})
        assert resp.status_code == 200, resp.text
        return resp

    first = post("tenant zero").json()
    rid, home = first["id"], first["backend"]
    # follow-ups with other instructions (prefixes that spread over both backends when new)
    seen = {post(f"tenant {t}", previous_response_id=rid).json()["backend"]
            for t in range(1, 7)}
    assert seen == {home}
    # the same prefixes without the id do land on the other backend: the test can fail
    assert {post(f"tenant {t}").json()["backend"] for t in range(7, 13)} == {"a", "b"}
    # a streamed response: its id is read from the first event as it passes
    with client.stream("POST", "/v1/responses", json={
            "model": "m", "instructions": "streaming tenant", "input": "go",
            "stream": True}) as resp:
        text = "".join(resp.iter_text())
    srid = re.search(r'"id": "(resp_[a-z0-9]+)"', text).group(1)
    shome = resp.headers["x-backend"]
    seen = {post(f"tenant {t}", previous_response_id=srid).json()["backend"]
            for t in range(20, 26)}
    assert seen == {shome}
    # GET /v1/responses/{id} goes there too
    got = client.get(f"/v1/responses/{rid}")
    assert got.status_code == 200 and got.json()["backend"] == home
    # an unknown id falls back to the prefix route (the backend answers for itself)
    assert client.post("/v1/responses", json={"model": "m", "instructions": "tenant zero",
                                              "previous_response_id": "resp_unknown",
                                              "input": "go"}).status_code == 404


def test_body_too_large_is_413(cluster):
    a = cluster.backend("a")
    r = cluster.router([a], max_body=4096)
    with httpx.Client(base_url=r.url, timeout=10) as client:
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
        resp = client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "request_too_large"
        resp = client.post("/v1/messages", json=big)
        assert resp.status_code == 413
        assert resp.json()["type"] == "error"

        def chunks():  # no Content-Length: the limit applies as it arrives
            for _ in range(10):
                yield b"x" * 1000

        resp = client.post("/v1/chat/completions", content=chunks())
        assert resp.status_code == 413
        assert cluster.states[a].requests == []
        ok = client.post("/v1/chat/completions", json=chat_body("small"))
        assert ok.status_code == 200


def test_root_path(cluster):
    a = cluster.backend("a")
    r = cluster.router([a], root_path="/kv")
    with httpx.Client(base_url=r.url, timeout=10) as client:
        assert client.get("/kv/health").status_code == 200
        resp = client.post("/kv/v1/chat/completions", json=chat_body("rooted"))
        assert resp.status_code == 200
        assert cluster.states[a].requests[-1]["path"] == "/v1/chat/completions"
        text = client.get("/kv/metrics").text
        assert metric(text, "kvshare_router_requests_total", backend=a, reason="ring") == 1


# --------------------------------------------------------------------------- command line

def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvshare")
    sub = parser.add_subparsers(dest="command")
    add_route_parser(sub, environ or {})
    return parser.parse_args(["route", *argv])


def test_cli_flags_and_environment():
    args = parse([], {"KVSHARE_BACKENDS": "http://a:1, http://b:2", "KVSHARE_PORT": "9000"})
    assert args.backend == ["http://a:1", "http://b:2"] and args.port == 9000
    args = parse(["--backend", "http://c:3", "--backend", "http://d:4,http://e:5",
                  "--api-key", "k", "--load-factor", "1.25"],
                 {"KVSHARE_BACKENDS": "http://a:1"})
    assert args.backend == ["http://c:3", "http://d:4", "http://e:5"]  # flags replace env
    assert args.api_key == ["k"] and args.load_factor == 1.25
    assert args.max_body == 32 * 1024 * 1024 and args.timeout == 600
    with pytest.raises(SystemExit):
        parse(["--load-factor", "0.5"])
    # a bad value in the environment is refused when `route` runs, and only then
    with pytest.raises(SystemExit):
        parse([], {"KVSHARE_HEALTH_INTERVAL": "soon"})
    assert parse(["--health-interval", "1"], {"KVSHARE_HEALTH_INTERVAL": "soon"}
                 ).health_interval == 1.0
    parser = argparse.ArgumentParser(prog="kvshare")
    sub = parser.add_subparsers(dest="command")
    add_route_parser(sub, {"KVSHARE_HEALTH_INTERVAL": "soon"})
    sub.add_parser("serve")
    assert parser.parse_args(["serve"]).command == "serve"


@pytest.mark.parametrize("argv, message", [
    ([], "at least one --backend"),
    (["--backend", "ftp://x:1"], "is not an http(s) URL"),
    (["--backend", "localhost:8080"], "is not an http(s) URL"),
    (["--backend", "http://x:1", "--root-path", "kv"], "--root-path must start with '/'"),
])
def test_cli_bad_flags_exit_2_with_one_line(argv, message, capsys):
    assert route(parse(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvshare: error: ") and message in err


def test_kvshare_route_command(cluster):
    a = cluster.backend("a")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvshare.server.cli", "route", "--backend", a, "--port", "0",
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        m = re.search(r"routing at (http://\S+) to 1 backend", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        resp = httpx.post(m.group(1) + "/v1/chat/completions", json=chat_body("cli"),
                          timeout=10)
        assert resp.status_code == 200 and resp.headers["x-backend"] == "a"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "kvshare: stopped" in out


def test_cli_api_key_file_is_the_replicas_key_file(tmp_path, capsys):
    from kvshare.router.cli import settings_from_args

    f = tmp_path / "keys"
    f.write_text("# tenants\nkey-one team-a\nkey-two\n")
    f.chmod(0o600)
    s = settings_from_args(parse(["--backend", "http://a:1", "--api-key", "k0",
                                  "--api-key-file", str(f)]))
    assert s.api_keys == ("k0", "key-one", "key-two")
    assert route(parse(["--backend", "http://a:1", "--api-key-file", str(tmp_path / "no")])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvshare: error: ")
