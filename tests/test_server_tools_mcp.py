"""MCP stdio servers (`--mcp-servers-json`, `--mcp-servers-config`) and the MCP CORS proxy
(`--ui-mcp-proxy`) on a real kvshare process on loopback, with tests/mcp_stdio_server.py as
the MCP server, as llama.cpp's test_mcp_servers.py and test_proxy.py check them: each
server's tools are listed at startup as `<server>_<tool>` (a server that cannot start has
none; a name already taken is skipped; the warmup processes are stopped), a call respawns
the server and returns its text, its errors come back as `error`, a crashed server is
respawned on the next call; a bad MCP config stops the server at startup with one line,
exit 2. The proxy forwards only the X-Llama-Server-Proxy-Header-* headers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from server_tools_helpers import kvshare_server
from tier_helpers import ROOT, TINY_MODEL, _clean_env

SCRIPT = str(Path(__file__).resolve().parent / "mcp_stdio_server.py")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcp")
    config = tmp / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "cfg": {"command": sys.executable, "args": [SCRIPT, "--tools", "add"]},
        "echo": {"command": "/bin/false"},  # read first: the inline "echo" is a duplicate
    }}))
    inline = {"mcpServers": {
        "echo": {"command": sys.executable, "args": [SCRIPT], "timeout_ms": 5000},
        "read": {"command": sys.executable, "args": [SCRIPT, "--tools", "echo", "--rename",
                                                     "echo=file"]},
        "bad": {"command": "this_executable_does_not_exist_12345"},
        "nocmd": {"args": ["x"]},
    }}
    with kvshare_server(["--tools", "read_file", "--mcp-servers-config", str(config),
                         "--mcp-servers-json", json.dumps(inline), "--ui-mcp-proxy"],
                        tmp / "server.log") as (c, proc):
        yield c, proc


def call(c, tool: str, params: dict) -> dict:
    r = c.post("/tools", json={"tool": tool, "params": params})
    assert r.status_code == 200, r.text
    return r.json()


def test_listing_names_schemas_collisions_and_stopped_warmup(srv):
    c, proc = srv
    tools = c.get("/tools").json()
    names = [t["tool"] for t in tools]
    # the file's servers come first (llama.cpp reads --mcp-servers-config, then the JSON);
    # its "echo" (/bin/false, no tools) keeps the name, so the inline "echo" is skipped;
    # "read"'s tool "file" is read_file, taken by the built-in tool
    assert names == ["read_file", "cfg_add"], names
    add = next(t for t in tools if t["tool"] == "cfg_add")
    assert add["type"] == "mcp" and add["permissions"] == {"write": False}
    fn = add["definition"]["function"]
    assert add["definition"]["type"] == "function" and fn["name"] == "cfg_add"
    assert fn["description"] == "Add two numbers"
    assert fn["parameters"]["required"] == ["a", "b"]
    assert _children(proc.pid) == []  # warmup spawned each server, listed, stopped it


def test_call_respawns_and_answers(srv):
    c, proc = srv
    assert call(c, "cfg_add", {"a": 2, "b": 3}) == {"plain_text_response": "5"}
    assert len(_children(proc.pid)) == 1  # kept for the next call
    assert call(c, "cfg_add", {"a": 1.5, "b": 1}) == {"plain_text_response": "2.5"}
    r = c.post("/tools", json={"tool": "bad_x", "params": {}})
    assert r.status_code == 404 and r.json()["error"]["message"] == 'unknown tool "bad_x"'


@pytest.fixture(scope="module")
def echo_srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcp_echo")
    inline = {"mcpServers": {"echo": {"command": sys.executable, "args": [SCRIPT],
                                      "timeout_ms": 5000}}}
    with kvshare_server(["--mcp-servers-json", json.dumps(inline), "--ui-mcp-proxy",
                         "--api-key", "k"], tmp / "server.log",
                        {"Authorization": "Bearer k"}) as (c, proc):
        yield c, proc


def test_mcp_only_lists_no_builtin_tool(echo_srv):
    c, _ = echo_srv
    assert [t["tool"] for t in c.get("/tools").json()] == [
        "echo_echo", "echo_add", "echo_fail_once", "echo_crash", "echo_is_error"]


def test_errors_notifications_and_respawn_after_a_crash(echo_srv):
    c, _ = echo_srv
    # a notification precedes each reply and stderr is written: both skipped
    assert call(c, "echo_echo", {"message": "hi"}) == {"plain_text_response": "echo: hi"}
    assert call(c, "echo_fail_once", {}) == {"error": "transient error"}
    assert call(c, "echo_fail_once", {}) == {"plain_text_response": "ok"}
    assert call(c, "echo_is_error", {}) == {"error": "it went wrong"}
    assert call(c, "echo_crash", {}) == {"error": "transport closed"}
    assert call(c, "echo_echo", {"message": "again"}) == {
        "plain_text_response": "echo: again"}
    for i in range(20):  # ids stay matched
        assert call(c, "echo_echo", {"message": str(i)})["plain_text_response"] == f"echo: {i}"


class _Target(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Target.seen.append(dict(self.headers))
        body = b'{"hello": "proxy"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length") or 0)
        _Target.seen.append({"body": self.rfile.read(n).decode()})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_cors_proxy_forwards_only_proxy_headers(echo_srv):
    c, _ = echo_srv
    target = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{target.server_port}/x"
        r = c.get("/cors-proxy", params={"url": url},
                  headers={"X-Llama-Server-Proxy-Header-X-Upstream-Key": "abc",
                           "Cookie": "secret=1"})
        assert r.status_code == 200 and r.json() == {"hello": "proxy"}
        assert "access-control-allow-origin" not in r.headers  # the target's is dropped
        sent = {k.lower(): v for k, v in _Target.seen[-1].items()}
        assert sent["x-upstream-key"] == "abc"
        assert "authorization" not in sent and "cookie" not in sent
        r = c.post("/cors-proxy", params={"url": url}, content=b'{"a": 1}')
        assert r.status_code == 204 and r.content == b""
        assert _Target.seen[-1] == {"body": '{"a": 1}'}
        # a body over the server's limit (--max-body-mib, 16 MiB) is not forwarded
        n_seen = len(_Target.seen)
        r = c.post("/cors-proxy", params={"url": url}, content=b"x" * (17 * 1024 * 1024))
        assert r.status_code == 413 and len(_Target.seen) == n_seen
        # through the proxy, to this server itself (llama.cpp's test_mcp_proxy_custom_port)
        self_url = str(c.base_url).rstrip("/") + "/v1/models"
        r = c.get("/cors-proxy", params={"url": self_url})
        assert r.status_code == 401  # the caller's key is not forwarded
        r = c.get("/cors-proxy", params={"url": "ftp://127.0.0.1/x"})
        assert r.status_code == 500 and r.json()["error"]["message"] == \
            "unsupported URL scheme in target URL: ftp"
        assert c.get("/cors-proxy", params={"url": "nohost"}).status_code == 500
    finally:
        target.shutdown()
        target.server_close()


@pytest.mark.parametrize("args,want", [
    (["--mcp-servers-json", "not valid json"], "failed to parse MCP config JSON"),
    (["--mcp-servers-config", "/nonexistent/path.json"], "failed to open MCP config file"),
    (["--mcp-servers-json", '{"mcpServers": {"x": {"command": 5}}}'], "MCP server 'x'"),
    (["--tools", "read_file,nope"], 'unknown tool "nope". available tools: read_file'),
    (["--tools-runtime", "ssh:host"], "kvshare runs tools on the host only"),
])
def test_bad_tools_flags_exit_2_with_one_line(args, want):
    p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", "-m", str(TINY_MODEL),
                        "--port", "0", *args], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=_clean_env())
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and want in err[0], p.stderr
