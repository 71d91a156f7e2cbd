"""The CuPy plumbing every GPU op module shares (`kvshare.ops.gpu`, `kvshare.ops.gpu_blocks`):
kernels by name, launch grids, device attributes, host-to-device uploads, element strides, the
float32 row views the kernels read, and the f16 cuBLAS GEMM.

It sits below the op modules so that they need not import one another for it. Like them, it
imports nothing GPU-related at import time (CuPy comes from `kvshare.backend` on first use).
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from kvshare import kernels
from kvshare.backend import cupy_module

__all__ = [
    "ENTRY_POINTS", "declare_entry_points", "kernel", "device_id", "device_attr", "grid",
    "is_device", "upload", "host", "estrides", "f32_lastdim_view", "as_rows", "gemm_f16",
    "ELEMWISE_THREADS", "ROWS_PER_BLOCK", "MAX_GRID", "empty", "Workspace", "using",
    "capturing", "is_capturing", "FUSED_ENV", "fused_ops",
]

# Every kernel the GPU ops launch, by kernel module: each op module declares the ones it
# launches (tests/test_kernels_compile.py checks each against the compiled module), and
# `kernel` loads no other.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {}

ROWS_PER_BLOCK = 4  # rms_norm / row-scaled conversion: 128 threads, one warp per row
ELEMWISE_THREADS = 256
MAX_GRID = 65535 * 4  # grid-stride kernels: enough CTAs to fill any current GPU
UPLOAD_CACHE_SIZE = 64  # host arrays kept uploaded (and plans cached) by content

_lock = threading.Lock()
_kernel_cache: dict[tuple[str, str, int], Any] = {}
_upload_cache: OrderedDict = OrderedDict()
_device_attrs: dict[tuple[int, str], int] = {}
# cudaDeviceAttr codes, for CuPy versions whose Device.attributes lacks a name
_ATTR_CODES = {"MultiProcessorCount": 16, "MaxSharedMemoryPerBlockOptin": 97,
               "ComputeCapabilityMajor": 75, "ComputeCapabilityMinor": 76}

_CUDA_R_32F = 0  # cudaDataType_t values (library_types.h)
_CUDA_R_16F = 2
_CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0
_CUBLAS_OP_T = 1


FUSED_ENV = "KVSHARE_GPU_FUSED"


def fused_ops() -> bool:
    """Whether the GPU runs the decode step's fused ops: `qkv_rope_write` as one kernel, the
    block mat-vec adding into the residual stream (`linear_add`), the gate|up mat-vec with
    its activation (`linear_glu`). KVSHARE_GPU_FUSED=0 runs the op sequences they replace
    instead (the same values up to float32 rounding): the way around a device on which the
    fused kernels fail their tests (bench/gpu_check.sh switches them off then). Read at each
    call, as the other GPU switches, so that a test can flip it."""
    return os.environ.get(FUSED_ENV, "1") != "0"


def declare_entry_points(module: str, entries: tuple[str, ...]) -> None:
    """Add the kernels of kernel module `module` that an op module launches."""
    ENTRY_POINTS[module] = tuple(dict.fromkeys((*ENTRY_POINTS.get(module, ()), *entries)))


def kernel_units(roots: Any) -> list[tuple[str, str | None]]:
    """What a GPU model may launch, as kernel units (`(module, part)`) for
    `kernels.compile_parallel`: the parts its weights name (`kernel_parts()` of each weight
    reachable from `roots` through lists, tuples, dicts and attributes: a `GpuBlockWeight`'s
    block types, `GpuStackedExperts`' expert types), then every module that has no parts,
    whole (a few of which a model may never launch: they cost a thread's time, not the
    start's, where there are cores to spare)."""
    typed: set[tuple[str, str]] = set()
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(roots, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > 6:
            continue
        seen.add(id(obj))
        if hasattr(type(obj), "kernel_parts"):
            typed |= obj.kernel_parts()
            continue
        if isinstance(obj, (list, tuple)):
            kids: Any = obj
        elif isinstance(obj, dict):
            kids = obj.values()
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            kids = vars(obj).values()
        else:
            continue
        stack.extend((k, depth + 1) for k in kids)
    whole: list[tuple[str, str | None]] = [
        (name, None) for name in kernels.module_names() if kernels.parts(name) == (None,)]
    return [*sorted(typed), *whole]


def device_id() -> int:
    return int(cupy_module().cuda.runtime.getDevice())


def kernel(module: str, entry: str) -> Any:
    """Kernel `entry` of kernel module `module` on the current device (compiled once)."""
    if entry not in ENTRY_POINTS.get(module, ()):
        raise KeyError(f"{entry!r} is not a listed entry point of kernel module {module!r}")
    key = (module, entry, device_id())
    fn = _kernel_cache.get(key)
    if fn is None:
        with _lock:
            fn = _kernel_cache.get(key)
            if fn is None:
                fn = kernels.get_function(module, entry)
                _kernel_cache[key] = fn
    prof = _profile
    return fn if prof is None else _TimedKernel(fn, entry, prof)


def device_attr(name: str) -> int:
    """A device attribute of the current device (cached): MultiProcessorCount,
    MaxSharedMemoryPerBlockOptin, ComputeCapabilityMajor / Minor."""
    dev = device_id()
    key = (dev, name)
    v = _device_attrs.get(key)
    if v is None:
        cp = cupy_module()
        try:
            v = int(cp.cuda.Device(dev).attributes[name])
        except (KeyError, AttributeError):
            v = int(cp.cuda.runtime.deviceGetAttribute(_ATTR_CODES[name], dev))
        _device_attrs[key] = v
    return v


def grid(total: int, threads: int = ELEMWISE_THREADS) -> tuple[int, int, int]:
    """The grid of a grid-stride kernel over `total` items, `threads` per CTA."""
    return (max(1, min(MAX_GRID, -(-int(total) // threads))), 1, 1)


def is_device(a: Any) -> bool:
    return isinstance(a, cupy_module().ndarray)


def upload(a: Any, dtype: Any) -> Any:
    """`a` as a C-contiguous device array of `dtype`. Host arrays are cached by content (the
    same block tables / slots / tiles are uploaded once for all layers of a forward call).
    A host array during a graph capture raises: the graph would keep whatever the upload
    gave at capture time (a step's inputs must come from the graph's input buffers)."""
    cp = cupy_module()
    if isinstance(a, cp.ndarray):
        return cp.ascontiguousarray(a, dtype=dtype)
    if is_capturing():
        raise RuntimeError("a host array reached a GPU op during CUDA graph capture (it would "
                           "become a constant of the graph)")
    h = np.ascontiguousarray(a, dtype=dtype)
    key = (device_id(), h.dtype.str, h.shape, h.tobytes())
    with _lock:
        d = _upload_cache.get(key)
        if d is not None:
            _upload_cache.move_to_end(key)
            return d
    d = cp.asarray(h)
    with _lock:
        _upload_cache[key] = d
        while len(_upload_cache) > UPLOAD_CACHE_SIZE:
            _upload_cache.popitem(last=False)
    return d


def host(a: Any, dtype: Any = None) -> np.ndarray:
    """`a` as a NumPy array (copied from the device when it is there)."""
    if is_device(a):
        a = cupy_module().asnumpy(a)
    return np.asarray(a, dtype=dtype)


def estrides(a: Any) -> tuple[int, ...]:
    """Strides in elements (every array here has element-aligned strides)."""
    it = a.dtype.itemsize
    return tuple(int(s) // it for s in a.strides)


def f32_lastdim_view(a: Any, ndim: int) -> Any:
    """`a` unchanged when it is a float32 device array of `ndim` dims with unit stride along the
    last axis (any other strides), else a C-contiguous float32 copy."""
    cp = cupy_module()
    if (isinstance(a, cp.ndarray) and a.dtype == np.float32 and a.ndim == ndim
            and (a.shape[-1] <= 1 or a.strides[-1] == 4)
            and all(s % 4 == 0 for s in a.strides)):
        return a
    return cp.ascontiguousarray(cp.asarray(a), dtype=np.float32)


def as_rows(a: Any) -> Any:
    """A 2-D float32 view with unit column stride (a copy only when needed)."""
    cp = cupy_module()
    if not isinstance(a, cp.ndarray):
        a = cp.asarray(a)
    if a.ndim != 2:
        a = cp.ascontiguousarray(a, dtype=np.float32).reshape(-1, a.shape[-1] if a.ndim else 1)
    return f32_lastdim_view(a, 2)


def gemm_f16(x16: Any, w: Any, y: Any, col: int = 0) -> None:
    """y[:, col : col + t] = x16[N, k] @ w[t, k].T, both f16 C-contiguous, into y a
    C-contiguous float32 `[N, n_out]`, float32 accumulation (cublasGemmEx). Column-major
    view: y^T = w . x16^T, i.e. m = t, n = N, k = k, A = w read transposed (lda = k),
    B = x16^T (ldb = k), C offset by `col` with ldc = n_out."""
    if _profile is not None:
        with _profile.span("cublas_gemm_f16"):
            _gemm_f16(x16, w, y, col)
    else:
        _gemm_f16(x16, w, y, col)


def _gemm_f16(x16: Any, w: Any, y: Any, col: int) -> None:
    cp = cupy_module()
    cublas = cp.cuda.cublas
    n, k = (int(s) for s in x16.shape)
    t = int(w.shape[0])
    ldc = int(y.shape[1])
    handle = cp.cuda.device.get_cublas_handle()
    one = np.ones(1, np.float32)
    zero = np.zeros(1, np.float32)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0))
    try:
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.gemmEx(handle, getattr(cublas, "CUBLAS_OP_T", _CUBLAS_OP_T),
                      getattr(cublas, "CUBLAS_OP_N", _CUBLAS_OP_N), t, n, k,
                      one.ctypes.data, w.data.ptr, _CUDA_R_16F, k,
                      x16.data.ptr, _CUDA_R_16F, k,
                      zero.ctypes.data, y.data.ptr + 4 * col, _CUDA_R_32F, ldc,
                      getattr(cublas, "CUBLAS_COMPUTE_32F", _CUBLAS_COMPUTE_32F),
                      getattr(cublas, "CUBLAS_GEMM_DEFAULT", _CUBLAS_GEMM_DEFAULT))
    finally:
        cublas.setPointerMode(handle, mode)


# --- workspaces: the intermediates of a captured step ---------------------------------------

_tls = threading.local()
WORKSPACE_ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (float4 loads)


class Workspace:
    """Device memory for the arrays a step's ops create (`empty`), handed out in order from
    one buffer: a CUDA graph keeps the addresses its kernels were captured with, so a step
    that is replayed must get the same buffers at every replay, and nothing may be
    allocated while it is captured. The same sequence of requests gets the same offsets, so
    a step run once to measure (`buf` None: ordinary allocations, offsets only counted)
    and then captured lays out identically. `mark` / `release` give back everything taken
    since the mark (a layer's intermediates, once the layer has added into the residual
    stream). Not thread-safe: one step at a time."""

    def __init__(self) -> None:
        self.buf: Any = None
        self.off = 0
        self.peak = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else int(self.buf.nbytes)

    def reserve(self, nbytes: int) -> None:
        """A buffer of at least `nbytes` (a new one: whatever referred to the old one, a
        captured graph included, must be dropped by the caller)."""
        n = -(-max(int(nbytes), 1) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
        raw = cupy_module().empty(n + WORKSPACE_ALIGN, np.uint8)
        skip = -raw.data.ptr % WORKSPACE_ALIGN  # CuPy's pool aligns already; others may not
        self.buf = raw[skip : skip + n]

    def reset(self) -> None:
        self.off = 0
        self.peak = 0

    def take(self, shape: Any, dtype: Any) -> Any:
        # (a step takes hundreds of arrays: this is kept to a few Python operations)
        shape = (int(shape),) if not isinstance(shape, (tuple, list)) else tuple(shape)
        dt = np.dtype(dtype)
        n = dt.itemsize * math.prod(shape)
        off = self.off
        self.off = end = off + -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
        if end > self.peak:
            self.peak = end
        buf = self.buf
        if buf is None:
            return cupy_module().empty(shape, dt)
        if end > buf.nbytes:
            raise MemoryError(f"workspace of {buf.nbytes} bytes exhausted (needs {end})")
        return buf[off : off + n].view(dt).reshape(shape)

    def mark(self) -> int:
        return self.off

    def release(self, mark: int) -> None:
        self.off = mark


class using:  # noqa: N801 - a context manager used like a function
    """`with using(ws):` the ops' `empty` takes from `ws` in this thread."""

    def __init__(self, ws: Workspace | None):
        self.ws = ws

    def __enter__(self) -> Workspace | None:
        self.prev = getattr(_tls, "ws", None)
        _tls.ws = self.ws
        return self.ws

    def __exit__(self, *exc: Any) -> None:
        _tls.ws = self.prev


def empty(shape: Any, dtype: Any) -> Any:
    """A new device array for an op's result or scratch: from the active `Workspace` when a
    step runs in one (`using`), else CuPy's pool."""
    ws = getattr(_tls, "ws", None)
    if ws is not None:
        return ws.take(shape, dtype)
    return cupy_module().empty(shape, dtype)


class capturing:  # noqa: N801
    """`with capturing():` marks this thread as capturing a CUDA graph (`upload` refuses host
    arrays then)."""

    def __enter__(self) -> None:
        self.prev = getattr(_tls, "capturing", False)
        _tls.capturing = True

    def __exit__(self, *exc: Any) -> None:
        _tls.capturing = self.prev


def is_capturing() -> bool:
    return bool(getattr(_tls, "capturing", False))


# --- kernel profile: device time per kernel over eager steps ----------------------------------

_profile: KernelProfile | None = None


class KernelProfile:
    """Device time per kernel entry point (and cuBLAS GEMM) while active (`with
    kernel_profile() as prof:`): a pair of CUDA events on the current stream around each
    launch that goes through `kernel` or `gemm_f16`. Launches of CuPy's own kernels
    (elementwise ops, copies) are not timed: a step's device time less the sum of its
    kernels' holds them and the device's idle time between launches.
    An event pair measures a kernel alone only when the device is never idle between the
    host's launches (bench/gpu_kernel_profile.py queues a long-running kernel first); eager
    steps only (a graph being captured refuses it)."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Any, Any]] = []
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def span(self, name: str) -> _ProfileSpan:
        """`with prof.span(name):` times the device work launched inside under `name`."""
        if is_capturing():
            raise RuntimeError("a kernel profile times eager launches; this thread captures")
        return _ProfileSpan(self, name)

    def collect(self) -> dict[str, tuple[int, float]]:
        """Waits for the device, then returns {name: (calls, milliseconds)} over every span
        so far."""
        cp = cupy_module()
        for name, a, b in self.pending:
            b.synchronize()
            self.ms[name] = self.ms.get(name, 0.0) + float(cp.cuda.get_elapsed_time(a, b))
            self.calls[name] = self.calls.get(name, 0) + 1
        self.pending.clear()
        return {n: (self.calls[n], self.ms[n]) for n in self.ms}


class _ProfileSpan:
    __slots__ = ("prof", "name", "start")

    def __init__(self, prof: KernelProfile, name: str):
        self.prof, self.name = prof, name

    def __enter__(self) -> None:
        self.start = cupy_module().cuda.Event()
        self.start.record()

    def __exit__(self, *exc: Any) -> None:
        stop = cupy_module().cuda.Event()
        stop.record()
        self.prof.pending.append((self.name, self.start, stop))


class _TimedKernel:
    """A kernel whose launches a `KernelProfile` times (attributes reach the kernel)."""

    __slots__ = ("_fn", "_name", "_prof")

    def __init__(self, fn: Any, name: str, prof: KernelProfile):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_prof", prof)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._prof.span(self._name):
            return self._fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)


class kernel_profile:  # noqa: N801 - a context manager used like a function
    """`with kernel_profile() as prof:` times this process's kernel launches (one profile at
    a time; `KernelProfile`)."""

    def __enter__(self) -> KernelProfile:
        global _profile
        if _profile is not None:
            raise RuntimeError("a kernel profile is already active")
        _profile = KernelProfile()
        return _profile

    def __exit__(self, *exc: Any) -> None:
        global _profile
        _profile = None
