"""llama-server's common flags keep their meaning in kvshare (server/cli/, docs/llama-server.md):
sampling defaults (`--temp`, `--seed`, ...), `-b`/`-ub` as the prefill chunk, `-c` over `-np`
slots as the total context, `-ngl`, `-fa`, `--no-jinja`, `--offline`, `--kv-unified`, `-v`;
parsed, then as real `kvshare` processes started with llama-server command lines (as its README
and tools/server/tests write them) against the tiny model."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kvshare.server import cli
from kvshare.server.cli.config import ctx_per_sequence
from kvshare.server.cli.preflight import choose_device
from tier_helpers import (ROOT, TINY_MODEL, _clean_env, served_url, stop_server,
                          wait_healthy)

# --------------------------------------------------------------------------- parsing


def test_sampling_flags_are_server_defaults():
    a = cli.parse_args(["-m", "x.gguf", "--temp", "0.5", "--top-k", "20", "--top-p", "0.9",
                        "--min-p", "0.1", "-s", "7", "--repeat-penalty", "1.1",
                        "--repeat-last-n", "32", "--presence-penalty", "0.2",
                        "--frequency-penalty", "0.3"], {})
    assert cli.llama_settings_kwargs(a)["sampling_defaults"] == {
        "temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.1, "seed": 7,
        "repetition_penalty": 1.1, "penalty_last_n": 32, "presence_penalty": 0.2,
        "frequency_penalty": 0.3}
    assert cli.llama_settings_kwargs(cli.parse_args(["serve"], {}))["sampling_defaults"] == {}
    assert cli.parse_args(["serve"], {"KVSHARE_TEMP": "0"}).temp == 0.0


@pytest.mark.parametrize("argv,words", [
    (["--temp", "-1"], "cannot use --temp -1.0"),
    (["--top-p", "2"], "cannot use --top-p 2.0"),
    (["-fa", "sometimes"], "flash attention setting"),
    (["-ngl", "many"], "layer count"),
])
def test_bad_values_exit_2_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-m", "x.gguf", *argv], {})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


# llama-server's slot context for -c / -np / --kv-unified: llama_n_ctx_seq of a context made
# with those n_ctx / n_seq_max / kv_unified (src/llama-context.cpp: n_ctx padded to 256; not
# unified: n_ctx_seq = pad(n_ctx / n_seq_max, 256)), measured with llama.cpp's libllama on
# tests/data/models/tiny-qwen3-chat.gguf (n_ctx_train 32768), which server_context::n_ctx_slot
# caps at n_ctx_train and /props, /slots and /v1/models report.
@pytest.mark.parametrize("argv,env,per_seq", [
    (["-c", "512", "-np", "2"], {}, 256),  # the issue's line
    (["-c", "512", "-np", "2", "--kv-unified"], {}, 512),
    (["-c", "512", "-np", "2", "-kvu"], {}, 512),
    (["--ctx-size", "1024", "--parallel", "2"], {}, 512),  # llama.cpp's tests spell it so
    (["-c", "1000", "-np", "3"], {}, 512),  # 1000 -> 1024, / 3 = 341 -> 512
    (["-c", "1024", "-np", "4"], {}, 256),
    (["-c", "16384", "-np", "4"], {}, 4096),
    (["-c", "256", "-np", "2"], {}, 256),  # 128 rounds up: 512 in all
    (["-c", "100", "-np", "1"], {}, 256),
    (["-c", "100"], {}, 256),  # no slot count: 4 slots over a unified KV
    (["-c", "1024"], {}, 1024),
    (["-c", "1024", "-np", "-1"], {}, 1024),  # -np -1: auto, 4 slots over a unified KV
    ([], {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_N_PARALLEL": "4"}, 256),
    ([], {"KVSHARE_CTX_SIZE": "1024", "KVSHARE_PARALLEL": "4"}, 256),
    (["-c", "1024"], {"LLAMA_ARG_N_PARALLEL": "2"}, 512),
    ([], {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_KV_UNIFIED": "1",
          "LLAMA_ARG_N_PARALLEL": "4"}, 1024),
    (["-c", "0", "-np", "2"], {}, 16384),  # the model's trained context over 2 slots
    (["-c", "0"], {}, 32768),
    (["-c", "65536", "-np", "1"], {}, 32768),  # capped at the trained context
    # each sequence's own context: without -c the pool is np x N; with it, at most N
    (["--kv-unified-per-slot", "96", "--parallel", "1"], {}, 96),
    (["--kv-unified-per-slot", "1000", "-np", "4"], {}, 1000),
    (["--kv-unified-per-slot", "300", "-c", "1024", "-np", "2"], {}, 300),
    (["--kv-unified-per-slot", "900", "-c", "1024", "-np", "2"], {}, 512),
    ([], {"LLAMA_ARG_KV_UNIFIED_PER_SLOT": "700"}, 700),
    ([], {}, None),  # kvshare's default: 8192 a sequence
])
def test_ctx_per_slot_as_llama_server(argv, env, per_seq):
    a = cli.parse_args(["serve", *argv], env)
    assert a.parallel == 4 if "-1" in argv else a.parallel > 0
    assert ctx_per_sequence(a, n_ctx_train=32768) == per_seq
    if per_seq is not None and "0" not in argv and "65536" not in argv:
        assert cli.engine_config_kwargs(a)["ctx_size"] == per_seq  # before the model loads


def test_batch_sizes_bound_the_prefill_chunk():
    def chunk(*argv: str) -> int | None:
        return cli.engine_config_kwargs(cli.parse_args(["serve", *argv], {})).get("prefill_chunk")

    assert chunk() is None
    assert chunk("-b", "32") == 32 and chunk("-ub", "64") == 64
    assert chunk("-b", "2048", "-ub", "512") == 512
    assert chunk("--batch-size", "64", "--prefill-chunk", "128") == 64
    assert cli.engine_config_kwargs(
        cli.parse_args(["serve"], {"LLAMA_ARG_UBATCH": "16"}))["prefill_chunk"] == 16


def test_accepted_flags():
    a = cli.parse_args(["-m", "x.gguf", "--no-jinja", "-fa", "on", "--offline", "-v"], {})
    assert (a.jinja, a.flash_attn, a.offline, a.log_level) == (False, "on", True, "debug")
    a = cli.parse_args(["serve", "--flash-attn", "auto", "--jinja", "--verbose"],
                       {"LLAMA_ARG_JINJA": "false"})
    assert a.jinja is True and a.log_level == "debug"
    assert cli.parse_args(["serve"], {"LLAMA_ARG_JINJA": "0"}).jinja is False
    assert cli.parse_args(["serve"], {"LLAMA_OFFLINE": "1"}).offline is True


@pytest.mark.parametrize("argv,env,device", [
    (["-ngl", "0"], {}, "cpu"),
    (["-ngl", "99", "--device", "cpu"], {}, "cpu"),  # --device wins
    (["--device", "cpu"], {"LLAMA_ARG_N_GPU_LAYERS": "99"}, "cpu"),
    (["--n-gpu-layers", "0", "--device", "cuda"], {}, "cuda"),
])
def test_gpu_layers_pick_the_device(argv, env, device):
    a = cli.parse_args(["serve", *argv], env)
    assert choose_device(a) is None and a.device == device


def test_gpu_layers_without_a_gpu_run_on_the_cpu():
    pytest.importorskip("kvshare.backend")
    from kvshare.backend import BackendError, get_backend

    try:
        get_backend("cuda")
        pytest.skip("a CUDA device is usable here")
    except BackendError:
        pass
    a = cli.parse_args(["serve", "-ngl", "all"], {})
    note = choose_device(a)
    assert a.device == "cpu" and note is not None and "running on the CPU" in note


@pytest.mark.parametrize("model,words", [
    ([], "kvshare pull"),  # the default PyPI catalog model
    (["-m", "hf:some-org/some-model-GGUF"], "offline"),  # a hub reference
])
def test_offline_refuses_a_model_not_in_the_store(model, words, tmp_path, capsys):
    code = cli.main(["serve", "--offline", *model, "--model-store", str(tmp_path),
                     "--port", "0"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "offline" in err[0] and words in err[0], err
    assert not any(tmp_path.iterdir())  # nothing fetched


# --------------------------------------------------------------------------- real servers

@contextmanager
def _kvshare(argv: list[str], log: Path) -> Iterator[httpx.Client]:
    """`python -m kvshare.server.cli ARGV` (flags only: a llama-server command line, with
    `--port 0`), until /health answers; stopped with SIGTERM afterwards."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvshare.server.cli", *argv],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_clean_env(), cwd=ROOT)
    try:
        with httpx.Client(base_url=served_url(proc, log), timeout=120) as c:
            wait_healthy(c, proc, log)
            yield c
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()


def _steps(c: httpx.Client) -> int:
    m = re.search(r"^llamacpp:n_decode_total (\S+)$", c.get("/metrics").text, re.M)
    assert m is not None
    return int(float(m.group(1)))


def _complete(c: httpx.Client, prompt: str, **fields) -> dict:
    r = c.post("/completion", json={"prompt": prompt, "n_predict": 8, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_issue_command_line_greedy_chunked_total_ctx(tmp_path):
    """`-m M --temp 0 --seed 42 -b 32 -ub 32 -fa on -ngl 0 --no-jinja --offline -np 2 -c 1024
    --verbose`: n_ctx 512 a slot, unsampled requests greedy, prompts computed 32 tokens a
    step, debug logging."""
    argv = ["-m", str(TINY_MODEL), "--port", "0", "--temp", "0", "--seed", "42",
            "-b", "32", "-ub", "32", "-fa", "on", "-ngl", "0", "--no-jinja", "--offline",
            "-np", "2", "-c", "1024", "--verbose"]
    log = tmp_path / "server.log"
    with _kvshare(argv, log) as c:
        props = c.get("/props").json()
        gen = props["default_generation_settings"]
        assert gen["n_ctx"] == 512 and props["total_slots"] == 2
        assert gen["params"]["temperature"] == 0 and gen["params"]["seed"] == 42
        # greedy: a request without a temperature equals one asking for 0
        prompt = "The quick brown fox jumps over the lazy dog. " * 3
        plain = _complete(c, prompt, cache_prompt=False)
        assert plain["content"] == _complete(c, prompt, temperature=0,
                                             cache_prompt=False)["content"]
        assert plain["generation_settings"]["temperature"] == 0
        # -b 32: a ~100-token prompt takes several steps (the default chunk takes one)
        long_prompt = " ".join(f"word{i}" for i in range(60))
        before = _steps(c)
        r = _complete(c, long_prompt, n_predict=1, cache_prompt=False)
        n_prompt = r["timings"]["prompt_n"]
        assert n_prompt > 64, r
        assert _steps(c) - before >= math.ceil(n_prompt / 32), (before, _steps(c), n_prompt)
        chat = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
    text = log.read_text()
    assert "parallel 2, ctx 512" in text, text
    assert " DEBUG " in text, text


def test_server_tests_command_line_seed_reproducible(tmp_path):
    """tools/server/tests' preset flags (long names, `--temp 0.8 --seed 42`), plus `-ngl 99`
    and `--kv-unified`: unseeded sampled requests repeat exactly; n_ctx per slot is -c."""
    argv = ["--host", "127.0.0.1", "--port", "0", "--temp", "0.8", "--seed", "42",
            "--model", str(TINY_MODEL), "--batch-size", "32", "--ubatch-size", "32",
            "--ctx-size", "512", "--parallel", "2", "--n-predict", "16", "--no-jinja",
            "--offline", "--slots", "--metrics", "--no-webui", "-c", "512", "-np", "2",
            "--kv-unified", "-ngl", "99", "-fa", "off"]
    with _kvshare(argv, tmp_path / "server.log") as c:
        assert c.get("/props").json()["default_generation_settings"]["n_ctx"] == 512
        prompt = "Once upon a time"
        first = _complete(c, prompt, n_predict=16, cache_prompt=False)
        again = _complete(c, prompt, n_predict=16, cache_prompt=False)
        assert first["content"] == again["content"]
        assert first["generation_settings"]["temperature"] == pytest.approx(0.8)
        seeded = _complete(c, prompt, n_predict=16, seed=42, cache_prompt=False)
        assert seeded["content"] == first["content"]
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
        r2 = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
        assert r.status_code == r2.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == r2.json()["choices"][0]["text"]


def test_ctx_over_slots_on_a_real_server(tmp_path):
    """`-c 512 -np 2`: each slot 256 tokens, as llama-server's /props, /slots and /v1/models
    report it; a 300-token prompt is refused with llama-server's exceed_context_size_error.
    With `--kv-unified` each slot has all 512 and the same prompt is served."""
    prompt = [100 + i % 50 for i in range(300)]
    base = ["-m", str(TINY_MODEL), "--port", "0", "--offline", "--no-webui",
            "--cache-ram", "0", "-c", "512", "-np", "2"]
    with _kvshare(base, tmp_path / "split.log") as c:
        props = c.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 256
        assert props["total_slots"] == 2
        assert [s["n_ctx"] for s in c.get("/slots").json()] == [256, 256]
        assert c.get("/v1/models").json()["data"][0]["meta"]["n_ctx"] == 256
        r = c.post("/completion", json={"prompt": prompt, "n_predict": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["type"], err["n_ctx"]) == (400, "exceed_context_size_error",
                                                             256)
        assert err["n_prompt_tokens"] >= 300
        assert err["message"] == (f"request ({err['n_prompt_tokens']} tokens) exceeds the "
                                  "available context size (256 tokens), try increasing it")
        assert _complete(c, "Hello", n_predict=2)["tokens_predicted"] >= 1
    with _kvshare([*base, "--kv-unified"], tmp_path / "unified.log") as c:
        assert c.get("/props").json()["default_generation_settings"]["n_ctx"] == 512
        assert [s["n_ctx"] for s in c.get("/slots").json()] == [512, 512]
        r = c.post("/completion", json={"prompt": prompt, "n_predict": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("argv,reason", [
    (["--embedding"], "no embeddings or reranking"),
    (["--lora", "adapter.gguf"], "no LoRA adapters"),
    (["--model-draft", "draft.gguf"], "no speculative decoding"),
    (["--mmproj", "mmproj.gguf"], "text only"),
    (["-ctk", "q4_0"], "use --kv-dtype"),
])
def test_flags_kvshare_cannot_honour_are_refused_with_the_reason(argv, reason, capsys):
    """llama-server flags whose meaning kvshare lacks (docs/llama-server.md, "Refused"): one
    line naming the flag and why, exit 2, never taken silently."""
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["-m", "x.gguf", *argv], {})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and argv[0] in err[0] and reason in err[0], err
