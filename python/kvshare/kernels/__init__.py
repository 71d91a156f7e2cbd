"""CUDA C++ sources of the GPU ops, compiled at run time with NVRTC through CuPy.

Each `<name>.cu` in this package is one module; `source(name)` is the exact text NVRTC gets:
`common.cuh` (the shared prelude: f16 conversions, warp reductions) followed by the module,
with `#line` markers so compiler messages name the right file and line. A module whose first
line is `// uses: <other>.cu` gets `<other>.cu`'s text in between, less its `extern "C"`
kernel lines (its device functions and templates only: `moe_blocks.cu` reuses the GGUF block
decoders of `blocks.cu` without compiling its kernels twice). The sources need no
include paths and no CUDA headers, so the same text compiles on a GPU machine (`load_module`)
and on a CPU-only one (`tests/test_kernels_compile.py` calls NVRTC directly).

The sources are package data read through `importlib.resources` (maturin puts every file under
`python/kvshare` into the wheel, `.cu`/`.cuh` included). This module imports CuPy only through
`kvshare.backend`, and only in `load_module`.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from importlib import resources
from typing import Any

PRELUDE = "common.cuh"

# NVRTC options of every module (CuPy adds the target architecture of the device). No fast
# math: the kernels are checked against their NumPy twins at float32 tolerances.
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)

_ENTRY_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?'
                       r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def _read(filename: str) -> str:
    return resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")


def module_names() -> list[str]:
    """Names of the kernel modules (the `.cu` files of this package, without the suffix)."""
    return sorted(p.name[:-3] for p in resources.files(__package__).iterdir()
                  if p.name.endswith(".cu"))


_USES_RE = re.compile(r"\A// uses: ([A-Za-z_][A-Za-z0-9_]*)\.cu[ \t]*$", re.M)
# a one-line kernel definition (every `extern "C"` line of a module another module uses)
_KERNEL_LINE_RE = re.compile(r'^extern\s+"C"\s+__global__\s.*$', re.M)


def uses(name: str) -> str | None:
    """The module whose device code module `name` reuses (its `// uses: <other>.cu` line)."""
    m = _USES_RE.match(_read(name + ".cu"))
    return m.group(1) if m else None


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The full NVRTC source of module `name`: the prelude, the module it uses (if any) less
    its kernel lines (blanked, so line numbers hold), then `<name>.cu`."""
    if name not in module_names():
        raise KeyError(f"no kernel module {name!r} (have {', '.join(module_names())})")
    dep = uses(name)
    used = ""
    if dep is not None:
        if dep not in module_names() or uses(dep) is not None:
            raise KeyError(f"{name}.cu uses {dep!r}, which is not a module without uses")
        body = _KERNEL_LINE_RE.sub("", _read(dep + ".cu"))
        used = f'#line 1 "{dep}.cu"\n{body}\n'
    return (f'#line 1 "{PRELUDE}"\n{_read(PRELUDE)}\n{used}'
            f'#line 1 "{name}.cu"\n{_read(name + ".cu")}')


def entry_points(name: str) -> list[str]:
    """The `extern "C" __global__` function names declared in module `name`'s source."""
    return _ENTRY_RE.findall(_read(name + ".cu"))


_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}


def load_module(name: str) -> Any:
    """Module `name` as a `cupy.RawModule` for the current CUDA device (compiled by NVRTC on
    first use, then cached per process and device; CuPy also keeps its on-disk kernel cache)."""
    from kvshare.backend import cupy_module  # noqa: PLC0415

    cp = cupy_module()
    key = (name, cp.cuda.runtime.getDevice())
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cp.RawModule(code=source(name), options=NVRTC_OPTIONS)
                _modules[key] = mod
    return mod


def get_function(module: str, entry: str) -> Any:
    """Kernel `entry` of module `module` (a `cupy.RawKernel`), for the current device."""
    return load_module(module).get_function(entry)
