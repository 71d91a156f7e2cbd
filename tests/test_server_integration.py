"""The real server (`python -m kvshare.server.cli serve`) with the real engine and the default
model (Gemma 3 270M), on a loopback port: the openai client, prompt-cache semantics, sharing on
vs off, bad input, 64 concurrent clients, SIGTERM.

One server process per configuration (module scope). Requests are kept short (small prompts,
a few tokens) so that the module runs in about a minute or two on a CPU.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from tier_helpers import served_url

DATA = Path(__file__).parent / "data"
STARTUP_TIMEOUT = float(os.environ.get("KVSHARE_TEST_STARTUP_TIMEOUT", "600"))
REQUEST_TIMEOUT = 600.0
CTX = 1024
# the reference outputs and tokenizer checks are Gemma's (serve's own default is SmolLM2)
SERVER_ARGS = ["--model", "gemma3-270m", "--parallel", "4", "--kv-unified-per-slot", str(CTX)]


class ServerProcess:
    def __init__(self, *extra: str):
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        # Fail fast, with the real error, when the engine is not there yet.
        importlib.import_module("kvshare.engine.engine")
        cmd = [sys.executable, "-m", "kvshare.server.cli", "serve", "--host", "127.0.0.1",
               "--port", "0", *SERVER_ARGS, *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHARE_")}
        # the server writes the log through its own copy of the descriptor
        with tempfile.NamedTemporaryFile("w+", prefix="kvshare-server-", suffix=".log",
                                         delete=False) as logfile:
            self.proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT,
                                         env=env)
        self.logpath = Path(logfile.name)
        deadline = time.time() + STARTUP_TIMEOUT
        try:  # (--port 0: the port the OS gave it, from its start-up line)
            self.url = served_url(self.proc, self.logpath, STARTUP_TIMEOUT)
        except AssertionError:
            self.kill()
            raise
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT} s:\n{self.log()}")

    def ensure(self) -> "ServerProcess":
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def log(self) -> str:
        return self.logpath.read_text()[-5000:]

    def terminate(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Servers:
    """Lazily started server processes, one per configuration."""

    def __init__(self):
        self.procs: dict[str, ServerProcess] = {}

    def get(self, name: str) -> ServerProcess:
        args = {"attach": (), "no_attach": ("--no-slot-attach",)}[name]
        if name not in self.procs:
            self.procs[name] = ServerProcess(*args)
        return self.procs[name].ensure()

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers.get("attach")


def post(server: ServerProcess, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT, **kw)


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


def nonce() -> str:
    return uuid.uuid4().hex[:8]


# --------------------------------------------------------------------------- basics

def test_health_models_tokenize(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == server.model
    # text is tokenized as llama-server does: special tokens parsed, BOS per the metadata
    cases = json.loads((DATA / "gemma-3-270m-q4_k_m.public.tokenizer.json").read_text())
    for case in cases[:4]:
        r = post(server, "/tokenize", {"content": case["text"], "add_special": True})
        assert r.json()["tokens"] == case["ids_special"], case["text"]
    r = post(server, "/tokenize", {"content": "<start_of_turn>user", "with_pieces": True})
    pieces = r.json()["tokens"]
    assert pieces[0] == {"id": 105, "piece": "<start_of_turn>"}
    ids = [p["id"] for p in pieces]
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == "<start_of_turn>user"


def test_reference_prompts(server):
    """Prompt token counts match llama.cpp's (chat: one BOS, from the template) and the greedy
    continuation starts like llama.cpp's."""
    ref = np.load(DATA / "gemma-3-270m-q4_k_m.public.npz")
    texts = json.loads((DATA / "gemma-3-270m-q4_k_m.public.texts.json").read_text())
    r = post(server, "/v1/completions", {"prompt": texts["short"], "max_tokens": 6,
                                         "temperature": 0})
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ref["short/tokens"])
    want = post(server, "/detokenize", {"tokens": ref["short/greedy"][:6].tolist()}).json()
    assert body["choices"][0]["text"] == want["content"]
    msg = [{"role": "user", "content": "Write a haiku about caches."}]
    r = post(server, "/v1/chat/completions", {"messages": msg, "max_tokens": 1,
                                              "temperature": 0})
    assert r.json()["usage"]["prompt_tokens"] == len(ref["chat/tokens"])


# --------------------------------------------------------------------------- openai client

def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT)
    assert [m.id for m in client.models.list().data] == [server.model]

    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
        temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens <= 3
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0
    assert chat.model_extra["timings"]["prompt_n"] + chat.model_extra["timings"]["cache_n"] \
        == chat.usage.prompt_tokens

    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # greedy: same as the non-streamed one
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        chat.usage.completion_tokens
    # the repeated prompt was served from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 1

    comp = client.completions.create(model=server.model, prompt="The capital of France is",
                                     max_tokens=3, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 3
    parts = list(client.completions.create(model=server.model, prompt="The capital of France is",
                                           max_tokens=3, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == comp.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"

    other = client.chat.completions.create(model="gpt-4o", max_tokens=2, messages=[
        {"role": "user", "content": "x"}])  # any model name is served by the loaded model
    assert other.model == "gpt-4o" and other.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[])


# --------------------------------------------------------------------------- prompt cache

def _completion(server, prompt, **kw) -> dict:
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                         **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    t, u = body["timings"], body["usage"]
    assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
    return body


def test_prompt_cache_semantics(server):
    text1 = f"Session {nonce()}. " + "The quick brown fox jumps over the lazy dog. " * 6
    first = _completion(server, text1)
    n1 = first["usage"]["prompt_tokens"]
    assert n1 > 48  # spans several blocks

    again = _completion(server, text1)  # a repeated prompt reuses all but at most one token
    assert again["timings"]["cache_n"] >= n1 - 1
    assert again["timings"]["prompt_n"] <= 1

    # a prompt extending the earlier one reuses the earlier one in full (token prompts, so the
    # extension does not re-tokenize the join)
    ids1 = post(server, "/tokenize", {"content": text1, "add_special": True}).json()["tokens"]
    assert len(ids1) == n1
    more = post(server, "/tokenize", {"content": " And then it rested."}).json()["tokens"]
    ext = _completion(server, ids1 + more)
    assert ext["usage"]["prompt_tokens"] == n1 + len(more)
    assert ext["timings"]["cache_n"] >= n1

    # chat: the same conversation twice
    msgs = [{"role": "system", "content": f"You are agent {nonce()}."},
            {"role": "user", "content": "List three colors."}]
    c1 = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2}).json()
    c2 = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2}).json()
    assert c2["usage"]["prompt_tokens"] == c1["usage"]["prompt_tokens"]
    assert c2["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        c1["usage"]["prompt_tokens"] - 1

    # a different cache_salt sees none of it
    salted = _completion(server, text1, cache_salt=f"tenant-{nonce()}")
    assert salted["timings"]["cache_n"] == 0


# --------------------------------------------------------------------------- sharing on/off

def _greedy_scenario(server: ServerProcess, tag: str) -> tuple[dict, dict]:
    """Sequential and concurrent greedy requests with shared prefixes, including a donor that
    is mid-generation when another session attaches to its prefix. Returns the outputs and
    each request's cache_n."""
    prefix = (f"Agent {tag}. You are a careful assistant. Tools: read_file, write_file, "
              "search, run_tests. Always answer briefly. ")
    out, cache_n = {}, {}
    for i, q in enumerate(("What is 2+2?", "Name a prime number.")):
        r = post(server, "/v1/completions", {"prompt": prefix + q, "max_tokens": 4,
                                             "temperature": 0, "logprobs": 0})
        body = r.json()
        out[f"seq{i}"] = (body["choices"][0]["text"], body["choices"][0]["logprobs"]["tokens"])
        cache_n[f"seq{i}"] = body["timings"]["cache_n"]

    results: dict[str, str] = {}
    started = threading.Event()

    def donor():
        body = {"prompt": prefix + "Write a long story about a cat.", "max_tokens": 10,
                "temperature": 0, "ignore_eos": True, "stream": True}
        text = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=REQUEST_TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["text"])
                        if chunk["choices"][0]["text"]:
                            started.set()
        results["donor"] = "".join(text)

    t = threading.Thread(target=donor)
    t.start()
    assert started.wait(REQUEST_TIMEOUT)
    r = post(server, "/v1/completions", {"prompt": prefix + "Write a long story about a cat. "
                                                            "Make it funny.",
                                         "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    results["attacher"] = r.json()["choices"][0]["text"]
    cache_n["attacher"] = r.json()["timings"]["cache_n"]
    t.join(REQUEST_TIMEOUT)
    out.update(results)
    return out, cache_n


def test_sharing_does_not_change_greedy_tokens(servers):
    tag = nonce()
    with_sharing, cached = _greedy_scenario(servers.get("attach"), tag)
    without, not_cached = _greedy_scenario(servers.get("no_attach"), tag)
    assert with_sharing == without
    assert cached["seq1"] > 16 and cached["attacher"] > 16  # sharing did happen
    assert set(not_cached.values()) == {0}  # and did not without it


# --------------------------------------------------------------------------- bad input

BAD_INPUTS = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user"', None),
    ("/v1/chat/completions", {"messages": "hello"}, None),
    ("/v1/chat/completions", {"messages": []}, None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": -5}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function", "function": {"name": "x"}}},
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": "warm"}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "nonsense"}}}}, None),
    ("/v1/completions", {"prompt": "hello " * (CTX + 50)}, None),
    ("/v1/completions", {"prompt": [7] * (CTX + 1)}, None),
    ("/v1/completions", {"prompt": [10**9]}, None),
    ("/v1/completions", {"prompt": ["a", []]}, None),
    ("/v1/completions", {"prompt": "x", "n": 99}, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None),
    ("/detokenize", {"tokens": [-1]}, None),
]


def test_bad_input_matrix(server):
    for path, body, status in BAD_INPUTS:
        if isinstance(body, bytes):
            r = httpx.post(server.url + path, content=body,
                           headers={"content-type": "application/json"})
        else:
            r = post(server, path, body)
        assert_openai_error(r, status)
    err = assert_openai_error(post(server, "/v1/completions", {"prompt": "hello " * (CTX + 50)}))
    assert err["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/chat/completions", content="hi",
                   headers={"content-type": "image/png"})
    assert_openai_error(r, 415)
    # what a browser page may send cross-origin without a preflight
    r = httpx.post(server.url + "/v1/chat/completions", content="{}",
                   headers={"content-type": "text/plain", "origin": "https://evil.example"})
    assert_openai_error(r, 415)
    big = b'{"prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(r, 413)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


# --------------------------------------------------------------------------- concurrency

def test_64_concurrent_clients(server):
    prefix = f"Shared agent prefix {nonce()}: be concise. "
    bad = [
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
        ("/v1/completions", {"prompt": [5] * (CTX + 10)}),
        ("/v1/chat/completions", {"n": 99, "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "temperature": "hot"}),
    ]

    def make(i: int):  # a quarter valid (short, 2-3 tokens), three quarters invalid
        if i % 4:
            return (*bad[i % len(bad)], False)
        kind = (i // 4) % 4
        if kind == 0:
            return "/v1/chat/completions", {"messages": [{"role": "user",
                                                          "content": f"{prefix}Q{i}"}],
                                            "max_tokens": 3}, True
        if kind == 1:
            return "/v1/chat/completions", {"messages": [{"role": "user",
                                                          "content": f"{prefix}Q{i}"}],
                                            "max_tokens": 3, "stream": True}, True
        if kind == 2:
            return "/v1/completions", {"prompt": f"{prefix}{i}", "max_tokens": 2,
                                       "temperature": 0.7, "seed": i}, True
        return "/v1/completions", {"prompt": f"{prefix}{i}", "max_tokens": 2,
                                   "stream": True}, True

    async def one(client: httpx.AsyncClient, i: int):
        if i % 16 == 2:  # hangs up after the first streamed chunk: its generation is cancelled
            body = {"prompt": f"{prefix}abandoned {i}", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            return i, None, r.status_code, ""
        path, body, valid = make(i)
        r = await client.post(path, json=body)
        return i, valid, r.status_code, r.text

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT,
                                     limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    for i, valid, status, text in results:
        assert status < 500, (i, status, text)
        if valid is None:  # abandoned stream
            assert status == 200
        elif valid:
            assert status == 200, (i, status, text)
            if "[DONE]" not in text:
                assert json.loads(text)["usage"]["completion_tokens"] >= 1
            else:
                assert text.rstrip().endswith("data: [DONE]")
        else:
            assert 400 <= status < 500
            assert "error" in json.loads(text)

    # back to idle: no sequence holds blocks, nothing in flight
    deadline = time.time() + 30
    while time.time() < deadline:
        cache = httpx.get(server.url + "/cache").json()
        if cache["pool"]["used"] == 0 and cache["sequences"] == 0:
            break
        time.sleep(0.2)
    assert cache["pool"]["used"] == 0, cache
    assert httpx.get(server.url + "/cache").json()["sequences"] == 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server.url + "/metrics").text
    assert "kvshare_requests_in_flight 0.0" in metrics
    assert 'kvshare_kv_blocks{state="used"} 0.0' in metrics


def test_metrics_and_introspection(server):
    _completion(server, f"Metrics {nonce()}: hello there")
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvshare_kv_blocks{state=\"used\"}", "kvshare_kv_blocks{state=\"free\"}",
                 "kvshare_kv_blocks{state=\"cached\"}", "kvshare_kv_blocks_shared",
                 "kvshare_kv_tokens_used", "kvshare_prompt_tokens_total",
                 "kvshare_prompt_tokens_cached_total", "kvshare_generated_tokens_total",
                 "kvshare_requests_total{", "kvshare_time_to_first_token_seconds_bucket"):
        assert name in text, name
    vals = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}
    assert vals["kvshare_prompt_tokens_total"] > 0
    assert vals["kvshare_generated_tokens_total"] > 0
    cache = httpx.get(server.url + "/cache").json()
    for k in ("total", "used", "free", "cached", "shared", "tokens_used", "block_size"):
        assert k in cache["pool"], k
    assert isinstance(httpx.get(server.url + "/slots").json(), list)


# --------------------------------------------------------------------------- startup errors

def test_bad_model_file_exits_2(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00")  # truncated header
    for model in (str(bad), str(tmp_path / "missing.gguf")):
        p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", "serve", "--model", model,
                            "--port", "0"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvshare: error:"), p.stderr


# --------------------------------------------------------------------------- shutdown

def test_sigterm_shuts_down_cleanly(servers):
    """Keep last: it stops the no-attach server (a later user would restart it)."""
    proc = servers.get("no_attach")
    lines: list[str] = []
    first = threading.Event()

    def client():
        body = {"prompt": "Count from one to one hundred:", "max_tokens": 24,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", proc.url + "/v1/completions", json=body,
                              timeout=REQUEST_TIMEOUT) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
        except httpx.HTTPError as e:  # pragma: no cover - reported by the assertion below
            lines.append(f"ERROR {e!r}")
        first.set()

    t = threading.Thread(target=client)
    t.start()
    assert first.wait(REQUEST_TIMEOUT)
    code = proc.terminate(timeout=60)
    t.join(30)
    assert code == 0, proc.log()
    assert lines[-1] == "data: [DONE]", lines[-3:]  # finished or cancelled, framed cleanly
    assert not any(line.startswith("ERROR") for line in lines)
    assert "kvshare: stopped" in proc.log()
