"""Slots belong to tenants, on a real server (issue 45, item 1): `kvshare serve` on loopback
with two API keys (default `--cache-scope key`), `--parallel 2`, `--slot-save-path`, the tiny
qwen3 model.

The PIN attack: Alice's prompt holds a 4-digit PIN and she saves her slot. Bob, who knows the
text around the PIN and the file's name, lists `/slots`, saves Alice's slot, restores her file
into his slots, then probes the PIN digit by digit through `timings.cache_n` (token-exact:
the cache extends a match into a partial block): for each digit, ten prompts "before + guess +
digit + '#'", and a digit is read when exactly one shows more cached tokens than the others.
Before the fix Bob's restore put Alice's tokens under his keys and this read 5 of 5 PINs; now
every step of it is a 404 and it reads 0 of 10. The control: Alice's own probes of her own
cache read her PIN (the probe can succeed).

Across a restart: a stored response and a slot file of Alice stay invisible to Bob; her file
is still hers."""

from __future__ import annotations

import random

import pytest

from tier_helpers import TINY_MODEL, Server, text

pytestmark = pytest.mark.skipif(not TINY_MODEL.exists(),
                                reason="run tests/data/make_tiny_qwen3_chat.py")

KEYS = {"alice": "sk-alice-slot-attack-01", "bob": "sk-bob-slot-attack-02"}
N_PINS = 10


def start(launcher, slot_dir) -> Server:
    return Server(launcher, "--parallel", "2", "--kv-unified-per-slot", "1024",
                  "--api-key", f"{KEYS['alice']},{KEYS['bob']}",
                  "--slot-save-path", str(slot_dir))


def post(server: Server, who: str, path: str, body: dict):
    return server.client.post(path, json=body,
                              headers={"Authorization": f"Bearer {KEYS[who]}"})


def cache_n(server: Server, who: str, prompt: str) -> int:
    r = post(server, who, "/completion", {"prompt": prompt, "n_predict": 1,
                                          "temperature": 0})
    assert r.status_code == 200, (r.text, server.log())
    return r.json()["timings"]["cache_n"]


def probe_pin(server: Server, who: str, before: str) -> str | None:
    """The PIN as `who` reads it from cached tokens, digit by digit; None when some digit
    has no unique best candidate."""
    found = ""
    for _ in range(4):
        seen = {d: cache_n(server, who, before + found + d + "#") for d in "0123456789"}
        best = max(seen.values())
        winners = [d for d, n in seen.items() if n == best]
        if len(winners) != 1:
            return None
        found += winners[0]
    return found


def victim_prompt(rng: random.Random, k: int) -> tuple[str, str, str]:
    nonce = f"{rng.getrandbits(32):08x}"
    before = f"Account {nonce}. The customer's card PIN is "
    pin = "".join(rng.choice("0123456789") for _ in range(4))
    return before, pin, ". Never read it back. " + text(k, 60)


@pytest.fixture
def slot_dir(tmp_path):
    return tmp_path


def test_pin_attack_through_slots_finds_nothing(launcher, slot_dir):
    server = start(launcher, slot_dir)
    try:
        rng = random.Random(45)
        found = control = 0
        for k in range(N_PINS):
            before, pin, after = victim_prompt(rng, k)
            r = post(server, "alice", "/completion", {"prompt": before + pin + after,
                                                      "n_predict": 2, "id_slot": 0,
                                                      "temperature": 0})
            assert r.status_code == 200 and r.json()["id_slot"] == 0, r.text
            n_alice = r.json()["tokens_evaluated"]
            name = f"alice-{k}.json"
            assert post(server, "alice", "/slots/0?action=save",
                        {"filename": name}).status_code == 200
            # Bob: the listing shows none of Alice's slots, and every action on her slot or
            # file is a 404 that names no length of hers
            slots = server.client.get("/slots", headers={
                "Authorization": f"Bearer {KEYS['bob']}"}).json()
            assert 0 not in [s["id"] for s in slots], slots
            for path, body in (("/slots/0?action=save", {"filename": f"bob-{k}.json"}),
                               ("/slots/0?action=erase", {}),
                               ("/slots/0?action=restore", {"filename": name}),
                               ("/slots/1?action=restore", {"filename": name}),
                               ("/slots/1?action=save", {"filename": name})):
                r = post(server, "bob", path, body)
                assert r.status_code == 404, (path, r.text)
                assert str(n_alice) not in r.text and pin not in r.text
            if probe_pin(server, "bob", before) == pin:
                found += 1
            if k < 2 and probe_pin(server, "alice", before) == pin:
                control += 1
        print(f"PIN attack through slots: {found} of {N_PINS} PINs found by the other "
              f"tenant; control (the owner's own probes): {control} of 2")
        assert found == 0
        assert control == 2  # the probe reads a PIN where the cache is shared
    finally:
        server.kill9()


def test_stored_response_and_slot_file_invisible_across_restart(launcher, slot_dir):
    server = start(launcher, slot_dir)
    try:
        r = post(server, "alice", "/v1/responses", {"input": "Keep this: 7391.",
                                                    "max_output_tokens": 2, "store": True})
        assert r.status_code == 200, r.text
        resp_id = r.json()["id"]
        prompt = "Alice's notes: " + text(3, 80)
        assert post(server, "alice", "/completion", {"prompt": prompt, "n_predict": 2,
                                                     "id_slot": 0}).status_code == 200
        assert post(server, "alice", "/slots/0?action=save",
                    {"filename": "notes.json"}).status_code == 200
        bob = {"Authorization": f"Bearer {KEYS['bob']}"}
        assert server.client.get(f"/v1/responses/{resp_id}", headers=bob).status_code == 404
    finally:
        server.terminate()
    server = start(launcher, slot_dir)
    try:
        bob = {"Authorization": f"Bearer {KEYS['bob']}"}
        assert server.client.get(f"/v1/responses/{resp_id}", headers=bob).status_code == 404
        for slot in (0, 1):
            r = post(server, "bob", f"/slots/{slot}?action=restore", {"filename": "notes.json"})
            assert r.status_code == 404, r.text
        r = post(server, "alice", "/slots/1?action=restore", {"filename": "notes.json"})
        assert r.status_code == 200, r.text
        # restored under Alice's keys: hers to reuse, nothing for Bob
        assert cache_n(server, "bob", prompt + " again") == 0
        assert cache_n(server, "alice", prompt + " more") >= len(prompt) // 2
    finally:
        server.kill9()
