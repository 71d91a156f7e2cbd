"""A model file's memory map in 2 MiB pages.

On a CPU a decode step reads every weight once, straight from the file's memory map (the
random 1.9B qwen3 test model: ~1.3 GB a token), so the step runs at the memory's rate. With
the map in 4 KiB pages the CPU walks the page tables every 4 KiB of that stream (its TLB
covers a few MiB); when the file's page cache is in 2 MiB folios, Linux maps each with one
entry (`FilePmdMapped` in /proc/PID/smaps). Measured on the 1.9B model (Zen 4, 2 threads,
the same model loaded from two copies of the file, decode rounds alternating in one
process): a decode step took 0.93x the time from a file in 2 MiB folios (quartiles
0.92-0.95, 12 rounds).

Whether the page cache holds a file in 2 MiB folios depends on how its pages came in: read
by a large readahead (a fresh mapping; ext4 and xfs on Linux 6.x) they are; written by a
process (a download, a copy, the test-model generator) they stay 4 KiB as long as they are
cached. `map_in_huge_pages` touches one byte per 2 MiB of the map and reads how much of it
Linux mapped in 2 MiB entries; when less than `REREAD_BELOW`, it drops the file's clean
cached pages (POSIX_FADV_DONTNEED: pages another process maps, or dirty ones, stay) and maps
the file afresh, so that it is read back in large folios: one extra read of the file, after
which later starts find it cached in large folios. Set KVSHARE_HUGE_PAGES=0 to leave the
map as it comes.

A file cached in large folios does not stay so: when the kernel reclaims some of its pages
(memory pressure, or proactive reclaim such as DAMON's `pageout`, which this project's VMs
run), what is read back later fills only the holes, in small folios. The 1.9B model's file,
fully in 2 MiB entries after a re-read, was found 82% so the next day and 61% two days
later; from 61% and from 100% (two copies of the file, decode rounds alternating in one
process) a step took 1.00x and 0.978x the time (quartiles 0.946-1.022, 12 rounds). Hence
the re-read below 90%, not below half: a partly reclaimed file is read once more at
startup (~1 s per GB from disk) for the whole life of the server.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from pathlib import Path

import numpy as np

HUGE = 2 << 20
# filesystems whose page cache takes large folios (Linux >= 6.x): a re-read elsewhere would
# come back in 4 KiB pages again, so it is not tried
_LARGE_FOLIO_FS = {"ext4", "xfs"}
# re-read the file when less of its map than this is in 2 MiB entries
REREAD_BELOW = 0.9


def enabled() -> bool:
    return os.environ.get("KVSHARE_HUGE_PAGES", "1").strip() not in ("0", "false", "no", "off")


def huge_fraction(mm: mmap.mmap) -> float:
    """Touch one byte per 2 MiB of the map (faulting in what is not yet mapped) and return the
    share of its whole 2 MiB stretches that Linux maps with 2 MiB entries (0.0 when the map's
    entry in /proc/self/smaps cannot be read)."""
    view = np.frombuffer(mm, dtype=np.uint8)
    try:
        addr = view.ctypes.data
        start = -(-addr // HUGE) * HUGE
        stop = (addr + view.size) // HUGE * HUGE
        if stop <= start:
            return 0.0
        # one read per 2 MiB: a fault maps the whole folio (or fault-around's 64 KiB)
        int(view[start - addr:stop - addr:HUGE].sum())
        pmd_kib = _smaps_field(addr, "FilePmdMapped")
    finally:
        del view
    return min(1.0, pmd_kib * 1024 / (stop - start)) if pmd_kib is not None else 0.0


def _smaps_field(addr: int, field: str) -> int | None:
    """`field` (kB) of the mapping that starts at `addr` in /proc/self/smaps."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    at = text.find(f"{addr:08x}-")
    if at < 0:
        return None
    m = re.compile(rf"^{field}:\s+(\d+) kB", re.M).search(text, at)
    nxt = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ", re.M).search(text, at + 1)
    if m is None or (nxt is not None and m.start() > nxt.start()):
        return None
    return int(m.group(1))


def _fs_type(path: Path) -> str | None:
    """The type of the filesystem that holds `path` (the longest mount point above it in
    /proc/self/mountinfo)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real = str(path.resolve())
    best, fs = -1, None
    for line in lines:
        left, _, right = line.partition(" - ")
        parts = left.split()
        if len(parts) < 5 or not right:
            continue
        point = parts[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, fs = len(point), right.split()[0]
    return fs


def map_in_huge_pages(path: Path, mm: mmap.mmap) -> tuple[mmap.mmap, float]:
    """The file's read-only map (`mm`, or a fresh one after its cached pages were dropped)
    and the share of it in 2 MiB entries. `mm` must have no buffer exported yet."""
    if not enabled() or len(mm) < 2 * HUGE:  # no whole 2 MiB stretch worth a re-read
        return mm, 0.0
    _ask_for_huge_pages(mm)
    frac = huge_fraction(mm)
    if frac >= REREAD_BELOW or _fs_type(path) not in _LARGE_FOLIO_FS or not hasattr(os, "posix_fadvise"):
        return mm, frac
    mm.close()
    with open(path, "rb") as f:
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())  # pages still dirty (a file just written) are not dropped
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        fresh = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    _ask_for_huge_pages(fresh)
    return fresh, huge_fraction(fresh)


def _ask_for_huge_pages(mm: mmap.mmap) -> None:
    """MADV_HUGEPAGE where Linux has it: faults on pages not yet cached read them in 2 MiB
    folios."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None:
        return
    with contextlib.suppress(OSError):
        mm.madvise(advise)
