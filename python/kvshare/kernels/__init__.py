"""CUDA C++ sources of the GPU ops, compiled at run time with NVRTC through CuPy.

Each `<name>.cu` in this package is one module; `source(name)` is the exact text NVRTC gets:
`common.cuh` (the shared prelude: f16 conversions, warp reductions) followed by the module,
with `#line` markers so compiler messages name the right file and line. A module whose first
line is `// uses: <other>.cu` gets `<other>.cu`'s text in between, less its `extern "C"`
kernel lines (its device functions and templates only: `moe_blocks.cu` reuses the GGUF block
decoders of `blocks.cu` without compiling its kernels twice). A module with a line
`// parts by type: <family> ...` (`blocks.cu`, `moe_blocks.cu`, `mmvq.cu`: a kernel per GGUF
block type and family, each defined on one line, `<family>_<type>[_m<M>]`) is compiled in
parts, one per block type (`source(name, part)`: the module less the other types' kernel
lines; part "" has the kernels of no type), each at its first launch: a model runs the two or
three types its file has, and one type's part compiles in a fourteenth of the whole
module's time. The sources need no
include paths and no CUDA headers, so the same text compiles on a GPU machine (`load_module`)
and on a CPU-only one (`tests/test_kernels_compile.py` calls NVRTC directly).

The sources are package data read through `importlib.resources` (maturin puts every file under
`python/kvshare` into the wheel, `.cu`/`.cuh` included). This module imports CuPy only through
`kvshare.backend`, and only in `load_module`.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable

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
def source(name: str, part: str | None = None) -> str:
    """The full NVRTC source of module `name`: the prelude, the module it uses (if any) less
    its kernel lines (blanked, so line numbers hold), then `<name>.cu` (with `part`: as that
    part compiles it, see `parts`)."""
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
            f'#line 1 "{name}.cu"\n{_own_text(name, part)}')


def entry_points(name: str, part: str | None = None) -> list[str]:
    """The `extern "C" __global__` function names declared in module `name`'s source (of
    its part `part` only, when given)."""
    return _ENTRY_RE.findall(_read(name + ".cu") if part is None else _own_text(name, part))


# ---- modules compiled in parts, one per GGUF block type ---------------------------------------
_PARTS_RE = re.compile(r"^// parts by type: ([a-z0-9_]+(?: [a-z0-9_]+)*)[ \t]*$", re.M)


@lru_cache(maxsize=None)
def _part_families(name: str) -> tuple[str, ...]:
    """The kernel families of module `name` written one kernel per block type (its `// parts
    by type:` line); () for a module compiled whole."""
    m = _PARTS_RE.search(_read(name + ".cu"))
    return tuple(m.group(1).split()) if m else ()


def _typed_name(families: tuple[str, ...]) -> str:
    # a typed kernel's name, `<family>_<type>[_m<M>]`; its one group: the type
    return rf"(?:{'|'.join(map(re.escape, families))})_([a-z0-9_]+?)(?:_m[0-9]+)?"


@lru_cache(maxsize=None)
def _typed_line_re(families: tuple[str, ...]) -> re.Pattern[str]:
    # a typed kernel's one-line definition `extern "C" ... <name>(...) { ... }`
    return re.compile(r'^extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?'
                      rf"{_typed_name(families)}\s*\(.*\}}[ \t]*$", re.M)


@lru_cache(maxsize=None)
def _typed_name_re(families: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(_typed_name(families))


def entry_part(name: str, entry: str) -> str | None:
    """The part of module `name` that defines kernel `entry`: its block type, "" for a
    kernel of no type, None where the module is compiled whole."""
    families = _part_families(name)
    if not families:
        return None
    m = _typed_name_re(families).fullmatch(entry)
    return m.group(1) if m else ""


@lru_cache(maxsize=None)
def parts(name: str) -> tuple[str | None, ...]:
    """The parts module `name` compiles in: (None,) for a whole module, else its block types
    (sorted) and "" where it also has kernels of no type."""
    if not _part_families(name):
        return (None,)
    return tuple(sorted({entry_part(name, e) or "" for e in entry_points(name)}))


@lru_cache(maxsize=None)
def _own_text(name: str, part: str | None) -> str:
    """`<name>.cu` as part `part` compiles it: the kernel lines of the other block types (of
    every type, for part "") blanked, so line numbers hold."""
    text = _read(name + ".cu")
    if part is None:
        return text
    if part not in parts(name):
        raise KeyError(f"kernel module {name!r} has no part {part!r} (have "
                       f"{', '.join(map(repr, parts(name)))})")
    return _typed_line_re(_part_families(name)).sub(
        lambda m: m.group(0) if m.group(1) == part else "", text)


_lock = threading.Lock()
_modules: dict[tuple[str, str | None, int], Any] = {}


def load_module(name: str, part: str | None = None) -> Any:
    """Module `name` (its part `part`, see `parts`) as a `cupy.RawModule` for the current
    CUDA device (compiled by NVRTC on first use, then cached per process and device; CuPy
    also keeps its on-disk kernel cache)."""
    from kvshare.backend import cupy_module  # noqa: PLC0415

    cp = cupy_module()
    key = (name, part, cp.cuda.runtime.getDevice())
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cp.RawModule(code=source(name, part), options=NVRTC_OPTIONS)
                _modules[key] = mod
    return mod


def compile_parallel(units: Iterable[tuple[str, str | None]], workers: int | None = None
                     ) -> int:
    """Compile kernel units (`(module, part)`, see `parts`) for the current device at once, in
    `workers` threads (default: one per CPU, at most one per unit): NVRTC runs without the
    interpreter lock, so a fresh start's first steps find their kernels compiled in about the
    time of the slowest unit instead of the sum (which is what compiling each at its first
    launch costs). A unit compiled before costs a cache look-up. Returns how many units were
    given; raises the first unit's compile error after every unit has finished."""
    from kvshare.backend import cupy_module  # noqa: PLC0415

    cp = cupy_module()
    dev = cp.cuda.runtime.getDevice()
    mods = [load_module(name, part) for name, part in dict.fromkeys(units)]
    if not mods:
        return 0

    def build(mod: Any) -> None:
        with cp.cuda.Device(dev):  # the worker thread's current device (and its context)
            mod.compile()

    n = max(1, min(len(mods), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(n, thread_name_prefix="kvshare-nvrtc") as pool:
        done = [pool.submit(build, m) for m in mods]
    for f in done:
        f.result()
    return len(mods)


def get_function(module: str, entry: str) -> Any:
    """Kernel `entry` of module `module` (a `cupy.RawKernel`, from the part that defines
    it), for the current device."""
    return load_module(module, entry_part(module, entry)).get_function(entry)
