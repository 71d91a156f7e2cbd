"""Row-parallel CPU execution of one forward step's NumPy work.

A prefill step on the CPU is GEMMs (OpenBLAS) plus elementwise work and attention (NumPy),
and NumPy runs single-threaded. Instead of a multi-threaded BLAS (whose idle workers spin and
leave the elementwise work one core), the step's token rows are split into one part per
thread, each part runs its whole chain (norms, projections with a 1-thread BLAS, rope, MLP) on
its own Python thread, and attention tiles are spread the same way. NumPy and OpenBLAS release
the GIL inside their loops, so the parts run concurrently. On 2 cores this turns the ~45% of a
prefill step that was single-threaded into parallel work at the same GEMM rate.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


class RowParallel:
    """A small pool that runs `fn` over items concurrently (the first on the calling thread)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0
        self._lock = threading.Lock()

    def inside(self) -> bool:
        """Whether the calling thread is running a part of a `run` with several parts (its
        kernels should then use one thread: the other parts hold the other cores)."""
        return getattr(_PART, "active", False)

    def run(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        if len(items) <= 1:
            return [fn(it) for it in items]
        fn = _as_part(fn)
        with self._lock:
            if self._pool is None or self._workers < len(items) - 1:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._workers = len(items) - 1
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvshare-rows")
            pool = self._pool
        futures = [pool.submit(fn, it) for it in items[1:]]
        try:
            first = fn(items[0])
        finally:
            rest = [f.result() for f in futures]  # wait for all, even when ours failed
        return [first, *rest]


_PART = threading.local()


def _as_part(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def part(item: Any) -> Any:
        was = getattr(_PART, "active", False)
        _PART.active = True
        try:
            return fn(item)
        finally:
            _PART.active = was
    return part


def split_rows(n: int, parts: int) -> list[slice]:
    """`parts` contiguous, near-equal row ranges covering `[0, n)` (fewer when n is small)."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


ROWS = RowParallel()
