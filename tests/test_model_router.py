"""llama-server's router mode (`--models-dir`, `--models-preset`, `--models-max`,
`--no-models-autoload`) with real processes: a `kvshare serve` router on loopback over a
models directory holding the tiny model twice (`alpha.gguf`, and `beta/beta.gguf` in a folder
as llama-server's multi-file layout), and a preset file adding `gamma` with its own settings.
Each model runs in a `kvshare serve` child the router starts on demand.

Checked against llama-server's shapes (tools/server/README.md, tests/unit/test_router.py):
GET /models (ids, sources, status value/args/preset, failed + exit_code), GET /props
(role router), routing by the body's `model` (both models answer, the OpenAI, Anthropic and
native endpoints, a stream), GET ?model=, POST /models/load and /models/unload and their
errors, `--models-max 1` unloading the least recently used model, `--no-models-autoload`
(400 `model is not loaded`, `?autoload=true` loads), an unknown model's 400, the API key, a
model whose server fails, and no child left once the router stops (SIGTERM or SIGINT)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tier_helpers import TINY_MODEL, _clean_env, keepalive_limits

ROOT = Path(__file__).resolve().parent.parent
ROUTER_LINES = [e for e in json.loads(
    (ROOT / "tests" / "data" / "llama_server_cmdlines.json").read_text())["lines"]
    if e["expect"] == "router" and any(a.startswith("--models-") or a == "--no-models-autoload"
                                       for a in e["argv"])]
KEY = "sk-router-test"


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Router:
    """`kvshare --models-dir ... --port 0 ...` as a process; `url` once it routes."""

    def __init__(self, tmp: Path, *args: str,
                 extra: tuple[str, ...] = ("--host", "127.0.0.1", "--port", "0", "-c", "512",
                                           "-np", "1"), cwd: Path = ROOT):
        self.log = tmp / f"router-{time.monotonic_ns()}.log"
        # KVSHARE_PORT: a line without --port listens on a free port, not on 8080
        env = {**_clean_env(), "KVSHARE_MODEL_STORE": str(tmp / "store"), "KVSHARE_PORT": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvshare.server.cli", *args, *extra],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True)
        self.lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("kvshare: routing"):
                    found.set()
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 120
        while not found.wait(0.1) and self.proc.poll() is None and time.monotonic() < deadline:
            pass
        if not found.is_set():
            self.proc.kill()
            pytest.fail("the router did not start:\n" + self.log.read_text())
        self.url = self.lines[-1].split(" at ", 1)[1].split()[0]
        self.client = httpx.Client(base_url=self.url, timeout=120, limits=keepalive_limits(args))

    def models(self, **headers: str) -> dict[str, dict]:
        r = self.client.get("/models", headers=headers)
        assert r.status_code == 200, r.text
        return {m["id"]: m for m in r.json()["data"]}

    def status(self, name: str, **headers: str) -> str:
        return self.models(**headers)[name]["status"]["value"]

    def wait_status(self, name: str, want: str, seconds: float = 60, **headers: str) -> dict:
        deadline = time.monotonic() + seconds
        while True:
            m = self.models(**headers)[name]
            if m["status"]["value"] == want:
                return m
            assert time.monotonic() < deadline, (name, m, self.log.read_text()[-3000:])
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, list[int]]:
        """Stops the router; (its exit status, the children it had)."""
        kids = _children(self.proc.pid)
        self.client.close()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return code, kids


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, **extra}


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("model_router")
    models = tmp / "models"
    (models / "beta").mkdir(parents=True)
    (models / "alpha.gguf").symlink_to(TINY_MODEL)
    (models / "beta" / "beta.gguf").symlink_to(TINY_MODEL)
    (models / "beta" / "mmproj-beta.gguf").write_text("not a model: a companion file")
    (models / "notes.txt").write_text("not a model")
    (tmp / "presets.ini").write_text(
        "version = 1\n\n[*]\nc = 512\n\n"
        "; a model of --models-dir gets settings\n[alpha]\nalias = first\n\n"
        f"[gamma]\nmodel = {TINY_MODEL}\nn-predict = 2\nLLAMA_ARG_CACHE_RAM = 0\nKVSHARE_TEMP = 0\n"
        "tags = preset-made\nno-slots = true\n")
    return tmp


def test_router_models_routing_load_unload_and_models_max(layout):
    r = Router(layout, "--models-dir", str(layout / "models"), "--models-preset",
               str(layout / "presets.ini"), "--models-max", "1", "--api-key", KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        # the key guards the router's own endpoints; /health is open
        assert r.client.get("/health").json() == {"status": "ok"}
        denied = r.client.get("/models")
        assert denied.status_code == 401
        denied = r.client.post("/v1/chat/completions", json=_chat("alpha"))
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        r.client.headers.update(auth)

        models = r.models()
        assert {"alpha", "beta", "gamma"} <= set(models)
        assert "mmproj-beta" not in models and "notes" not in models
        assert models["alpha"]["source"] == "models_dir"
        assert models["gamma"]["source"] == "preset"
        assert models["alpha"]["aliases"] == ["first"]
        assert models["gamma"]["tags"] == ["preset-made"]
        for name in ("alpha", "beta", "gamma"):
            st = models[name]["status"]
            assert st["value"] == "unloaded" and "failed" not in st, st
            assert st["args"][st["args"].index("--model") + 1] == str(TINY_MODEL.resolve()) \
                or name == "gamma"
        g = models["gamma"]["status"]
        assert "[gamma]" in g["preset"] and "n-predict = 2" in g["preset"]
        assert g["args"][g["args"].index("--n-predict") + 1] == "2"
        assert "--no-slots" in g["args"] and "--api-key" in g["args"]
        assert g["args"][g["args"].index("--cache-ram") + 1] == "0"
        assert g["args"][g["args"].index("--temp") + 1] == "0"
        props = r.client.get("/props").json()
        assert props["role"] == "router" and props["max_instances"] == 1
        assert props["models_autoload"] is True

        # routing by the body's model: each model answers under its own name
        a = r.client.post("/v1/chat/completions", json=_chat("alpha"))
        assert a.status_code == 200, a.text
        assert a.json()["model"] == "alpha"
        assert r.status("alpha") == "loaded"
        assert r.client.get("/props", params={"model": "alpha"}).json()["total_slots"] == 1
        native = r.client.post("/completion", json={"model": "first", "prompt": "hi",
                                                    "n_predict": 2, "temperature": 0})
        assert native.status_code == 200 and native.json()["tokens_predicted"] == 2

        # --models-max 1: beta's load unloads alpha; a stream passes through
        with r.client.stream("POST", "/v1/chat/completions",
                             json=_chat("beta", stream=True)) as s:
            assert s.status_code == 200
            events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[0][6:])["model"] == "beta"
        models = r.models()
        assert models["beta"]["status"]["value"] == "loaded"
        assert models["alpha"]["status"]["value"] == "unloaded"
        msg = r.client.post("/v1/messages", json={"model": "beta", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]})
        assert msg.status_code == 200 and msg.json()["type"] == "message"

        # the preset's settings reach gamma's server: n-predict 2 when max_tokens is left out
        g = r.client.post("/v1/chat/completions", json={
            "model": "gamma", "messages": [{"role": "user", "content": "hi"}]})
        assert g.status_code == 200, g.text
        assert g.json()["usage"]["completion_tokens"] == 2
        assert r.client.get("/slots", params={"model": "gamma"}).status_code == 501

        # errors in llama-server's words
        unknown = r.client.post("/v1/chat/completions", json=_chat("nope"))
        assert unknown.status_code == 400
        assert unknown.json()["error"]["message"] == "model 'nope' not found"
        missing = r.client.post("/completion", json={"prompt": "hi"})
        assert missing.status_code == 400
        assert missing.json()["error"] == {"code": 400, "type": "invalid_request_error",
                                           "message": "model name is missing from the request"}
        assert r.client.get("/slots").status_code == 400  # a GET names its model by ?model=
        nf = r.client.post("/models/load", json={"model": "nope"})
        assert nf.status_code == 404 and nf.json()["error"]["message"] == "model is not found"
        running = r.client.post("/models/load", json={"model": "gamma"})
        assert running.status_code == 400
        assert running.json()["error"]["message"] == "model is already running"
        idle = r.client.post("/models/unload", json={"model": "alpha"})
        assert idle.status_code == 400
        assert idle.json()["error"]["message"] == "model is not running"

        # load and unload by hand
        loaded = r.client.post("/models/unload", json={"model": "gamma"})
        assert loaded.json() == {"success": True}
        assert r.status("gamma") == "unloaded"
        assert r.client.post("/models/load", json={"model": "beta"}).json() == {"success": True}
        r.wait_status("beta", "loaded")
    finally:
        code, kids = r.stop(signal.SIGTERM)
    assert code == 0, r.log.read_text()[-3000:]
    assert kids, "the router had a child running"
    assert not [k for k in kids if _alive(k)], "a child outlived the router"
    assert "kvshare: stopped" in "".join(r.lines)


def test_router_without_autoload_and_a_failing_model(layout, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "alpha.gguf").symlink_to(TINY_MODEL)
    (models / "broken.gguf").write_bytes(b"GGUF but not really a model file")
    r = Router(layout, "--models-dir", str(models), "--no-models-autoload")
    try:
        assert r.client.get("/props").json()["models_autoload"] is False
        # a browser's preflight is the router's to answer (no model named, no key needed)
        pre = r.client.options("/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        no = r.client.post("/v1/chat/completions", json=_chat("alpha"))
        assert no.status_code == 400
        assert no.json()["error"]["message"] == "model is not loaded"
        assert r.status("alpha") == "unloaded"
        yes = r.client.post("/v1/chat/completions", params={"autoload": "true"},
                            json=_chat("alpha"), headers={"Origin": "http://localhost:3000"})
        assert yes.status_code == 200, yes.text
        # one Access-Control-Allow-Origin, the router's, though the child sends its own too
        assert yes.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]
        assert r.client.post("/v1/chat/completions", json=_chat("alpha")).status_code == 200

        # a model whose server cannot start: the request says why; /models has its exit code
        bad = r.client.post("/v1/chat/completions", params={"autoload": "1"},
                            json=_chat("broken"))
        assert bad.status_code == 503
        assert "model 'broken' failed to load" in bad.json()["error"]["message"]
        st = r.models()["broken"]["status"]
        assert st["value"] == "unloaded" and st["failed"] is True and st["exit_code"] != 0
        assert r.status("alpha") == "loaded"  # no limit hit: --models-max defaults to 4
    finally:
        code, kids = r.stop(signal.SIGINT)
    assert code == 0, r.log.read_text()[-3000:]
    assert kids and not [k for k in kids if _alive(k)], "a child outlived the router"


@pytest.mark.parametrize("argv,message", [
    (["--models-dir", "/nonexistent/models"], "does not exist or is not a directory"),
    (["--models-preset", "PRESET", "--models-max", "1"], "option 'warp-drive' not recognized"),
    (["--models-preset", "PRESET2"], "no LoRA adapters"),
    (["--models-preset", "PRESET3"], "--ctx-size"),
])
def test_bad_router_setups_exit_2_with_one_line(tmp_path, argv, message):
    (tmp_path / "p.ini").write_text(f"[m]\nmodel = {TINY_MODEL}\nwarp-drive = 9\n")
    (tmp_path / "p2.ini").write_text(f"[m]\nmodel = {TINY_MODEL}\nlora = x.gguf\n")
    (tmp_path / "p3.ini").write_text(f"[m]\nmodel = {TINY_MODEL}\nc = lots\n")
    files = {"PRESET": "p.ini", "PRESET2": "p2.ini", "PRESET3": "p3.ini"}
    argv = [str(tmp_path / files[a]) if a in files else a for a in argv]
    p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", *argv, "--port", "0"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**_clean_env(), "KVSHARE_MODEL_STORE": str(tmp_path / "store")})
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and message in err[0], p.stderr


def test_router_flags_without_a_model_only():
    """A model on the command line serves that model: the router flags need no model."""
    from kvshare.model_router.cli import is_router_mode, passed_on
    from kvshare.server.cli import parse_args

    assert is_router_mode(parse_args(["--models-max", "2"], {}))
    assert is_router_mode(parse_args([], {"LLAMA_ARG_MODELS_DIR": "/m"}))
    assert not is_router_mode(parse_args([], {}))
    assert not is_router_mode(parse_args(["-m", "x.gguf", "--models-dir", "/m"], {}))
    assert passed_on(["--models-dir", "/m", "-c", "512", "--host", "0.0.0.0", "--port=9",
                      "--no-models-autoload", "-a", "x", "--api-key", "k", "--jinja"]) \
        == ["-c", "512", "--api-key", "k", "--jinja"]


@pytest.mark.parametrize("line", ROUTER_LINES, ids=lambda e: e["id"])
def test_llama_server_router_lines_start_the_router(line, tmp_path):
    """llama.cpp's README and test_router.py router lines as written (a free port; the
    README's ./models_directory and ./my-models.ini made in the working directory): the
    router starts and its /props and /models say what the flags set (test_router_props)."""
    (tmp_path / "models_directory").mkdir()
    (tmp_path / "models_directory" / "alpha.gguf").symlink_to(TINY_MODEL)
    (tmp_path / "my-models.ini").write_text(f"[*]\nc = 512\n[custom_model]\nmodel = {TINY_MODEL}\n")
    argv = ["0" if a == "8080" else a for a in line["argv"]]
    r = Router(tmp_path, *argv, extra=(), cwd=tmp_path)
    try:
        props = r.client.get("/props").json()
        assert props["role"] == "router"
        argv = line["argv"]
        want_max = int(argv[argv.index("--models-max") + 1]) if "--models-max" in argv else 4
        assert props["max_instances"] == want_max
        assert props["models_autoload"] is ("--no-models-autoload" not in argv)
        models = r.models()
        if "--models-dir" in argv:
            assert models["alpha"]["source"] == "models_dir"
        if "--models-preset" in argv:
            assert models["custom_model"]["source"] == "preset"
    finally:
        code, kids = r.stop()
    assert code == 0 and not kids


def test_children_die_with_a_killed_router(layout):
    """A router killed outright (SIGKILL: no shutdown code runs) leaves no child behind: each
    child gets SIGTERM from the kernel when the router dies (PR_SET_PDEATHSIG)."""
    r = Router(layout, "--models-dir", str(layout / "models"))
    try:
        assert r.client.post("/models/load", json={"model": "alpha"}).status_code == 200
        r.wait_status("alpha", "loaded")
        kids = _children(r.proc.pid)
        assert kids
    finally:
        r.client.close()
        r.proc.kill()
        r.proc.wait(30)
    deadline = time.monotonic() + 30
    while [k for k in kids if _alive(k)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if _alive(k)], "a child outlived its killed router"


def test_a_half_sent_body_is_cut_and_the_router_serves_on(layout):
    """The router bounds what a client makes it hold, as `kvshare serve` and `kvshare route`:
    a body that stops arriving is a 408 after --body-timeout (llama-server's error shape),
    and requests past --max-connections in progress are a 503; /health is never counted."""
    r = Router(layout, "--models-dir", str(layout / "models"), "--body-timeout", "1",
               "--max-connections", "1")
    try:
        host, port = r.url.removeprefix("http://").split(":")
        t0 = time.monotonic()
        with socket.create_connection((host, int(port.rstrip("/"))), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"mo")
            # while this one is in progress, a second request is over the limit of one
            busy = r.client.post("/v1/chat/completions", json=_chat("alpha"))
            assert busy.status_code == 503, busy.text
            assert r.client.get("/health").status_code == 200
            got = b""
            while not got.endswith(b"}") and time.monotonic() - t0 < 10:
                data = s.recv(65536)
                if not data:
                    break
                got += data
        assert got.startswith(b"HTTP/1.1 408"), got[:300]
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert 0.9 < time.monotonic() - t0 < 6
        ok = r.client.post("/v1/chat/completions", json=_chat("alpha"))
        assert ok.status_code == 200, ok.text
    finally:
        r.stop()
