"""A CPU stand-in for the subset of CuPy that kvshare's GPU path uses, to run the real CUDA
sources and `kvshare.ops.gpu` without a GPU (see docs/gpu.md, "Verification"):

- device arrays are a NumPy subclass (`ndarray`, with `.data.ptr`); `empty` poisons floats
  with NaN like uninitialised device memory;
- `RawModule(code)` compiles the NVRTC source with g++ against `shim.h` (one ucontext fiber
  per CUDA thread, barriers and shuffles through a scheduler that aborts on deadlock, shared
  memory poisoned before each block) and launches kernels through ctypes, checking grid,
  block and shared-memory limits (dynamic shared memory above 48 KB needs the opt-in);
- cuBLAS `gemmEx` is a column-major NumPy GEMM over the raw pointers (checks leading dims).
- streams and CUDA graphs as CuPy 14 has them (`cuda.Stream`, `Stream.begin_capture` /
  `end_capture`, `cuda.graph.Graph.launch`): while a stream captures, kernel launches, cuBLAS
  calls, in-place array operations and device-to-device copies issued on it are recorded, not
  run, with their arguments taken by value (pointers included) as CUDA takes them, and
  `Graph.launch` replays them in order. What breaks a capture on a GPU raises here: any
  allocation (`empty`, `zeros`, copies, an array operation without `out`), any
  device-to-host read (`get`, `asnumpy`, `int()` / `float()` / `bool()` of a device array,
  `synchronize`), any host-to-device copy, and work issued on another stream. A replay whose
  recorded pointer belongs to an allocation freed since the capture raises too (on a GPU it
  would write freed memory).

- page-locked host memory (`cuda.alloc_pinned_memory`) and asynchronous host-to-device copies
  from it (`ndarray.set(arr, stream=s)`): the copy is done at once, as the device would do it
  when its turn comes, and stays pending until the host knows it done (an event recorded
  after it synchronized or queried done, a stream or device synchronize, a blocking read of
  device memory). A pending copy whose host bytes changed before then raises (on a GPU the
  copy might have read the new bytes): the host wrote a staging buffer the device may not
  have read yet. Asynchronous device-to-host copies into it (`asnumpy(a, out=pinned,
  blocking=False)`, `a.get(stream=s, out=pinned, blocking=False)`) land only when the host
  knows them done: until then the host buffer holds poison (a read too early gets 0xFF
  bytes), and a device source freed before then raises.

`KVSHARE_EMU_ORDER=reverse` (or `shuffle`, seeded by `KVSHARE_EMU_SEED`) resumes a block's
fibers in reverse thread order (a new random order each pass) instead of thread order: a
kernel that reads what another of its threads wrote without a barrier between gets the old
value in one of the two orders, as a GPU may (docs/gpu.md, "Verification").

`KVSHARE_EMU_SANITIZE=1` builds the kernels with UndefinedBehaviorSanitizer (`_sanitize_flags`):
misaligned loads, over-wide shifts, signed overflow and out-of-bounds fixed-size arrays
abort with the source line.

`KVSHARE_EMU_NOOP=1` checks and records launches without running them, for measuring the
host's side of a step (`bench/gpu_host_cost.py`, which reads `COUNTS`: the launches, GEMMs,
array operations, graph launches and copies the host issued, and the seconds this module's
own plumbing took).

Not a test module: `PYTHONPATH=tests/gpu_emu python -m pytest -p emu_plugin tests/test_ops_gpu.py`
installs it as `cupy` (the `gpu` tests then run instead of skipping). Needs g++ >= 12
(`_Float16`) on x86-64 Linux.
"""
import ctypes, hashlib, os, re, subprocess, sys, tempfile, threading, time, types
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(tempfile.gettempdir(), "kvshare-gpu-emu"); os.makedirs(BUILD, exist_ok=True)

# ---- the real CuPy's API, which the stand-in holds kvshare to ----
# NumPy accepts what CuPy refuses: a function CuPy lacks, a keyword its function does not take,
# a host array beside a device one in an operation. Each would pass here and fail on a GPU,
# so the names, keywords and operand rules below are read off the installed CuPy (in a
# subprocess: this module takes its name), cached per version. Without CuPy installed the
# checks are off, unless KVSHARE_EMU_CUPY_API=require (CI) makes that an error.
_API_SCRIPT = r"""
import inspect, json, sys
import cupy
def spec(f):
    if type(f).__name__ == "ufunc":
        return {"kind": "ufunc"}
    if not callable(f) or isinstance(f, type):
        return {"kind": "other"}
    try:
        ps = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return {"kind": "function", "params": None}
    if any(p.kind is p.VAR_KEYWORD for p in ps):
        return {"kind": "function", "params": None}
    return {"kind": "function", "params": [p.name for p in ps if p.kind is not p.VAR_POSITIONAL]}
api = {"version": cupy.__version__,
       "numpy": {n: spec(getattr(cupy, n)) for n in dir(cupy) if not n.startswith("_")},
       "numpy.linalg": {n: spec(getattr(cupy.linalg, n)) for n in dir(cupy.linalg)
                        if not n.startswith("_")},
       "ndarray": sorted(dir(cupy.ndarray))}
json.dump(api, sys.stdout)
"""

def _cupy_dist():
    """The installed CuPy distribution and version ("cupy-cuda12x_14.2.0"), from its metadata
    (nothing imported), or "" without one: the cache key of its API."""
    import importlib.metadata as m
    for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy"):
        try:
            return f"{d}_{m.version(d)}"
        except m.PackageNotFoundError:
            pass
    return ""

def _load_api():
    import json
    mode = os.environ.get("KVSHARE_EMU_CUPY_API", "on")
    if mode == "off":
        return None
    ver = _cupy_dist()
    path = os.path.join(BUILD, f"cupy_api_{ver or 'none'}.json")
    if ver and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", _API_SCRIPT], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        if mode == "require":
            raise RuntimeError("KVSHARE_EMU_CUPY_API=require: the real CuPy's API could not be "
                               "read: " + (r.stderr.strip().splitlines() or ["?"])[-1])
        return None
    api = json.loads(r.stdout)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(api, f)
    os.replace(tmp, path)
    return api

API = _load_api()

def _check_call(namespace, name, kwargs):
    """Raise as CuPy would where `cupy.<name>` (of `namespace`, "numpy" or "numpy.linalg")
    does not exist or does not take one of `kwargs`."""
    if API is None:
        return
    spec = API.get(namespace, {}).get(name)
    where = "cupy" if namespace == "numpy" else "cupy.linalg"
    if spec is None:
        raise AttributeError(f"{where} has no {name!r} (CuPy {API['version']}): NumPy's runs "
                             f"here, a GPU raises")
    if spec["kind"] == "ufunc":
        bad = set(kwargs) - _UFUNC_KW
    elif spec["kind"] == "function" and spec["params"] is not None:
        bad = set(kwargs) - set(spec["params"])
    else:
        return
    if bad:
        raise TypeError(f"{where}.{name} takes no {', '.join(sorted(bad))} (CuPy "
                        f"{API['version']}): NumPy's takes it, a GPU raises")

_UFUNC_KW = {"out", "dtype", "casting"}   # what CuPy's ufunc.__call__ takes

class _Mem:
    def __init__(self, ptr): self.ptr = ptr

class CaptureError(RuntimeError):
    """What CUDA refuses during stream capture (cudaErrorStreamCapture*)."""

_CAPTURE = None       # the active capture: a _Capture, or None
_ALLOCS = []          # sorted (start, end, serial, weakref to the owner) of device memory

def _register(a):
    """Record a new device allocation (a NumPy array owning its memory)."""
    import bisect, weakref
    if _CAPTURE is not None:
        raise CaptureError(f"device allocation of {a.nbytes} bytes during stream capture")
    if len(_ALLOCS) > 2 * _PRUNED[0] + 64:   # drop freed allocations now and then
        _ALLOCS[:] = [e for e in _ALLOCS if e[3]() is not None]
        _PRUNED[0] = len(_ALLOCS)
    start = a.__array_interface__["data"][0]
    _PRUNED[1] += 1
    bisect.insort(_ALLOCS, (start, start + max(1, a.nbytes), _PRUNED[1], weakref.ref(a)))
_PRUNED = [0, 0]   # entries after the last pruning; allocations so far

def _owner(ptr):
    """The weakref of the live allocation holding device address ptr, or None."""
    import bisect
    i = bisect.bisect_right(_ALLOCS, (ptr, float("inf"))) - 1
    for j in range(i, max(-1, i - 64), -1):   # live allocations do not overlap
        s, e, _, ref = _ALLOCS[j]
        if s <= ptr < e and ref() is not None:
            return ref
    return None

def _no_capture(what, elsewhere_ok=False):
    """Raise where a capture forbids `what`. CuPy captures in relaxed mode, so another
    thread's synchronous call is refused only where it implicitly joins the capturing
    stream's work; `elsewhere_ok`: the call allows that in a thread other than the capturing
    one (an event's wait, or a copy on a non-blocking stream)."""
    if _CAPTURE is not None and not (elsewhere_ok and threading.get_ident() != _CAPTURE.thread):
        raise CaptureError(f"{what} during stream capture")

def _off_stream(stream):
    """True for a copy issued on a given non-blocking stream: it joins no other stream's work
    (neither the legacy default stream nor a capture)."""
    return stream is not None and getattr(stream, "non_blocking", False)

def _capturing_here(what):
    """True when the current stream captures (the op is to be recorded); raises when another
    stream captures (work on another stream during capture)."""
    if _CAPTURE is None:
        return False
    _same_thread(what)
    if cuda.get_current_stream() is not _CAPTURE.stream:
        raise CaptureError(f"{what} on stream {cuda.get_current_stream().ptr} while stream "
                           f"{_CAPTURE.stream.ptr} captures")
    return True

def _same_thread(what):
    """Work issued from another thread while one captures is not modelled here (the
    current-stream stack is one for all threads): refuse it rather than record it."""
    if threading.get_ident() != _CAPTURE.thread:
        raise CaptureError(f"{what} from another thread during a capture (not emulated)")

def _base(a):
    return a.view(np.ndarray) if isinstance(a, ndarray) else a

def _by_address(a):
    """A function that rebuilds array `a` from its address, shape and strides: a recorded
    operation holds pointers, not arrays, as a CUDA graph does (the replay check finds a
    freed one before it is used)."""
    if not isinstance(a, np.ndarray):
        return lambda: a
    shape, strides, dt = a.shape, a.strides, a.dtype
    if a.size == 0:
        return lambda: np.empty(shape, dt)
    ptr = a.__array_interface__["data"][0]
    lo = sum(min(0, (n - 1) * st) for n, st in zip(shape, strides))
    hi = sum(max(0, (n - 1) * st) for n, st in zip(shape, strides)) + dt.itemsize
    def get():
        buf = (ctypes.c_char * (hi - lo)).from_address(ptr + lo)
        return np.ndarray(shape, dt, buffer=buf, offset=-lo, strides=strides)
    return get

class ndarray(np.ndarray):
    @property
    def data(self):
        return _Mem(self.__array_interface__["data"][0])

    def __array_finalize__(self, obj):
        if self.flags.owndata:   # a new buffer (a copy), not a view
            _register(self)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        t0 = time.perf_counter()
        try:
            return self._ufunc(ufunc, method, *inputs, out=out, **kw)
        finally:
            COUNTS["emu_s"] += time.perf_counter() - t0

    def _ufunc(self, ufunc, method, *inputs, out=None, **kw):
        for a in (*inputs, *(out or ())):
            if type(a) is np.ndarray:
                raise TypeError(f"{ufunc.__name__}: a host array (numpy.ndarray) beside a device "
                                f"one: CuPy raises TypeError (Unsupported type)")
        if method == "__call__" and API is not None and set(kw) - _UFUNC_KW:
            raise TypeError(f"cupy.{ufunc.__name__} takes no "
                            f"{', '.join(sorted(set(kw) - _UFUNC_KW))}: a GPU raises")
        args = tuple(_base(a) for a in inputs)
        outs = tuple(_base(o) for o in out) if out is not None else None
        if _capturing_here(f"{ufunc.__name__}.{method}"):
            if out is None:
                raise CaptureError(f"{ufunc.__name__} without out= allocates during stream capture")
            for a in (*inputs, *out):
                if isinstance(a, np.ndarray) and not isinstance(a, ndarray):
                    raise CaptureError(f"{ufunc.__name__}: a host array during stream capture")
            get_args = [_by_address(a) for a in args]
            get_outs = [_by_address(o) for o in outs]
            _CAPTURE.record(f"{ufunc.__name__}.{method}",
                            lambda: getattr(ufunc, method)(*(g() for g in get_args),
                                                           out=tuple(g() for g in get_outs), **kw),
                            [a for a in (*inputs, *out) if isinstance(a, ndarray)])
            return out[0] if len(out) == 1 else out
        COUNTS["elementwise"] += 1
        r = getattr(ufunc, method)(*args, **({"out": outs} if outs is not None else {}), **kw)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if isinstance(r, tuple):
            return tuple(_dev(x) if isinstance(x, np.ndarray) else x for x in r)
        return _dev(r) if isinstance(r, np.ndarray) else r

    def __array_function__(self, func, types, args, kwargs):
        # numpy.<func>(device array): CuPy runs cupy.<func> instead, where it exists
        if func.__module__ in ("numpy", "numpy.linalg"):
            _check_call(func.__module__, func.__name__, kwargs)
        return super().__array_function__(func, types, args, kwargs)

    def __setitem__(self, key, value):
        if _capturing_here("array assignment"):
            if isinstance(value, np.ndarray) and not isinstance(value, ndarray):
                raise CaptureError("host-to-device copy during stream capture")
            if any(isinstance(k, np.ndarray) and not isinstance(k, ndarray)
                   for k in (key if isinstance(key, tuple) else (key,))):
                raise CaptureError("host index array during stream capture")
            dst, src = _by_address(_base(self)), _by_address(_base(value))
            _CAPTURE.record("copy", lambda: np.ndarray.__setitem__(dst(), key, src()),
                            [a for a in (self, value) if isinstance(a, ndarray)])
            return
        np.ndarray.__setitem__(self, key, value)

    def fill(self, value):
        if _capturing_here("fill"):
            dst = _by_address(_base(self))
            _CAPTURE.record("fill", lambda: np.ndarray.fill(dst(), value), [self])
            return
        np.ndarray.fill(self, value)

    def set(self, arr, stream=None):
        """Host-to-device copy (CuPy's ndarray.set); asynchronous from pinned memory on a
        given stream (`_pending_copy`)."""
        _no_capture("host-to-device copy (ndarray.set)")
        COUNTS["h2d"] += 1
        src = np.asarray(arr)
        if stream is not None:
            _pending_copy(src)
        np.ndarray.__setitem__(self, Ellipsis, src)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            return asnumpy(self, stream, order, out, blocking=blocking)
        _no_capture("device-to-host copy (ndarray.get)")
        COUNTS["d2h"] += 1
        if stream is None:
            _retire_copies()
        return np.array(self.view(np.ndarray))

    def __int__(self):
        _no_capture("int() of a device array (a device-to-host read)")
        return int(self.view(np.ndarray))

    def __float__(self):
        _no_capture("float() of a device array (a device-to-host read)")
        return float(self.view(np.ndarray))

    def __bool__(self):
        _no_capture("bool() of a device array (a device-to-host read)")
        return bool(self.view(np.ndarray))

    def item(self, *a):
        _no_capture("item() of a device array (a device-to-host read)")
        return self.view(np.ndarray).item(*a)

    def tolist(self):
        _no_capture("tolist() of a device array (a device-to-host read)")
        return self.view(np.ndarray).tolist()

def _not_in_cupy(name):
    def missing(self):
        raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
    return property(missing)
if API is not None:   # NumPy's array attributes CuPy's lack (ctypes, resize, setflags, ...)
    for _name in set(dir(np.ndarray)) - set(API["ndarray"]) - set(vars(ndarray)):
        if not _name.startswith("__"):
            setattr(ndarray, _name, _not_in_cupy(_name))

def _dev(a):
    if isinstance(a, ndarray):
        return a
    if a.base is None:   # a new buffer
        _register(a)
    return a.view(ndarray)

def asarray(a, dtype=None):
    if isinstance(a, ndarray):
        return _dev(np.asarray(a, dtype=dtype))
    COUNTS["h2d"] += 1
    return _dev(np.array(a, dtype=dtype, copy=True))
def array(a, dtype=None): return _dev(np.array(a, dtype=dtype, copy=True))
def ascontiguousarray(a, dtype=None): return _dev(np.ascontiguousarray(a, dtype=dtype))
def empty(shape, dtype=float):
    if NOOP:   # a memory pool's allocation on a GPU: not kvshare's time
        t0 = time.perf_counter()
        # zeros, not garbage: a no-op step's sampled tokens read back as token 0 with status
        # ok (a served request runs to its end), its logits as zeros (finite)
        a = _dev(np.zeros(shape, dtype))
        COUNTS["emu_s"] += time.perf_counter() - t0
        return a
    a = np.empty(shape, dtype)
    if a.dtype.kind == "f": a.fill(np.nan)   # uninitialised device memory: poison
    elif a.dtype == np.uint8: a.fill(0xFF)   # (raw buffers, e.g. a workspace: NaN bytes)
    return _dev(a)
def zeros(shape, dtype=float): return _dev(np.zeros(shape, dtype))
def full(shape, v, dtype=None): return _dev(np.full(shape, v, dtype))
def matmul(a, b, out=None):
    if out is not None:
        return np.matmul(a, b, out=out)   # through ndarray.__array_ufunc__ (captured)
    _no_capture("matmul without out= (an allocation)")
    return _dev(np.matmul(_base(a), _base(b)))
def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        _no_capture("device-to-host copy (asnumpy)", elsewhere_ok=_off_stream(stream))
        COUNTS["d2h"] += 1
        if blocking:
            # (on a non-blocking stream the copy waits for that stream's work only: others'
            # copies stay pending)
            if not _off_stream(stream):
                _retire_copies()
        elif out is not None and _pending_read(a, out):
            return out
    if out is not None:
        np.copyto(out, np.asarray(a).view(np.ndarray))
        return out
    return np.array(np.asarray(a).view(np.ndarray))
def __getattr__(name):
    # NumPy for the rest of CuPy's array API (exp, negative, multiply, arange, ...): ufuncs
    # keep the device subclass of their inputs; new arrays become device arrays
    if API is not None and name not in API["numpy"] and not name.startswith("__"):
        raise AttributeError(f"module 'cupy' has no attribute {name!r} (CuPy {API['version']})")
    f = getattr(np, name)
    if not callable(f) or isinstance(f, type):
        return f
    def on_device(*a, **k):
        _check_call("numpy", name, k)
        r = f(*a, **k)
        return _dev(r) if type(r) is np.ndarray else r
    return on_device
float16, float32, int32, int64 = np.float16, np.float32, np.int32, np.int64

# ---- cuda ----
cuda = types.ModuleType("fakecupy.cuda")
runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                memGetInfo=lambda: (120 << 30, 141 << 30),
                                deviceGetAttribute=lambda code, dev: {16: 132, 97: 232448,
                                                                      75: 9, 76: 0}[code])
cuda.runtime = runtime
class _MemoryPool:
    """cupy.get_default_memory_pool(): nothing held free (NumPy allocates directly)."""
    def free_bytes(self): return 0
_POOL = _MemoryPool()
def get_default_memory_pool(): return _POOL
class Device:
    def __init__(self, i=0): self.id = i
    attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448,
                  "ComputeCapabilityMajor": 9, "ComputeCapabilityMinor": 0}
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def synchronize(self):
        _no_capture("Device.synchronize")
        _retire_copies()
cuda.Device = Device
cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 1)
runtime.streamCaptureModeGlobal, runtime.streamCaptureModeThreadLocal = 0, 1
runtime.streamCaptureModeRelaxed = 2

class _Capture:
    """The work recorded on a capturing stream: (what, run, pointers and their owners)."""
    def __init__(self, stream):
        self.stream, self.ops = stream, []
    def record(self, what, run, arrays=(), ptrs=()):
        owners = []
        for p in [a.__array_interface__["data"][0] for a in arrays if a.size] + list(ptrs):
            ref = _owner(p)
            if ref is None:
                raise CaptureError(f"{what}: address {p:#x} is not device memory")
            owners.append((p, ref))
        self.ops.append((what, run, owners))

class Stream:
    """cupy.cuda.Stream: a handle, the current-stream stack (`with s:`, `use()`), and stream
    capture into a `graph.Graph`."""
    _next = [0x1000]
    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        if null:
            self.ptr = 0
        elif ptds:
            self.ptr = 2
        else:
            Stream._next[0] += 0x10
            self.ptr = Stream._next[0]
        self.device_id = -1 if (null or ptds) else 0
        self.non_blocking = non_blocking
    def __enter__(self):
        _STREAMS.append(self); return self
    def __exit__(self, *a):
        _STREAMS.pop()
    def use(self):
        _STREAMS[-1:] = [self]; return self
    @property
    def done(self):
        _no_capture("Stream.done (a query)"); _retire_copies(); return True
    def synchronize(self):
        _no_capture("Stream.synchronize")
        _retire_copies()
    def begin_capture(self, mode=None):
        global _CAPTURE
        if self.ptr in (0, 1):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _CAPTURE is not None:
            raise CaptureError("a stream is already capturing")
        _CAPTURE = _Capture(self)
        _CAPTURE.thread = threading.get_ident()
    def end_capture(self):
        global _CAPTURE
        if _CAPTURE is None or _CAPTURE.stream is not self:
            raise CaptureError("end_capture on a stream that is not capturing")
        cap, _CAPTURE = _CAPTURE, None
        return graph.Graph._from(cap.ops)
    def is_capturing(self):
        return _CAPTURE is not None and _CAPTURE.stream is self
Stream.null = Stream(null=True)
_STREAMS = [Stream.null]
cuda.Stream = Stream
cuda.get_current_stream = lambda device_id=-1: _STREAMS[-1]

class Event:
    """An event: what was issued before its `record` is done once the host synchronizes it
    or finds it done (the asynchronous copies issued before it are then known complete)."""
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._seq = None
    def record(self, stream=None):
        self._seq = _COPY_SEQ[0]
    def synchronize(self):
        _no_capture("Event.synchronize", elsewhere_ok=True)
        if self._seq is not None:   # (an event never recorded is done at once)
            _retire_copies(self._seq)
    @property
    def done(self):
        _no_capture("Event.done (a query)")
        if self._seq is not None:
            _retire_copies(self._seq)
        return True
cuda.Event = Event

def _plumbing(fn):
    """Count a call's time as the emulator's own bookkeeping (`COUNTS["emu_s"]`), not
    kvshare's: what a GPU's driver would not spend."""
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            COUNTS["emu_s"] += time.perf_counter() - t0
    timed.__name__, timed.__doc__ = fn.__name__, fn.__doc__
    return timed

# page-locked host memory: a buffer whose address range is remembered, so that a copy from it
# on a stream is asynchronous (`_pending_copy`)
_PINNED = []   # (start, end, weakref to the buffer)
class _PinnedBuffer(bytearray):
    pass
@_plumbing
def alloc_pinned_memory(nbytes):
    import weakref
    buf = _PinnedBuffer(int(nbytes))
    if len(buf):
        start = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        _PINNED[:] = [e for e in _PINNED if e[2]() is not None]
        _PINNED.append((start, start + len(buf), weakref.ref(buf)))
    return buf
cuda.alloc_pinned_memory = alloc_pinned_memory

_COPY_SEQ = [0]    # asynchronous copies issued so far
_PENDING = []      # (seq, host address, bytes of the source when issued, weakref to the buffer)
_COPY_LOCK = threading.RLock()   # the list above, as threads issue and retire copies

def _copies_locked(fn):
    def locked(*a, **k):
        with _COPY_LOCK:
            return fn(*a, **k)
    locked.__name__, locked.__doc__ = fn.__name__, fn.__doc__
    return locked

def _pinned_ref(host):
    """The weakref of the live pinned buffer holding C-contiguous host array `host` wholly,
    or None (pageable memory, or nothing to copy)."""
    if not host.flags.c_contiguous or host.nbytes == 0:
        return None
    addr = host.__array_interface__["data"][0]
    for start, end, ref in _PINNED:
        if ref() is not None and start <= addr and addr + host.nbytes <= end:
            return ref
    return None

@_plumbing
@_copies_locked
def _pending_copy(src):
    """Record an asynchronous copy from host array `src` when it lies in pinned memory
    (from pageable memory the driver stages the bytes before returning: nothing pends)."""
    ref = _pinned_ref(src)
    if ref is not None:
        addr = src.__array_interface__["data"][0]
        _COPY_SEQ[0] += 1
        _PENDING.append((_COPY_SEQ[0], addr, ctypes.string_at(addr, src.nbytes), ref))

@_plumbing
@_copies_locked
def _pending_read(src, out):
    """A device-to-host copy of device array `src` into `out` without waiting: into pinned
    memory it is asynchronous, so `out` holds poison (0xFF bytes: NaN in floats, -1 in ints)
    until the host knows the copy done (`_retire_copies`), and the device bytes are read then:
    a host that reads `out` before waiting for the copy reads poison, and one that frees or
    reuses `src` before then is caught or copies the new bytes, as a GPU might. False where
    `out` is pageable (the driver copies before returning: nothing pends)."""
    ref = _pinned_ref(out)
    if ref is None or src.shape != out.shape:
        return False
    addr = out.__array_interface__["data"][0]
    owner = _owner(src.__array_interface__["data"][0]) if src.size else None
    read = _by_address(src)
    _COPY_SEQ[0] += 1
    _PENDING.append((_COPY_SEQ[0], addr, (out, read, owner), ref))
    out.view(np.uint8).reshape(-1).fill(0xFF)
    return True

@_plumbing
@_copies_locked
def _retire_copies(upto=None):
    """The pending copies issued up to `upto` (all: None) are known complete: each one's host
    bytes must still be what they were when it was issued; a device-to-host copy lands."""
    keep = []
    for entry in _PENDING:
        seq, addr, snap, ref = entry
        if upto is not None and seq > upto:
            keep.append(entry)
            continue
        if isinstance(snap, tuple):   # a device-to-host copy (`_pending_read`)
            out, read, owner = snap
            if ref() is None:
                raise RuntimeError("pinned host memory freed while an asynchronous copy into "
                                   "it was pending")
            if owner is not None and owner() is None:
                raise RuntimeError("device memory freed while an asynchronous copy from it "
                                   "was pending")
            np.copyto(out, read())
            continue
        if ref() is None:
            raise RuntimeError("pinned host memory freed while an asynchronous copy from it "
                               "was pending")
        if ctypes.string_at(addr, len(snap)) != snap:
            _PENDING[:] = keep
            raise RuntimeError(f"the host wrote {len(snap)} bytes of pinned memory at "
                               f"{addr:#x} while an asynchronous copy from them was pending "
                               "(the device may read the new bytes): wait for the copy first")
    _PENDING[:] = keep
cuda.get_elapsed_time = lambda a, b: 0.0

graph = types.ModuleType("fakecupy.cuda.graph")
class Graph:
    """cupy.cuda.graph.Graph: `launch` replays the captured work in order, on the same
    addresses; a recorded address whose allocation has been freed since raises."""
    def __init__(self, *a, **k):
        raise NotImplementedError("a Graph comes from Stream.end_capture")
    @classmethod
    def _from(cls, ops):
        g = cls.__new__(cls); g._ops = list(ops); g.launches = 0; return g
    def launch(self, stream=None):
        t0 = time.perf_counter()
        try:
            self._launch(stream)
        finally:
            COUNTS["emu_s"] += time.perf_counter() - t0
    def _launch(self, stream=None):
        _no_capture("Graph.launch")
        COUNTS["graph"] += 1
        for what, _, owners in self._ops:
            for p, ref in owners:
                if ref() is None:
                    raise CaptureError(f"graph replay of {what}: address {p:#x} was freed "
                                       "after the capture")
        for _, run, _ in self._ops:
            run()
        self.launches += 1
    def upload(self, stream=None): pass
    @property
    def n_nodes(self): return len(self._ops)
graph.Graph = Graph
cuda.graph = graph

class _Cublas:
    CUBLAS_POINTER_MODE_HOST = 0
    CUBLAS_POINTER_MODE_DEVICE = 1
    CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
    CUBLAS_COMPUTE_32F = 68
    CUBLAS_GEMM_DEFAULT = -1
    mode = 0
    calls = 0
    def getPointerMode(self, h): return self.mode
    def setPointerMode(self, h, m): self.mode = m
    stream = 0
    def setStream(self, h, s): _Cublas.stream = s
    def gemmEx(self, handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
               Ctype, ldc, ct, algo):
        assert self.mode == 0, "alpha/beta are host pointers"
        assert ct == 68 and algo == -1
        if _CAPTURE is not None:
            if _Cublas.stream != _CAPTURE.stream.ptr:
                raise CaptureError("cuBLAS call on another stream during stream capture")
            # alpha and beta are read now (host pointer mode), the matrices at replay
            al_be = (ctypes.c_float * 2)(*(np.frombuffer((ctypes.c_char * 4).from_address(p),
                                                         np.float32)[0] for p in (alpha, beta)))
            args = (handle, ta, tb, m, n, k, ctypes.addressof(al_be), A, Atype, lda, B, Btype,
                    ldb, ctypes.addressof(al_be) + 4, C, Ctype, ldc, ct, algo)
            def run(args=args, keep=al_be):
                mode, _Cublas.mode = _Cublas.mode, 0
                try:
                    _Cublas.gemm(*args)
                finally:
                    _Cublas.mode = mode
            _CAPTURE.record("gemmEx", run, ptrs=(A, B, C))
            return
        COUNTS["gemm"] += 1
        _Cublas.gemm(handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
                     Ctype, ldc, ct, algo)
    @staticmethod
    def gemm(handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
             ldc, ct, algo):
        if NOOP:
            _Cublas.calls += 1
            return
        dt = {0: np.float32, 2: np.float16}
        al = np.frombuffer((ctypes.c_char * 4).from_address(alpha), np.float32)[0]
        be = np.frombuffer((ctypes.c_char * 4).from_address(beta), np.float32)[0]
        def mat(ptr, t, rows, cols, ld):
            assert ld >= max(1, rows), f"ld {ld} < rows {rows}"
            d = np.dtype(dt[t]); size = ld * (cols - 1) + rows
            flat = np.frombuffer((ctypes.c_char * (size * d.itemsize)).from_address(ptr), d)
            return np.lib.stride_tricks.as_strided(flat, (rows, cols), (d.itemsize, ld * d.itemsize))
        Am = mat(A, Atype, *((m, k) if ta == 0 else (k, m)), lda)
        Bm = mat(B, Btype, *((k, n) if tb == 0 else (n, k)), ldb)
        opA = Am if ta == 0 else Am.T
        opB = Bm if tb == 0 else Bm.T
        d = np.dtype(dt[Ctype]); size = ldc * (n - 1) + m
        assert ldc >= m
        cflat = np.frombuffer((ctypes.c_char * (size * d.itemsize)).from_address(C), d)
        Cm = np.lib.stride_tricks.as_strided(cflat, (m, n), (d.itemsize, ldc * d.itemsize))
        # each column (a token's row of the product) alone, as float64 sums of the exact
        # products rounded once: a row's result does not depend on the other rows of the
        # batch or on the buffers' addresses (NumPy's BLAS blocks and vectorises by both);
        # a decode step padded to its graph's batch size gives the same logits
        A64 = opA.astype(np.float64)
        r = np.empty((m, n), np.float32)
        for j in range(n):
            r[:, j] = (A64 * opB[:, j].astype(np.float64)[None, :]).sum(axis=1)
        r *= al
        if be != 0: r += be * Cm
        Cm[...] = r.astype(d)
        _Cublas.calls += 1
cuda.cublas = _Cublas()

# ---- RawModule ----
ENTRY_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*\(')
LAUNCHES = []
# What the host issued, for bench/gpu_host_cost.py: host-to-device copies (asarray of a host
# array, ndarray.set), device-to-host reads (asnumpy, ndarray.get), kernel launches, cuBLAS
# GEMMs and graph launches (not what a graph replays), array operations (`elementwise`: each
# a CuPy elementwise kernel on a GPU); and `emu_s`, the seconds this module's own plumbing
# took (launch marshalling, allocations, array operations: what a GPU would not spend).
COUNTS = {"h2d": 0, "d2h": 0, "kernel": 0, "gemm": 0, "graph": 0, "elementwise": 0,
          "emu_s": 0.0}
# KVSHARE_EMU_NOOP=1: kernels and GEMMs are checked and recorded but not run, and `empty`
# returns zeros; results are meaningless. For measuring the host side of the GPU path
# (bench/gpu_host_cost.py, a no-op server's fleet), never for tests.
NOOP = os.environ.get("KVSHARE_EMU_NOOP") == "1"

# a static shared declaration: `__shared__ [__align__(n)] TYPE NAME[...]...;`
SHARED_RE = re.compile(r"(?<!extern )__shared__\s+(?:__align__\(\d+\)\s+)?[\w:<>]+\s+(\w+)"
                       r"(?:\[[^;\]]*\])*\s*;")

def _sanitize_flags():
    """g++ flags of KVSHARE_EMU_SANITIZE=1: the kernels built with UndefinedBehaviorSanitizer,
    aborting at the first report. It catches what faults or differs on a GPU and passes
    silently on x86: a misaligned typed load or store (a `float4`, `uint4`, `u32` or `f16`
    read at an address its size does not divide: "misaligned address" on a GPU), shifts by
    the type's width or more (x86 masks the count, PTX clamps it), signed overflow, and
    indexing past a fixed-size array. Not a signed left shift out of range (`shift-base`):
    the quant kernels shift packed signed words as llama.cpp's do, which the GPU compilers
    emit as a plain `shl` and C++20 defines as the same wrap-around."""
    if os.environ.get("KVSHARE_EMU_SANITIZE") != "1":
        return []
    return ["-fsanitize=undefined", "-fno-sanitize=shift-base",
            "-fno-sanitize-recover=undefined"]

def _build(code):
    with open(os.path.join(HERE, "shim.h"), "rb") as f: shim = f.read()
    san = _sanitize_flags()
    h = hashlib.sha1(code.encode() + shim + " ".join(san).encode()).hexdigest()[:16]
    so = os.path.join(BUILD, f"k_{h}.so")
    if os.path.exists(so):
        return so
    src = code.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_h2f(h);")
    src = src.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);")
    # device-only code (inline PTX the emulator has its own version of in shim.h)
    src = re.sub(r"// emu: begin device-only.*?// emu: end device-only", "", src, flags=re.S)
    assert "asm(" not in src and "asm volatile(" not in src
    # static shared objects are poisoned at each block's first use (shim.h emu_poison_shared)
    n_shared = len(re.findall(r"(?<!extern )__shared__", src))
    assert len(SHARED_RE.findall(src)) == n_shared, "a __shared__ declaration SHARED_RE misses"
    src = SHARED_RE.sub(lambda m: f"{m.group(0)} emu_poison_shared(&{m.group(1)}, "
                                  f"sizeof({m.group(1)}));", src)
    src = src.replace("extern __shared__ float4 pa_smem4[];",
                      "float4* pa_smem4 = reinterpret_cast<float4*>(emu_smem_ptr);")
    names = ENTRY_RE.findall(code)
    reg = "\nstatic std::map<std::string, std::function<void(void**)>> emu_registry = {\n"
    reg += ",\n".join(f'  {{"{n}", [](void** a) {{ emu_call(&{n}, a); }}}}' for n in names)
    reg += "\n};\n"
    reg += r'''
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned long smem, void** argv) {
    auto it = emu_registry.find(name);
    if (it == emu_registry.end()) return -1;
    const char* order = std::getenv("KVSHARE_EMU_ORDER");
    emu_order_mode = !order ? 0 : !std::strcmp(order, "reverse") ? 1 : !std::strcmp(order, "shuffle") ? 2 : 0;
    if (const char* seed = std::getenv("KVSHARE_EMU_SEED")) emu_order_rng = std::strtoull(seed, nullptr, 10) * 2 + 1;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = gz; blockDim.x = bx; blockDim.y = 1; blockDim.z = 1;
    std::vector<unsigned char> sm(smem + 64);
    unsigned char* p = sm.data() + (16 - ((uintptr_t)sm.data() & 15)) % 16;
    emu_smem_ptr = p;
    auto fn = it->second;
    emu_body = [&]() { fn(argv); };
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
        std::memset(p, 0xFF, smem);   // uninitialised shared memory: NaN pattern
        emu_run_block((int)bx);
    }
    return 0;
}
'''
    full = '#include "shim.h"\n' + src + reg
    # a name of this build's own, renamed into place: builds of one source at once (threads,
    # processes) never load a half-written object
    tmp = f"{so}.{os.getpid()}.{threading.get_ident()}"
    cpp = so[:-3] + ".cpp"
    with open(tmp, "w") as f: f.write(full)
    os.replace(tmp, cpp)   # (the same text whoever writes it)
    r = subprocess.run(["g++", "-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-Wno-unknown-pragmas",
                        *san, "-I", HERE, cpp, "-o", tmp], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-6000:])
    os.replace(tmp, so)
    return so

class RawKernel:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        self.max_dynamic_shared_size_bytes = 0
    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        t0 = time.perf_counter()
        try:
            self._call(grid, block, args, shared_mem, stream)
        finally:
            COUNTS["emu_s"] += time.perf_counter() - t0
    def _call(self, grid, block, args, shared_mem=0, stream=None):
        grid = tuple(grid) + (1,) * (3 - len(grid)); block = tuple(block) + (1,) * (3 - len(block))
        assert block[1] == block[2] == 1 and 0 < block[0] <= 1024
        assert 0 < grid[0] < 2**31 and 0 < grid[1] <= 65535 and 0 < grid[2] <= 65535, grid
        if shared_mem > 48 * 1024:
            assert self.max_dynamic_shared_size_bytes >= shared_mem, \
                f"{self.name}: {shared_mem} B of shared memory without opt-in"
        assert shared_mem <= 232448
        keep, ptrs = [], []
        for a in args:
            if isinstance(a, np.ndarray) and not isinstance(a, ndarray):
                raise TypeError(f"{self.name}: host array passed to a kernel")
            if isinstance(a, ndarray):
                c = ctypes.c_void_p(a.__array_interface__["data"][0])
            elif isinstance(a, np.int32): c = ctypes.c_int32(int(a))
            elif isinstance(a, np.int64): c = ctypes.c_int64(int(a))
            elif isinstance(a, np.float32): c = ctypes.c_float(float(a))
            elif isinstance(a, np.uint64): c = ctypes.c_uint64(int(a))   # e.g. a null pointer
            elif isinstance(a, np.float64): c = ctypes.c_double(float(a))
            else:
                raise TypeError(f"{self.name}: argument of type {type(a)}")
            keep.append(c); ptrs.append(ctypes.cast(ctypes.pointer(c), ctypes.c_void_p))
        argv = (ctypes.c_void_p * max(1, len(ptrs)))(*[p.value for p in ptrs])
        def run(keep=keep, argv=argv):
            LAUNCHES.append((self.name, grid, block, shared_mem))
            if NOOP:
                return
            rc = self.lib.emu_launch(self.name.encode(), grid[0], grid[1], grid[2], block[0],
                                     ctypes.c_ulong(shared_mem), argv)
            assert rc == 0, f"unknown kernel {self.name}"
        if _CAPTURE is not None:
            _same_thread(f"launch of {self.name}")
            on = stream if stream is not None else cuda.get_current_stream()
            if on is not _CAPTURE.stream:
                raise CaptureError(f"{self.name} launched on stream {on.ptr} while stream "
                                   f"{_CAPTURE.stream.ptr} captures")
            # the arguments are taken now, by value (pointers included), as CUDA does
            _CAPTURE.record(self.name, run,
                            ptrs=[a.__array_interface__["data"][0] for a in args
                                  if isinstance(a, ndarray) and a.size])
            return
        COUNTS["kernel"] += 1
        run()

class RawModule:
    """cupy.RawModule: built (g++, `_build`) at `compile()` or at the first `get_function`, as
    CuPy compiles at first use; threads may build different modules at once."""
    def __init__(self, code=None, options=(), **kw):
        self.code, self.lib = code, None
        self._lock = threading.Lock()
    def compile(self, log_stream=None):
        with self._lock:
            if self.lib is None:
                lib = ctypes.CDLL(_build(self.code))
                lib.emu_launch.restype = ctypes.c_int
                self.lib = lib
    def get_function(self, name):
        self.compile()
        return RawKernel(self.lib, name)

def install():
    m = sys.modules[__name__]
    sys.modules["cupy"] = m
    m.cuda = cuda
