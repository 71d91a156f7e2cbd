"""The array backend: NumPy on the CPU, CuPy on a CUDA device.

This is the only module that imports CuPy, and it does so lazily (only when a CUDA backend is
asked for), so the CPU path never needs CuPy installed. Everything else takes a `Backend` and
uses `backend.xp` for array code that is the same on both, or branches on `backend.is_gpu` at an
op's dispatch point (see `kvshare.ops`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class BackendError(RuntimeError):
    """The requested device cannot be used (no CuPy, no CUDA device, bad device string)."""


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "cuda"
    xp: Any = field(repr=False)  # numpy or cupy
    device_id: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.name == "cuda"

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """`a` as an array of this backend (copied to the device when needed)."""
        if self.is_gpu:
            with self.xp.cuda.Device(self.device_id):
                return self.xp.asarray(a, dtype=dtype)
        return np.asarray(a, dtype=dtype)

    def to_host(self, a: Any, out: np.ndarray | None = None) -> np.ndarray:
        """`a` as a NumPy array (copied from the device when it lives there). With `out`
        (C-contiguous, `a`'s shape and dtype): copied into `out`, one device-to-host copy on
        a GPU, and `out` returned."""
        if out is not None:
            if self.is_gpu:
                return self.xp.asnumpy(a, out=out)
            np.copyto(out, a)
            return out
        if self.is_gpu and isinstance(a, self.xp.ndarray):
            return self.xp.asnumpy(a)
        return np.asarray(a)

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device(self.device_id).synchronize()


CPU = Backend("cpu", np)


def get_backend(device: str | Backend | None = "cpu") -> Backend:
    """A backend for `device`: "cpu", "cuda", "cuda:N", or "auto" (CUDA when usable, else CPU)."""
    if isinstance(device, Backend):
        return device
    device = (device or "cpu").strip().lower()
    if device == "cpu":
        return CPU
    if device == "auto":
        try:
            return get_backend("cuda")
        except BackendError:
            return CPU
    if device == "cuda" or device.startswith("cuda:") or device == "gpu":
        dev_id = 0
        if device.startswith("cuda:"):
            try:
                dev_id = int(device.split(":", 1)[1])
            except ValueError as exc:
                raise BackendError(f"bad device string {device!r}") from exc
        try:
            import cupy  # noqa: PLC0415 - the one lazy CuPy import of the package
        except Exception as exc:  # ImportError, or a broken CUDA install
            raise BackendError(
                f"device {device!r} needs CuPy: pip install \"kvshare[gpu]\" ({exc})"
            ) from exc
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise BackendError(f"no usable CUDA device ({exc})") from exc
        if dev_id >= n:
            raise BackendError(f"CUDA device {dev_id} requested, {n} present")
        return Backend("cuda", cupy, dev_id)
    raise BackendError(f"unknown device {device!r} (expected cpu, cuda, cuda:N or auto)")


def cupy_module() -> Any:
    """The CuPy module, imported on first use. Needs no CUDA device (NVRTC, CuPy's compiler
    wrapper, works without one); raises `BackendError` when CuPy cannot be imported. For code
    that must reach CuPy itself (kernel loading, cuBLAS calls) without going through a
    `Backend`."""
    try:
        import cupy  # noqa: PLC0415 - lazy, like get_backend's
    except Exception as exc:
        raise BackendError(f"CuPy is not usable: pip install \"kvshare[gpu]\" ({exc})") from exc
    return cupy


# Steps of at least this many tokens are "big": their GEMMs run either on the multi-threaded
# BLAS pool or as row-parallel parts (ops.parallel); smaller steps (decode) run the kernels
# (Rust's `_core.qmatmul_t`, Numba's f32 small-batch one) on every core and BLAS on one thread.
# Multi-threaded BLAS and other threaded work must never overlap: OpenBLAS's workers spin for
# ~0.1 s after each call, and work launched meanwhile shares its cores with them (on 2 cores, a
# decode step at 6K context went from 54 ms to 288 ms).
BLAS_PARALLEL_MIN_TOKENS = 33  # ops.linear.Q_KERNEL_MAX follows from it


class _CpuThreads:
    """The CPU thread budget and the switch between the BLAS pool and the kernels' threads."""

    def __init__(self) -> None:
        self.max_threads = cpu_count()
        self._blas: list[Any] | None = None  # threadpoolctl controllers of the BLAS libraries
        self._blas_now: int | None = None
        self.kernel_threads = self.max_threads  # threads of the Rust kernels (kvshare._core)
        # (thread, threads) of the last _set_numba_threads call
        self._numba_now: tuple[int, int] | None = None

    def _blas_controllers(self) -> list[Any]:
        if self._blas is None:
            try:
                from threadpoolctl import ThreadpoolController  # noqa: PLC0415

                self._blas = list(ThreadpoolController().select(user_api="blas")
                                  .lib_controllers)
            except Exception:  # noqa: BLE001 - not installed or no BLAS found: nothing to set
                self._blas = []
        return self._blas

    def set_max(self, n: int | None) -> None:
        """The thread budget (None: one per usable core), applied to both pools now."""
        self.max_threads = max(1, int(n)) if n else cpu_count()
        self._blas_now = None
        self.set_blas(self.max_threads)
        self.kernel_threads = self.max_threads
        self._numba_now = (threading.get_ident(), self.max_threads)
        _set_numba_threads(self.max_threads)

    def set_blas(self, n: int) -> None:
        if n != self._blas_now:
            for lib in self._blas_controllers():
                lib.set_num_threads(n)
            self._blas_now = n

    def for_tokens(self, n_tokens: int, row_parallel: bool = False) -> int:
        """Set the pools for a step of `n_tokens` tokens; return the number of row-parallel
        parts the step should use (1: none). Big steps of models that allow it
        (`row_parallel`) run as parts on Python threads with a 1-thread BLAS (`ops.parallel`);
        other big steps give the cores to BLAS; small steps (decode) give them to the kernels."""
        big = n_tokens >= BLAS_PARALLEL_MIN_TOKENS
        parts = self.max_threads if big and row_parallel else 1
        self.set_blas(self.max_threads if big and parts == 1 else 1)
        kernel_threads = 1 if big and parts == 1 else self.max_threads
        # numba.set_num_threads costs ~20 us a call, and its setting is per thread
        now = (threading.get_ident(), kernel_threads)
        if now != self._numba_now:
            _set_numba_threads(kernel_threads)
            self._numba_now = now
        self.kernel_threads = kernel_threads
        return parts


def _set_numba_threads(n: int) -> None:
    try:
        import numba  # noqa: PLC0415
    except ImportError:
        return
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_cpu_threads(n: int | None) -> None:
    """Use at most `n` threads for CPU compute from now on (None: one per usable core). Each
    forward step then runs its GEMMs on up to `n` BLAS threads or its kernels on up to `n`
    threads, never both (`CPU_THREADS.for_tokens`)."""
    CPU_THREADS.set_max(n)


CPU_THREADS = _CpuThreads()
