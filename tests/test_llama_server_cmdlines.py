"""Every llama-server command line of llama.cpp's tools/server/README.md and of its server tests
(tests/data/llama_server_cmdlines.json, scripts/extract_llama_server_cmdlines.py) against
kvshare: each line kvshare must accept parses, with the flags' meanings checked on the parsed
arguments; each refused line exits 2 with one stderr line naming the flags it refuses; a line
without a model (llama-server's router mode) parses as kvshare's router when it carries a router
flag, else as kvshare's default-model server.

Every line kvshare must accept, and every line without a model or router flag (kvshare's
default model), starts a real `kvshare` process with the line as written, but the model
(the tiny model; an `-hf` repository: a loopback hub stand-in serving it), the port (a free
one) and paths of llama.cpp's tree (templates under tests/data/templates and
tests/data/llama_server_templates, a temporary slot
directory, an MCP config of no servers) replaced, and sends one request on an endpoint that
line's test uses, checking what the flags make observable: `/props` n_ctx and total_slots, the
sampling defaults, the API key, the alias in /v1/models."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from hub_standin import HubStandIn
from test_gguf_split import write_split
from kvshare.model import hub
from kvshare.server import cli
from kvshare.server.cli.preflight import hub_flags_problem
from tier_helpers import ROOT, TINY_MODEL, _clean_env, stop_server

# llama-server's router flags: a line without a model carrying one starts kvshare's router
ROUTER_FLAGS = ("--models-dir", "--models-preset", "--models-max", "--models-autoload",
                "--no-models-autoload")

DATA = json.loads((ROOT / "tests" / "data" / "llama_server_cmdlines.json").read_text())
LINES: list[dict[str, Any]] = DATA["lines"]
TEMPLATES = ROOT / "tests" / "data" / "templates"
LLAMA_SERVER_TEMPLATES = ROOT / "tests" / "data" / "llama_server_templates"
_by = lambda kind: [e for e in LINES if e["expect"] == kind]  # noqa: E731


def test_the_data_covers_both_sources():
    readme = [e for e in LINES if e["id"].startswith("readme")]
    tests = [e for e in LINES if e["id"].startswith("tests")]
    assert len(readme) >= 10 and len(tests) >= 100
    assert sum(len(e["sources"]) for e in tests) == DATA["launches_recorded"] >= 500
    for e in _by("refuse"):
        assert e["refused_flags"] and e["capability"], e


def _value(argv: list[str], *names: str) -> str | None:
    """The last value of any of `names` on the command line."""
    found = None
    for i, a in enumerate(argv[:-1]):
        if a in names:
            found = argv[i + 1]
    return found


def _parse(argv: list[str], env: dict[str, str]):
    return cli.parse_args(argv, env)


@pytest.mark.parametrize("line", _by("accept"), ids=lambda e: e["id"])
def test_accepted_line_parses_with_its_meaning(line):
    argv, env = line["argv"], line["env"]
    a = _parse(argv, env)
    kw = cli.engine_config_kwargs(a)
    slots = _value(argv, "-np", "--parallel") or env.get("LLAMA_ARG_N_PARALLEL")
    assert a.parallel == int(slots or 4)
    total = _value(argv, "-c", "--ctx-size") or env.get("LLAMA_ARG_CTX_SIZE")
    if total and int(total):  # llama-server's slot context (llama_n_ctx_seq): total over slots
        unified = slots is None or "--kv-unified" in argv or "-kvu" in argv
        padded = -(-int(total) // 256) * 256
        want = padded if unified else -(-(padded // int(slots)) // 256) * 256
        assert kw["ctx_size"] == want
    defaults = cli.llama_settings_kwargs(a)["sampling_defaults"]
    for flag, field in (("--temp", "temperature"), ("--seed", "seed")):
        if _value(argv, flag) is not None:
            assert defaults[field] == pytest.approx(float(_value(argv, flag)))
    for flag, attr in (("--alias", "alias"), ("--tags", "tags"), ("--api-key", "api_key"),
                       ("--chat-template", "chat_template"),
                       ("--reasoning-format", "reasoning_format"), ("--reasoning", "reasoning"),
                       ("--n-predict", "n_predict"), ("--batch-size", "batch_size")):
        if _value(argv, flag) is not None:
            assert str(getattr(a, attr)) == _value(argv, flag), flag
    assert a.jinja is ("--no-jinja" not in argv)
    assert a.slots is ("--no-slots" not in argv)
    repo = _value(argv, "-hf", "--hf-repo")
    if repo and not repo.startswith("<"):  # README's `-hf <user>/<model>:<tag>`: a pattern
        assert hub_flags_problem(a) is None
        ref = hub.parse_ref(a.model)
        assert ref.repo == repo.split(":")[0]
        hf_file = _value(argv, "--hf-file")
        if hf_file:  # the file's name picks exactly that file
            name = hf_file.rsplit("/", 1)[-1]
            others = [hub.HubFile(f"x/{n}", 1, None) for n in ("other-Q4_K_M.gguf", "a.gguf")]
            m = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", hf_file)
            parts = ([hf_file.replace(m.group(0), f"-{k:05d}-of-{m.group(2)}.gguf")
                      for k in range(1, int(m.group(2)) + 1)] if m else [hf_file])
            picked = hub.pick([*others, *(hub.HubFile(p, 1, None) for p in parts)], ref)
            assert picked[0].name == name, (picked, hf_file)


@pytest.mark.parametrize("line", _by("refuse"), ids=lambda e: e["id"])
def test_refused_line_exits_2_naming_its_flags(line, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(line["argv"], line["env"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for flag in line["refused_flags"]:
        assert flag in err[0].replace("_", "-"), (flag, err)


def _router_flags(line: dict) -> bool:
    return any(a.split("=", 1)[0] in ROUTER_FLAGS for a in line["argv"])


@pytest.mark.parametrize("line", _by("router"), ids=lambda e: e["id"])
def test_line_without_a_model_is_kvshares_default_model_or_its_router(line):
    """llama-server without a model is its router. kvshare is one too when a router flag is
    given (--models-dir, --models-preset, --models-max, --[no-]models-autoload:
    tests/test_model_router.py); without one it serves its default catalog model
    (`--offline`: only when it is in the model store)."""
    from kvshare.model_router.cli import is_router_mode

    a = _parse(line["argv"], line["env"])
    assert a.model is None and a.hf_repo is None
    assert is_router_mode(a) == _router_flags(line)


def test_router_line_offline_without_the_default_model_exits_2(tmp_path):
    line = next(e for e in _by("router") if "--offline" in e["argv"] and not _router_flags(e))
    argv = [_free_port() if a == "8080" else a for a in line["argv"]]
    p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", *argv],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**_clean_env(), "KVSHARE_MODEL_STORE": str(tmp_path)})
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "offline" in err[0], p.stderr


def test_underscores_in_long_flags_are_dashes():
    """llama-server reads `--backend_sampling` as `--backend-sampling`; values keep theirs."""
    a = cli.parse_args(["-m", "x.gguf", "--backend_sampling", "--n_predict", "8",
                        "--alias", "my_model", "--chat_template", "chatml"], {})
    assert (a.backend_sampling, a.n_predict, a.alias, a.chat_template) == (
        True, 8, "my_model", "chatml")


# --------------------------------------------------------------------------- real servers

# llama.cpp tests whose line must not start (the test expects the server to exit): kvshare
# exits 2 with one line
NOT_STARTING = ("::test_mcp_config_file_errors",)

# the request each llama.cpp test file's lines are checked with: (method, path, body)
_CHAT = ("POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
ENDPOINT: dict[str, tuple[str, str, dict | None]] = {
    "test_chat_completion.py": _CHAT, "test_tool_call.py": _CHAT,
    "test_template.py": ("POST", "/apply-template",
                         {"messages": [{"role": "user", "content": "hi"}]}),
    "test_compat_anthropic.py": ("POST", "/v1/messages", {
        "model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    "test_compat_oai_responses.py": ("POST", "/v1/responses",
                                     {"input": "hi", "max_output_tokens": 4}),
    "test_metrics.py": ("GET", "/metrics", None),
    "test_slot_save.py": ("POST", "/slots/0?action=save", {"filename": "slot0.bin"}),
    "test_basic.py": ("GET", "/v1/models", None),
}
_COMPLETION = ("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 4})


def _template_for(path: str) -> Path | None:
    """The copy of a template a llama.cpp test names (its models/templates/), if kept here."""
    name = Path(path.replace("\\", "/")).name
    for folder in (TEMPLATES, TEMPLATES / "thinking", LLAMA_SERVER_TEMPLATES):
        if (folder / name).is_file():
            return folder / name
    return None


def _startable(line: dict) -> bool:
    tpl = _value(line["argv"], "--chat-template-file")
    return tpl is None or _template_for(tpl) is not None


def _started() -> list[dict]:
    """Every line kvshare must accept, and every line without a model that is not a router
    line (kvshare's default model: the test gives it the tiny model instead, as it does every
    line's model). The router lines start in tests/test_model_router.py."""
    return _by("accept") + [e for e in _by("router") if not _router_flags(e)]


REAL = _started()


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _hub_file(repo: str, hf_file: str | None) -> str:
    """A file name the stand-in repository lists for the line's reference to pick."""
    if hf_file:
        return hf_file
    _, _, tag = repo.partition(":")
    return f"{repo.split(':')[0].split('/')[-1]}-{tag}.gguf" if tag else "model.gguf"


def _local_line(line: dict, port: str, tmp: Path) -> tuple[list[str], dict[str, str], str]:
    """The line with this machine's model, port and paths; its environment; the hub
    reference it serves ("" for a file)."""
    argv, env = list(line["argv"]), dict(line["env"])
    ref = ""
    for i, a in enumerate(argv[:-1]):
        nxt = argv[i + 1]
        if a in ("-m", "--model"):
            argv[i + 1] = str(TINY_MODEL)
        elif a in ("-hf", "--hf-repo") and nxt.startswith("<"):
            argv[i + 1] = "acme/Tiny-GGUF:Q4_K_M"
        elif a == "--port":
            argv[i + 1] = port
        elif a == "--chat-template-file":
            argv[i + 1] = str(_template_for(nxt))
        elif a == "--slot-save-path":
            argv[i + 1] = str(tmp)
        elif a == "--mcp-servers-config":  # README's mcp.json: a config of no servers
            (tmp / "mcp.json").write_text('{"mcpServers": {}}')
            argv[i + 1] = str(tmp / "mcp.json")
    if "LLAMA_ARG_MODEL" in env:
        env["LLAMA_ARG_MODEL"] = str(TINY_MODEL)
    elif not any(a in ("-m", "--model", "-hf", "-hfr", "--hf-repo") for a in argv):
        env["KVSHARE_MODEL"] = str(TINY_MODEL)  # for the default model: below the line
    if "LLAMA_ARG_PORT" in env or "--port" in argv:
        env["LLAMA_ARG_PORT"] = port
    else:
        env["KVSHARE_PORT"] = port  # below the command line: the line stays as written
    repo = _value(argv, "-hf", "--hf-repo")
    if repo:
        ref = repo
    return argv, env, ref


def _repo_files(name: str, tmp: Path) -> dict[str, bytes]:
    """The stand-in repository's GGUF files for the line's file `name`: the tiny model, or
    for the first part of a split GGUF (`-00001-of-0000N`) the tiny model split into its N
    parts as gguf-split writes them."""
    m = re.search(r"-00001-of-(\d{5})\.gguf$", name)
    if m is None:
        return {name: TINY_MODEL.read_bytes()}
    n = int(m.group(1))
    (tmp / "split").mkdir()
    parts = write_split(TINY_MODEL, tmp / "split", n)
    return {name.replace("-00001-of-", f"-{k:05d}-of-"): p.read_bytes()
            for k, p in enumerate(parts, 1)}


@contextlib.contextmanager
def _server(argv: list[str], env: dict[str, str], port: str, log: Path
            ) -> Iterator[subprocess.Popen]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvshare.server.cli", *argv],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**_clean_env(), **env}, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield proc
    finally:
        stop_server(proc)


@pytest.mark.parametrize("line", REAL, ids=lambda e: e["id"])
def test_line_starts_a_real_server(line, tmp_path):
    port = _free_port()
    argv, env, repo = _local_line(line, port, tmp_path)
    store = tmp_path / "store"
    env["KVSHARE_MODEL_STORE"] = str(store)
    stack = contextlib.ExitStack()
    with stack:
        if repo:
            name = _hub_file(repo, _value(argv, "--hf-file"))
            standin = stack.enter_context(HubStandIn(
                {repo.split(":")[0]: {**_repo_files(name, tmp_path), "README.md": b"#"}}))
            env["HF_ENDPOINT"] = standin.endpoint
            if "--offline" in argv:  # llama.cpp's tests fetch their presets first (load_all)
                a = _parse(argv, {})
                assert hub_flags_problem(a) is None
                hub.resolve(a.model, store, settings=hub.HubSettings(endpoint=standin.endpoint),
                            progress=False)
        if any(src.endswith(NOT_STARTING) for src in line["sources"]):
            p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", *argv],
                               capture_output=True, text=True, timeout=120, cwd=ROOT,
                               env={**_clean_env(), **env})
            err = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(err) == 1, p.stderr
            return
        stack.enter_context(_server(argv, env, port, tmp_path / "server.log"))
        _check(line, argv, env, f"http://127.0.0.1:{port}")


def _check(line: dict, argv: list[str], env: dict[str, str], url: str) -> None:
    key = _value(argv, "--api-key")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
        if key:
            assert httpx.get(url + "/props", timeout=30).status_code == 401
        a = _parse(line["argv"], line["env"])
        props = c.get("/props").json()
        gen = props["default_generation_settings"]
        assert props["total_slots"] == a.parallel
        want_ctx = cli.engine_config_kwargs(a).get("ctx_size")
        if want_ctx:
            assert gen["n_ctx"] == want_ctx
        for flag, field in (("--temp", "temperature"), ("--seed", "seed")):
            if _value(argv, flag) is not None:
                assert gen["params"][field] == pytest.approx(float(_value(argv, flag)))
        alias = _value(argv, "--alias")
        if alias:
            assert c.get("/v1/models").json()["data"][0]["id"] == alias.split(",")[0]
        test_file = line["sources"][0].split("::")[0].rsplit("/", 1)[-1]
        method, path, body = ENDPOINT.get(test_file, _COMPLETION)
        r = c.request(method, path, json=body)
        assert r.status_code == 200, (path, r.text)
        if path == "/apply-template":
            _check_prompt(line, r.json()["prompt"])


def _check_prompt(line: dict, prompt: str) -> None:
    """What llama.cpp's test_template.py asserts of the line's prompt, read from its test ids:
    test_reasoning[TEMPLATE-MODE-EXPECTED_END-TOOLS] (the prompt's end), and
    test_date_inside_prompt[TEMPLATE-FORMAT-TOOLS] (today, formatted, in the prompt)."""
    for src in line["sources"]:
        m = re.search(r"::test_reasoning\[.+-(?:on|off|auto)-(.*)-(?:None|tools\d+)\]$", src)
        if m:
            assert prompt.endswith(m.group(1).replace("\\n", "\n")), (src, prompt)
        m = re.search(r"::test_date_inside_prompt\[.+-(%[^-]*)-(?:None|tools\d+)\]$", src)
        if m:
            assert datetime.now().strftime(m.group(1)) in prompt, (src, prompt)


def test_every_line_kvshare_starts_is_started():
    assert all(_startable(e) for e in _by("accept")), [
        _value(e["argv"], "--chat-template-file") for e in _by("accept") if not _startable(e)]
    ids = {e["id"] for e in REAL}
    assert {e["id"] for e in _by("accept")} <= ids and len(ids) == len(REAL) >= 120
    assert not [e for e in REAL if _router_flags(e)]
