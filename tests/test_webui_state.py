"""The web UI's JSON endpoint (`GET /webui/state`, server/webui.py) and its session board
(server/webui_sessions.py), over the fake engine: auth, each tenant's own sessions only, no
prompt text unless the operator asks, the prefix tree, `--no-webui`. The browser tests are in
tests/test_webui_browser.py."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from kvshare.engine.api import FinishEvent, GenerationRequest, Timings
from kvshare.server import cli
from kvshare.server.app import create_app
from kvshare.server.cli.config import llama_settings_kwargs
from kvshare.server.settings import ServerSettings
from kvshare.server.tenancy import ApiKey
from kvshare.server.webui import WebUI, page_files
from kvshare.server.webui_sessions import SessionBoard, block_chain, prefix_tree

from fake_engine import FakeEngine

SYSTEM = "You are the support agent of Example Bank. Answer briefly and politely. " * 2
SECRET = "my PIN is 4711 and my name is Zebulon"
KEYS = [ApiKey("sk-alice-0123456789", "alice"), ApiKey("sk-bob-0123456789", "bob")]


def chat(client: TestClient, content: str, key: str | None = None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = client.post("/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def state(client: TestClient, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = client.get("/webui/state", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_page_and_state_without_keys():
    with TestClient(create_app(FakeEngine(ctx_size=512))) as client:
        page = client.get("/")
        assert page.status_code == 200 and "<title>kvshare</title>" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for path in ("/webui/main.js", "/webui/webui.css", "/webui/chat.js"):
            assert client.get(path).status_code == 200, path
        assert client.get("/webui/../settings.py").status_code == 404
        assert client.get("/webui/nothing.js").status_code == 404
        chat(client, "first question")
        chat(client, "second question")
        s = state(client)
        assert s["server"]["auth"] is False and s["server"]["tenant"] is None
        assert [t["name"] for t in s["tiers"]] == ["pool"]
        assert len(s["sessions"]) == 2 and not any(x["running"] for x in s["sessions"])
        # the two prompts share the system prompt's blocks: one root with both sessions
        root, = s["tree"]
        assert len(root["sessions"]) == 2 and root["tokens"] >= 16 * 8
        assert {len(c["sessions"]) for c in root["children"]} == {1}
        assert s["savings"]["requests"] == 2 and s["savings"]["cached_tokens"] > 0
        assert s["savings"]["history"][-1]["requests"] == 2


def test_state_needs_a_key_and_shows_each_tenant_its_own():
    with TestClient(create_app(FakeEngine(ctx_size=512), ServerSettings(api_keys=KEYS))) as client:
        assert client.get("/").status_code == 200  # the page itself: no key, no data
        assert client.get("/webui/main.js").status_code == 200
        r = client.get("/webui/state")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/webui/state", headers={"Authorization": "Bearer nope"}
                          ).status_code == 401
        a1 = chat(client, "alice asks one", KEYS[0].key)["id"]
        a2 = chat(client, "alice asks two", KEYS[0].key)["id"]
        b1 = chat(client, SECRET, KEYS[1].key)["id"]
        alice, bob = state(client, KEYS[0].key), state(client, KEYS[1].key)
        assert alice["server"]["tenant"] == "alice" and bob["server"]["tenant"] == "bob"
        assert {x["id"] for x in alice["sessions"]} == {a1, a2}
        assert {x["id"] for x in bob["sessions"]} == {b1}
        ids = json.dumps(alice["tree"])
        assert b1 not in ids and a1 in ids and a2 in ids
        assert b1 not in json.dumps(alice) and a1 not in json.dumps(bob)
        assert alice["savings"]["requests"] == 2 and bob["savings"]["requests"] == 1
        # same system prompt, different tenants: separate roots (the salts differ)
        assert len(bob["tree"]) == 1 and len(bob["tree"][0]["sessions"]) == 1


def test_no_prompt_text_unless_the_operator_asks(monkeypatch):
    with TestClient(create_app(FakeEngine(ctx_size=512))) as client:
        chat(client, SECRET)
        body = client.get("/webui/state").text
        assert "4711" not in body and "Zebulon" not in body and "Example Bank" not in body
        assert json.loads(body)["server"]["prompt_text"] is False
    monkeypatch.setenv("KVSHARE_WEBUI_PROMPTS", "1")
    with TestClient(create_app(FakeEngine(ctx_size=512))) as client:
        chat(client, SECRET)
        s = state(client)
        assert s["server"]["prompt_text"] is True
        assert "Example Bank" in json.dumps(s["tree"])


def test_no_webui_is_a_404_as_before():
    args = cli.parse_args(["serve", "--no-webui"], {})
    assert llama_settings_kwargs(args)["webui"] is False
    assert llama_settings_kwargs(cli.parse_args(["serve"], {}))["webui"] is True
    settings = ServerSettings(**{k: v for k, v in llama_settings_kwargs(args).items()})
    with TestClient(create_app(FakeEngine(ctx_size=512), settings)) as client:
        for path in ("/", "/webui/state", "/webui/main.js"):
            assert client.get(path).status_code == 404, path
        chat(client, "still serves")


def _finish(cache_n: int, restore_ms: float = 0.0) -> FinishEvent:
    return FinishEvent("stop", 64, 3, Timings(64 - cache_n, cache_n, 10.0, 3, 5.0, restore_ms),
                       0.01)


def test_tree_shape_and_tiers():
    board = SessionBoard(block_size=4)
    shared = list(range(100, 116))  # four blocks
    for rid, tail in (("a", [1] * 8), ("b", [2] * 8), ("c", [2] * 4 + [3] * 4)):
        board.acquire(rid, GenerationRequest(prompt_tokens=shared + tail, max_tokens=4))
    board.acquire("solo", GenerationRequest(prompt_tokens=[7] * 9, max_tokens=4,
                                            cache_store=False))
    board.release("a", _finish(16))
    board.release("solo", _finish(0))
    tree = prefix_tree(board.visible(None, True), 4, ["RAM", "disk"])
    by_start = sorted(tree, key=lambda n: -len(n["sessions"]))
    root, solo = by_start
    assert root["sessions"] == ["a", "b", "c"] and (root["start"], root["tokens"]) == (0, 16)
    assert root["held"] == ["pool", "RAM", "disk"]  # b and c run; a ended and saved
    kids = {tuple(k["sessions"]): k for k in root["children"]}
    assert kids[("a",)]["held"] == ["RAM", "disk"] and kids[("a",)]["tokens"] == 8
    bc = kids[("b", "c")]
    assert bc["tokens"] == 4 and bc["held"] == ["pool"]
    assert sorted(k["sessions"][0] for k in bc["children"]) == ["b", "c"]
    assert solo["sessions"] == ["solo"] and solo["held"] == [] and solo["tokens"] == 8
    # salts: the same tokens under another salt are another chain; a public prefix is shared
    toks = shared + [1] * 8
    assert block_chain(toks, 4, b"s1", 0)[0] != block_chain(toks, 4, b"s2", 0)[0]
    assert block_chain(toks, 4, b"s1", 8)[:2] == block_chain(toks, 4, b"s2", 8)[:2]
    assert block_chain(toks, 4, b"s1", 8)[2] != block_chain(toks, 4, b"s2", 8)[2]


def test_restores_are_attributed_to_the_tier_that_served():
    board = SessionBoard(block_size=4)
    board.attribute_restores({"RAM": 0, "disk": 0})
    board.acquire("r", GenerationRequest(prompt_tokens=list(range(20)), max_tokens=2))
    board.release("r", _finish(16, restore_ms=2.0))
    board.attribute_restores({"RAM": 0, "disk": 16})
    assert board.sessions["r"].as_json()["restored_from"] == ["disk"]


def test_the_board_forgets_old_sessions():
    now = [1000.0]
    board = SessionBoard(block_size=4, clock=lambda: now[0])
    for i in range(300):
        board.acquire(f"r{i}", GenerationRequest(prompt_tokens=[1] * 8, max_tokens=2))
        board.release(f"r{i}", _finish(4))
    assert len(board.sessions) == 256
    now[0] += 3600
    assert board.visible(None, True) == []
    total, history = board.savings(None, True)
    assert total.requests == 300 and history[-1]["requests"] == 300


def test_state_with_64_sessions_and_10000_blocks():
    """The poll's load from the issue (its cost is bench/webui_bench.py's figure): 64 sessions
    with a 100-block shared prefix; the tree is rebuilt only when a session comes or goes, and
    the body is the JSON of the state."""
    engine = FakeEngine(ctx_size=4096)
    ui = WebUI(engine, None, show_prompts=False)
    prefix = list(range(1000, 1000 + 16 * 100))
    for i in range(64):
        tail = [i % 200 + 1] * (16 * 56)
        ui.board.acquire(f"s{i}", GenerationRequest(prompt_tokens=prefix + tail, max_tokens=4))
    first = json.loads(ui.state.encoded(None))
    root = max(first["tree"], key=lambda n: len(n["sessions"]))
    assert len(root["sessions"]) == 64 and (root["start"], root["tokens"]) == (0, 1600)
    assert sorted(len(c["sessions"]) for c in root["children"]) == [1] * 64
    assert all(c["tokens"] == 16 * 56 and c["children"] == [] for c in root["children"])
    tree = ui.state.build(None)["tree"]
    assert ui.state.build(None)["tree"] is tree  # nothing changed: reused
    ui.board.release("s0", _finish(1600))
    again = ui.state.build(None)
    assert again["tree"] is not tree and len(again["sessions"]) == 64
    assert [s["running"] for s in again["sessions"]].count(False) == 1


def test_page_files_are_the_package_data():
    files = page_files()
    assert "/" in files and "/webui/index.html" not in files
    assert {"/webui/main.js", "/webui/cache.js", "/webui/chat.js", "/webui/api.js",
            "/webui/chart.js", "/webui/webui.css"} <= set(files)
