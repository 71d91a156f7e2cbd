"""What CUDA graphs of decode steps rest on (`kvshare.model.gpu_graphs`): stream capture and
replay, the workspace the captured ops allocate from, paged attention from static device
buffers with the split count on the device, and rope tables computed from device positions.
Marked `gpu`: skipped without a CUDA device (conftest); under the CPU emulator
(tests/gpu_emu) the capture-model tests also check that the emulator refuses what breaks a
capture on a GPU (they skip on a real device, where CuPy's own errors differ).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvshare.backend import get_backend
from kvshare.ops import gpu
from kvshare.ops import gpu_runtime as rt
from kvshare.ops.attention import pad_block_tables, paged_attention
from kvshare.ops.rope import rope_cos_sin

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    return get_backend("cuda").xp


@pytest.fixture
def emu(cp):
    if not hasattr(cp, "CaptureError"):
        pytest.skip("checks the CPU emulator's capture model")
    return cp


def _scale_kernel():
    """A one-kernel op: y = 2 x (rms_norm-free: the rope kernel on a [n, 1, 2] view)."""
    return rt.kernel("rope", "rope_f32")


def _capture(cp, st, fn):
    st.begin_capture()
    try:
        with rt.capturing():
            fn()
    finally:
        g = st.end_capture()
    return g


# --- capture and replay --------------------------------------------------------------------------

def test_replay_reads_the_buffers_as_they_are_at_launch(cp):
    """A captured launch reads its inputs at replay: new contents, new results; the
    arguments (pointers, sizes) are the capture's."""
    be = get_backend("cuda")
    x = cp.asarray(np.ones((3, 1, 2), np.float32))
    cos = cp.zeros((3, 1), np.float32)
    sin = cp.zeros((3, 1), np.float32)
    st = cp.cuda.Stream()
    with st:
        g = _capture(cp, st, lambda: gpu.apply_rope(x, cos, sin, "neox"))
        # nothing ran during the capture
        assert np.array_equal(be.to_host(x), np.ones((3, 1, 2), np.float32))
        cos.set(np.full((3, 1), 2.0, np.float32))  # rotate by "cos 2, sin 0": x * 2
        g.launch(stream=st)
        g.launch(stream=st)
        st.synchronize()
        assert np.array_equal(be.to_host(x), np.full((3, 1, 2), 4.0, np.float32))
        sin.set(np.ones((3, 1), np.float32))
        cos.set(np.zeros((3, 1), np.float32))
        g.launch(stream=st)  # (a, b) -> (-b, a)
        st.synchronize()
        assert np.array_equal(be.to_host(x)[:, 0], np.tile([-4.0, 4.0], (3, 1)))


def test_in_place_array_ops_and_copies_are_captured(cp):
    be = get_backend("cuda")
    x = cp.asarray(np.arange(4, dtype=np.float32))
    y = cp.asarray(np.ones(4, np.float32))
    z = cp.zeros(4, np.float32)
    st = cp.cuda.Stream()
    with st:
        def step():
            x.__iadd__(y)
            z[...] = x
        g = _capture(cp, st, step)
        assert np.array_equal(be.to_host(z), np.zeros(4, np.float32))
        g.launch(stream=st)
        g.launch(stream=st)
        st.synchronize()
    assert np.array_equal(be.to_host(z), np.arange(4) + 2.0)


@pytest.mark.parametrize("what", ["empty", "zeros", "asarray", "copy", "ufunc", "get",
                                  "asnumpy", "int", "sync", "upload", "other stream",
                                  "default stream"])
def test_emulator_refuses_what_breaks_a_capture(emu, what):
    cp = emu
    x = cp.asarray(np.ones(4, np.float32))
    other = cp.cuda.Stream()
    st = cp.cuda.Stream()
    ops = {
        "empty": lambda: cp.empty(4, np.float32),
        "zeros": lambda: cp.zeros(4, np.float32),
        "asarray": lambda: cp.asarray(np.ones(4, np.float32)),
        "copy": lambda: x.astype(np.float64),
        "ufunc": lambda: x + x,
        "get": lambda: x.get(),
        "asnumpy": lambda: cp.asnumpy(x),
        "int": lambda: int(x[:1]),
        "sync": lambda: st.synchronize(),
        "upload": lambda: rt.upload(np.ones(4, np.float32), np.float32),
        "other stream": lambda: _on(other, lambda: x.__iadd__(x)),
        "default stream": lambda: _on(cp.cuda.Stream.null, lambda: x.fill(0)),
    }
    with st:
        st.begin_capture()
        try:
            with rt.capturing(), pytest.raises(RuntimeError):
                ops[what]()
        finally:
            st.end_capture()


def _on(stream, fn):
    with stream:
        fn()


def test_emulator_refuses_a_replay_on_freed_memory(emu):
    cp = emu
    x = cp.asarray(np.ones(4, np.float32))
    held = [cp.asarray(np.ones(4, np.float32))]
    st = cp.cuda.Stream()
    with st:
        g = _capture(cp, st, lambda: x.__iadd__(held[0]))
        g.launch(stream=st)
        held.clear()
        import gc  # noqa: PLC0415

        gc.collect()
        with pytest.raises(RuntimeError, match="freed"):
            g.launch(stream=st)


def test_no_capture_on_the_default_stream(cp):
    with pytest.raises(RuntimeError):
        cp.cuda.Stream.null.begin_capture()


# --- the workspace -------------------------------------------------------------------------------

def test_workspace_same_requests_same_offsets(cp):
    ws = rt.Workspace()
    with rt.using(ws):  # measuring: ordinary allocations, offsets counted
        a = rt.empty((3, 5), np.float32)
        m = ws.mark()
        rt.empty(7, np.int64)
        ws.release(m)
        rt.empty((2, 2), np.float16)
    assert a.shape == (3, 5) and ws.peak == 256 + 256
    ws.reserve(ws.peak)
    ptrs = []
    for _ in range(2):
        ws.reset()
        with rt.using(ws):
            a = rt.empty((3, 5), np.float32)
            m = ws.mark()
            b = rt.empty(7, np.int64)
            ws.release(m)
            c = rt.empty((2, 2), np.float16)
        ptrs.append((a.data.ptr, b.data.ptr, c.data.ptr))
        assert a.dtype == np.float32 and b.dtype == np.int64 and c.shape == (2, 2)
        assert all(p % rt.WORKSPACE_ALIGN == 0 for p in ptrs[-1])
    assert ptrs[0] == ptrs[1] and ptrs[0][1] == ptrs[0][2]  # released, then reused
    ws.reset()
    with rt.using(ws), pytest.raises(MemoryError):
        rt.empty(10**6, np.float32)
    assert rt.empty(3, np.float32).shape == (3,)  # outside `using`: CuPy's pool


# --- paged attention from static buffers ---------------------------------------------------------

@pytest.mark.parametrize("ctx", [20, 700, 1500])
def test_static_attention_equals_planned_attention(cp, ctx):
    """A decode batch's attention from static tiles/tables with the split count on the
    device (grid.z at the graph's maximum) gives the planned launch's result bit for bit,
    padding rows and all."""
    be = get_backend("cuda")
    rng = np.random.default_rng(ctx)
    n_seq, pad, n_head, n_kv, hd, bs = 3, 1, 4, 2, 64, 16
    lens = [ctx, ctx - 5, ctx // 2 + 1]
    nbs = [-(-(n + 1) // bs) for n in lens]
    nb = sum(nbs) + 2
    perm = rng.permutation(nb)
    tables, o = [], 0
    for k in nbs:
        tables.append(perm[o : o + k])
        o += k
    kv = cp.asarray(rng.standard_normal((2, nb, bs, n_kv, hd)).astype(np.float16))
    q = cp.asarray(rng.standard_normal((n_seq, n_head, hd)).astype(np.float32))
    qs = np.arange(n_seq + 1, dtype=np.int64)
    sp = np.array(lens, np.int64)
    bt = pad_block_tables(tables)
    want = be.to_host(paged_attention(q, kv[0], kv[1], bt, qs, sp, scale=0.125, backend=be))
    gc, ngc = gpu.group_chunk(n_head, n_kv)
    tiles = gpu.pa_tiles(qs, sp, gc)
    splits = gpu.pa_splits(tiles, 0, n_kv, ngc, n_seq, n_head, hd,
                           rt.device_attr("MultiProcessorCount"))
    assert (splits > 1) == (ctx > 512)
    b = n_seq + pad
    width = bt.shape[1] + 3
    t = np.full((b, width), -1, np.int32)
    t[:n_seq, : bt.shape[1]] = bt
    t[n_seq:] = t[0]
    ti = np.concatenate([tiles, tiles[:1]])
    ti[:, 0] = ti[:, 1] = np.arange(b)
    qp = cp.concatenate([q, q[:1]])
    st = gpu.StaticAttention(cp.asarray(t), cp.asarray(ti), cp.asarray(np.array([splits],
                             np.int32)), max_splits=64)
    got = be.to_host(gpu.paged_attention(qp, kv[0], kv[1], None, None, None, scale=0.125,
                                         static=st))
    assert np.array_equal(got[:n_seq], want)
    assert np.array_equal(got[n_seq], want[0])


# --- rope tables on the device -------------------------------------------------------------------

def test_rope_tables_from_device_positions(cp):
    be = get_backend("cuda")
    pos = np.array([0, 1, 17, 530, 4095, 32767], np.int64)
    ff = np.linspace(1, 4, 32).astype(np.float32)
    for base, scale, factors in ((1e4, 1.0, None), (5e5, 0.25, ff)):
        want = rope_cos_sin(pos, 64, base, scale, factors)
        for p in (pos, cp.asarray(pos)):
            got = rope_cos_sin(p, 64, base, scale, factors, backend=be)
            for g, w in zip(got, want):
                g = be.to_host(g)
                assert g.shape == w.shape and g.dtype == np.float32
                # float64 angles on both sides; cos/sin may differ in their last float64 bit
                np.testing.assert_allclose(g, w, rtol=0, atol=2 ** -24)


def test_yarn_rope_tables_from_device_positions(cp):
    """gpt-oss's YaRN tables on the device (`rope_cos_sin_yarn_f32`), from host and device
    positions, equal the host op's (`rope_yarn.yarn_cos_sin`) to one float32 ulp of the
    scaled values; with ext_factor 0 and with the ramp; and a capture takes them."""
    from kvshare.ops.rope_yarn import Yarn, mscale, yarn_cos_sin  # noqa: PLC0415

    be = get_backend("cuda")
    pos = np.array([0, 1, 17, 130, 4095, 32767, 131071], np.int64)
    for n_rot, base, y in ((64, 150000.0, Yarn(0.03125, 4096)),
                           (32, 10000.0, Yarn(0.25, 2048, ext_factor=0.0, attn_factor=0.8)),
                           (48, 5e5, Yarn(0.125, 8192, beta_fast=16.0, beta_slow=2.0))):
        want = yarn_cos_sin(pos, n_rot, base, y)
        ulp = 2.0 ** -24 * float(mscale(y)) * 2
        for p in (pos, cp.asarray(pos)):
            got = yarn_cos_sin(p, n_rot, base, y, backend=be)
            for g, w in zip(got, want):
                g = be.to_host(g)
                assert g.shape == w.shape == (len(pos), n_rot // 2) and g.dtype == np.float32
                np.testing.assert_allclose(g, w, rtol=0, atol=ulp)
        # the ramp mixes the angles: the tables are not plain rope's at either frequency
        plain = rope_cos_sin(pos, n_rot, base, 1.0)[0] * float(mscale(y))
        assert not np.allclose(want[0], plain, atol=1e-3)
    # captured: the tables come from the positions buffer at replay
    from kvshare.ops import gpu_runtime as rt  # noqa: PLC0415

    y = Yarn(0.03125, 4096)
    yarn_cos_sin(pos, 64, 150000.0, y, backend=be)  # the constants uploaded before capture
    d_pos = cp.asarray(pos)
    st = cp.cuda.Stream(non_blocking=False)
    ws = rt.Workspace()
    ws.reserve(1 << 20)
    with st, rt.using(ws):
        st.begin_capture()
        with rt.capturing():
            out = yarn_cos_sin(d_pos, 64, 150000.0, y, backend=be)
        graph = st.end_capture()
    d_pos[...] = cp.asarray(pos[::-1].copy())
    graph.launch(stream=st)
    st.synchronize()
    want = yarn_cos_sin(pos[::-1].copy(), 64, 150000.0, y)
    np.testing.assert_allclose(be.to_host(out[0]), want[0], rtol=0, atol=2.0 ** -23)
