"""CPU-side checks of the GPU code path: every CUDA source in `kvshare.kernels` compiles with
NVRTC (through CuPy's NVRTC wrapper, called directly so that no CUDA device or driver is
needed), to PTX and to machine code for Ampere and Hopper, without register spills; every
kernel `kvshare.ops.gpu` launches is an entry point of the compiled module; every
`gpu_op("name")` the ops and the model call exists in `kvshare.ops.gpu` and accepts the
arguments it is called with; and the launch constants `gpu.py` shares with the CUDA sources
agree.

The compile tests skip (with the reason) only when the NVRTC library cannot be loaded at all
(`pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12`; both are in the `gpu-test` extra, which
`.ci/run` installs to run this file after the README's test command)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from kvshare import kernels
from kvshare.ops import gpu
from kvshare.ops import gpu_moe  # noqa: F401  (declares the moe_blocks kernels it launches)
from kvshare.ops import gpu_sampling  # noqa: F401  (declares the sampling kernel)
from kvshare.ops import gpu_mmvq  # noqa: F401  (declares the mmvq kernels it launches)

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "kvshare"


# --- NVRTC ---------------------------------------------------------------------------------------

def _nvrtc():
    try:
        from cupy.cuda import nvrtc  # noqa: PLC0415

        nvrtc.getVersion()
        return nvrtc, None
    except Exception as exc:  # ImportError, or the shared library cannot be loaded
        return None, f"NVRTC cannot be loaded ({type(exc).__name__}: {exc})"


NVRTC, NVRTC_MISSING = _nvrtc()
needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason=NVRTC_MISSING or "")


def _archs() -> tuple[str | None, list[str]]:
    """(PTX virtual arch, [cubin archs]) among those this NVRTC supports: the oldest of
    sm_75 and later as PTX (entry-point check), and sm_80 / sm_90 as machine code."""
    if NVRTC is None:
        return None, []
    sup = [int(a) for a in NVRTC.getSupportedArchs()]
    ptx = min((a for a in sup if a >= 75), default=None)
    return (f"compute_{ptx}" if ptx else None), [f"sm_{a}" for a in (80, 90) if a in sup]


PTX_ARCH, CUBIN_ARCHS = _archs()

# The options CuPy's RawModule passes besides ours (the architecture comes from the device).
_CUPY_OPTIONS = ("--device-as-default-execution-space",)


def compile_module(name: str, arch: str, extra: tuple[str, ...] = (),
                   part: str | None = None) -> tuple[bytes, str]:
    """Compile module `name` (its part `part`, when given) for `arch` ("compute_NN": PTX,
    "sm_NN": cubin); returns the output and NVRTC's log. Raises AssertionError with the log
    on a compile error."""
    prog = NVRTC.createProgram(kernels.source(name, part), f"{name}.cu", [], [])
    try:
        opts = [*kernels.NVRTC_OPTIONS, *_CUPY_OPTIONS, f"-arch={arch}", *extra]
        try:
            NVRTC.compileProgram(prog, opts)
        except NVRTC.NVRTCError as exc:
            raise AssertionError(f"{name}.cu does not compile for {arch}: {exc}\n"
                                 f"{NVRTC.getProgramLog(prog)}") from None
        log = NVRTC.getProgramLog(prog)
        out = NVRTC.getPTX(prog) if arch.startswith("compute_") else NVRTC.getCUBIN(prog)
        return out, log
    finally:
        NVRTC.destroyProgram(prog)


_ptx_cache: dict[str, str] = {}


def ptx_of(name: str) -> str:
    if name not in _ptx_cache:
        out, _ = compile_module(name, PTX_ARCH)
        _ptx_cache[name] = out.decode() if isinstance(out, bytes) else out
    return _ptx_cache[name]


MODULES = kernels.module_names()


def test_kernel_sources_are_found():
    assert set(MODULES) >= {"paged_attention", "kv_write", "rope", "rms_norm", "activation",
                            "embedding", "linear"}
    for name in MODULES:
        src = kernels.source(name)
        assert src.startswith(f'#line 1 "{kernels.PRELUDE}"')
        assert f'#line 1 "{name}.cu"' in src
        assert kernels.entry_points(name), f"{name}.cu declares no extern \"C\" kernel"
        assert "#include" not in src, "kernel sources must be self-contained (no includes)"


@needs_nvrtc
@pytest.mark.skipif(NVRTC is not None and PTX_ARCH is None,
                    reason="this NVRTC supports no arch >= 75")
@pytest.mark.parametrize("name", MODULES)
def test_compiles_to_ptx_with_every_entry_point(name):
    ptx = ptx_of(name)
    entries = set(re.findall(r"\.entry\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", ptx))
    declared = set(kernels.entry_points(name))
    assert declared <= entries, f"missing from the PTX: {sorted(declared - entries)}"
    launched = set(gpu.ENTRY_POINTS.get(name, ()))
    assert launched <= entries, f"gpu.py launches kernels {sorted(launched - entries)} " \
                                f"that {name}.cu does not define"


@needs_nvrtc
@pytest.mark.parametrize("arch", CUBIN_ARCHS)
@pytest.mark.parametrize("name", MODULES)
def test_compiles_to_machine_code_without_spills(name, arch):
    major, minor = NVRTC.getVersion()
    verbose = ("-Xptxas=-v",) if (major, minor) >= (12, 0) else ()
    try:
        cubin, log = compile_module(name, arch, verbose)
    except AssertionError:
        if not verbose:
            raise
        cubin, log = compile_module(name, arch)  # an NVRTC without -Xptxas
    assert len(cubin) > 0
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert all(s == ("0", "0") for s in spills), f"{name}.cu spills registers on {arch}:\n{log}"


# --- gpu.py against the sources ------------------------------------------------------------------

def test_every_launched_kernel_is_declared_and_every_kernel_is_launched():
    for module, entries in gpu.ENTRY_POINTS.items():
        assert module in MODULES, f"gpu.py names kernel module {module!r}, which does not exist"
        declared = set(kernels.entry_points(module))
        assert set(entries) <= declared, sorted(set(entries) - declared)
        assert declared <= set(entries), f"{module}.cu kernels never launched: " \
                                         f"{sorted(declared - set(entries))}"


def _gpu_op_calls() -> list[tuple[str, str, int, set[str]]]:
    """(file, op name, positional args, keyword names) of every `gpu_op("name")(...)` call in
    the ops and model packages."""
    calls = []
    for path in sorted([*(PKG / "ops").glob("*.py"), *(PKG / "model").glob("*.py")]):
        if path.name in ("gpu.py", "_dispatch.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
                    and isinstance(node.func.func, ast.Name) and node.func.func.id == "gpu_op"):
                arg = node.func.args[0]
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), \
                    f"{path.name}: gpu_op needs a literal name"
                calls.append((path.name, arg.value, len(node.args),
                              {k.arg for k in node.keywords if k.arg}))
    return calls


def test_every_gpu_op_exists_with_a_compatible_signature():
    calls = _gpu_op_calls()
    names = {c[1] for c in calls}
    assert {"paged_attention", "write_kv", "apply_rope", "rms_norm", "linear", "embedding",
            "geglu_tanh", "swiglu", "gelu_tanh"} <= names
    # every literal gpu_op("...") in the sources, including ones not called inline
    for path in [*(PKG / "ops").glob("*.py"), *(PKG / "model").glob("*.py")]:
        for name in re.findall(r'gpu_op\(\s*"([A-Za-z_0-9]+)"\s*\)', path.read_text()):
            names.add(name)
            assert callable(getattr(gpu, name, None)), f"{path.name}: gpu_op({name!r}) " \
                                                       "has no function in kvshare.ops.gpu"
    for file, name, n_pos, kws in calls:
        fn = getattr(gpu, name)
        try:
            inspect.signature(fn).bind(*([None] * n_pos), **{k: None for k in kws})
        except TypeError as exc:
            raise AssertionError(f"{file}: gpu_op({name!r}) is called with {n_pos} positional "
                                 f"args and keywords {sorted(kws)}: {exc}") from None


def _define(src: str, name: str) -> int:
    m = re.search(rf"#define\s+{name}\s+\(?([0-9]+)", src)
    assert m, f"#define {name} not found"
    return int(m.group(1))


def test_launch_constants_match_the_cuda_source():
    src = kernels.source("paged_attention")
    nw, rpw = _define(src, "PA_NW"), _define(src, "PA_RPW")
    assert nw * 32 == gpu.PA_THREADS
    assert nw * rpw == gpu.PA_ROWS
    assert gpu.PA_BN == _define(src, "PA_BN") == 32  # one key per lane
    assert _define(src, "PA_MAXD") == gpu.PA_MAXD
    for hd in gpu.PA_SPECIALISED_HD:
        assert f"paged_attn_f16_hd{hd}" in gpu.ENTRY_POINTS["paged_attention"]
    # the shared-memory size the host asks for: Hopper/Ampere opt-in limits must hold
    # everything up to the generic kernel's largest head size
    assert gpu._pa_smem_bytes(256, 2) == 16384 + 2048 + 256 + 256 * 34 * 2 + 32 * 256 * 2
    assert gpu._pa_smem_bytes(gpu.PA_MAXD, 4) <= 227 * 1024


def test_gated_delta_launch_constants_match_the_cuda_source():
    from kvshare.ops import gpu_hybrid

    src = kernels.source("gated_delta")
    for name in ("GD_WARPS", "GD_COLS", "GD_TILE", "GD_QK_TILE"):
        assert _define(src, name) == getattr(gpu_hybrid, name), name


def test_mma_attention_launch_constants_match_the_cuda_source():
    src = kernels.source("paged_attention_mma")
    nw = _define(src, "PM_NW")
    assert nw * 16 == gpu.PM_ROWS  # one 16-row mma tile per row group
    # each entry point: the block size the host launches = its launch bound = PM_NW row
    # groups of DS warps; its head size is the template's
    entries = {int(m[1]): (int(m[0]), int(m[2]), int(m[3])) for m in re.findall(
        r"__launch_bounds__\((\d+)\) paged_attn_mma_f16_hd(\d+)\(PM_PARAMS\) "
        r"\{ paged_attn_mma_impl<\2, (\d+), (\d+)>", src)}
    assert sorted(entries) == sorted(gpu.PM_HD)
    for hd in gpu.PM_HD:
        assert f"paged_attn_mma_f16_hd{hd}" in gpu.ENTRY_POINTS["paged_attention_mma"]
        bound, ds, bn = entries[hd]
        assert bound == gpu.pm_threads(hd) == nw * ds * 32, hd
        assert bn <= bound and bn % 16 == 0  # one thread per key resolves the key tile
    # the tiles the host cuts for it hold PM_ROWS rows of (token, head)
    tiles = gpu.pa_tiles(np.array([0, 100]), np.array([7]), 2, gpu.PM_ROWS)
    assert tiles[:, 2].max() == gpu.PM_ROWS // 2 and tiles[:, 2].sum() == 100


def test_bmv_launch_constants_match_the_cuda_source():
    from kvshare.ops import gpu_blocks  # noqa: PLC0415

    src = kernels.source("blocks")
    # the warps of a CTA split its rows' chunks: the host launches that many
    assert _define(src, "BK_MV_WARPS") == gpu_blocks.BMV_WARPS
    # BkRows<M, NW>::R: 2 for M = 1 or bmvglu, else 4; rows per CTA
    assert "(M == 1 || NW == 2) ? 2 : 4" in src
    rows = {m: 2 if m == 1 else 4 for m in gpu_blocks.BMV_M}
    assert rows == gpu_blocks.BMV_ROWS_PER_CTA
    assert gpu_blocks.BMVGLU_ROWS_PER_CTA == 2


def test_moe_blocks_reuses_the_block_decoders_without_their_kernels():
    assert kernels.uses("moe_blocks") == "blocks"
    src = kernels.source("moe_blocks")
    assert "struct BkQ4_K" in src and '#line 1 "blocks.cu"' in src
    assert not re.search(r'^extern\s+"C"[^\n]*\b(bmv|bdq|bemb)_', src, re.M)
    assert set(kernels.entry_points("moe_blocks")) == set(gpu_moe.ENTRY_POINTS)
    assert all(kernels.uses(m) is None for m in MODULES if m != "moe_blocks")


SPLIT = [m for m in MODULES if kernels.parts(m) != (None,)]


def test_modules_by_type_compile_in_parts_that_cover_their_kernels():
    assert set(SPLIT) == {"blocks", "moe_blocks", "mmvq"}
    assert kernels.parts("rope") == (None,) and kernels.entry_part("rope", "rope_f32") is None
    for name in SPLIT:
        parts = kernels.parts(name)
        assert {"q4_k", "q6_k", "q8_0"} <= set(parts)
        whole = kernels.source(name)
        untyped = set(kernels.entry_points(name, "")) if "" in parts else set()
        seen: list[str] = []
        for part in parts:
            src = kernels.source(name, part)
            # only kernel lines are blanked: every line number holds
            assert src.count("\n") == whole.count("\n") and len(src) < len(whole)
            assert all(a == b or not a for a, b in zip(src.split("\n"), whole.split("\n")))
            own = set(kernels.entry_points(name, part)) - untyped
            assert all(kernels.entry_part(name, e) == part for e in own)
            assert part == "" or own, f"{name} part {part!r} defines no kernel of its type"
            seen += own
        # each typed kernel in exactly one part; the untyped ones in every part, launched from ""
        assert sorted(seen + sorted(untyped)) == sorted(kernels.entry_points(name))
        assert all(kernels.entry_part(name, e) == "" for e in untyped)
    assert kernels.entry_part("blocks", "bmvglu_iq4_xs_m16") == "iq4_xs"
    assert kernels.entry_part("mmvq", "quantize_q8_1") == ""
    with pytest.raises(KeyError, match="no part 'q9_k'"):
        kernels.source("blocks", "q9_k")
    with pytest.raises(KeyError, match="no part"):
        kernels.source("rope", "q4_k")


@needs_nvrtc
@pytest.mark.skipif(NVRTC is not None and PTX_ARCH is None,
                    reason="this NVRTC supports no arch >= 75")
@pytest.mark.parametrize("name,part", [("blocks", "q4_k"), ("moe_blocks", "mxfp4"),
                                       ("moe_blocks", ""), ("mmvq", "q6_k")])
def test_a_part_compiles_to_its_kernels_only(name, part):
    out, log = compile_module(name, PTX_ARCH, part=part)
    ptx = out.decode() if isinstance(out, bytes) else out
    entries = set(re.findall(r"\.entry\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", ptx))
    assert entries == set(kernels.entry_points(name, part))
    assert not log.strip()


def test_moe_launch_constants_match_the_cuda_source():
    src = kernels.source("moe_blocks")
    assert _define(src, "GM_WARPS") == gpu_moe.GM_WARPS
    assert gpu_moe.GM_M == (1, 4, 16)
    # GmRows<M, NW>::R: gmv as bmv (2 for M = 1, else 4), gmvglu 2
    assert "(NW == 2 || M == 1) ? 2 : 4" in src
    rows = {(m, nw): 2 if (nw == 2 or m == 1) else 4 for m in gpu_moe.GM_M for nw in (1, 2)}
    assert rows == gpu_moe.GM_ROWS_PER_CTA
    assert set(gpu_moe.ACTIVATIONS) == {"silu", "gelu_tanh", "swiglu_oai"}


# --- the host-side planning of paged attention (pure NumPy) --------------------------------------

@pytest.mark.parametrize("gc", [1, 2, 4, 8, 16])
def test_tiles_cover_every_query_row_once(gc):
    rng = np.random.default_rng(gc)
    lens = rng.integers(0, 40, 7)
    lens[2] = 0
    qs = np.concatenate([[0], np.cumsum(lens)])
    sp = rng.integers(0, 500, 7)
    tiles = gpu.pa_tiles(qs, sp, gc)
    assert tiles.dtype == np.int32 and tiles.shape[1] == 4
    seen = np.zeros(qs[-1], int)
    for seq, row0, nr, pos0 in tiles:
        assert 1 <= nr <= max(1, gpu.PA_ROWS // gc) and nr * gc <= max(gpu.PA_ROWS, gc)
        assert qs[seq] <= row0 and row0 + nr <= qs[seq + 1]
        assert pos0 == sp[seq] + (row0 - qs[seq])
        seen[row0 : row0 + nr] += 1
    assert (seen == 1).all()


def test_split_kv_only_for_small_grids_with_long_ranges():
    one_decode = gpu.pa_tiles(np.array([0, 1]), np.array([6000]), 4)
    assert gpu.pa_splits(one_decode, 0, 1, 1, 1, 4, 256, 132) > 1
    assert gpu.pa_splits(one_decode, 128, 1, 1, 1, 4, 256, 132) == 1  # window: short range
    short = gpu.pa_tiles(np.array([0, 1]), np.array([127]), 4)  # 128 keys: one split
    assert gpu.pa_splits(short, 0, 1, 1, 1, 4, 256, 132) == 1
    # a decode token at 1K of context on 8 KV heads: splits of >= PA_SPLIT_KEYS (64) keys
    d1k = gpu.pa_tiles(np.array([0, 1]), np.array([1023]), 2)
    assert gpu.pa_splits(d1k, 0, 8, 1, 1, 16, 128, 132) == 16
    assert gpu.pa_splits(d1k, 0, 8, 1, 1, 16, 128, 32) == 8  # 2 CTAs per SM at most
    prefill = gpu.pa_tiles(np.array([0, 4096]), np.array([0]), 4)
    assert gpu.pa_splits(prefill, 0, 1, 1, 4096, 4, 256, 132) == 1  # 1024 tiles fill the GPU


def test_block_table_check_matches_the_numpy_op():
    from kvshare.ops.attention import paged_attention  # noqa: PLC0415

    bt = np.array([[0, 1, -1], [2, -1, -1]], np.int32)
    qs, sp = np.array([0, 3, 4]), np.array([30, 20])
    # seq 0 reads positions < 33: 3 blocks of 16, but its third entry is -1
    kc = np.zeros((4, 16, 1, 8), np.float32)
    with pytest.raises(IndexError, match="sequence 0"):
        paged_attention(np.zeros((4, 1, 8), np.float32), kc, kc, bt, qs, sp, scale=1.0)
    with pytest.raises(IndexError, match="sequence 0"):
        gpu._check_tables(bt, qs, sp, 16, 4, 0)
    # with a window of 8, seq 0 needs blocks 1..2 only, seq 1 (positions 13..20) blocks 0..1
    with pytest.raises(IndexError, match="sequence 0"):
        gpu._check_tables(bt, qs, sp, 16, 4, 8)
    bt_ok = np.array([[0, 1, 3], [2, 1, -1]], np.int32)
    gpu._check_tables(bt_ok, qs, sp, 16, 4, 0)
    with pytest.raises(IndexError):
        gpu._check_tables(bt_ok, qs, sp, 16, 3, 0)  # block id 3 >= n_blocks


def test_weights_name_the_parts_their_kernels_are_in(monkeypatch):
    """What `gpu_runtime.kernel_units` compiles ahead for a GPU model: a block weight's types
    (and with the 8-bit-activation mat-vec, mmvq's parts and its quantizer's), stacked
    experts' types and the routing part, then every module without parts, whole: each a part
    `kernels.parts` has. (Host arrays stand in for the device bytes: no device is needed.)"""
    from gguf import GGMLQuantizationType as Q

    from kvshare.ops import gpu_blocks, gpu_moe, gpu_runtime

    k = 256
    w = gpu_blocks.GpuBlockWeight([
        gpu_blocks.BlockPart(np.zeros((4, gpu_blocks.row_bytes(Q.Q4_K, k)), np.uint8), Q.Q4_K,
                             4, k, 0),
        gpu_blocks.BlockPart(np.zeros((2, gpu_blocks.row_bytes(Q.Q6_K, k)), np.uint8), Q.Q6_K,
                             2, k, 4)])
    experts = gpu_moe.GpuStackedExperts(
        [(np.zeros((3 * 2, 17 * k // 32), np.uint8), gpu_moe.MXFP4, 2)], 3, k)
    monkeypatch.delenv("KVSHARE_GPU_MATVEC", raising=False)
    assert w.kernel_parts() == {("blocks", "q4_k"), ("blocks", "q6_k")}
    monkeypatch.setenv("KVSHARE_GPU_MATVEC", "q8")
    assert w.kernel_parts() == {("blocks", "q4_k"), ("blocks", "q6_k"), ("mmvq", "q4_k"),
                                ("mmvq", "q6_k"), ("mmvq", "")}
    assert experts.kernel_parts() == {("moe_blocks", "mxfp4"), ("moe_blocks", "")}

    class Layer:  # weights as a model holds them: attributes, lists, a dict
        def __init__(self):
            self.wq, self.ffn = w, {"experts": [experts]}
            self.norm = np.ones(k, np.float32)

    units = gpu_runtime.kernel_units([None, Layer(), [Layer()]])
    typed = [u for u in units if u[1] is not None]
    assert set(typed) == w.kernel_parts() | experts.kernel_parts() and len(typed) == 7
    assert units[len(typed):] == [(m, None) for m in MODULES if kernels.parts(m) == (None,)]
    for module, part in units:
        assert part in kernels.parts(module), (module, part)
