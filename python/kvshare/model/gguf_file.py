"""A GGUF file: its key/value header as plain Python values, its tensor directory, and a
read-only memory map of the tensor data.

The `gguf` package's `GGUFReader` builds a Python object per vocabulary string and takes ~20 s
on a 262K-token vocabulary; this parser reads the same format in well under a second (numeric
arrays straight into NumPy) and still uses `gguf` for the type constants and dequantization.
Dequantization and weight layout live in `weights.py`.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvshare.model.huge_pages import map_in_huge_pages

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "|b1"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a readable GGUF file (missing, truncated, corrupt, wrong magic, ...)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first (ne[0], ne[1], ...)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int
    part: int = 0  # which file of a split GGUF holds it (0: the first, or the only one)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """Row-major shape (slowest dimension first), as the dequantized array is laid out."""
        return tuple(reversed(self.shape))


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise GGUFError("string runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFError("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos = end
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"unknown GGUF value type {vtype}")


_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class GGUFFile:
    """An open GGUF file. `metadata` maps GGUF keys to Python values (arrays as lists);
    `tensors` maps tensor names to `TensorInfo`; `raw(name)` is a zero-copy view of the bytes.

    A split GGUF (`NAME-00001-of-00003.gguf`, as llama.cpp's gguf-split writes it, metadata
    `split.count`) opens from its first part: the other parts are found beside it by name and
    their tensors join `tensors`; the metadata is the first part's."""

    def __init__(self, path: str | Path, *, huge_pages: bool = False):
        """`huge_pages`: map the file in 2 MiB pages where Linux can (`huge_pages.py`; for
        a model whose weights are read from the map at every step)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # empty file
                raise GGUFError(f"{self.path}: not a valid GGUF file (empty)") from exc
        # the share of the map in 2 MiB entries (0.0: not asked for, or none)
        self.huge_fraction = 0.0
        if huge_pages:
            self._map, self.huge_fraction = map_in_huge_pages(self.path, self._map)
        self._maps = [self._map]
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self.metadata = self._parse(self.path, self._map, 0)
            n_parts = int(self.metadata.get("split.count", 1) or 1)
            for i in range(1, n_parts):
                self._open_part(i, n_parts)
        except GGUFError:
            self.close()
            raise
        except (struct.error, ValueError, KeyError, OverflowError) as exc:
            self.close()
            raise GGUFError(f"{self.path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from exc

    def _open_part(self, i: int, n_parts: int) -> None:
        m = _SPLIT_NAME.search(self.path.name)
        if m is None or int(m.group(1)) != 1 or int(m.group(2)) != n_parts:
            raise GGUFError(f"{self.path}: a split GGUF of {n_parts} files opens from its "
                            f"first part, named NAME-00001-of-{n_parts:05d}.gguf")
        part = self.path.with_name(_SPLIT_NAME.sub(f"-{i + 1:05d}-of-{n_parts:05d}.gguf",
                                                   self.path.name))
        if not part.is_file():
            raise GGUFError(f"{self.path}: part {i + 1} of {n_parts} is missing ({part})")
        with open(part, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps.append(mm)
        self._parse(part, mm, i)

    def _parse(self, path: Path, buf: mmap.mmap, part: int) -> dict[str, Any]:
        """The file's metadata; its tensors are added to `tensors`."""
        cur = _Cursor(memoryview(buf))
        if bytes(cur.buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        if part == 0:
            self.version = version
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
            qtype = GGMLQuantizationType(cur.unpack("<I"))
            offset = cur.unpack("<Q")
            infos.append((name, shape, qtype, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(shape)) if shape else 1
            if n_elems % block:
                raise GGUFError(f"tensor {name}: {n_elems} elements not a multiple of {block}")
            n_bytes = n_elems // block * type_size
            start = data_start + offset
            if start + n_bytes > len(buf):
                raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, shape, qtype, start, n_bytes, part)
        return metadata

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a read-only uint8 view of the memory map."""
        info = self.tensors[name]
        return np.frombuffer(self._maps[info.part], dtype=np.uint8, count=info.n_bytes,
                             offset=info.offset)

    def close(self) -> None:
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still exported keeps its map
                m.close()


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The header of a GGUF file as {key: value}; tensor data is not touched."""
    return GGUFFile(path).metadata
