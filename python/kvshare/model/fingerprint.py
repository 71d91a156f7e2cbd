"""A model file's content fingerprint: the SHA-256 of its bytes, hex.

Cache keys mix it in (with the architecture, KV dtype and block size), so they must not change
for the same weights and must change for different ones. Hashing a few hundred MB takes about a
second, so results are kept in `~/.cache/kvshare/fingerprints.json` (or `$KVSHARE_CACHE_DIR`,
or `$XDG_CACHE_HOME/kvshare`) keyed by the resolved path, size and mtime_ns: a file that is
replaced or touched is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()
_CHUNK = 8 << 20


def cache_dir() -> Path:
    if os.environ.get("KVSHARE_CACHE_DIR"):
        return Path(os.environ["KVSHARE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvshare"


def hash_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path}|{st.st_size}|{st.st_mtime_ns}"


def file_fingerprint(path: str | Path, *, use_cache: bool = True) -> str:
    """SHA-256 (hex) of the file's contents, from the on-disk cache when path, size and
    mtime_ns are unchanged. A cache that cannot be read or written is ignored."""
    path = Path(path).resolve()
    key = _key(path)
    store = cache_dir() / "fingerprints.json"
    if use_cache:
        with _LOCK:
            entries = _read(store)
        if isinstance(entries.get(key), str):
            return entries[key]
    digest = hash_file(path)
    if key != _key(path):  # changed while we read it: don't cache a torn value
        return digest
    if use_cache:
        with _LOCK:
            entries = _read(store)
            # drop stale entries for the same path
            entries = {k: v for k, v in entries.items() if k.rsplit("|", 2)[0] != str(path)}
            entries[key] = digest
            _write(store, entries)
    return digest


def model_fingerprint(path: str | Path) -> bytes:
    """The 32-byte SHA-256 digest of the model file (what cache root keys mix in)."""
    return bytes.fromhex(file_fingerprint(path))


def _read(store: Path) -> dict:
    try:
        with open(store, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(store: Path, entries: dict) -> None:
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=store.parent, prefix=".fingerprints.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=0, sort_keys=True)
        os.replace(tmp, store)
    except OSError:
        pass
