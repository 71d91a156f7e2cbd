"""The device compiler's machine code, read back with nvdisasm: every f16 pair a kernel packs
must reach its use; and, with the device's NVRTC, every module compiles without spills.

ptxas of CUDA 13.0 compiled the old two-64-bit-store form of `bdq_q2_k` for sm_90 into code
that packed elements 2 and 3 of each chunk into a register it then overwrote, storing
(h3, 0) in their place: 21% of the elements wrong on an H200, while the PTX, every other
type and the CPU emulator (which compiles the CUDA source with g++) were right. Only the
device compiler's output shows such a bug, so this file reads it: a packing instruction
(`PRMT`, `F2FP...PACK_AB`) whose result is overwritten, unread, in the same basic block, in
the f16 tile kernels (`bdq_<type>`, where it happened) and in every other kernel.

Needs NVRTC (CuPy's, or the library in $KVSHARE_NVRTC_LIB: the device image's CUDA 13.0
`libnvrtc.so.13`, pip `nvidia-cuda-nvrtc==13.0.88`, which `.ci/run` installs) and nvdisasm
($KVSHARE_NVDISASM or on PATH; pip `nvidia-cuda-nvdisasm`); skips without them. A CUDA 13
NVRTC makes cubins that only a CUDA 13 nvdisasm reads. The spill check runs with
$KVSHARE_NVRTC_LIB only: `tests/test_kernels_compile.py` makes it with CuPy's NVRTC.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvshare import kernels

ARCH = "sm_90"
MODULES = kernels.module_names()


def _nvdisasm() -> str | None:
    return os.environ.get("KVSHARE_NVDISASM") or shutil.which("nvdisasm")


@functools.lru_cache(maxsize=None)
def _nvrtc_lib(path: str) -> ctypes.CDLL:
    """The NVRTC library at `path`, loaded once. NVRTC opens its builtins library by name:
    the one beside it is loaded first, so no LD_LIBRARY_PATH is needed."""
    for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(path)


@functools.lru_cache(maxsize=None)
def _compiled(name: str) -> tuple[bytes, str]:
    """Module `name` compiled whole for sm_90 with ptxas's resource report: (cubin, log)."""
    verbose = "-Xptxas=-v"
    lib_path = os.environ.get("KVSHARE_NVRTC_LIB")
    if lib_path is None:
        import sys  # noqa: PLC0415

        sys.path.insert(0, os.path.dirname(__file__))
        from test_kernels_compile import NVRTC, compile_module  # noqa: PLC0415

        if NVRTC is None:
            pytest.skip("NVRTC cannot be loaded")
        out, log = compile_module(name, ARCH, (verbose,))
        return out, log
    lib = _nvrtc_lib(lib_path)
    prog = ctypes.c_void_p()
    src = kernels.source(name).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{name}.cu".encode(), 0, None,
                                  None) == 0
    opts = [o.encode() for o in (*kernels.NVRTC_OPTIONS, "--device-as-default-execution-space",
                                 f"-arch={ARCH}", verbose)]
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        assert rc == 0, f"{name}.cu does not compile with {lib_path} (NVRTC error {rc}):\n{log}"
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        return buf.raw, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _kernels_sass(name: str, tmp_path) -> dict[str, str]:
    """Each kernel's disassembly in module `name`, by kernel name."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not found ($KVSHARE_NVDISASM, PATH)")
    path = tmp_path / f"{name}.cubin"
    path.write_bytes(_compiled(name)[0])
    r = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"nvdisasm cannot read this NVRTC's cubin: {r.stderr.strip()[:200]}")
    sections = re.split(r"(?m)^\.text\.", r.stdout)[1:]
    return {s.split(":", 1)[0]: ".text." + s for s in sections}


_INSN = re.compile(r"/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)\b")


def _width(op: str) -> int:
    return 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op else 1


# Matrix instructions name a fragment by its first register: HMMA.16816's A and accumulators
# are 4 registers, its B 2. Each operand is taken as 4 (reading more than it does can hide a
# dead pack, never invent one).
_FRAGMENT_OPS = ("HMMA", "IMMA", "DMMA", "BMMA", "HGMMA")


def dead_packs(sass: str) -> list[str]:
    """Packing instructions whose result is overwritten before any read, per basic block."""
    found: list[str] = []
    pending: dict[int, str] = {}  # register -> the unread packing instruction that wrote it
    for line in sass.splitlines():
        if re.match(r"^\s*\.L_|^\.text\.", line):
            pending.clear()  # a label: another basic block
            continue
        m = _INSN.search(line)
        if not m:
            continue
        pred, op, ops = m.groups()
        regs = [(int(r.group(1)), r.start()) for r in _REG.finditer(ops)]
        stores = op.startswith(("ST", "RED", "ATOM", "BRA", "EXIT", "CALL", "RET"))
        dst = None if stores or not regs or not ops.strip().startswith("R") else regs[0][0]
        srcs = regs if dst is None else regs[1:]
        w = 4 if op.startswith(_FRAGMENT_OPS) else _width(op)
        for r, _ in srcs:
            for k in range(w if stores or w == 4 else 1):
                pending.pop(r + k, None)
        if op.startswith(("BRA", "EXIT", "CALL", "RET", "BSYNC", "WARPSYNC")):
            pending.clear()
            continue
        if dst is None:
            continue
        for k in range(w):
            prev = pending.pop(dst + k, None)
            if prev is not None and pred is None:
                found.append(f"{prev.strip()}  overwritten by  {line.strip()}")
        if pred is None and (op.startswith("PRMT") or ("F2FP" in op and "PACK" in op)):
            pending[dst] = line
    return found


def test_dead_pack_detector_finds_the_q2_k_miscompile():
    """The SASS ptxas 13.0 made of the old bdq_q2_k's stores (abridged)."""
    old = """
        /*0ae0*/                   F2FP.F16.F32.PACK_AB R4, R19, R12 ;
        /*0af0*/                   F2FP.F16.F32.PACK_AB R21, RZ, R21 ;
        /*0b00*/                   F2FP.F16.F32.PACK_AB R12, R14, R15 ;
        /*0b10*/                   F2FP.F16.F32.PACK_AB R16, RZ, R16 ;
        /*0b20*/                   PRMT R13, R4, 0x7632, R13 ;
        /*0b30*/                   PRMT R14, R21, 0x7610, R14 ;
        /*0b40*/                   PRMT R15, R12, 0x7632, R15 ;
        /*0b50*/                   PRMT R8, R16, 0x5410, R9 ;
        /*0b60*/                   PRMT R8, R4, 0x5410, R13 ;
        /*0b70*/                   PRMT R5, R14, 0x5410, R5 ;
        /*0b80*/                   PRMT R4, R12, 0x5410, R15 ;
        /*0ba0*/                   STG.E.64 desc[UR10][R10.64], R8 ;
        /*0bb0*/                   STG.E.64 desc[UR10][R10.64+0x8], R4 ;
"""
    bad = dead_packs(old)
    assert len(bad) == 1 and "PRMT R8, R16" in bad[0]
    fixed = """
        /*0ac0*/                   F2FP.F16.F32.PACK_AB R13, R14, R13 ;
        /*0ae0*/                   F2FP.F16.F32.PACK_AB R14, R16, R15 ;
        /*0af0*/                   F2FP.F16.F32.PACK_AB R12, R19, R12 ;
        /*0b00*/                   F2FP.F16.F32.PACK_AB R15, R18, R9 ;
        /*0b20*/                   STG.E.128 desc[UR10][R10.64], R12 ;
"""
    assert dead_packs(fixed) == []


def test_f16_tile_kernels_store_every_packed_pair(tmp_path):
    bdq = {k: v for k, v in _kernels_sass("blocks", tmp_path).items() if k.startswith("bdq_")}
    assert len(bdq) >= 15, sorted(bdq)
    bad = {name: dead_packs(text) for name, text in bdq.items()}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("name", MODULES)
def test_no_kernel_overwrites_a_pair_unread(name, tmp_path):
    """The same check on every kernel of every module (the block mat-vecs beside their
    tiles, f16 K/V tiles, fragments, staged outputs): the bug was the compiler's, not the
    kernel's."""
    sass = _kernels_sass(name, tmp_path)
    missing = set(kernels.entry_points(name)) - set(sass)
    assert not missing, f"no machine code read for {sorted(missing)}"
    bad = {k: dead_packs(v) for k, v in sass.items()}
    assert not any(bad.values()), {k: v[:3] for k, v in bad.items() if v}


@pytest.mark.skipif("KVSHARE_NVRTC_LIB" not in os.environ,
                    reason="$KVSHARE_NVRTC_LIB unset: tests/test_kernels_compile.py checks "
                           "CuPy's NVRTC")
@pytest.mark.parametrize("name", MODULES)
def test_device_nvrtc_compiles_without_spills(name):
    """The device image's compiler, not only the one CuPy's wheel brings: a newer ptxas may
    allocate registers differently (CUDA 13.5's spills in `paged_attn_*_hd128`, 13.0's do
    not)."""
    _, log = _compiled(name)
    spills = [line for line in log.splitlines() if re.search(r"[1-9]\d* bytes spill", line)]
    assert "bytes spill stores" in log, f"no ptxas resource report for {name}.cu:\n{log[:2000]}"
    assert not spills, f"{name}.cu spills registers:\n{log}"
