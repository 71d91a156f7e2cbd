"""llama-server's built-in tools (`--tools all`) on a real kvshare process on loopback, as
llama.cpp's tools/server/tests/unit/test_tools_builtin.py checks them: GET /tools lists each
with its schema; POST /tools calls each on real files and real subprocesses; a tool's own
failure is a 200 with `error`; a bad call is llama-server's error JSON (unknown tool 404,
missing parameter 400, container/ssh runtime 500); the limits (16 KiB reads, output caps,
timeouts) hold; the API key guards /tools; CORS stays loopback-only. And a server without
the flags answers /tools and /cors-proxy with 403 feature_disabled."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from server_tools_helpers import kvshare_server

KEY = "sk-tools-test"
MARKER = "kvshare_server_tools_grep_marker"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "server.log"
    with kvshare_server(["--tools", "all", "--api-key", KEY], log,
                        {"Authorization": f"Bearer {KEY}"}) as (c, _):
        yield c


def call(c: httpx.Client, tool: str, params: dict, headers: dict | None = None) -> dict:
    r = c.post("/tools", json={"tool": tool, "params": params}, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def ok(c: httpx.Client, tool: str, params: dict, headers: dict | None = None) -> dict:
    body = call(c, tool, params, headers)
    assert "error" not in body, body
    return body


def test_get_tools_lists_every_builtin_tool_with_its_schema(srv):
    tools = srv.get("/tools").json()
    assert [t["tool"] for t in tools] == ["read_file", "file_glob_search", "grep_search",
                                          "exec_shell_command", "write_file", "edit_file",
                                          "get_info"]
    by = {t["tool"]: t for t in tools}
    assert by["read_file"]["display_name"] == "Read file"
    assert by["read_file"]["type"] == "server" and by["read_file"]["uses_cwd"] is True
    assert by["exec_shell_command"]["permissions"] == {"write": True}
    assert by["grep_search"]["permissions"] == {"write": False}
    fn = by["read_file"]["definition"]["function"]
    assert by["read_file"]["definition"]["type"] == "function" and fn["name"] == "read_file"
    assert fn["parameters"]["required"] == ["path"]
    assert set(fn["parameters"]["properties"]) == {"path", "start_line", "end_line",
                                                   "append_loc"}
    edit = by["edit_file"]["definition"]["function"]["parameters"]
    assert edit["properties"]["edits"]["items"]["required"] == ["old_text", "new_text"]
    assert by["get_info"]["definition"]["function"]["parameters"] == {
        "type": "object", "properties": {}}


def test_read_file_lines_and_limits(srv, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\ntwo\nthree\n")
    assert ok(srv, "read_file", {"path": str(f)})["plain_text_response"] == "one\ntwo\nthree\n"
    got = ok(srv, "read_file", {"path": str(f), "start_line": 2, "end_line": 3,
                                "append_loc": True})
    assert got["plain_text_response"] == "2\u2192two\n3\u2192three\n"
    big = tmp_path / "big.txt"
    big.write_text("x" * 100 + "\n" * 1 + ("y" * 99 + "\n") * 400)  # 40 KB
    err = call(srv, "read_file", {"path": str(big)})["error"]
    assert err.startswith("file too large (40101 bytes, max 16384)")
    part = ok(srv, "read_file", {"path": str(big), "start_line": 1, "end_line": 400})
    assert part["plain_text_response"].endswith("[output truncated]")
    assert len(part["plain_text_response"]) <= 16 * 1024 + len("[output truncated]")
    b64 = call(srv, "read_file", {"path": str(f)}, {"x-resp-type": "base64"})
    assert b64 == {"base64": "b25lCnR3bwp0aHJlZQo=", "size_bytes": 14}
    missing = str(tmp_path / "nope.txt")
    assert call(srv, "read_file", {"path": missing}) == {"error": "cannot stat file: " + missing}


def test_write_then_edit_file(srv, tmp_path):
    path = str(tmp_path / "sub" / "test.log")  # parent directories are made
    w = ok(srv, "write_file", {"path": path, "content": "line1\nline2\nline3\n"})
    assert w == {"result": "file written successfully", "path": path, "bytes": 18}
    e = ok(srv, "edit_file", {"path": path, "edits": [
        {"old_text": "line2", "new_text": "line2-edited"},
        {"old_text": "line3\n", "new_text": "line3\nline4\n"}]})
    assert e["result"] == "file edited successfully" and e["edits_applied"] == 2
    assert Path(path).read_text() == "line1\nline2-edited\nline3\nline4\n"
    # smart quotes and trailing spaces in the file still match a plain old_text
    Path(path).write_text("say \u201chi\u201d   \nkeep\u00a0me\n")
    ok(srv, "edit_file", {"path": path, "edits": [{"old_text": 'say "hi"', "new_text": "bye"}]})
    assert Path(path).read_text() == "bye\nkeep\u00a0me\n"


@pytest.mark.parametrize("content,edits,want", [
    ("dup\ndup\n", [{"old_text": "dup", "new_text": "x"}], "unique"),
    ("line1\nline2\n", [{"old_text": "line1\nline2", "new_text": "a"},
                        {"old_text": "line2", "new_text": "b"}], "overlap"),
    ("abc\n", [{"old_text": "zzz", "new_text": "y"}], "could not find edits[0].old_text"),
    ("abc\n", [{"old_text": "abc", "new_text": "abc"}], "no changes made"),
    ("abc\n", [], '"edits" must be a non-empty array'),
])
def test_edit_file_refusals_leave_the_file(srv, tmp_path, content, edits, want):
    f = tmp_path / "e.txt"
    f.write_text(content)
    assert want in call(srv, "edit_file", {"path": str(f), "edits": edits})["error"]
    assert f.read_text() == content


def _tree(root: Path) -> None:
    (root / "project-alpha" / "src").mkdir(parents=True)
    (root / "project-alpha" / "README.md").write_text("alpha\n")
    (root / "project-alpha" / "src" / "main.cpp").write_text(f"int main() {{}} // {MARKER}\n")
    (root / "project-beta").mkdir()
    (root / "project-beta" / "notes.txt").write_text(f"beta\n{MARKER} again\n")
    (root / "node_modules" / "pkg").mkdir(parents=True)  # listed, never entered
    (root / "node_modules" / "pkg" / "index.js").write_text(MARKER)


def test_file_glob_search(srv, tmp_path):
    _tree(tmp_path)
    files = ok(srv, "file_glob_search", {"path": str(tmp_path)})
    paths = sorted(e["path"] for e in files["entries"])
    assert paths == ["project-alpha/README.md", "project-alpha/src/main.cpp",
                     "project-beta/notes.txt"]
    assert files["base"] == str(tmp_path) and "Total matches: 3" in files["plain_text_response"]
    dirs = ok(srv, "file_glob_search", {"path": str(tmp_path), "type": "dir"})
    assert "project-alpha/src/" in dirs["plain_text_response"]
    assert {e["path"]: e["type"] for e in dirs["entries"]}["node_modules"] == "dir"
    assert "node_modules/pkg" not in [e["path"] for e in dirs["entries"]]
    cpp = ok(srv, "file_glob_search", {"path": str(tmp_path), "include": "src/*.cpp"})
    assert [e["path"] for e in cpp["entries"]] == ["project-alpha/src/main.cpp"]
    top = ok(srv, "file_glob_search", {"path": str(tmp_path), "type": "all", "max_depth": 1})
    assert sorted(e["path"] for e in top["entries"]) == ["node_modules", "project-alpha",
                                                         "project-beta"]
    one = ok(srv, "file_glob_search", {"path": str(tmp_path), "limit": 1})
    assert len(one["entries"]) == 1 and "[1 results limit reached (3 total matches)." in \
        one["plain_text_response"]
    assert call(srv, "file_glob_search", {"path": str(tmp_path), "limit": 0})["error"] == \
        "invalid limit: 0 (expected 1 or more)"
    assert "invalid type: x" in call(srv, "file_glob_search",
                                     {"path": str(tmp_path), "type": "x"})["error"]
    assert call(srv, "file_glob_search", {"path": str(tmp_path / "no")})["error"] == \
        "path does not exist or is not a directory: " + str(tmp_path / "no")


def test_grep_search(srv, tmp_path):
    _tree(tmp_path)
    text = ok(srv, "grep_search", {"path": str(tmp_path), "pattern": MARKER,
                                   "include": "*.txt", "return_line_numbers": True}
              )["plain_text_response"]
    assert f"project-beta/notes.txt:2:{MARKER} again" in text
    assert "Total matches: 1" in text
    every = ok(srv, "grep_search", {"path": str(tmp_path), "pattern": MARKER.upper(),
                                    "ignore_case": True})["plain_text_response"]
    assert "Total matches: 2" in every and "node_modules" not in every
    ctx = ok(srv, "grep_search", {"path": str(tmp_path / "project-beta" / "notes.txt"),
                                  "pattern": "again", "context_lines": 1})
    assert "notes.txt-1-beta\n" in ctx["plain_text_response"]
    lit = ok(srv, "grep_search", {"path": str(tmp_path), "pattern": "{}", "literal": True})
    assert "Total matches: 1" in lit["plain_text_response"]
    assert call(srv, "grep_search", {"path": str(tmp_path), "pattern": "("}
                )["error"].startswith("invalid regex")
    assert call(srv, "grep_search", {"path": str(tmp_path / "no"), "pattern": "x"}
                )["error"] == "path does not exist: " + str(tmp_path / "no")


def test_exec_shell_command_output_exit_code_and_limits(srv):
    out = ok(srv, "exec_shell_command", {"command": "echo hello; echo oops >&2; exit 3"})
    assert out["plain_text_response"] == "hello\noops\n\n[exit code: 3]"
    t0 = time.monotonic()
    slow = ok(srv, "exec_shell_command", {"command": "sleep 30", "timeout": 1})
    assert time.monotonic() - t0 < 10
    assert slow["plain_text_response"].endswith("[exit due to timed out]")
    big = ok(srv, "exec_shell_command", {"command": "yes | head -c 100000",
                                         "max_output_size": 50})
    assert big["plain_text_response"].startswith("y\n" * 25 + "\n[output truncated]")
    capped = ok(srv, "exec_shell_command", {"command": "yes | head -c 100000",
                                            "max_output_size": 10 ** 9})
    assert len(capped["plain_text_response"]) < 16 * 1024 + 100  # 16 KiB at most


def test_exec_shell_command_stream(srv):
    events = []
    with srv.stream("POST", "/tools", json={"tool": "exec_shell_command", "stream": True,
                                            "params": {"command": "echo hello"}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1] == {"done": True}
    chunks = "".join(e["chunk"] for e in events[:-1])
    assert "hello" in chunks and "[exit code: 0]" in chunks


def test_cwd_header_and_get_info(srv, tmp_path):
    (tmp_path / "rel.txt").write_text("relative\n")
    h = {"x-tool-cwd": str(tmp_path)}
    assert ok(srv, "read_file", {"path": "rel.txt"}, h)["plain_text_response"] == "relative\n"
    ok(srv, "exec_shell_command", {"command": "echo made > made.txt"}, h)
    assert (tmp_path / "made.txt").read_text() == "made\n"
    info = ok(srv, "get_info", {}, h)
    assert info["cwd"] == str(tmp_path) and os.uname().sysname in info["os"]
    # a cwd in params is ignored: only the header sets it
    assert call(srv, "read_file", {"path": "rel.txt", "cwd": str(tmp_path)})["error"] \
        .startswith("cannot stat file")


def test_bad_calls_get_llama_servers_errors(srv):
    r = srv.post("/tools", json={"tool": "nope", "params": {}})
    assert r.status_code == 404 and r.json() == {"error": {
        "code": 400, "message": 'unknown tool "nope"', "type": "invalid_request_error"}}
    r = srv.post("/tools", json={"tool": "read_file", "params": {}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "path" in r.json()["error"]["message"]
    r = srv.post("/tools", json={"tool": "read_file", "params": {"path": 5}})
    assert r.status_code == 400
    r = srv.post("/tools", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the server's body limit (--max-body-mib, 16 MiB) holds here too
    r = srv.post("/tools", content=b" " * (17 * 1024 * 1024),
                 headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    r = srv.post("/tools", json={"tool": "read_file", "params": {"path": "x"}, "stream": True})
    assert r.status_code == 404 and "does not support stream = true" in r.text
    r = srv.post("/tools", json={"tool": "exec_shell_command", "params": {"command": "echo hi"}},
                 headers={"x-tool-runtime": "docker-container:abc"})
    assert r.status_code == 500 and "unknown tool runtime" in r.json()["error"]["message"]


def test_api_key_guards_tools(srv):
    url = str(srv.base_url)
    assert httpx.get(url + "/tools").status_code == 401
    assert httpx.post(url + "/tools", json={"tool": "get_info"}).status_code == 401


def test_cors_stays_loopback_only_with_tools_on(srv):
    evil = srv.get("/tools", headers={"Origin": "http://evil.example"})
    assert evil.status_code == 200 and "access-control-allow-origin" not in evil.headers
    local = srv.get("/tools", headers={"Origin": "http://localhost:5173"})
    assert local.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_tools_and_proxy_are_off_by_default(tmp_path):
    with kvshare_server([], tmp_path / "server.log") as (c, _):
        for method, path in (("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"),
                             ("POST", "/cors-proxy")):
            r = c.request(method, path, json={"tool": "get_info"})
            assert r.status_code == 403, (path, r.text)
            assert r.json() == {"error": {"message": "this feature is disabled",
                                          "type": "feature_disabled"}}
