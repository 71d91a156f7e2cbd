"""The machine code of the f16 tile kernels (`bdq_<type>` in kernels/blocks.cu), read back with
nvdisasm: every f16 pair the kernel packs must reach its store.

ptxas of CUDA 13.0 compiled the old two-64-bit-store form of `bdq_q2_k` for sm_90 into code
that packed elements 2 and 3 of each chunk into a register it then overwrote, storing
(h3, 0) in their place: 21% of the elements wrong on an H200, while the PTX, every other
type and the CPU emulator (which compiles the CUDA source with g++) were right. Only the
device compiler's output shows such a bug, so this test reads it: a packing instruction
(`PRMT`, `F2FP...PACK_AB`) whose result is overwritten, unread, in the same basic block.

Needs NVRTC (CuPy's, or the library in $KVSHARE_NVRTC_LIB, e.g. CUDA 13's libnvrtc.so.13) and
nvdisasm ($KVSHARE_NVDISASM or on PATH; pip: nvidia-cuda-nvdisasm); skips without them. A
CUDA 13 NVRTC makes cubins that only a CUDA 13 nvdisasm reads.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from kvshare import kernels

ARCH = "sm_90"


def _nvdisasm() -> str | None:
    return os.environ.get("KVSHARE_NVDISASM") or shutil.which("nvdisasm")


def _cubin(name: str) -> bytes:
    lib_path = os.environ.get("KVSHARE_NVRTC_LIB")
    if lib_path is None:
        import sys  # noqa: PLC0415

        sys.path.insert(0, os.path.dirname(__file__))
        from test_kernels_compile import NVRTC, compile_module  # noqa: PLC0415

        if NVRTC is None:
            pytest.skip("NVRTC cannot be loaded")
        out, _ = compile_module(name, ARCH)
        return out
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    src = kernels.source(name).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{name}.cu".encode(), 0, None,
                                  None) == 0
    opts = [o.encode() for o in (*kernels.NVRTC_OPTIONS, "--device-as-default-execution-space",
                                 f"-arch={ARCH}")]
    assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


_INSN = re.compile(r"/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)\b")


def _width(op: str) -> int:
    return 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op else 1


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
        w = _width(op)
        for r, _ in srcs:
            for k in range(w if stores else 1):
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
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not found ($KVSHARE_NVDISASM, PATH)")
    path = tmp_path / "blocks.cubin"
    path.write_bytes(_cubin("blocks"))
    r = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"nvdisasm cannot read this NVRTC's cubin: {r.stderr.strip()[:200]}")
    sections = re.split(r"(?m)^\.text\.", r.stdout)
    bdq = {s.split(":", 1)[0]: s for s in sections if s.startswith("bdq_")}
    assert len(bdq) >= 15, sorted(bdq)
    bad = {name: dead_packs(".text." + text) for name, text in bdq.items()}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}
