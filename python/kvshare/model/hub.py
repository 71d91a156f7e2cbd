"""GGUF models from the Hugging Face Hub: `--hf REPO[:QUANT]`, `kvshare pull hf:REPO[:QUANT]`.

A reference names a repository and a quantization tag (`unsloth/Qwen3-1.7B-GGUF:Q4_K_M`; no tag:
Q4_K_M, else Q8_0, else the repository's only GGUF). The repository's file list
(`/api/models/{repo}/tree/{revision}`) gives each file's size and SHA-256 (its LFS object id);
the file whose name carries the tag is fetched from `/{repo}/resolve/{revision}/{path}` (the
hub redirects to its CDN; the token is not sent to another host), into the model store under
`hf/{owner}/{name}/`. A split GGUF (`-00001-of-00003.gguf`) is every part.

A download goes to `{file}.part` and resumes from there (an HTTP range request) when it was cut;
the complete file's size and SHA-256 must match the hub's before it is renamed to its final name
(fsynced), so a file under its final name is always whole. A mismatch deletes the part. Each
fetch also records the resolved files (`{tag}.json`), so a stored model resolves without the
network: offline (`HF_HUB_OFFLINE=1`, `--offline`) only stored files are used.

Environment: `HF_TOKEN` (or `HUGGING_FACE_HUB_TOKEN`) for gated and private repositories,
`HF_ENDPOINT` for a mirror, `HF_HUB_OFFLINE`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping
from urllib.parse import quote

from .store import FetchError, ModelNotFound, fsync_dir, locked, progress_bar, store_root

PREFIX = "hf:"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # tried in order when a reference names no tag
_CHUNK = 1 << 20
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(FetchError):
    """A hub model cannot be resolved or fetched (one line, for the user)."""


class HubNotFound(HubError, ModelNotFound):
    """No such repository, quantization or file on the hub, or a malformed reference."""


@dataclass(frozen=True)
class HubRef:
    repo: str  # owner/name
    quant: str | None = None  # the tag after ':' (None: the default choice)
    revision: str = "main"

    @property
    def folder(self) -> Path:
        owner, name = self.repo.split("/")
        return Path("hf") / owner / name

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class HubFile:
    path: str  # in the repository
    size: int
    sha256: str | None  # the LFS object id; None for a file kept in git itself

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def is_reference(model: str | None) -> bool:
    return model is not None and model.startswith(PREFIX)


def parse_ref(spec: str) -> HubRef:
    """`[hf:]owner/name[:QUANT]` (a revision as `owner/name@rev[:QUANT]`)."""
    s = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    repo, _, quant = s.partition(":")
    repo, _, revision = repo.partition("@")
    if not _REPO.match(repo) or ".." in repo:
        raise HubNotFound(f"not a Hugging Face repository: {spec!r} (want OWNER/NAME[:QUANT], "
                       "e.g. unsloth/Qwen3-1.7B-GGUF:Q4_K_M)")
    if quant and not re.fullmatch(r"[A-Za-z0-9_.-]+", quant):
        raise HubNotFound(f"not a quantization tag: {quant!r}")
    return HubRef(repo, quant.upper() or None, revision or "main")


@dataclass(frozen=True)
class HubSettings:
    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = None
    offline: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 offline: bool = False) -> HubSettings:
        env = os.environ if environ is None else environ
        off = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        return cls(endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
                   token=env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None,
                   offline=offline or off)


# ----------------------------------------------------------------------------- choosing files

def _has_tag(name: str, tag: str) -> bool:
    """The tag stands in the file name between separators (Q4_K does not match Q4_K_M)."""
    return re.search(rf"(^|[-._]){re.escape(tag)}($|[-.])", name, re.IGNORECASE) is not None


def _ggufs(files: list[HubFile]) -> list[HubFile]:
    return [f for f in files if f.name.lower().endswith(".gguf")
            and not f.name.lower().startswith("mmproj")]


def quant_tags(files: list[HubFile]) -> list[str]:
    """The quantization tags a repository's GGUF names carry (for messages)."""
    tags = set()
    for f in _ggufs(files):
        stem = _SPLIT.sub(".gguf", f.name)[:-5]
        m = re.search(r"(?:^|[-._])((?:I?Q\d[A-Z0-9_]*|F16|BF16|F32|MXFP4[A-Z0-9_]*))$", stem,
                      re.IGNORECASE)
        if m:
            tags.add(m.group(1).upper())
    return sorted(tags)


def pick(files: list[HubFile], ref: HubRef) -> list[HubFile]:
    """The GGUF file (or split parts, in order) for the reference's tag."""
    ggufs = _ggufs(files)
    if not ggufs:
        raise HubNotFound(f"{ref.repo} has no GGUF file")
    tags = [ref.quant] if ref.quant else list(DEFAULT_QUANTS)
    for tag in tags:
        found = [f for f in ggufs if _has_tag(f.name, tag)]
        if found:
            return _one_model(found, ref, tag)
    if ref.quant is None and len({_SPLIT.sub("", f.path) for f in ggufs}) == 1:
        return _one_model(ggufs, ref, "")
    have = ", ".join(quant_tags(files)) or ", ".join(f.name for f in ggufs)
    want = ref.quant or " or ".join(DEFAULT_QUANTS)
    raise HubNotFound(f"{ref.repo} has no {want} GGUF (it has: {have}); "
                   f"name one as {ref.repo}:QUANT")


def _one_model(found: list[HubFile], ref: HubRef, tag: str) -> list[HubFile]:
    singles = [f for f in found if not _SPLIT.search(f.name)]
    if singles:
        return [min(singles, key=lambda f: (f.path.count("/"), f.path))]
    first = min(found, key=lambda f: f.path)
    m = _SPLIT.search(first.name)
    assert m is not None  # every file in `found` is a part here
    total = int(m.group(2))
    stem = _SPLIT.sub("", first.path)
    parts = sorted((f for f in found if _SPLIT.sub("", f.path) == stem), key=lambda f: f.path)
    if len(parts) != total:
        raise HubError(f"{ref.repo}: {tag or 'the'} split GGUF has {len(parts)} of {total} "
                       "parts")
    return parts


# ----------------------------------------------------------------------------- the hub's API

class HubClient:
    def __init__(self, settings: HubSettings, timeout: float = 60.0):
        import httpx  # noqa: PLC0415

        self.settings = settings
        headers = {"User-Agent": "kvshare"}
        if settings.token:
            headers["Authorization"] = f"Bearer {settings.token}"
        # httpx drops Authorization on a redirect to another origin (the CDN)
        self.http = httpx.Client(headers=headers, follow_redirects=True,
                                 timeout=httpx.Timeout(timeout, connect=15.0))
        self._httpx = httpx

    def close(self) -> None:
        self.http.close()

    def _fail(self, ref: HubRef, what: str, status: int | None = None,
              err: Exception | None = None) -> HubError:
        if status in (401, 403):
            return HubError(f"{ref.repo}: access denied ({status}); a gated or private "
                            "repository needs HF_TOKEN")
        if status == 404:
            return HubNotFound(f"{ref.repo}: not found on {self.settings.endpoint} ({what})")
        detail = f"HTTP {status}" if status else str(err)
        return HubError(f"{ref.repo}: {what} failed: {detail}")

    def list_files(self, ref: HubRef) -> list[HubFile]:
        url = (f"{self.settings.endpoint}/api/models/{ref.repo}/tree/"
               f"{quote(ref.revision, safe='')}?recursive=true")
        try:
            r = self.http.get(url)
        except self._httpx.HTTPError as e:
            raise self._fail(ref, "listing its files", err=e) from None
        if r.status_code != 200:
            raise self._fail(ref, "listing its files", r.status_code)
        try:
            entries = r.json()
            return [HubFile(e["path"], int((e.get("lfs") or e)["size"]),
                            (e.get("lfs") or {}).get("oid"))
                    for e in entries if e.get("type") == "file"]
        except (ValueError, KeyError, TypeError) as e:
            raise HubError(f"{ref.repo}: the hub's file list is not understood ({e})") from None

    @contextlib.contextmanager
    def open_file(self, ref: HubRef, f: HubFile, start: int) -> Iterator:
        url = (f"{self.settings.endpoint}/{ref.repo}/resolve/{quote(ref.revision, safe='')}/"
               f"{quote(f.path)}")
        headers = {"Range": f"bytes={start}-"} if start else {}
        try:
            with self.http.stream("GET", url, headers=headers) as r:
                if r.status_code not in (200, 206):
                    raise self._fail(ref, f"downloading {f.name}", r.status_code)
                yield r
        except self._httpx.HTTPError as e:
            raise self._fail(ref, f"downloading {f.name}", err=e) from None


# ----------------------------------------------------------------------------- fetching

def _manifest(root: Path, ref: HubRef) -> Path:
    return root / ref.folder / f"{ref.quant or 'default'}@{ref.revision}.json"


def stored(ref: HubRef, store: str | Path | None = None) -> Path | None:
    """The first file of a model fetched earlier for this reference, or None."""
    root = store_root(store)
    try:
        names = json.loads(_manifest(root, ref).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    paths = [root / ref.folder / n for n in names]
    return paths[0] if paths and all(p.is_file() for p in paths) else None


def stored_models(store: str | Path | None = None) -> list[tuple[str, int]]:
    """(`hf:` reference, bytes) of every hub model fetched into the store."""
    root = store_root(store)
    out = []
    for manifest in sorted((root / "hf").glob("*/*/*.json")):
        owner, name = manifest.parent.parent.name, manifest.parent.name
        tag, _, revision = manifest.stem.partition("@")
        ref = HubRef(f"{owner}/{name}", None if tag == "default" else tag, revision or "main")
        found = stored(ref, root)
        if found is not None:
            size = sum(p.stat().st_size for p in found.parent.glob("*.gguf"))
            rev = "" if ref.revision == "main" else f"@{ref.revision}"
            out.append((f"{PREFIX}{ref.repo}{rev}" + (f":{ref.quant}" if ref.quant else ""),
                        size))
    return out


def resolve(spec: str, store: str | Path | None = None, *, settings: HubSettings | None = None,
            progress: bool = True, client: HubClient | None = None) -> Path:
    """A hub reference to the local path of its (first) GGUF file, fetched when needed."""
    ref = parse_ref(spec)
    settings = settings or HubSettings.from_env()
    root = store_root(store)
    found = stored(ref, root)
    if found is not None:
        return found
    if settings.offline:
        raise HubError(f"{ref} is not in the model store {root} and the hub is offline "
                       "(HF_HUB_OFFLINE / --offline)")
    own = client is None
    client = client or HubClient(settings)
    try:
        files = pick(client.list_files(ref), ref)
        folder = root / ref.folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HubError(f"cannot create {folder}: {e.strerror or e}") from e
        with locked(folder):
            for f in files:
                _fetch_file(client, ref, f, folder, progress)
            _write_manifest(_manifest(root, ref), [f.name for f in files])
        return folder / files[0].name
    finally:
        if own:
            client.close()


def _fetch_file(client: HubClient, ref: HubRef, f: HubFile, folder: Path,
                progress: bool) -> None:
    target = folder / f.name
    if target.is_file() and target.stat().st_size == f.size:
        return  # verified when it was renamed into place
    part = folder / (f.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:
        part.unlink()
        have = 0
    if progress:
        how = f"resuming at {have / 2**20:.0f} MiB" if have else f"{f.size / 2**20:.0f} MiB"
        print(f"kvshare: fetching {ref.repo}/{f.path} ({how}) into {folder}", file=sys.stderr,
              flush=True)
    h = hashlib.sha256()
    with client.open_file(ref, f, have) as r:
        if have and r.status_code != 206:
            have = 0  # the server ignored the range: start over
        mode = "r+b" if have else "wb"
        with open(part, mode) as out:
            if have:
                _hash_prefix(out, have, h)
            out.seek(have)
            out.truncate()
            with progress_bar(f.size, f.name, progress) as bar:
                bar.update(have)
                for chunk in r.iter_bytes():  # as received: a cut keeps all it got
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
    _check_and_place(ref, f, part, target, size, h.hexdigest())


def _hash_prefix(out, n: int, h) -> None:
    out.seek(0)
    left = n
    while left:
        chunk = out.read(min(_CHUNK, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)


def _check_and_place(ref: HubRef, f: HubFile, part: Path, target: Path, size: int,
                     digest: str) -> None:
    if size < f.size:
        raise HubError(f"{ref.repo}/{f.path}: the download stopped at {size} of {f.size} "
                       "bytes (run it again to resume)")
    if size != f.size or (f.sha256 is not None and digest != f.sha256):
        part.unlink(missing_ok=True)
        raise HubError(f"{ref.repo}/{f.path}: the downloaded file does not match the hub's "
                       f"({size} bytes, sha256 {digest[:16]}...; want {f.size} bytes, "
                       f"{(f.sha256 or '?')[:16]}...): removed")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(part, 0o666 & ~umask)
    os.replace(part, target)
    fsync_dir(target.parent)


def _write_manifest(path: Path, names: list[str]) -> None:
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as out:
        json.dump({"files": names}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
