"""Models from the Hugging Face Hub (model/hub.py) against a loopback stand-in of its HTTP API
(tests/hub_standin.py: the file list, `resolve` with its redirect to a CDN on another origin,
range requests): a full download, a resume after the connection is cut half way, a wrong
checksum, a missing quantization tag, offline with and without a stored file, a gated
repository's token (never sent to the CDN), split GGUFs, and `kvshare serve --model hf:...`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hub_standin import HubStandIn
from kvshare.model import catalog, hub
from kvshare.model.hub import HubError, HubFile, HubNotFound, HubRef, HubSettings

TINY = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"
REPO = "acme/Tiny-GGUF"


def _files() -> dict[str, bytes]:
    return {"Tiny-Q4_K_M.gguf": TINY.read_bytes(), "Tiny-Q8_0.gguf": os.urandom(50_000),
            "sub/Tiny-Q4_K.gguf": b"not this one" * 100, "mmproj-Tiny-F16.gguf": b"vision",
            "README.md": b"# Tiny"}


@pytest.fixture
def standin():
    with HubStandIn({REPO: _files()}, token="sekret", gated={"acme/Gated-GGUF"}) as s:
        s.repos["acme/Gated-GGUF"] = {"G-Q4_K_M.gguf": b"gated bytes" * 1000}
        yield s


def _settings(s: HubStandIn, **kw) -> HubSettings:
    return HubSettings(endpoint=s.endpoint, **kw)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


def test_full_download_then_offline(standin, tmp_path):
    path = hub.resolve(f"hf:{REPO}:Q4_K_M", tmp_path, settings=_settings(standin),
                       progress=False)
    assert path == tmp_path / "hf" / "acme" / "Tiny-GGUF" / "Tiny-Q4_K_M.gguf"
    assert path.read_bytes() == TINY.read_bytes()
    assert not list(path.parent.glob("*.part"))
    # the CDN served the bytes; the hub only redirected
    assert [p for m, p, h in standin.requests("cdn")] == [f"/blobs/{REPO}/Tiny-Q4_K_M.gguf"]
    n = len(standin.log)
    # stored: no request at all, offline or not, and the default tag is Q4_K_M
    assert hub.resolve(f"hf:{REPO}:Q4_K_M", tmp_path, settings=_settings(standin, offline=True),
                       progress=False) == path
    assert hub.resolve(f"{REPO}:q4_k_m", tmp_path, settings=_settings(standin),
                       progress=False) == path
    assert len(standin.log) == n


def test_resume_after_the_connection_is_cut(standin, tmp_path):
    standin.cut_once.add("Tiny-Q4_K_M.gguf")
    with pytest.raises(HubError):
        hub.resolve(f"hf:{REPO}", tmp_path, settings=_settings(standin), progress=False)
    folder = tmp_path / "hf" / "acme" / "Tiny-GGUF"
    part = folder / "Tiny-Q4_K_M.gguf.part"
    size = TINY.stat().st_size
    assert part.is_file() and 0 < part.stat().st_size < size
    assert not (folder / "Tiny-Q4_K_M.gguf").exists()
    have = part.stat().st_size
    path = hub.resolve(f"hf:{REPO}", tmp_path, settings=_settings(standin), progress=False)
    assert path.read_bytes() == TINY.read_bytes() and not part.exists()
    ranges = [h.get("Range") for m, p, h in standin.requests("cdn")]
    assert ranges == [None, f"bytes={have}-"]


def test_wrong_checksum_leaves_nothing(standin, tmp_path):
    standin.bad_sha.add("Tiny-Q8_0.gguf")
    with pytest.raises(HubError, match="does not match the hub"):
        hub.resolve(f"hf:{REPO}:Q8_0", tmp_path, settings=_settings(standin), progress=False)
    assert _leftovers(tmp_path / "hf" / "acme" / "Tiny-GGUF") == []


def test_missing_quant_names_the_quants_there(standin, tmp_path):
    with pytest.raises(HubNotFound) as e:
        hub.resolve(f"hf:{REPO}:Q5_K_S", tmp_path, settings=_settings(standin), progress=False)
    msg = str(e.value)
    assert "Q5_K_S" in msg and "Q4_K_M" in msg and "Q8_0" in msg and "\n" not in msg
    with pytest.raises(HubNotFound, match="not found"):
        hub.resolve("hf:acme/Nope-GGUF", tmp_path, settings=_settings(standin), progress=False)


def test_offline_without_a_stored_file(standin, tmp_path):
    with pytest.raises(HubError, match="offline"):
        hub.resolve(f"hf:{REPO}", tmp_path, settings=_settings(standin, offline=True),
                    progress=False)
    assert standin.log == []
    assert HubSettings.from_env({"HF_HUB_OFFLINE": "1"}).offline
    assert HubSettings.from_env({"HF_ENDPOINT": "http://m/", "HF_TOKEN": "t"}) == \
        HubSettings(endpoint="http://m", token="t")


def test_gated_repo_needs_the_token_which_stays_at_the_hub(standin, tmp_path):
    with pytest.raises(HubError, match="HF_TOKEN"):
        hub.resolve("hf:acme/Gated-GGUF", tmp_path, settings=_settings(standin),
                    progress=False)
    path = hub.resolve("hf:acme/Gated-GGUF", tmp_path,
                       settings=_settings(standin, token="sekret"), progress=False)
    assert path.read_bytes() == b"gated bytes" * 1000
    assert all(h.get("Authorization") is None for m, p, h in standin.requests("cdn"))
    assert any(h.get("Authorization") == "Bearer sekret" for m, p, h in standin.requests("hub"))


def test_split_gguf_fetches_every_part(standin, tmp_path):
    standin.repos["acme/Big-GGUF"] = {
        "Big-Q4_K_M-00002-of-00002.gguf": b"two" * 999,
        "Big-Q4_K_M-00001-of-00002.gguf": b"one" * 999,
        "Big-Q8_0-00001-of-00002.gguf": b"other"}
    path = hub.resolve("hf:acme/Big-GGUF:Q4_K_M", tmp_path, settings=_settings(standin),
                       progress=False)
    assert path.name == "Big-Q4_K_M-00001-of-00002.gguf"
    assert (path.parent / "Big-Q4_K_M-00002-of-00002.gguf").read_bytes() == b"two" * 999
    with pytest.raises(HubError, match="1 of 2 parts"):
        hub.resolve("hf:acme/Big-GGUF:Q8_0", tmp_path, settings=_settings(standin),
                    progress=False)


def test_pick_and_parse():
    files = [HubFile(n, 1, None) for n in ("a/X-Q4_K.gguf", "X-Q4_K_M.gguf", "X-IQ4_XS.gguf",
                                            "mmproj-X-Q4_K_M.gguf", "X-F16.gguf")]
    assert [f.path for f in hub.pick(files, HubRef("o/r", "Q4_K"))] == ["a/X-Q4_K.gguf"]
    assert [f.path for f in hub.pick(files, HubRef("o/r"))] == ["X-Q4_K_M.gguf"]
    assert [f.path for f in hub.pick(files, HubRef("o/r", "f16"))] == ["X-F16.gguf"]
    assert hub.quant_tags(files) == ["F16", "IQ4_XS", "Q4_K", "Q4_K_M"]
    only = [HubFile("model.gguf", 1, None)]
    assert hub.pick(only, HubRef("o/r")) == only
    assert hub.parse_ref("hf:o/r@v2:Q8_0") == HubRef("o/r", "Q8_0", "v2")
    for bad in ("hf:noslash", "hf:o/r/x", "hf:../x", "hf:o/r:Q4 K"):
        with pytest.raises(HubNotFound):
            hub.parse_ref(bad)
        assert not catalog.is_known(bad)
    assert catalog.is_known("hf:o/r:Q4_K_M") and catalog.is_known("qwen3-1.7b")


def _env(standin: HubStandIn) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSHARE_", "HF_"))}
    env["HF_ENDPOINT"] = standin.endpoint
    return env


def test_pull_command(standin, tmp_path):
    run = [sys.executable, "-m", "kvshare.server.cli", "pull"]
    p = subprocess.run([*run, f"hf:{REPO}:Q5_K_S", "--model-store", str(tmp_path)],
                       capture_output=True, text=True, env=_env(standin), timeout=120)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Q4_K_M" in p.stderr, p.stderr
    p = subprocess.run([*run, f"hf:{REPO}", "--model-store", str(tmp_path)],
                       capture_output=True, text=True, env=_env(standin), timeout=120)
    assert p.returncode == 0, p.stderr
    assert Path(p.stdout.strip()).read_bytes() == TINY.read_bytes()


def test_serve_a_hub_model(standin, tmp_path):
    """`kvshare serve -hf OWNER/NAME:QUANT` (llama-server's spelling of --model hf:...)
    fetches the file, loads it and answers; `kvshare models` then lists it."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvshare.server.cli", "serve", "--port", str(port),
             "-hf", f"{REPO}:Q4_K_M", "--model-store", str(tmp_path / "store"),
             "--parallel", "1", "--ctx-size", "256", "--cache-ram", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=_env(standin))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)
    assert (tmp_path / "store" / "hf" / "acme" / "Tiny-GGUF" / "Tiny-Q4_K_M.gguf").is_file()
    p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", "models", "--model-store",
                        str(tmp_path / "store")], capture_output=True, text=True,
                       env=_env(standin), timeout=60)
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"hf:{REPO}:Q4_K_M"))
    assert "downloaded" in row, p.stdout
    p = subprocess.run([sys.executable, "-m", "kvshare.server.cli", "serve", "-hf", REPO,
                        "--model", "x.gguf"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not both" in p.stderr, p.stderr
