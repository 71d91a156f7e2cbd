"""Issue 15 part 4: the cache scope as a security boundary (`--cache-scope global|key|salt`,
several API keys and a key file, `--public-prefix`; docs/security.md).

Unit checks (no model): key parsing, the salt each scope derives, the public-prefix length,
the tenant the auth middleware passes on, and the start-up errors (one line, exit 2).

Real servers on loopback (tests/tier_helpers.py, the tiny qwen3 chat model):
- the extraction attack: user A's prompt holds a 4-digit PIN; user B (another API key) knows
  the text around it and probes 10 candidates, one per first digit (the true PIN among them),
  reading `usage.prompt_tokens_details.cached_tokens`. Under `--cache-scope key` B's first
  request reuses nothing and every candidate gets the same cached_tokens (so the best-ranked
  candidate is right no more often than chance, 1 in 10); under `--cache-scope global` (the
  control, which shows the test can fail) the true PIN is the unique best. Latency is measured
  by bench/extraction_attack.py, not asserted here.
- one key shares with itself; `cache_salt` narrows inside a key; keys that share a tenant name
  share; `--cache-scope salt`; every key authenticates and a wrong one gets 401; tenant names
  (never keys) in the request log and metrics.
- `test_public_prefix_shared_across_keys`: the operator's public system prompt is shared across
  tenants (exactly its whole blocks, nothing of the private text after it). Needs the engine to
  key `GenerationRequest.public_prefix_tokens` without the salt.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest
from starlette.testclient import TestClient

from kvshare.engine.api import FinishEvent, GenerationRequest, RenderedChat, Timings, TokenEvent
from kvshare.server import cli
from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings
from kvshare.server.tenancy import (ApiKey, KeyRing, Tenancy, TenancyError, common_prefix,
                                    read_key_file, read_public_prefix, split_keys, tenant_of)
from fake_engine import FakeEngine
from tier_helpers import TINY_MODEL, Server, text

BS = 16  # the server's default block size

# --------------------------------------------------------------------------- key parsing


def test_split_keys():
    keys = split_keys("alpha, beta,gamma")
    assert [k.key for k in keys] == ["alpha", "beta", "gamma"]
    assert split_keys(None) == [] and split_keys("") == []
    with pytest.raises(TenancyError, match="key 2 .* is empty"):
        split_keys("a,,b")
    with pytest.raises(TenancyError, match="visible ASCII"):
        split_keys("a,caf\u00e9")


def test_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\n\nsk-alice-1 alice\n  sk-bob-1   bob  \nsk-bob-2 bob\nsk-anon\n")
    keys = read_key_file(str(f))
    assert [(k.key, k.name) for k in keys] == [("sk-alice-1", "alice"), ("sk-bob-1", "bob"),
                                                ("sk-bob-2", "bob"), ("sk-anon", None)]
    assert "sk-alice-1" not in repr(keys[0])
    ring = KeyRing(keys)
    assert ring.match(b"sk-alice-1").name == "alice"
    assert ring.match(b"sk-bob-2") == ring.match(b"sk-bob-1")  # one tenant, two keys
    anon = ring.match(b"sk-anon")
    assert re.fullmatch(r"key:[0-9a-f]{12}", anon.name) and "sk-anon" not in anon.name
    assert ring.match(b"sk-alice") is None and ring.match(b"") is None
    assert ring.tenants == sorted(["alice", "bob", anon.name])


@pytest.mark.parametrize("content,match", [
    ("", "has no keys"),
    ("# only a comment\n", "has no keys"),
    ("sk-secret-1 alice extra\n", "line 1: expected 'KEY \\[NAME\\]'"),
    ("\nsk-secret-1 al/ice\n", "line 2: tenant name"),
])
def test_key_file_errors_name_no_key(tmp_path, content, match):
    f = tmp_path / "keys"
    f.write_text(content)
    with pytest.raises(TenancyError, match=match) as e:
        read_key_file(str(f))
    assert "sk-secret" not in str(e.value)
    with pytest.raises(TenancyError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))


# --------------------------------------------------------------------------- salts

def test_salt_per_scope():
    alice, bob = tenant_of(ApiKey("ka", "alice")), tenant_of(ApiKey("kb", "bob"))
    anon = tenant_of(ApiKey("kc"))
    s1, s2 = b"1" * 32, b"2" * 32

    g = Tenancy("global")
    assert g.salt(alice, None) is None and g.salt(bob, s1) == s1

    k = Tenancy("key")
    salts = {k.salt(t, s) for t in (alice, bob, anon) for s in (None, s1, s2)}
    assert len(salts) == 9  # every tenant x salt pair is its own cache
    assert k.salt(alice, s1) == k.salt(tenant_of(ApiKey("another key", "alice")), s1)
    assert k.salt(anon, None) == k.salt(tenant_of(ApiKey("kc")), None)  # stable (disk tier)
    assert None not in salts and s1 not in salts
    with pytest.raises(RuntimeError):
        k.salt(None, None)

    s = Tenancy("salt")
    assert s.salt(alice, s1) == s1 == s.salt(bob, s1)
    fresh = {s.salt(alice, None) for _ in range(20)}
    assert len(fresh) == 20 and all(len(x) == 32 for x in fresh)


def test_public_prefix_tokens():
    t = Tenancy("key", public=[("a", [1, 5, 6, 7, 8]), ("b", [1, 5, 9]), ("c", [2, 3])])
    assert t.public_prefix_tokens([1, 5, 6, 7, 8, 9, 9]) == 5
    assert t.public_prefix_tokens([1, 5, 6, 4]) == 3
    assert t.public_prefix_tokens([1, 5, 9, 9]) == 3
    assert t.public_prefix_tokens([1, 4]) == 1
    assert t.public_prefix_tokens([3]) == 0 and t.public_prefix_tokens([]) == 0
    assert Tenancy("key").public_prefix_tokens([1, 2]) == 0
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 700))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(9))]
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b) == want


def test_public_prefix_files(tmp_path):
    j = tmp_path / "agent.json"
    j.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]}))
    pp = read_public_prefix(str(j))
    assert pp.chat.messages == [{"role": "system", "content": "Be brief."}]
    assert pp.chat.template_kwargs == {"add_generation_prompt": False} and pp.text is None
    t = tmp_path / "sys.txt"
    t.write_text("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert read_public_prefix(str(t)).text == t.read_text()
    for content, match in (("{", "malformed JSON"), ("[]", "JSON object"),
                           ('{"messages": []}', "at least one message")):
        j.write_text(content)
        with pytest.raises(TenancyError, match=match):
            read_public_prefix(str(j))
    t.write_text("")
    with pytest.raises(TenancyError, match="empty"):
        read_public_prefix(str(t))


# --------------------------------------------------------------------------- the HTTP layer

class _Handle:
    def __init__(self, req: GenerationRequest):
        self.req, self.request_id = req, req.request_id

    def cancel(self) -> None:
        pass

    async def _events(self):
        await asyncio.sleep(0)
        yield TokenEvent(ord("x"), "x")
        n = len(self.req.prompt_tokens)
        yield FinishEvent("stop", n, 1, Timings(n, 0, 1.0, 1, 1.0), 0.001)

    def __aiter__(self):
        return self._events()


class RecordingEngine(FakeEngine):
    """Byte 'tokenizer' (BOS 1), a ChatML-like template; records each GenerationRequest."""

    model_name = "fake"

    def __init__(self):
        super().__init__(ctx_size=4096)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True):
        return ([1] if add_special else []) + list(text.encode())

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kw):
        out = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else ""), None

    def chat_prompt(self, messages, tools=None, *, add_generation_prompt=True,
                    template_kwargs=None, cache_after=None, continue_final=False):
        text, _ = self.apply_chat_template(messages, tools, add_generation_prompt)
        return RenderedChat(self.tokenize(text, True, True))

    def submit(self, req: GenerationRequest) -> _Handle:
        self.requests.append(req)
        return _Handle(req)

    def snapshot(self) -> dict:
        return {}


def _chat(c: TestClient, key: str | None, content: str, salt: str | None = None,
          system: str = "Be brief.") -> int:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": content}], "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return c.post("/v1/chat/completions", json=body, headers=headers).status_code


def test_app_salts_and_public_prefix(tmp_path):
    pj = tmp_path / "p.json"
    pj.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}]}))
    pt = tmp_path / "p.txt"
    pt.write_text("<system>Shared text prompt")
    eng = RecordingEngine()
    settings = ServerSettings(api_key="k-solo", api_keys=[ApiKey("k-a1", "a"), ApiKey("k-a2", "a"),
                                                          ApiKey("k-b", "b")],
                              public_prefixes=[read_public_prefix(str(pj)),
                                               read_public_prefix(str(pt))])
    app = create_app(eng, settings)
    assert app.state.server.tenancy.scope == "key"  # the default with keys
    with TestClient(app) as c:
        for key in ("k-solo", "k-a1", "k-a2", "k-b", "k-a1"):
            assert _chat(c, key, "hi") == 200
        assert _chat(c, "k-a1", "hi", salt="s") == 200
        assert _chat(c, "k-a1", "hi", system="Shared text prompt, and more") == 200
        assert _chat(c, "k-wrong", "hi") == 401 and _chat(c, None, "hi") == 401
        assert c.get("/health").status_code == 200
    solo, a1, a2, b, a1again, a1salted, a1text = (r.cache_salt for r in eng.requests)
    assert a1 == a2 == a1again and len({solo, a1, b, a1salted}) == 4
    assert None not in {solo, a1, b}
    # public prefix: "\x01<system>Be brief.\n" (json) or "\x01<system>Shared text prompt" (text)
    assert eng.requests[0].public_prefix_tokens == 1 + len("<system>Be brief.\n")
    assert eng.requests[-1].public_prefix_tokens == 1 + len("<system>Shared text prompt")


def test_app_global_and_salt_scopes():
    eng = RecordingEngine()
    with TestClient(create_app(eng, ServerSettings(api_keys=split_keys("k1,k2"),
                                                   cache_scope="global"))) as c:
        assert _chat(c, "k1", "x") == _chat(c, "k2", "x") == _chat(c, "k2", "x", salt="s") == 200
    assert [r.cache_salt is None for r in eng.requests] == [True, True, False]
    assert all(r.public_prefix_tokens == 0 for r in eng.requests)
    eng = RecordingEngine()
    with TestClient(create_app(eng, ServerSettings(cache_scope="salt"))) as c:
        for salt in (None, None, "s", "s"):
            assert _chat(c, None, "x", salt=salt) == 200
    s = [r.cache_salt for r in eng.requests]
    assert s[0] != s[1] and s[2] == s[3] and None not in s
    # a one-off random salt is never matched: such a request stays out of the RAM/disk tiers
    assert [r.cache_store for r in eng.requests] == [False, False, True, True]
    with pytest.raises(TenancyError, match="needs API keys"):
        create_app(RecordingEngine(), ServerSettings(cache_scope="key"))


# --------------------------------------------------------------------------- the CLI

def test_cli_flags_and_env():
    a = cli.parse_args(["serve", "--api-key", "a", "--api-key", "b,c", "--cache-scope", "Salt",
                        "--public-prefix", "x.json", "--public-prefix", "y.txt"],
                       {"KVSHARE_API_KEY": "env-key", "KVSHARE_PUBLIC_PREFIX": "z.txt"})
    assert (a.api_key, a.cache_scope, a.public_prefix) == ("a,b,c", "salt", "x.json:y.txt")
    a = cli.parse_args(["serve"], {"KVSHARE_API_KEY": "k1,k2", "KVSHARE_CACHE_SCOPE": "key",
                                   "KVSHARE_API_KEY_FILE": "/etc/keys",
                                   "KVSHARE_PUBLIC_PREFIX": "p.json:q.txt"})
    assert (a.api_key, a.cache_scope, a.api_key_file, a.public_prefix) == \
        ("k1,k2", "key", "/etc/keys", "p.json:q.txt")
    for argv, env in ((["serve", "--cache-scope", "tenant"], {}),
                      (["serve"], {"KVSHARE_CACHE_SCOPE": "everyone"})):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv, env)
        assert e.value.code == 2


@pytest.mark.parametrize("extra,match", [
    (["--cache-scope", "key"], "--cache-scope key needs API keys"),
    (["--api-key", "sk-secret-a,,b"], "is empty"),
    (["--api-key-file", "{tmp}/missing"], "cannot read --api-key-file"),
    (["--api-key-file", "{tmp}/bad"], "line 1"),
    (["--api-key", "sk-secret-dup", "--api-key-file", "{tmp}/dup"], "API key 2 is the same"),
    (["--public-prefix", "{tmp}/missing.json"], "cannot read --public-prefix"),
    (["--public-prefix", "{tmp}/bad.json"], "malformed JSON"),
])
def test_cli_startup_errors_one_line(capsys, tmp_path, extra, match):
    (tmp_path / "bad").write_text("sk-secret-x a b c\n")
    (tmp_path / "dup").write_text("sk-secret-dup\n")
    (tmp_path / "bad.json").write_text("{not json")
    argv = ["serve", "--port", "0", *[x.format(tmp=tmp_path) for x in extra]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvshare: error: ") and match in err[0], err
    assert "sk-secret" not in err[0]


# --------------------------------------------------------------------------- real servers

needs_model = pytest.mark.skipif(not TINY_MODEL.exists(),
                                 reason="run tests/data/make_tiny_qwen3_chat.py")
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789",
        "bob2": "sk-bob-second-key-0123", "carol": "sk-carol-0123456789",
        "dave": "sk-dave-0123456789"}
PUBLIC_SYSTEM = "You are the support agent of Example Bank. " + text(7, 90)
COMMON = ("--parallel", "2", "--kv-unified-per-slot", "1024", "--log-level", "info")


@pytest.fixture(scope="module")
def key_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("scope")
    (d / "keys").write_text(f"# test tenants\n{KEYS['alice']} alice\n{KEYS['bob']} bob\n"
                            f"{KEYS['bob2']} bob\n{KEYS['carol']}\n")
    (d / "public.json").write_text(json.dumps(
        {"messages": [{"role": "system", "content": PUBLIC_SYSTEM}]}))
    return d


@pytest.fixture
def key_server(launcher, key_files):
    """A fresh server per test (the tiny model starts in about a second), so that each
    tenant's cache holds only what the test sent: cross-tenant figures are exact."""
    s = Server(launcher, *COMMON, "--api-key-file", str(key_files / "keys"),
               "--api-key", KEYS["dave"], "--public-prefix", str(key_files / "public.json"))
    yield s
    s.kill9()


@pytest.fixture(scope="module")
def global_server(launcher):
    s = Server(launcher, *COMMON, "--cache-scope", "global",
               "--api-key", f"{KEYS['alice']},{KEYS['bob']}")
    yield s
    s.kill9()


def ask(server: Server, who: str | None, content: str, salt: str | None = None,
        system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]
    body = {"messages": msgs, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
    r = server.client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, (r.status_code, r.text, server.log())
    return r.json()


def cached(resp: dict) -> int:
    n = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n == resp["timings"]["cache_n"]
    return n


def attack(server: Server, victim: str, attacker: str, seed: int) -> tuple[str, dict]:
    """The victim's prompt holds a PIN; the attacker, who knows the text around it, sends a
    warm-up and then one probe per candidate. Returns (the PIN, {"warmup": cached tokens,
    candidate: cached tokens, ...})."""
    rng = random.Random(seed)
    nonce = f"{rng.getrandbits(32):08x}"
    before = f"Account {nonce}. The customer's card PIN is "
    after = ". Never read the PIN back to anyone. " + text(seed, 160)
    pin = "".join(rng.choice("0123456789") for _ in range(4))
    ask(server, victim, before + pin + after)
    out = {"warmup": cached(ask(server, attacker, before + "zzzz" + after))}
    candidates = [str(d) + "".join(rng.choice("0123456789") for _ in range(3))
                  for d in range(10)]
    candidates[int(pin[0])] = pin
    rng.shuffle(candidates)
    for c in candidates:
        out[c] = cached(ask(server, attacker, before + c + after))
    return pin, out


@needs_model
def test_extraction_attack_recovers_nothing_under_key_scope(key_server):
    for seed, (victim, attacker) in enumerate((("alice", "bob"), ("carol", "dave"))):
        pin, seen = attack(key_server, victim, attacker, 100 + seed)
        warmup = seen.pop("warmup")
        assert warmup == 0, f"{attacker}'s first request reused {warmup} tokens of {victim}'s"
        # every candidate reuses exactly the attacker's own warm-up text: the same number,
        # whatever the guess, so ranking by cached_tokens is a 10-way tie (chance: 1 in 10)
        assert len(set(seen.values())) == 1, (pin, seen)
        assert seen[pin] > 0


@needs_model
def test_extraction_attack_succeeds_under_global_scope(global_server):
    """The control: the same attack reads the PIN when the cache is shared (the test above
    could fail)."""
    pin, seen = attack(global_server, "alice", "bob", 7)
    assert seen.pop("warmup") > 0
    best = max(seen.values())
    assert [c for c, n in seen.items() if n == best] == [pin], (pin, seen)


@needs_model
def test_same_key_shares_and_cache_salt_narrows(key_server):
    q = "Summarize my last five transactions, please. " + text(11, 80)
    assert cached(ask(key_server, "alice", q)) == 0
    first = cached(ask(key_server, "alice", q))
    assert first > len(q) // 2  # the repeat reuses the prompt (the tiny model: ~1 token/char)
    assert cached(ask(key_server, "alice", q, salt="project-1")) == 0  # narrower
    assert cached(ask(key_server, "alice", q, salt="project-1")) == first
    assert cached(ask(key_server, "alice", q, salt="project-2")) == 0
    assert cached(ask(key_server, "bob", q)) == 0  # another tenant
    assert cached(ask(key_server, "bob", q, salt="project-1")) == 0  # even with alice's salt
    assert cached(ask(key_server, "bob2", q)) == first  # bob's second key: the same tenant
    assert cached(ask(key_server, "dave", q)) == 0  # a --api-key key, its own tenant


@needs_model
def test_keys_auth_and_tenant_names(key_server):
    c = key_server.client
    for who in KEYS:
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[who]}"})
        assert r.status_code == 200, who
    assert c.get("/v1/models", headers={"X-Api-Key": KEYS["carol"]}).status_code == 200
    for headers in ({}, {"Authorization": "Bearer sk-alice-012345678"},
                    {"Authorization": f"Bearer {KEYS['alice']}x"}, {"X-Api-Key": "nope"}):
        r = c.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ask(key_server, "carol", "hello there")
    metrics = c.get("/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"}).text
    assert re.search(r'kvshare_tenant_requests_total\{tenant="key:[0-9a-f]{12}"\}', metrics)
    log = key_server.log()
    assert '"tenant":"key:' in log
    for k in KEYS.values():
        assert k not in log and k not in metrics


@needs_model
def test_salt_scope(launcher):
    s = Server(launcher, *COMMON, "--cache-scope", "salt")
    try:
        q = "What is the opening time of the branch on Main Street? " + text(12, 60)
        assert [cached(ask(s, None, q)) for _ in range(2)] == [0, 0]  # no salt: no reuse
        assert cached(ask(s, None, q, salt="team-a")) == 0
        assert cached(ask(s, None, q, salt="team-a")) > len(q) // 2
        assert cached(ask(s, None, q, salt="team-b")) == 0
        held = s.wait_ram_idle()
        assert held["entries"] > 0
        assert cached(ask(s, None, q + " And on Sundays?")) == 0
        # an unsalted request's blocks are not stored: nobody could match its one-off salt
        assert s.wait_ram_idle()["entries"] == held["entries"], (held, s.tier("ram"))
    finally:
        s.kill9()


@needs_model
def test_public_prefix_shared_across_keys(key_server):
    """Carol (another tenant) reuses the public system prompt that alice's request computed:
    exactly its whole blocks, nothing of alice's private question after it, even though
    carol's question is identical."""
    def system_tokens(system: str) -> list[int]:
        r = key_server.client.post(
            "/tokenize", json={"content": f"<|im_start|>system\n{system}<|im_end|>\n",
                               "add_special": True},
            headers={"Authorization": f"Bearer {KEYS['alice']}"})
        return r.json()["tokens"]

    public = system_tokens(PUBLIC_SYSTEM)
    n_public = len(public)
    assert n_public > 3 * BS
    q = "My account number is 5512 9034; why was my card declined? " + text(13, 40)
    assert cached(ask(key_server, "alice", q, system=PUBLIC_SYSTEM)) <= n_public
    assert cached(ask(key_server, "carol", q, system=PUBLIC_SYSTEM)) == n_public // BS * BS
    # a private system prompt that starts like the public one shares only the common blocks
    other = PUBLIC_SYSTEM[: len(PUBLIC_SYSTEM) // 2] + " Internal note: VIP customer."
    n_common = common_prefix(public, system_tokens(other))
    assert n_common >= 2 * BS
    assert cached(ask(key_server, "dave", "hi", system=other)) == n_common // BS * BS
    # and within a tenant the private part is shared as usual
    assert cached(ask(key_server, "carol", q, system=PUBLIC_SYSTEM)) > n_public + len(q) // 2
