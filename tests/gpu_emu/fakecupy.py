"""A CPU stand-in for the subset of CuPy that kvshare's GPU path uses, to run the real CUDA
sources and `kvshare.ops.gpu` without a GPU (see docs/gpu.md, "Verification"):

- device arrays are a NumPy subclass (`ndarray`, with `.data.ptr`); `empty` poisons floats
  with NaN like uninitialised device memory;
- `RawModule(code)` compiles the NVRTC source with g++ against `shim.h` (one ucontext fiber
  per CUDA thread, barriers and shuffles through a scheduler that aborts on deadlock, shared
  memory poisoned before each block) and launches kernels through ctypes, checking grid,
  block and shared-memory limits (dynamic shared memory above 48 KB needs the opt-in);
- cuBLAS `gemmEx` is a column-major NumPy GEMM over the raw pointers (checks leading dims).

Not a test module: `PYTHONPATH=tests/gpu_emu python -m pytest -p emu_plugin tests/test_ops_gpu.py`
installs it as `cupy` (the `gpu` tests then run instead of skipping). Needs g++ >= 12
(`_Float16`) on x86-64 Linux.
"""
import ctypes, hashlib, os, re, subprocess, sys, tempfile, types
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(tempfile.gettempdir(), "kvshare-gpu-emu"); os.makedirs(BUILD, exist_ok=True)

class _Mem:
    def __init__(self, ptr): self.ptr = ptr

class ndarray(np.ndarray):
    @property
    def data(self):
        return _Mem(self.__array_interface__["data"][0])

def _dev(a):
    return a.view(ndarray)

def asarray(a, dtype=None):
    if isinstance(a, ndarray):
        return _dev(np.asarray(a, dtype=dtype))
    return _dev(np.array(a, dtype=dtype, copy=True))
def array(a, dtype=None): return _dev(np.array(a, dtype=dtype, copy=True))
def ascontiguousarray(a, dtype=None): return _dev(np.ascontiguousarray(a, dtype=dtype))
def empty(shape, dtype=np.float32):
    a = np.empty(shape, dtype)
    if a.dtype.kind == "f": a.fill(np.nan)   # uninitialised device memory: poison
    return _dev(a)
def zeros(shape, dtype=np.float32): return _dev(np.zeros(shape, dtype))
def full(shape, v, dtype=np.float32): return _dev(np.full(shape, v, dtype))
def matmul(a, b, out=None):
    r = np.matmul(np.asarray(a), np.asarray(b))
    if out is not None:
        out[...] = r; return out
    return _dev(r)
def asnumpy(a): return np.array(np.asarray(a).view(np.ndarray))
def __getattr__(name):
    # NumPy for the rest of CuPy's array API (exp, negative, multiply, arange, ...): ufuncs
    # keep the device subclass of their inputs; new arrays become device arrays
    f = getattr(np, name)
    if not callable(f) or isinstance(f, type):
        return f
    def on_device(*a, **k):
        r = f(*a, **k)
        return _dev(r) if type(r) is np.ndarray else r
    return on_device
float16, float32, int32, int64 = np.float16, np.float32, np.int32, np.int64

# ---- cuda ----
cuda = types.ModuleType("fakecupy.cuda")
runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                deviceGetAttribute=lambda code, dev: {16: 132, 97: 232448}[code])
cuda.runtime = runtime
class Device:
    def __init__(self, i=0): self.id = i
    attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448}
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def synchronize(self): pass
cuda.Device = Device
cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 1)

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
    def setStream(self, h, s): pass
    def gemmEx(self, handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
               Ctype, ldc, ct, algo):
        assert self.mode == 0, "alpha/beta are host pointers"
        assert ct == 68 and algo == -1
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
        r = al * (opA.astype(np.float32) @ opB.astype(np.float32))
        if be != 0: r += be * Cm
        Cm[...] = r.astype(d)
        _Cublas.calls += 1
cuda.cublas = _Cublas()

# ---- RawModule ----
ENTRY_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*\(')
LAUNCHES = []

def _build(code):
    with open(os.path.join(HERE, "shim.h"), "rb") as f: shim = f.read()
    h = hashlib.sha1(code.encode() + shim).hexdigest()[:16]
    so = os.path.join(BUILD, f"k_{h}.so")
    if os.path.exists(so):
        return so
    src = code.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_h2f(h);")
    src = src.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);")
    assert "asm(" not in src
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
    cpp = so[:-3] + ".cpp"
    with open(cpp, "w") as f: f.write(full)
    r = subprocess.run(["g++", "-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-Wno-unknown-pragmas",
                        "-I", HERE, cpp, "-o", so], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-6000:])
    return so

class RawKernel:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        self.max_dynamic_shared_size_bytes = 0
    def __call__(self, grid, block, args, shared_mem=0, stream=None):
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
            else:
                raise TypeError(f"{self.name}: argument of type {type(a)}")
            keep.append(c); ptrs.append(ctypes.cast(ctypes.pointer(c), ctypes.c_void_p))
        argv = (ctypes.c_void_p * max(1, len(ptrs)))(*[p.value for p in ptrs])
        LAUNCHES.append((self.name, grid, block, shared_mem))
        rc = self.lib.emu_launch(self.name.encode(), grid[0], grid[1], grid[2], block[0],
                                 ctypes.c_ulong(shared_mem), argv)
        assert rc == 0, f"unknown kernel {self.name}"

class RawModule:
    def __init__(self, code=None, options=(), **kw):
        self.lib = ctypes.CDLL(_build(code))
        self.lib.emu_launch.restype = ctypes.c_int
    def get_function(self, name):
        return RawKernel(self.lib, name)

def install():
    m = sys.modules[__name__]
    sys.modules["cupy"] = m
    m.cuda = cuda
