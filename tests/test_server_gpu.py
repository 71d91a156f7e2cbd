"""`kvshare serve --device cuda` end to end over HTTP, against `kvshare serve` on the CPU: the
same requests through the openai SDK get the same replies from both.

Each model gets a CPU server (the reference) and GPU servers started as a user starts them
(the command line, the start-up capture of the agent shapes, the engine thread, Hypercorn on
loopback): with CUDA graphs, without them (`--no-cuda-graphs`), and one with a small KV pool
over the RAM and disk tiers, restarted on its disk tier. Checked: greedy replies, streamed and
not, with their logprobs; a forced tool call (the grammar's masks on logits that come from
the device); two agent sessions at once sharing their system prompt's blocks, each replying
as the CPU replies to it alone; KV read back from the device into the RAM and disk tiers and
restored onto it.

Marked `gpu`. On a CUDA device the servers are plain `kvshare serve` processes; under the CPU
emulator (CI: `PYTHONPATH=tests/gpu_emu pytest -p emu_plugin`) each GPU server is
`tests/gpu_emu/kvshare_emu.py serve ...`, kvshare's command line with the emulator installed.
The MoE models (their grouped kernels take minutes per step shape on the emulator) are
served only on a device.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tier_helpers import served_url

pytestmark = pytest.mark.gpu

HERE = Path(__file__).parent
MODELS = HERE / "data" / "models"
EMU_LAUNCHER = HERE / "gpu_emu" / "kvshare_emu.py"


def _on_emulator() -> bool:
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return False
    return cupy.__name__ == "fakecupy"


EMU = _on_emulator()
# a dense attention model (every step a graph) and a hybrid (recurrent states, checkpoints;
# decode steps as graphs, prompt chunks eager); on a device the MoE agent models as well
NAMES = ["tiny-qwen3-chat", "tiny-qwen35"] + ([] if EMU else ["tiny-gpt-oss", "tiny-qwen3moe"])
# small prompt chunks and two slots: few shapes for the start-up capture (seconds on the
# emulator instead of a minute), and chunked prefill on every prompt here
COMMON = ["--parallel", "2", "--prefill-chunk", "64", "--ctx-size", "4096", "--seed", "7"]
STARTUP_TIMEOUT = 900 if EMU else 300
LOGPROB_TOL = 0.1  # as tests/test_model_moe_gpu.py: f16 KV and weights on both, other kernels
SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), "
          "run(cmd). Answer briefly. ") * 2


class Serve:
    """One `kvshare serve` process on a loopback port of the OS's choosing, healthy when
    constructed."""

    def __init__(self, name: str, device: str, *args: str):
        launch = [sys.executable, str(EMU_LAUNCHER)] if device == "cuda" and EMU else \
            [sys.executable, "-m", "kvshare.server.cli"]
        cmd = [*launch, "serve", "--model", str(MODELS / f"{name}.gguf"), "--host",
               "127.0.0.1", "--port", "0", "--device", device, *COMMON, *args]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KVSHARE_") or k.startswith(("KVSHARE_EMU_", "KVSHARE_GPU_"))}
        with tempfile.NamedTemporaryFile("w+", prefix=f"kvshare-{name}-{device}-",
                                         suffix=".log", delete=False) as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.logpath = Path(log.name)
        deadline = time.time() + STARTUP_TIMEOUT
        try:  # (--port 0: the port the OS gave it, from its start-up line)
            self.url = served_url(self.proc, self.logpath, STARTUP_TIMEOUT)
        except AssertionError:
            self.stop()
            raise
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"not healthy after {STARTUP_TIMEOUT} s:\n{self.log()}")
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none",
                                    timeout=STARTUP_TIMEOUT, max_retries=0)

    def log(self) -> str:
        return self.logpath.read_text(errors="replace")[-5000:]

    def cache(self) -> dict:
        return httpx.get(self.url + "/cache", timeout=30).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module", params=NAMES)
def servers(request):
    """(name, started): `started(kind)` starts (once) the CPU server "cpu", the GPU server
    "cuda" (CUDA graphs on) or "eager" (`--no-cuda-graphs`)."""
    name = request.param
    procs: dict[str, Serve] = {}
    args = {"cpu": ("cpu",), "cuda": ("cuda", "--cuda-graphs"),
            "eager": ("cuda", "--no-cuda-graphs")}

    def started(kind: str) -> Serve:
        if kind not in procs:
            procs[kind] = Serve(name, *args[kind])
        return procs[kind]

    yield name, started
    for p in procs.values():
        p.stop()


def chat(s: Serve, messages: list[dict], **kw) -> dict:
    """One chat completion (greedy unless told otherwise; with the top-3 logprobs of each
    token, which the tiny hybrid's near-certain greedy tokens alone would not show), as a
    plain dict."""
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 10)
    if "tools" not in kw:
        kw.setdefault("logprobs", True)
        kw.setdefault("top_logprobs", 3)
    r = s.client.chat.completions.create(model=s.model, messages=messages, **kw)
    return r.model_dump()


def streamed(s: Serve, messages: list[dict], **kw) -> tuple[str, str | None]:
    """A streamed chat completion: the content deltas joined, and the finish reason."""
    text, finish = [], None
    for ev in s.client.chat.completions.create(model=s.model, messages=messages, stream=True,
                                               temperature=0.0, max_tokens=10, **kw):
        for c in ev.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish


def tokens_and_logprobs(reply: dict) -> list[tuple[str, float, list[float]]]:
    return [(t["token"], t["logprob"], sorted(a["logprob"] for a in t["top_logprobs"]))
            for t in reply["choices"][0]["logprobs"]["content"]]


def assert_same_reply(gpu: dict, cpu: dict) -> None:
    """The CPU server's reply: its text, finish reason and tokens, its logprobs within
    LOGPROB_TOL."""
    (g_choice,), (c_choice,) = gpu["choices"], cpu["choices"]
    assert g_choice["message"]["content"] == c_choice["message"]["content"]
    assert g_choice["finish_reason"] == c_choice["finish_reason"]
    assert gpu["usage"]["prompt_tokens"] == cpu["usage"]["prompt_tokens"]
    g, c = tokens_and_logprobs(gpu), tokens_and_logprobs(cpu)
    assert [t for t, _, _ in g] == [t for t, _, _ in c] and c
    for (_, lp_g, top_g), (_, lp_c, top_c) in zip(g, c):
        assert lp_g == pytest.approx(lp_c, abs=LOGPROB_TOL)
        assert top_g == pytest.approx(top_c, abs=LOGPROB_TOL)


PROMPTS = [[{"role": "user", "content": "Say hi."}],
           [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files, then open the README."}]]


@pytest.mark.parametrize("kind", ["cuda", "eager"])
def test_greedy_replies_equal_the_cpu_servers(servers, kind):
    """Greedy replies, from a GPU server with CUDA graphs and from one without: the CPU
    server's (`assert_same_reply`); streamed, the same text and finish reason."""
    _, started = servers
    cpu, gpu = started("cpu"), started(kind)
    # /health said ok only once the start-up capture was done (before: "Loading model")
    assert ("captured" in gpu.log()) == (kind == "cuda"), gpu.log()
    for messages in PROMPTS:
        want, got = chat(cpu, messages), chat(gpu, messages)
        assert_same_reply(got, want)
        assert len(tokens_and_logprobs(want)) == 10
        text, finish = streamed(gpu, messages)
        assert (text, finish) == (want["choices"][0]["message"]["content"],
                                  want["choices"][0]["finish_reason"])


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the workspace.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 16},
        "lines": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["path", "lines"], "additionalProperties": False}}}]


def test_forced_tool_call_equals_the_cpus(servers):
    """`tool_choice: "required"`: the GPU server's call (its arguments constrained by the
    grammar's masks on the device's logits) is the CPU server's, complete and valid against
    the schema, and the reply ends with it."""
    _, started = servers
    messages = [{"role": "user", "content": "Open the README."}]
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=200, parallel_tool_calls=False)
    want, got = chat(started("cpu"), messages, **kw), chat(started("cuda"), messages, **kw)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in got["choices"][0]["message"]["tool_calls"]]
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in want["choices"][0]["message"]["tool_calls"]]
    assert got["choices"][0]["finish_reason"] == "tool_calls"
    [(name, args)] = calls
    assert name == "read_file" and set(args) == {"path", "lines"}
    assert isinstance(args["path"], str) and len(args["path"]) <= 16
    assert isinstance(args["lines"], int) and 1 <= args["lines"] <= 99


def test_two_agent_sessions_at_once_reply_as_alone(servers):
    """Two sessions on one system prompt, two turns each, at once on the GPU server (their
    rows in one step): every reply is the CPU server's to the same messages sent alone, and
    each second turn finds its first turn's blocks cached."""
    _, started = servers
    gpu, cpu = started("cuda"), started("cpu")
    turns: dict[int, list[tuple[list[dict], dict]]] = {}
    errors: list[BaseException] = []

    def session(i: int) -> None:
        try:
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Session {i}: fix the failing test."}]
            out = []
            for turn in range(2):
                r = chat(gpu, messages, max_tokens=12)
                out.append((list(messages), r))
                messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"Tool result {turn}: ok. Next?"}]
            turns[i] = out
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STARTUP_TIMEOUT)
    assert not errors, errors
    for i in range(2):
        (m1, r1), (m2, r2) = turns[i]
        first = r1["usage"]["prompt_tokens"]
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= first - 16
        for messages, r in ((m1, r1), (m2, r2)):
            assert_same_reply(r, chat(cpu, messages, max_tokens=12))


def test_kv_through_the_ram_and_disk_tiers(servers, tmp_path):
    """A GPU server whose KV pool holds one prompt: prompt A, then B and C push A's blocks out
    of the device; A again is served from the RAM tier (its KV read back from the device when
    A finished, restored onto it now); restarted on the same disk tier without a RAM tier, A
    is served from disk. Every reply is the CPU server's."""
    name, started = servers
    cpu = started("cpu")
    prompts = [[{"role": "system", "content": f"{word} " * 40},
                {"role": "user", "content": "Summarise."}] for word in ("alpha", "bravo", "delta")]
    tiers = ("--kv-blocks", "24", "--cache-dir", str(tmp_path / "disk"), "--cache-min-tokens", "64")
    gpu = Serve(name, "cuda", "--cache-ram", "64", *tiers)
    try:
        replies = [chat(gpu, p) for p in (*prompts, prompts[0])]
        ram = gpu.cache()["tiers"]["ram"]
    finally:
        gpu.stop()
    again = replies[-1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert ram["tokens_served"] >= again["usage"]["prompt_tokens_details"]["cached_tokens"]
    want = [chat(cpu, p) for p in prompts]
    for r, w in zip(replies, [*want, want[0]]):
        assert_same_reply(r, w)

    gpu = Serve(name, "cuda", "--cache-ram", "0", *tiers)
    try:
        r = chat(gpu, prompts[0])
        disk = gpu.cache()["tiers"]["disk"]
    finally:
        gpu.stop()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert disk["tokens_served"] >= r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert_same_reply(r, want[0])
