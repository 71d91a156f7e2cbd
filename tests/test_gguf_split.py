"""Split GGUFs (llama.cpp's gguf-split layout: `NAME-0000k-of-0000N.gguf`, every part a GGUF
with `split.no`, `split.count` and `split.tensors.count`, the model's metadata in the first):
opened from the first part, the same tensors, metadata and logits as the one-file model; a
missing part is one clear error."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kvshare.model.gguf_file import GGUF_MAGIC, GGUFError, GGUFFile, _Cursor

TINY = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"
ALIGN = 32


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, fmt: str, vtype: int, value: int) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + struct.pack(fmt, value)


def write_split(src: Path, out_dir: Path, n_parts: int) -> list[Path]:
    """`src` as llama.cpp's gguf-split writes it: tensors in order over `n_parts` files."""
    buf = src.read_bytes()
    cur = _Cursor(memoryview(buf))
    cur.pos = 8
    cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    kv_start = cur.pos
    for _ in range(n_kv):
        cur.string()
        cur.value(cur.unpack("<I"))
    model_kv = buf[kv_start:cur.pos]
    gf = GGUFFile(src)
    assert int(gf.metadata.get("general.alignment", ALIGN)) == ALIGN
    names = list(gf.tensors)
    groups = np.array_split(np.arange(len(names)), n_parts)
    paths = []
    for i, idx in enumerate(groups):
        kv = (model_kv if i == 0 else b"") + _kv("split.no", "<H", 2, i) + \
            _kv("split.count", "<H", 2, n_parts) + _kv("split.tensors.count", "<i", 5, len(names))
        n = (n_kv if i == 0 else 0) + 3
        infos, data = b"", b""
        for j in idx:
            t = gf.tensors[names[j]]
            infos += _str(t.name) + struct.pack("<I", len(t.shape)) + \
                b"".join(struct.pack("<Q", d) for d in t.shape) + \
                struct.pack("<IQ", int(t.qtype), len(data))
            data += bytes(gf.raw(t.name)) + b"\0" * (-t.n_bytes % ALIGN)
        head = GGUF_MAGIC + struct.pack("<IQQ", 3, len(idx), n) + kv + infos
        head += b"\0" * (-len(head) % ALIGN)
        p = out_dir / f"tiny-{i + 1:05d}-of-{n_parts:05d}.gguf"
        p.write_bytes(head + data)
        paths.append(p)
    gf.close()
    return paths


def test_split_opens_from_its_first_part(tmp_path):
    parts = write_split(TINY, tmp_path, 3)
    one, split = GGUFFile(TINY), GGUFFile(parts[0])
    assert set(split.tensors) == set(one.tensors)
    assert {t.part for t in split.tensors.values()} == {0, 1, 2}
    for name in one.tensors:
        assert bytes(split.raw(name)) == bytes(one.raw(name)), name
    extra = {k: v for k, v in split.metadata.items() if k not in one.metadata}
    assert extra == {"split.no": 0, "split.count": 3, "split.tensors.count": len(one.tensors)}
    with pytest.raises(GGUFError, match="first part"):
        GGUFFile(parts[1])
    parts[2].unlink()
    with pytest.raises(GGUFError, match="part 3 of 3 is missing"):
        GGUFFile(parts[0])


def test_split_model_has_the_same_logits(tmp_path):
    from kvshare.model.batch import SeqChunk
    from kvshare.model.loader import load_model

    parts = write_split(TINY, tmp_path, 2)
    toks = np.arange(2, 30)

    def logits(path):
        m = load_model(path)
        out = m.forward([SeqChunk(toks, 0, np.arange(2))], m.new_cache(2, 16))
        return np.asarray(out).copy()

    np.testing.assert_array_equal(logits(parts[0]), logits(TINY))
