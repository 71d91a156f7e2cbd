"""llama-server command lines start kvshare unchanged (server/cli.py, docs/llama-server.md):
its flag names and LLAMA_ARG_* variables, flags without a command meaning `serve`, flags
kvshare lacks refused in one line (exit 2), `--chat-template` / `--chat-template-file`
replacing the model's template, and the README's command line starting a real server."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys

import httpx
import pytest

from kvshare.server import cli
from kvshare.server.cli.model_load import load_engine
from kvshare.server.cli.parser import serve_parser
from tier_helpers import ROOT, TINY_MODEL, _clean_env, stop_server, wait_healthy

README_LINE = ("-m {model} -c 16384 -np 4 -t 2 --port {port} --jinja --api-key K --alias NAME "
               "--cors-origins http://localhost:3000")


def readme_argv(model: str = "model.gguf", port: int = 8080) -> list[str]:
    return README_LINE.format(model=model, port=port).split()


# --------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("command", [["serve"], []])
def test_readme_command_line_parses(command):
    a = cli.parse_args([*command, *readme_argv()], {})
    assert a.command == "serve"
    assert (a.model, a.ctx_size, a.parallel, a.threads, a.port) == ("model.gguf", 16384, 4, 2,
                                                                     8080)
    assert a.jinja is True and a.api_key == "K" and a.alias == "NAME"
    kw = cli.engine_config_kwargs(a)  # -c with -np: all slots together, as llama-server's
    assert (kw["ctx_size"], kw["parallel"], kw["threads"]) == (4096, 4, 2)
    st = cli.llama_settings_kwargs(a)
    assert st["cors_origins"] == ["http://localhost:3000"]
    assert st["default_max_tokens"] is None and st["reasoning_format"] == "auto"
    assert st["slots_endpoint"] is True and st["slot_save_path"] is None


def test_llama_server_names_for_kvshare_flags(tmp_path):
    a = cli.parse_args(["-m", "x.gguf", "-n", "64", "-a", "one", "-a", "two,three", "-cram", "0",
                        "-ctxcp", "3", "-cms", "256", "-to", "120", "--reasoning-format",
                        "deepseek", "--no-slots", "--slot-save-path", str(tmp_path),
                        "--metrics", "-cb", "--no-webui", "--cors-methods", "GET, POST",
                        "--cors-headers", "Authorization"], {})
    assert (a.cache_ram, a.ctx_checkpoints, a.checkpoint_min_step, a.body_timeout) == \
        (0, 3, 256, 120.0)
    assert a.alias == "one,two,three"
    st = cli.llama_settings_kwargs(a)
    assert st["default_max_tokens"] == 64 and st["reasoning_format"] == "deepseek"
    assert st["slots_endpoint"] is False and st["slot_save_path"] == str(tmp_path)
    assert (st["cors_methods"], st["cors_headers"]) == ("GET, POST", "Authorization")
    assert cli.parse_args(["serve", "--swa-checkpoints", "2", "--predict", "-1", "--slots",
                           "--timeout", "5"], {}).ctx_checkpoints == 2
    a = cli.parse_args(["serve", "-n", "-1", "-t", "-1", "-c", "0"], {})
    assert cli.llama_settings_kwargs(a)["default_max_tokens"] is None  # until the context is full
    assert a.threads is None  # llama-server: <= 0 is one per core
    assert a.ctx_size == 0 and "ctx_size" not in cli.engine_config_kwargs(a)  # the model's
    assert cli.parse_args(["serve", "--no-slots", "--slots"], {}).slots is True  # last wins


@pytest.mark.parametrize("argv", [["serve", "-n", "0"], ["serve", "-n", "-3"],
                                  ["serve", "--reasoning-format", "think"],
                                  ["serve", "--chat-template", "chatml",
                                   "--chat-template-file", "t.jinja"]])
def test_bad_llama_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv, {})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvshare: error: "), err


def test_llama_env_fallbacks():
    env = {"LLAMA_ARG_MODEL": "/m.gguf", "LLAMA_ARG_CTX_SIZE": "2048",
           "LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_THREADS": "5", "LLAMA_ARG_PORT": "9100",
           "LLAMA_ARG_HOST": "0.0.0.0", "LLAMA_API_KEY": "k1,k2", "LLAMA_ARG_ALIAS": "al",
           "LLAMA_ARG_N_PREDICT": "32", "LLAMA_ARG_CACHE_RAM": "128",
           "LLAMA_ARG_CTX_CHECKPOINTS": "4", "LLAMA_ARG_TIMEOUT": "60",
           "LLAMA_ARG_THINK": "none", "LLAMA_ARG_CORS_ORIGINS": "https://a.example",
           "LLAMA_ARG_ENDPOINT_SLOTS": "0", "LLAMA_ARG_JINJA": "1",
           "LLAMA_ARG_CHAT_TEMPLATE": "chatml", "LLAMA_ARG_ENDPOINT_METRICS": "1"}
    a = cli.parse_args(["serve"], env)
    assert (a.model, a.ctx_size, a.parallel, a.threads, a.port, a.host) == \
        ("/m.gguf", 2048, 3, 5, 9100, "0.0.0.0")
    assert (a.api_key, a.alias, a.n_predict, a.cache_ram, a.ctx_checkpoints) == \
        ("k1,k2", "al", 32, 128, 4)
    assert (a.body_timeout, a.reasoning_format, a.cors_origins, a.slots, a.jinja) == \
        (60.0, "none", "https://a.example", False, True)
    assert a.chat_template == "chatml" and a.metrics is True
    # KVSHARE_* wins over LLAMA_ARG_*, a flag over both
    a = cli.parse_args(["serve"], {"LLAMA_ARG_PORT": "1", "KVSHARE_PORT": "2"})
    assert a.port == 2
    a = cli.parse_args(["serve", "--port", "3"], {"LLAMA_ARG_PORT": "1", "KVSHARE_PORT": "2"})
    assert a.port == 3
    a = cli.parse_args(["serve", "--api-key", "flag"], {"LLAMA_API_KEY": "env"})
    assert a.api_key == "flag"  # a repeatable flag replaces the environment's value


@pytest.mark.parametrize("env,words", [
    ({"LLAMA_ARG_PORT": "http"}, "LLAMA_ARG_PORT='http'"),
    ({"LLAMA_ARG_FLASH_ATTN": "maybe"}, "LLAMA_ARG_FLASH_ATTN='maybe'"),
    ({"LLAMA_ARG_ENDPOINT_SLOTS": "maybe"}, "LLAMA_ARG_ENDPOINT_SLOTS"),
])
def test_bad_llama_env_exit_2_one_line(env, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["serve"], env)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@pytest.mark.parametrize("extra,named", [
    (["--embedding", "--lora", "a.gguf"], ["--embedding", "--lora"]),
    (["--mmproj", "p.gguf", "-md", "d.gguf"], ["--mmproj", "-md"]),
    (["-mg", "0"], ["-mg"]),  # not `-m g`
    (["-ctk", "q8_0", "-ctv", "q8_0"], ["-ctk", "-ctv"]),  # not `-c tk`
    (["--ctx", "100"], ["--ctx"]),  # no abbreviations of --ctx-size / --ctx-checkpoints
    (["--mlock", "--port", "1", "--no-mmap"], ["--mlock", "--no-mmap"]),
])
def test_unsupported_flags_are_named_in_one_line(extra, named, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-m", "x.gguf", *extra], {})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvshare: error: unsupported flag(s): "), err
    listed = err[0].split("unsupported flag(s): ", 1)[1].split(";")[0]
    for flag in named:
        assert re.search(rf"(^|, ){re.escape(flag)}( \(|,|$)", listed), (flag, err[0])


def test_values_are_not_taken_for_flags():
    a = cli.parse_args(["serve", "-n", "-1", "--api-key", "k", "--alias", "x",
                        "--port", "0"], {})
    assert a.n_predict == -1
    assert cli.unsupported_flags(serve_parser(cli.build_parser({})),
                                 ["--alias=-weird", "--port", "1", "--", "--anything"]) == []


def test_unsupported_flag_process_exits_2_with_one_line():
    """As a user runs it: the `kvshare` entry point (or `python -m kvshare.server.cli`), a
    llama-server command line without a command, an unsupported flag among supported ones."""
    exe = shutil.which("kvshare")
    base = [exe] if exe else [sys.executable, "-m", "kvshare.server.cli"]
    p = subprocess.run([*base, *readme_argv(str(TINY_MODEL), 0), "--reranking", "-mm", "p"],
                       capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert p.returncode == 2, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--reranking" in lines[0] and "-mm" in lines[0], p.stderr
    assert p.stdout == ""  # refused before anything was loaded


# --------------------------------------------------------------------------- chat template

def _engine(tmp_path, *flags: str):
    a = cli.parse_args(["serve", "-m", str(TINY_MODEL), "--cache-ram", "0", "-c", "512",
                        "-np", "1", *flags], {})
    return load_engine(a, a.model, "tiny", cli.chat_template_override(a))


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_chat_template_override_changes_the_prompt(tmp_path):
    from kvshare.model.chat_template import CHATML_TEMPLATE

    own = _engine(tmp_path)
    chatml = _engine(tmp_path, "--chat-template", "chatml")
    assert chatml.chat_template.name == "chatml" and chatml.chat_template.source == CHATML_TEMPLATE
    assert own.chat_template.source != CHATML_TEMPLATE
    assert chatml.apply_chat_template(MSGS)[0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    custom = _engine(tmp_path, "--chat-template-file", str(f))
    text = custom.apply_chat_template(MSGS)[0]
    assert text == "[SYSTEM] Be brief.\n[USER] hi\n[ASSISTANT]"
    ids = custom.chat_prompt(MSGS).tokens  # what the engine computes
    assert ids != own.chat_prompt(MSGS).tokens
    assert custom.detokenize(ids).endswith(text)
    inline = _engine(tmp_path, "--chat-template", f.read_text())
    assert inline.apply_chat_template(MSGS)[0] == text
    # BOS/EOS handling is the model's: the template sees its BOS text
    assert custom.chat_template.bos_token == own.chat_template.bos_token
    assert custom.chat_template.add_bos == own.chat_template.add_bos


def test_ctx_size_0_is_the_trained_context(tmp_path):
    a = cli.parse_args(["serve", "-m", str(TINY_MODEL), "--cache-ram", "0", "-c", "0",
                        "-np", "1"], {})
    e = load_engine(a, a.model, "tiny")
    assert e.ctx_size == e.model.config.context_length > 0


@pytest.mark.parametrize("flags,words", [
    (["--chat-template", "llama-9"], "neither a template kvshare has built in"),
    (["--chat-template", "{{% if %}}"], "cannot use --chat-template"),
    (["--chat-template-file", "{tmp}/missing.jinja"], "cannot read --chat-template-file"),
    (["--slot-save-path", "{tmp}/nodir"], "cannot use --slot-save-path"),
])
def test_startup_errors_are_one_line(flags, words, tmp_path, capsys):
    argv = ["serve", "-m", str(TINY_MODEL), "--port", "0",
            *[x.format(tmp=tmp_path) for x in flags]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvshare: error: ") and words in err[0], err


# --------------------------------------------------------------------------- a real server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_command_line_starts_a_server(tmp_path):
    """`kvshare serve` + the README's llama-server command line, unchanged: it serves /health
    without a key, chat with it, lists the alias, answers a CORS preflight from the allowed
    origin."""
    port = _free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "kvshare.server.cli", "serve",
            *readme_argv(str(TINY_MODEL), port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_clean_env(), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            wait_healthy(c, proc, log)
            text = log.read_text()
            assert "parallel 4, ctx 4096" in text, text  # -c 16384 over -np 4, as llama-server
            body = {"model": "NAME", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}
            assert c.post("/v1/chat/completions", json=body).status_code == 401
            r = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer K"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
            assert r.json()["model"] == "NAME"
            models = c.get("/v1/models", headers={"Authorization": "Bearer K"}).json()
            assert [m["id"] for m in models["data"]] == ["NAME"]
            pre = c.options("/v1/chat/completions", headers={
                "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert pre.status_code == 200
            assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
            evil = c.options("/v1/chat/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert evil.status_code == 200
            assert "access-control-allow-origin" not in evil.headers
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()
    assert "kvshare: stopped" in log.read_text()
