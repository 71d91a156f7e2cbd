"""The CPU emulator's own checks (tests/gpu_emu), each shown to catch its class of bug:

- thread orders (`KVSHARE_EMU_ORDER`, shim.h): a kernel whose threads read what a lower
  thread wrote without a barrier between passes in thread order (the default, where the
  writer has run first) and fails in reverse and shuffled order, as it may fail on a GPU;
  with the barrier it passes in every order;
- shared memory poisoned before each block: a block that reads a static `__shared__` array
  another block wrote reads NaN (on a GPU, whatever the memory held), not that block's
  values;
- the sanitizer build (`KVSHARE_EMU_SANITIZE=1`, fakecupy): a `float4` load at an address
  16 does not divide (a "misaligned address" fault on a GPU, silent on x86) aborts with
  UndefinedBehaviorSanitizer's report; aligned, it runs;
- asynchronous copies from pinned memory: the host writing the bytes of a copy it has not
  yet waited for raises when the copy is known done (on a GPU the device may read the new
  bytes); waited for first, or from pageable memory, it does not;
- threads: while one thread captures, another thread's copy on a non-blocking stream and its
  wait for an event go ahead (CuPy captures in relaxed mode), where its copy on the legacy
  default stream, which would join the capture, raises; a blocking copy on a non-blocking
  stream leaves another stream's asynchronous copy pending, as a GPU does.

Runs only on the emulator (`PYTHONPATH=tests/gpu_emu pytest -p emu_plugin`; CI's emulator
step): a GPU gives no control over its scheduling, so elsewhere it skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SRC = r"""
extern "C" __global__ void shift_%(name)s(const float* x, float* y) {
    __shared__ float s[128];
    const int t = threadIdx.x;
    s[t] = x[t];
    %(barrier)s
    y[t] = t > 0 ? s[t - 1] : 0.f;   // a lower thread's value
}
"""


@pytest.fixture(scope="module")
def cp():
    mod = sys.modules.get("cupy")
    if mod is None or not hasattr(mod, "COUNTS"):
        pytest.skip("checks of the CPU emulator (tests/gpu_emu) itself")
    return mod


def _shift(cp, barrier: bool, order: str, monkeypatch, seed: int = 1) -> bool:
    """Whether the kernel's output is the shifted input under `order`."""
    monkeypatch.setenv("KVSHARE_EMU_ORDER", order)
    monkeypatch.setenv("KVSHARE_EMU_SEED", str(seed))
    name = "sync" if barrier else "racy"
    code = SRC % {"name": name, "barrier": "__syncthreads();" if barrier else ""}
    fn = cp.RawModule(code=code).get_function(f"shift_{name}")
    ok = True
    # a fresh input each launch: the static shared array keeps the previous launch's values
    for rep in range(3):
        x = np.arange(128, dtype=np.float32) + 1000 * (rep + 1)
        y = cp.empty(128, np.float32)
        fn((1, 1, 1), (128, 1, 1), (cp.asarray(x), y))
        ok &= bool(np.array_equal(cp.asnumpy(y)[1:], x[:-1]))
    return ok


def test_missing_barrier_is_caught_in_reverse_and_shuffled_order(cp, monkeypatch):
    assert _shift(cp, False, "forward", monkeypatch)  # the writer ran first: no sign of it
    assert not _shift(cp, False, "reverse", monkeypatch)
    assert not _shift(cp, False, "shuffle", monkeypatch, seed=7)


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle"])
def test_barrier_orders_the_threads_in_every_order(cp, monkeypatch, order):
    assert _shift(cp, True, order, monkeypatch)


MISALIGNED = r"""
import sys
import numpy as np
import fakecupy
fakecupy.install()
import cupy as cp
src = r'''
extern "C" __global__ void load4(const float* x, float* y, int offset) {
    const float4 v = *reinterpret_cast<const float4*>(x + offset);
    y[threadIdx.x] = v.x + v.y + v.z + v.w;
}'''
fn = cp.RawModule(code=src).get_function("load4")
y = cp.empty(32, np.float32)
fn((1, 1, 1), (32, 1, 1), (cp.asarray(np.ones(64, np.float32)), y, np.int32(sys.argv[1])))
print(float(cp.asnumpy(y)[0]))
"""


def _load4(offset: int, sanitize: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent / "gpu_emu"),
               KVSHARE_EMU_SANITIZE="1" if sanitize else "0")
    return subprocess.run([sys.executable, "-c", MISALIGNED, str(offset)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_sanitizer_build_catches_a_misaligned_vector_load(cp):
    plain = _load4(1, sanitize=False)
    assert plain.returncode == 0 and plain.stdout.strip() == "4.0", plain.stderr
    bad = _load4(1, sanitize=True)
    assert bad.returncode != 0
    assert "misaligned address" in bad.stderr and "float4" in bad.stderr, bad.stderr
    good = _load4(4, sanitize=True)
    assert good.returncode == 0 and good.stdout.strip() == "4.0", good.stderr


def test_static_shared_memory_is_poisoned_for_each_block(cp):
    code = r"""
extern "C" __global__ void first_block_writes(const float* x, float* y) {
    __shared__ float s[32];
    const int t = threadIdx.x;
    if (blockIdx.x == 0) s[t] = x[t];
    __syncthreads();
    y[32 * blockIdx.x + t] = s[t];
}
"""
    fn = cp.RawModule(code=code).get_function("first_block_writes")
    x = np.arange(32, dtype=np.float32)
    y = cp.empty(64, np.float32)
    fn((2, 1, 1), (32, 1, 1), (cp.asarray(x), y))
    out = cp.asnumpy(y)
    assert np.array_equal(out[:32], x)
    assert np.isnan(out[32:]).all()  # not block 0's values


def _pinned(cp, n: int) -> np.ndarray:
    return np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.float32, n)


def test_host_write_to_pinned_memory_before_its_copy_is_known_done_raises(cp):
    """An asynchronous copy from pinned memory reads the host bytes when the device gets to
    it: writing them before the host knows the copy done is a race the emulator reports
    when it learns the copy done (here: the event recorded after it)."""
    stream = cp.cuda.Stream()
    host, dev = _pinned(cp, 64), cp.zeros(64, np.float32)
    host[:] = 1.0
    dev.set(host, stream=stream)
    ev = cp.cuda.Event()
    ev.record(stream)
    host[:] = 2.0  # too early
    with pytest.raises(RuntimeError, match="pending"):
        ev.synchronize()
    # the same, waited for first: fine, and the device holds what was sent
    host[:] = 3.0
    dev.set(host, stream=stream)
    ev.record(stream)
    ev.synchronize()
    host[:] = 4.0
    stream.synchronize()
    assert (cp.asnumpy(dev) == 3.0).all()


def test_copies_from_pageable_memory_or_without_a_stream_do_not_pend(cp):
    stream = cp.cuda.Stream()
    dev = cp.zeros(8, np.float32)
    pageable = np.ones(8, np.float32)
    dev.set(pageable, stream=stream)  # staged by the driver before it returns
    pageable[:] = 5.0
    host = _pinned(cp, 8)
    dev.set(host)  # no stream: synchronous
    host[:] = 6.0
    cp.cuda.Device().synchronize()  # nothing pending: no error
    ev = cp.cuda.Event()
    ev.synchronize()  # never recorded: done at once


def test_another_threads_copy_during_a_capture_is_refused_only_on_the_legacy_stream(cp):
    import threading  # noqa: PLC0415

    dev, ev = cp.arange(8, dtype=np.float32), cp.cuda.Event()
    ev.record()
    capturing, copier = cp.cuda.Stream(), cp.cuda.Stream(non_blocking=True)
    results: dict[str, object] = {}

    def other_thread() -> None:
        for name, stream in (("off", copier), ("legacy", None)):
            try:
                ev.synchronize()
                results[name] = cp.asnumpy(dev, stream=stream).tolist()
            except cp.CaptureError as exc:
                results[name] = exc

    capturing.begin_capture()
    try:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        with pytest.raises(cp.CaptureError):  # the capturing thread's own copy
            cp.asnumpy(dev, stream=copier)
    finally:
        capturing.end_capture()
    assert results["off"] == list(range(8))
    assert isinstance(results["legacy"], cp.CaptureError)


def test_a_copy_on_a_non_blocking_stream_leaves_other_copies_pending(cp):
    """A blocking copy on a non-blocking stream waits for that stream only: an asynchronous
    copy into pinned memory issued elsewhere has not landed (its bytes are poison) until the
    host knows it done."""
    src, other = cp.full(4, 7.0, dtype=np.float32), cp.ones(4, dtype=np.float32)
    back = _pinned(cp, 4)
    cp.asnumpy(src, out=back, blocking=False)
    assert cp.asnumpy(other, stream=cp.cuda.Stream(non_blocking=True)).tolist() == [1.0] * 4
    assert np.isnan(back).all()
    cp.asnumpy(other)  # on the legacy stream: joins every stream's work
    assert back.tolist() == [7.0] * 4


@pytest.fixture
def api(cp):
    if cp.API is None:
        pytest.skip("no CuPy installed: the emulator's API checks are off")
    return cp.API


def test_names_and_keywords_cupy_lacks_raise(cp, api):
    """What NumPy underneath would run and CuPy refuses: a function CuPy lacks, a keyword
    its function or ufunc does not take; what CuPy has runs."""
    a = cp.zeros(4, np.float32)
    assert "insert" not in api["numpy"] and "concatenate" in api["numpy"]
    with pytest.raises(AttributeError, match="insert"):
        cp.insert(a, 0, 1.0)
    with pytest.raises(TypeError, match="dtype"):
        cp.clip(a, 0, 1, dtype=np.float32)
    with pytest.raises(TypeError, match="where"):
        cp.exp(a, where=a > 0)
    with pytest.raises(TypeError, match="where"):
        np.exp(a, out=cp.empty(4, np.float32), where=a > 0)
    assert cp.concatenate([a, a], dtype=np.float32).shape == (8,)
    assert cp.clip(a, 0, 1).dtype == np.float32 and cp.exp(a).dtype == np.float32


def test_numpy_functions_on_device_arrays_follow_cupy(cp, api):
    """numpy.<f>(device array) runs cupy.<f> on a GPU: raises where CuPy has no <f> or <f>
    takes no such keyword."""
    a = cp.zeros(4, np.float32)
    assert float(np.sum(a)) == 0.0 and np.concatenate([a, a]).shape == (8,)
    with pytest.raises(AttributeError, match="insert"):
        np.insert(a, 0, 1.0)
    with pytest.raises(TypeError, match="dtype"):
        np.clip(a, 0, 1, dtype=np.float32)


def test_host_arrays_beside_device_arrays_raise(cp, api):
    """CuPy refuses a host numpy.ndarray in an operation with a device array ("Unsupported
    type"), either side, as an operand or as the output; scalars are fine."""
    dev, host = cp.zeros(4, np.float32), np.ones(4, np.float32)
    for op in (lambda: dev + host, lambda: host * dev, lambda: np.add(dev, 1, out=host),
               lambda: cp.maximum(dev, host)):
        with pytest.raises(TypeError, match="host array"):
            op()
    assert float((dev + np.float32(2))[0]) == 2.0 and float((dev * 3)[1]) == 0.0


def test_array_attributes_and_defaults_follow_cupy(cp, api):
    a = cp.zeros(4, np.float32)
    for name in ("ctypes", "setflags", "resize"):
        assert name not in api["ndarray"]
        with pytest.raises(AttributeError, match=name):
            getattr(a, name)
    assert a.reshape(2, 2).T.copy().shape == (2, 2)  # what CuPy's arrays have works
    assert cp.zeros(2).dtype == np.float64 and cp.empty(2).dtype == np.float64
