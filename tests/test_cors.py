"""CORS (server/cors.py), in-process against the fake engine with an API key set: preflights
are answered without a key, loopback origins are allowed by default, `--cors-origins` widens
the list (`*`: any origin), and actual responses from an allowed origin carry
`Access-Control-Allow-Origin` (successes, a 401, an SSE stream); other origins get none."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvshare.server import cli
from kvshare.server.app import create_app
from kvshare.server.cors import CORSPolicy, is_loopback_origin, parse_origins
from kvshare.server.settings import ServerSettings
from test_server_http import FakeEngine

KEY = "sk-cors-test"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def client(**settings) -> TestClient:
    return TestClient(create_app(FakeEngine(), ServerSettings(api_key=KEY, **settings)))


def preflight(c: TestClient, origin: str, path: str = "/v1/chat/completions",
              headers: str | None = "authorization, content-type"):
    h = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return c.options(path, headers=h)


def vary_has_origin(r) -> bool:
    headers = getattr(r, "headers", r)
    return "origin" in [v.strip().lower() for v in headers.get("vary", "").split(",")]


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://localhost",
                                    "https://127.0.0.1:8443", "http://[::1]:5173"])
def test_preflight_from_loopback_needs_no_key(origin):
    with client() as c:
        r = preflight(c, origin)
    assert r.status_code == 200, r.text
    h = r.headers
    assert h["access-control-allow-origin"] == origin
    assert {m.strip() for m in h["access-control-allow-methods"].split(",")} >= \
        {"GET", "POST", "DELETE", "OPTIONS"}
    assert h["access-control-allow-headers"] == "authorization, content-type"  # echoed
    assert int(h["access-control-max-age"]) > 0
    assert h["access-control-allow-credentials"] == "true"
    assert vary_has_origin(r)
    assert r.content == b""


def test_preflight_without_requested_headers_allows_the_api_headers():
    with client() as c:
        r = preflight(c, "http://localhost:3000", path="/v1/messages", headers=None)
    assert r.status_code == 200
    allowed = {x.strip().lower() for x in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key", "anthropic-version"} <= allowed


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example",
                                    "http://127.0.0.1.evil.example:80", "null",
                                    "file://localhost"])
def test_preflight_from_other_origin_is_refused(origin):
    # llama-server's answer: 200 and an empty body; without the allow headers the browser
    # refuses the page's request
    with client() as c:
        r = preflight(c, origin)
    assert r.status_code == 200 and r.content == b""
    assert not any(k.lower().startswith("access-control-") for k in r.headers)
    assert vary_has_origin(r)


def test_actual_requests_from_allowed_origin_carry_the_header():
    origin = "http://localhost:3000"
    with client() as c:
        ok = c.post("/v1/chat/completions", json=CHAT,
                    headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        unauth = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert unauth.status_code == 401
        bad = c.post("/v1/chat/completions", json={"messages": "x"},
                     headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
        assert bad.status_code == 400
        health = c.get("/health", headers={"Origin": origin})
        assert health.status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            stream_headers = s.headers
            body = b"".join(s.iter_bytes())
        assert b"[DONE]" in body
    for r in (ok, unauth, bad, health):
        assert r.headers["access-control-allow-origin"] == origin, r
        assert vary_has_origin(r)
    assert stream_headers["access-control-allow-origin"] == origin
    assert vary_has_origin(stream_headers)


def test_actual_request_from_other_origin_is_served_without_the_header():
    with client() as c:
        r = c.post("/v1/chat/completions", json=CHAT,
                   headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200  # served: the browser, not the server, withholds it
    assert "access-control-allow-origin" not in r.headers
    assert vary_has_origin(r)


def test_requests_without_origin_are_untouched():
    with client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
        o = c.options("/v1/chat/completions")  # no Origin: not a preflight, the app answers
    assert r.status_code == 200
    assert not any(k.lower().startswith("access-control-") for k in r.headers)
    assert "vary" not in r.headers
    assert o.status_code in (401, 405)  # auth or routing, as without CORS


def test_cors_origins_widen_the_list():
    with client(cors_origins=parse_origins("https://app.example, https://other.example:8443/"
                                           )) as c:
        def allowed(origin: str) -> bool:
            r = preflight(c, origin)
            assert r.status_code == 200  # llama-server's status, allowed or not
            return r.headers.get("access-control-allow-origin") == origin

        assert allowed("https://app.example")
        assert preflight(c, "https://APP.example").headers[
            "access-control-allow-origin"] == "https://APP.example"
        assert allowed("https://other.example:8443")
        assert allowed("http://localhost:3000")  # still allowed
        assert not allowed("https://app.example:444")
        assert not allowed("https://evil.example")
        r = c.get("/v1/models", headers={"Origin": "https://app.example",
                                         "Authorization": f"Bearer {KEY}"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_star_allows_any_origin():
    with client(cors_origins=["*"]) as c:
        r = preflight(c, "https://evil.example")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://evil.example"
        r = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://evil.example"


def test_cors_headers_and_methods_settings():
    with client(cors_headers="Authorization, Content-Type", cors_methods="GET, POST") as c:
        r = preflight(c, "http://localhost:1", headers="x-custom")
    assert r.headers["access-control-allow-headers"] == "Authorization, Content-Type"
    assert r.headers["access-control-allow-methods"] == "GET, POST"


def test_existing_vary_header_is_merged():
    from kvshare.server.cors import _add_vary

    assert _add_vary([(b"vary", b"Accept-Encoding")]) == [(b"vary", b"Accept-Encoding, Origin")]
    assert _add_vary([(b"vary", b"origin")]) == [(b"vary", b"origin")]
    assert _add_vary([]) == [(b"vary", b"Origin")]


def test_origin_helpers():
    assert is_loopback_origin("http://localhost:3000")
    assert is_loopback_origin("https://[::1]")
    assert not is_loopback_origin("http://localhost:3000/path")
    assert not is_loopback_origin("ftp://localhost")
    assert not is_loopback_origin("http://localhost:notaport")
    assert parse_origins(["a.example,b.example", "localhost", "*"]) == ["a.example", "b.example",
                                                                          "*"]
    p = CORSPolicy(["https://x.example/"])
    assert p.allows("https://x.example") and not p.allows("null")


def test_cli_flags_reach_the_settings():
    a = cli.parse_args(["serve", "--cors-origins", "https://a.example",
                        "--cors-origins", "https://b.example,https://c.example",
                        "--cors-headers", "Authorization"], {})
    kw = cli.llama_settings_kwargs(a)
    assert kw["cors_origins"] == ["https://a.example", "https://b.example", "https://c.example"]
    assert kw["cors_headers"] == "Authorization"
    a = cli.parse_args(["serve"], {"LLAMA_ARG_CORS_ORIGINS": "*"})
    assert cli.llama_settings_kwargs(a)["cors_origins"] == ["*"]


def test_no_cors_credentials():
    a = cli.parse_args(["serve", "--no-cors-credentials"], {})
    assert cli.llama_settings_kwargs(a)["cors_credentials"] is False
    assert cli.parse_args(["serve"], {"LLAMA_ARG_CORS_CREDENTIALS": "false"}).cors_credentials \
        is False
    with client(cors_credentials=False) as c:
        r = preflight(c, "http://localhost:3000")
        assert r.status_code == 200 and "access-control-allow-credentials" not in r.headers
        r = c.get("/health", headers={"Origin": "http://localhost:3000"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "access-control-allow-credentials" not in r.headers
