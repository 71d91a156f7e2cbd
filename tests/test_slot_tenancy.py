"""Slots belong to tenants (issue 45, item 1; apis/llama_slots.py): with API keys, `/slots`
lists, saves, restores into and erases only the caller's slots; a slot file carries its tenant
and salt, and another tenant's restore or overwrite of it reads as a missing file (404); an
owner's restore warms the cache under the salt the slot's request used. Fake engine (the
request shapes and the salts the engine is given); the real-server attack is in
tests/test_slot_tenancy_server.py."""

from __future__ import annotations

import json
import os

import pytest
from starlette.testclient import TestClient

from kvshare.apis.llama_slots import owner_tag
from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings
from kvshare.server.tenancy import ApiKey, tenant_of
from fake_engine import FakeEngine

KEYS = {"alice": "sk-alice-slots-0001", "bob": "sk-bob-slots-0002"}


def make(tmp_path, scope: str | None = None, parallel: int = 3):
    engine = FakeEngine(parallel=parallel)
    settings = ServerSettings(api_keys=[ApiKey(KEYS["alice"], "alice"),
                                        ApiKey(KEYS["bob"], "bob")],
                              cache_scope=scope, slot_save_path=str(tmp_path))
    return engine, TestClient(create_app(engine, settings))


def auth(who: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def complete(c: TestClient, who: str, prompt: str, id_slot: int = -1, **kw) -> dict:
    r = c.post("/completion", json={"prompt": prompt, "n_predict": 3, "id_slot": id_slot, **kw},
               headers=auth(who))
    assert r.status_code == 200, r.text
    return r.json()


def act(c: TestClient, who: str, slot: int, action: str, filename: str | None = None):
    body = {"filename": filename} if filename is not None else {}
    return c.post(f"/slots/{slot}?action={action}", json=body, headers=auth(who))


def assert_hidden(r, *secrets: object) -> None:
    """A 404 in llama-server's shape that says nothing of the other tenant's slot."""
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == 404 and err["type"] == "not_found_error"
    for s in secrets:
        assert str(s) not in r.text


def test_listing_and_actions_are_per_tenant(tmp_path):
    engine, c = make(tmp_path)
    with c:
        a = complete(c, "alice", "PIN 4821 is secret", id_slot=0)
        assert a["id_slot"] == 0
        b = complete(c, "bob", "hello there", id_slot=0)  # Alice's idle slot 0 is not his
        assert b["id_slot"] == 1
        bob_view = c.get("/slots", headers=auth("bob")).json()
        alice_view = c.get("/slots", headers=auth("alice")).json()
        assert [s["id"] for s in bob_view] == [1, 2] and [s["id"] for s in alice_view] == [0, 2]
        # task ids count per tenant: Bob's do not tell him how many requests Alice sent
        assert bob_view[0]["id_task"] == 0 and alice_view[0]["id_task"] == 0
        n_alice = a["tokens_evaluated"] + 3
        for action in ("save", "restore", "erase"):
            assert_hidden(act(c, "bob", 0, action, "x.json"), n_alice)
        assert not (tmp_path / "x.json").exists()
        assert act(c, "alice", 0, "save", "alice.json").status_code == 200
        n_requests = len(engine.requests)
        for slot in (0, 1, 2):  # Alice's file into any slot, Alice's or his own
            assert_hidden(act(c, "bob", slot, "restore", "alice.json"), n_alice)
        assert len(engine.requests) == n_requests  # nothing was computed for Bob
        before = (tmp_path / "alice.json").read_bytes()
        assert_hidden(act(c, "bob", 1, "save", "alice.json"))  # no overwriting hers
        assert (tmp_path / "alice.json").read_bytes() == before
        # a missing file reads the same as hers
        missing = act(c, "bob", 1, "restore", "nobody.json")
        assert missing.json() == act(c, "bob", 1, "restore", "alice.json").json()
        assert act(c, "alice", 0, "erase").json() == {"id_slot": 0, "n_erased": n_alice}


def test_slot_file_carries_tenant_and_salt(tmp_path):
    engine, c = make(tmp_path)
    with c:
        complete(c, "alice", "remember me", id_slot=0, cache_salt="project-7")
        salt = engine.requests[-1].cache_salt
        assert act(c, "alice", 0, "save", "mine.json").status_code == 200
        data = json.loads((tmp_path / "mine.json").read_text())
        alice = tenant_of(ApiKey(KEYS["alice"], "alice"))
        assert data["tenant"] == owner_tag(alice) and data["scope"] == "key"
        assert data["salt"] == salt.hex() and data["store"] is True
        assert KEYS["alice"] not in json.dumps(data)
        # her restore computes the tokens under the salt her request used (project-7)
        r = act(c, "alice", 2, "restore", "mine.json")
        assert r.status_code == 200, r.text
        warm = engine.requests[-1]
        assert warm.max_tokens == 1 and warm.cache_salt == salt
        assert warm.prompt_tokens == data["tokens"]
        assert [s["id"] for s in c.get("/slots", headers=auth("bob")).json()] == [1]


def test_foreign_and_unowned_files_after_restart(tmp_path):
    engine, c = make(tmp_path)
    with c:
        complete(c, "alice", "before the restart", id_slot=0)
        salt = engine.requests[-1].cache_salt
        assert act(c, "alice", 0, "save", "a.json").status_code == 200
    engine, c = make(tmp_path)  # a new server on the same directory
    with c:
        assert_hidden(act(c, "bob", 0, "restore", "a.json"))
        r = act(c, "alice", 0, "restore", "a.json")
        assert r.status_code == 200 and engine.requests[-1].cache_salt == salt
        # a file with no tenant (an older kvshare's, or hand-made) is nobody's with keys
        data = json.loads((tmp_path / "a.json").read_text())
        del data["tenant"]
        (tmp_path / "legacy.json").write_text(json.dumps(data))
        assert_hidden(act(c, "alice", 0, "restore", "legacy.json"))
        (tmp_path / "junk").write_text("not json")
        assert_hidden(act(c, "alice", 0, "restore", "junk"))
        assert_hidden(act(c, "alice", 0, "save", "junk"))


def test_directories_and_fifos_are_not_slot_files(tmp_path):
    _, c = make(tmp_path)
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    with c:
        complete(c, "alice", "x", id_slot=0)
        r = act(c, "alice", 0, "save", "adir")
        assert r.status_code == 400 and "directory" in r.json()["error"]["message"]
        assert_hidden(act(c, "alice", 0, "restore", "adir"))
        assert_hidden(act(c, "alice", 0, "restore", "fifo"))  # opened non-blocking
        assert_hidden(act(c, "alice", 0, "save", "fifo"))
    with TestClient(create_app(FakeEngine(parallel=1),
                               ServerSettings(slot_save_path=str(tmp_path)))) as c:
        r = c.post("/slots/0?action=save", json={"filename": "adir"})
        assert r.status_code == 400
        assert c.post("/slots/0?action=restore", json={"filename": "adir"}).status_code == 404


@pytest.mark.parametrize("scope", ["global", "salt"])
def test_other_scopes_keep_slots_per_tenant(tmp_path, scope):
    """Under `global` and `salt` slots still belong to tenants; the restore warms under the
    salt the request had (global: none, or its cache_salt's)."""
    engine, c = make(tmp_path, scope=scope)
    with c:
        complete(c, "alice", "shared text", id_slot=0, cache_salt="s1")
        salt = engine.requests[-1].cache_salt
        assert [s["id"] for s in c.get("/slots", headers=auth("bob")).json()] == [1, 2]
        assert act(c, "alice", 0, "save", "g.json").status_code == 200
        assert_hidden(act(c, "bob", 1, "restore", "g.json"))
        assert act(c, "alice", 0, "restore", "g.json").status_code == 200
        assert engine.requests[-1].cache_salt == salt


def test_without_keys_slots_are_everyones(tmp_path):
    engine = FakeEngine(parallel=2)
    with TestClient(create_app(engine, ServerSettings(slot_save_path=str(tmp_path)))) as c:
        c.post("/completion", json={"prompt": "abc", "n_predict": 2, "id_slot": 0})
        assert len(c.get("/slots").json()) == 2
        assert c.post("/slots/0?action=save", json={"filename": "f"}).status_code == 200
        assert json.loads((tmp_path / "f").read_text())["tenant"] is None
        assert c.post("/slots/1?action=restore", json={"filename": "f"}).status_code == 200
        assert engine.requests[-1].cache_salt is None
