"""A model file mapped in 2 MiB pages (`kvshare.model.huge_pages`): a file just written (its
page cache in 4 KiB pages), or one partly reclaimed and read back in small pieces, comes back
mapped in 2 MiB entries, with the same bytes."""

import os
import platform
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvshare.model import huge_pages
from kvshare.model.gguf_file import GGUFFile

MIB = 1 << 20


def _kernel() -> tuple[int, int]:
    try:
        major, minor = platform.release().split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def _large_folios(path: Path) -> bool:
    """Whether this machine's page cache can hold `path` in large folios: Linux, ext4 from
    6.16 (its large folio support), xfs from 5.18."""
    fs = huge_pages._fs_type(path)
    need = {"ext4": (6, 16), "xfs": (5, 18)}.get(fs or "")
    return platform.system() == "Linux" and need is not None and _kernel() >= need


def _need_large_folios(path: Path) -> None:
    if not _large_folios(path):
        pytest.skip(f"no large folios for {huge_pages._fs_type(path)} on {platform.release()}")


def _write_gguf(path: Path, mib: int, seed: int) -> np.ndarray:
    """A GGUF file of one `mib` MiB tensor, written 4 KiB at a time (as a download streams
    in): its page cache in small folios."""
    data = np.random.default_rng(seed).standard_normal(mib * MIB // 4).astype(np.float32)
    staged = path.with_suffix(".staged")
    w = gguf.GGUFWriter(str(staged), "llama")
    w.add_tensor("blob", data.reshape(-1, 1024))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _copy_in_small_writes(staged, path)
    staged.unlink()
    return data


def _copy_in_small_writes(src: Path, dst: Path) -> None:
    with open(src, "rb") as i, open(dst, "wb") as o:
        while chunk := i.read(4096):
            o.write(chunk)
            o.flush()


def test_a_file_just_written_is_mapped_in_huge_pages(tmp_path):
    _need_large_folios(tmp_path)
    path = tmp_path / "blob.gguf"
    data = _write_gguf(path, 24, seed=1)
    # written in small pieces: cached in small folios, mapped in 4 KiB entries
    plain = GGUFFile(path)
    assert huge_pages.huge_fraction(plain._map) < 0.5
    plain.close()
    f = GGUFFile(path, huge_pages=True)
    assert f.huge_fraction >= 0.9, f.huge_fraction
    np.testing.assert_array_equal(f.raw("blob").view(np.float32), data)
    f.close()
    # a later open finds the file cached in large folios: mapped in 2 MiB entries at once
    again = GGUFFile(path)
    assert huge_pages.huge_fraction(again._map) >= 0.9
    again.close()


def _read_back_in_small_folios(path: Path, start: int) -> None:
    """Drop the file's cached pages from `start` on and read them back 4 KiB at a time with
    readahead off (POSIX_FADV_RANDOM): cached again, in small folios, as the holes a reclaim
    leaves are filled."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, start, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, start, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size
        for off in range(start, size, 4096):
            os.pread(fd, 4096, off)
    finally:
        os.close(fd)


def test_a_partly_reclaimed_file_is_read_again(tmp_path):
    """A file cached in large folios, then its last 10 MiB reclaimed and read back in small
    folios (~60% of its map in 2 MiB entries: over half, under `REREAD_BELOW`): loading
    re-reads it into 2 MiB entries again, with the same bytes."""
    _need_large_folios(tmp_path)
    path = tmp_path / "blob.gguf"
    data = _write_gguf(path, 24, seed=3)
    f = GGUFFile(path, huge_pages=True)
    assert f.huge_fraction >= 0.9, f.huge_fraction
    f.close()
    _read_back_in_small_folios(path, 14 * MIB)
    plain = GGUFFile(path)
    part = huge_pages.huge_fraction(plain._map)
    plain.close()
    assert 0.5 < part < huge_pages.REREAD_BELOW, part
    f = GGUFFile(path, huge_pages=True)
    assert f.huge_fraction >= 0.9, f.huge_fraction
    np.testing.assert_array_equal(f.raw("blob").view(np.float32), data)
    f.close()


def test_switched_off_the_map_is_left_as_it_comes(tmp_path, monkeypatch):
    path = tmp_path / "blob.gguf"
    data = _write_gguf(path, 6, seed=2)
    monkeypatch.setenv("KVSHARE_HUGE_PAGES", "0")
    f = GGUFFile(path, huge_pages=True)
    assert f.huge_fraction == 0.0
    np.testing.assert_array_equal(f.raw("blob").view(np.float32), data)
    f.close()


def test_fs_type_names_the_filesystem_of_a_path(tmp_path):
    if not os.path.exists("/proc/self/mountinfo"):
        pytest.skip("no /proc/self/mountinfo")
    assert huge_pages._fs_type(Path("/proc/self")) == "proc"
    assert huge_pages._fs_type(tmp_path) is not None


def test_a_model_copied_in_small_writes_loads_in_huge_pages_with_the_same_logits(
        tmp_path, monkeypatch):
    """Gemma 3 270M from a copy of its file written 4 KiB at a time: loaded with the map left
    alone and then re-read into 2 MiB pages, the same logits."""
    from kvshare.model.batch import SeqChunk
    from kvshare.model.loader import default_model_path, load_model

    src = Path(default_model_path())
    if not src.is_file():
        pytest.skip("Gemma 3 270M is not in the model cache")
    path = tmp_path / "model.gguf"
    _copy_in_small_writes(src, path)
    toks = np.arange(2, 40)

    def logits():
        m = load_model(path)
        out = m.forward([SeqChunk(toks, 0, np.arange(3))], m.new_cache(3, 16))
        return m.huge_page_fraction, np.asarray(out).copy()

    monkeypatch.setenv("KVSHARE_HUGE_PAGES", "0")
    frac0, ref = logits()
    assert frac0 == 0.0
    monkeypatch.setenv("KVSHARE_HUGE_PAGES", "1")
    frac1, got = logits()
    np.testing.assert_array_equal(got, ref)
    if _large_folios(tmp_path):
        assert frac1 >= 0.9, frac1
