"""`gpu_runtime.kernel_profile`, the device time per kernel that bench/gpu_kernel_profile.py
reads: every launch of a step through `gpu_runtime.kernel` and `gemm_f16` is timed once under
its entry point's name, a kernel's attributes still reach it, and a capture refuses it.
Marked `gpu`: skipped without a CUDA device; CI runs it on the CPU emulator (tests/gpu_emu),
where the emulator's own record of the launches is the reference.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvshare.model.batch import SeqChunk
from kvshare.ops import gpu_runtime as rt
from test_model_gpu import _tokens, write_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvshare.model.loader import load_model  # noqa: PLC0415

    path = tmp_path_factory.mktemp("tiny-profile") / "qwen3.gguf"
    write_model(path, "qwen3")
    m = load_model(path, "cuda")
    m.cuda_graphs = False
    return m


def _decode(model, cache, pos):
    return model.forward([SeqChunk(_tokens(1, seed=pos), pos, np.arange(4))], cache)


def test_profile_times_each_launch_once(model):
    cache = model.new_cache(4, 16)
    model.forward([SeqChunk(_tokens(20, seed=1), 0, np.arange(4), logits="last")], cache)
    cp = rt.cupy_module()
    launches = getattr(cp, "LAUNCHES", None)
    n0 = len(launches) if launches is not None else 0
    g0 = cp.COUNTS["gemm"] if launches is not None else 0
    with rt.kernel_profile() as prof:
        _decode(model, cache, 20)
        got = prof.collect()
        # a second collect adds nothing new; the next step's launches add to the totals
        assert prof.collect() == got
        _decode(model, cache, 21)
        twice = prof.collect()
    assert got, "no launch was timed"
    for name, (calls, ms) in got.items():
        assert calls >= 1 and ms >= 0.0, name
        assert twice[name][0] == 2 * calls, name
    assert rt._profile is None  # noqa: SLF001 - the profile ends with its block
    if launches is not None:
        # the emulator records every launch (kernels by name, cuBLAS GEMMs counted): each one
        # of the two steps was timed once
        seen = Counter(name for name, *_ in launches[n0:])
        if cp.COUNTS["gemm"] > g0:
            seen["cublas_gemm_f16"] = cp.COUNTS["gemm"] - g0
        assert {n: c for n, (c, _) in twice.items()} == dict(seen)


def test_timed_kernel_forwards_attributes():
    with rt.kernel_profile():
        fn = rt.kernel("rope", "rope_f32")
        fn.max_dynamic_shared_size_bytes = 0
        assert fn.max_dynamic_shared_size_bytes == 0
        assert type(fn).__name__ == "_TimedKernel"
    assert type(rt.kernel("rope", "rope_f32")).__name__ != "_TimedKernel"


def test_profile_refuses_a_capture_and_a_second_profile():
    with rt.kernel_profile() as prof:
        with pytest.raises(RuntimeError, match="already active"):
            rt.kernel_profile().__enter__()
        with rt.capturing(), pytest.raises(RuntimeError, match="captures"):
            prof.span("x")
