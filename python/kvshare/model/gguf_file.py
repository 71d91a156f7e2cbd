"""Reading GGUF metadata: the key/value header as plain Python values.

Tensor loading and dequantization live in `weights.py`; this module is just the header, so the
tokenizer and chat template can be built without touching tensor data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader


class GGUFError(ValueError):
    """The file is not a readable GGUF file (truncated, corrupt, wrong magic, ...)."""


def open_reader(path: str | Path) -> GGUFReader:
    """Open a GGUF file memory-mapped, turning the library's assorted failures into GGUFError."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"model file not found: {path}")
    try:
        return GGUFReader(str(path), "r")
    except Exception as exc:  # gguf raises ValueError/struct.error/IndexError on bad files
        raise GGUFError(f"{path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from exc


def read_metadata(reader_or_path: GGUFReader | str | Path) -> dict[str, Any]:
    """All header fields as {GGUF key: str | int | float | bool | list}, arrays as Python lists."""
    reader = reader_or_path if isinstance(reader_or_path, GGUFReader) else open_reader(reader_or_path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except Exception as exc:
            raise GGUFError(f"cannot decode GGUF field {key!r}: {exc}") from exc
        meta[key] = value
    return meta
