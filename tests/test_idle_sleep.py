"""llama-server's `--sleep-idle-seconds` on a real kvshare server (the tiny model, loopback):
after a second without a request the model and its KV pool are released (the process's RSS
falls by the pool), /props says `is_sleeping`, the endpoints that need no model answer without
waking it, and the next request loads it again and answers as before the sleep, with the
prefix cache's RAM tier (kept across the sleep) or disk tier (reopened) serving its prompt.
Requests sent together while it wakes all succeed. Also `--ui-config` in /props."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tier_helpers import TINY_MODEL, SubprocessLauncher, Server

KV_MIB = 192  # the pool's size: what sleeping must give back, well above RSS noise
PROMPT = [{"role": "system", "content": "You are a terse assistant that answers about builds. "
                                        * 8},
          {"role": "user", "content": "Describe the build in one short sentence."}]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def props(s: Server) -> dict:
    r = s.client.get("/props")
    assert r.status_code == 200, r.text
    return r.json()


def wait_sleeping(s: Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not props(s)["is_sleeping"]:
        assert time.monotonic() < deadline, f"did not fall asleep:\n{s.log()}"
        time.sleep(0.1)


def ask(s: Server) -> dict:
    r = s.client.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 8,
                                                     "temperature": 0})
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{s.log()}"
    return r.json()


def metric(s: Server, name: str) -> float:
    text = s.client.get("/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith(name + " ")))


@pytest.fixture(scope="module")
def launcher():
    la = SubprocessLauncher()  # a process of its own: its RSS is the server's alone
    yield la
    la.close()


@pytest.fixture(scope="module")
def ui_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("ui") / "ui.json"
    p.write_text(json.dumps({"theme": "dark", "showTokensPerSecond": True}))
    return p


@pytest.fixture(scope="module")
def server(launcher, tmp_path_factory, ui_file):
    disk = tmp_path_factory.mktemp("disk")
    s = Server(launcher, "--sleep-idle-seconds", "1", "--kv-mem", str(KV_MIB),
               "--cache-ram", "64", "--cache-dir", str(disk), "--cache-min-tokens", "16",
               "-np", "4", "--webui-config-file", str(ui_file))
    yield s
    s.terminate()


def test_sleeps_releases_memory_and_wakes_with_the_same_answer(server):
    s = server
    first = ask(s)
    assert props(s)["is_sleeping"] is False
    awake = rss_mib(s.pid)
    generated = metric(s, "kvshare_generated_tokens_total")
    wait_sleeping(s)  # is_sleeping turns true as the release begins: RSS falls just after
    deadline = time.monotonic() + 10
    while awake - (asleep := rss_mib(s.pid)) <= 0.75 * KV_MIB and time.monotonic() < deadline:
        time.sleep(0.05)
    # the KV pool (prefaulted at load) and the weights are gone
    assert awake - asleep > 0.75 * KV_MIB, (awake, asleep)
    # what needs no model answers and leaves it asleep (llama-server's exempt endpoints)
    for path in ("/health", "/v1/models", "/metrics", "/cache", "/props"):
        assert s.client.get(path).status_code == 200, path
    assert s.client.get("/cache").json()["sleeping"] is True
    time.sleep(1.5)
    assert props(s)["is_sleeping"] is True
    assert s.client.get("/v1/models").json()["data"][0]["id"]
    # counters do not go back while asleep
    assert metric(s, "kvshare_generated_tokens_total") == generated

    again = ask(s)  # wakes it: loads the model, then answers
    assert props(s)["is_sleeping"] is False
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    # the prompt came back from the RAM tier kept across the sleep (the pool was new)
    assert again["timings"]["cache_n"] >= 64, again["timings"]
    assert s.client.get("/cache").json()["tiers"]["ram"]["restores"] >= 1
    assert metric(s, "kvshare_generated_tokens_total") >= generated + 1
    assert rss_mib(s.pid) - asleep > 0.75 * KV_MIB  # the pool is back


def test_requests_sent_together_during_a_wake_all_succeed(server):
    s = server
    wait_sleeping(s)

    def one(i: int) -> int:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            r = c.post("/v1/completions", json={"prompt": f"Number {i} is", "max_tokens": 4,
                                                "temperature": 0})
            return r.status_code

    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(one, range(6)))
    assert codes == [200] * 6, f"{codes}\n{s.log()}"
    assert props(s)["is_sleeping"] is False


def test_tokenize_wakes_it_as_llama_server(server):
    s = server
    wait_sleeping(s)
    r = s.client.post("/tokenize", json={"content": "Hello"})
    assert r.status_code == 200 and r.json()["tokens"]
    assert props(s)["is_sleeping"] is False


def test_props_carries_the_ui_config_file(server, ui_file):
    assert props(server)["ui_settings"] == json.loads(ui_file.read_text())


def test_disk_tier_serves_the_prompt_after_a_wake(launcher, tmp_path):
    # no RAM tier: only the disk tier, closed as the engine sleeps and opened again, has it
    s = Server(launcher, "--sleep-idle-seconds", "1", "--cache-ram", "0", "--cache-dir",
               str(tmp_path), "--cache-min-tokens", "16", "--ui-config", "[1, 2]")
    try:
        first = ask(s)
        wait_sleeping(s)
        again = ask(s)
        assert again["choices"][0]["message"]["content"] == \
            first["choices"][0]["message"]["content"]
        assert again["timings"]["cache_n"] >= 64, again["timings"]
        assert props(s)["ui_settings"] == [1, 2]  # any JSON value, as llama-server
    finally:
        s.terminate()


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshare.server.cli", "--model",
                           str(TINY_MODEL), "--port", "0", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, said", [
    (["--ui-config", "{not json"], "cannot use --ui-config: not valid JSON"),
    (["--webui-config-file", "/nonexistent/ui.json"],
     "cannot use --ui-config-file /nonexistent/ui.json:"),
    (["--sleep-idle-seconds", "0"], "--sleep-idle-seconds"),
    (["--sleep-idle-seconds", "-2"], "--sleep-idle-seconds"),
])
def test_bad_values_are_one_line_and_exit_2(argv, said):
    p = _serve(*argv)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], p.stderr


def test_the_last_ui_config_flag_wins(tmp_path):
    from kvshare.server.cli.config import ui_config
    from kvshare.server.cli.parser import parse_args

    f = tmp_path / "ui.json"
    f.write_text('{"from": "file"}')
    assert ui_config(parse_args(["--ui-config-file", str(f), "--ui-config", "{}"])) == {}
    assert ui_config(parse_args(["--webui-config", "{}", "--webui-config-file", str(f)])) == \
        {"from": "file"}
    env = {"LLAMA_ARG_UI_CONFIG": '{"from": "env"}'}
    assert ui_config(parse_args([], environ=env)) == {"from": "env"}
    assert ui_config(parse_args(["--ui-config", ""])) is None  # empty: none, as llama-server
