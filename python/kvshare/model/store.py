"""The model store: the folder models are downloaded into (`--model-store DIR`,
`$KVSHARE_MODEL_STORE`, older names `--model-cache` / `$KVSHARE_MODEL_CACHE`; else
`$XDG_CACHE_HOME/kvshare/models`, else `~/.cache/kvshare/models`), and what every fetch into
it shares: one fetch per folder at a time, fsynced renames, the progress bar."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

STORE_ENV = "KVSHARE_MODEL_STORE"
OLD_STORE_ENV = "KVSHARE_MODEL_CACHE"  # the older name, still read


class FetchError(Exception):
    """A model cannot be resolved or fetched (one line, for the user)."""


class ModelNotFound(FetchError):
    """The name names nothing that exists: no such file, catalog model, repository or
    quantization (a usage error, exit 2)."""


def store_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    for name in (STORE_ENV, OLD_STORE_ENV):
        if env.get(name):
            return Path(env[name]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvshare" / "models"


def store_root(store: str | Path | None = None) -> Path:
    """The folder `--model-store` names, else the default one (`store_dir`)."""
    return Path(store).expanduser() if store else store_dir()


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """One fetch into this folder at a time (an advisory lock; none on platforms without
    fcntl)."""
    try:
        import fcntl  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        yield
        return
    with open(root / ".lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm  # noqa: PLC0415

    tty = sys.stderr.isatty()
    # kept when done (leave): to a file or a pipe a bar that clears itself leaves its last
    # state without a newline, and the next log line ran on after it
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                file=sys.stderr, disable=not enabled, mininterval=0.2 if tty else 5.0,
                leave=True)
