"""The gated delta rule's decode step as one kernel on the cache's states by slot
(`kvshare.ops.gpu_hybrid.gated_delta_step_slots`, kernels/gated_delta.cu) against NumPy's
`step_impl` (`kvshare.ops.gated_delta.gated_delta_step` on the CPU) run on the gathered states:
the outputs and the updated states within float32 rounding (the kernel's sums run in its own
fixed order, NumPy's in BLAS's), the other slots and the other layers of the state array
untouched bit for bit, padding rows (slot < 0) giving zeros and touching nothing; key heads
shared by several value heads (H_k < H_v), Dk != Dv, Dk above what a thread keeps in
registers, strided inputs (views of a fused projection), device and host slots, and qwen35's
decode on the GPU taking it on `cache.states[SSM]` with no gather or scatter of that state.
The rule over a step's sequences of rows (`gated_delta_seq_slots`: prompt chunks beside decode
rows, each sequence a scan) against the decode kernel run one row at a time (bit for bit), a
float64 recurrence and the CPU's chunked form. Marked `gpu`: skipped without a CUDA device; runs on the CPU emulator (tests/gpu_emu).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.ops import gpu_hybrid
from kvshare.ops.gated_delta import gated_delta_step

pytestmark = pytest.mark.gpu

MODELS = Path(__file__).resolve().parent / "data" / "models"
# |o - ref| <= RTOL * max|ref| (the states alike): float32 sums in another order
RTOL = 1e-6


def inputs(rng: np.random.Generator, B: int, Hk: int, H: int, Dk: int, Dv: int):
    """q, k L2-normalised per head (as the model feeds them), g <= 0, beta in (0, 1)."""
    q = rng.standard_normal((B, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, Hk, Dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, Dv)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (B, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (B, H)).astype(np.float32)
    return q, k, v, g, beta


def close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = float(np.abs(got - ref).max()) if ref.size else 0.0
    bound = RTOL * max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-30)
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def run_case(B: int, Hk: int, H: int, Dk: int, Dv: int, *, n_slots: int, n_rec: int,
             rec: int, slots: list[int], device_slots: bool, seed: int,
             strided: bool = False) -> None:
    import cupy as cp

    rng = np.random.default_rng(seed)
    q, k, v, g, beta = inputs(rng, B, Hk, H, Dk, Dv)
    states = rng.standard_normal((n_slots, n_rec, H, Dk, Dv)).astype(np.float32)
    live = [b for b in range(B) if slots[b] >= 0]
    # the reference: NumPy's step on the live rows' gathered states
    st_ref = states[[slots[b] for b in live], rec].copy()
    o_ref = np.zeros((B, H, Dv), np.float32)
    if live:
        o_ref[live] = gated_delta_step(q[live], k[live], v[live], g[live], beta[live], st_ref,
                                       scale=1.0 / np.sqrt(Dk))
    want = states.copy()
    for i, b in enumerate(live):
        want[slots[b], rec] = st_ref[i]

    d_states = cp.asarray(states)
    if strided:  # q | k | v as views of one fused row, g and beta columns of another
        fused = cp.asarray(np.concatenate([q.reshape(B, -1), k.reshape(B, -1),
                                           v.reshape(B, -1), np.zeros((B, 3), np.float32)],
                                          axis=1))
        kd = Hk * Dk
        dq = fused[:, :kd].reshape(B, Hk, Dk)
        dk = fused[:, kd : 2 * kd].reshape(B, Hk, Dk)
        dv = fused[:, 2 * kd : 2 * kd + H * Dv].reshape(B, H, Dv)
        gb = cp.asarray(np.stack([g, beta], axis=2))  # [B, H, 2]: head stride 2
        dg, dbeta = gb[:, :, 0], gb[:, :, 1]
        assert dv.strides[0] != H * Dv * 4 and dg.strides[1] == 8
    else:
        dq, dk, dv, dg, dbeta = (cp.asarray(a) for a in (q, k, v, g, beta))
    s_arg = cp.asarray(np.asarray(slots, np.int32)) if device_slots else slots
    o = gpu_hybrid.gated_delta_step_slots(dq, dk, dv, dg, dbeta, d_states, s_arg, rec,
                                          scale=1.0 / np.sqrt(Dk))
    o = cp.asnumpy(o)
    got = cp.asnumpy(d_states)
    close(o, o_ref, "o")
    for b in range(B):
        if slots[b] < 0:
            assert np.array_equal(o[b], np.zeros((H, Dv), np.float32)), f"padding row {b}"
    close(got[:, rec], want[:, rec], "updated states")
    touched = np.zeros((n_slots, n_rec), bool)
    for b in live:
        touched[slots[b], rec] = True
    # every other (slot, layer) state bit for bit as it was
    assert np.array_equal(got[~touched].view(np.uint32), states[~touched].view(np.uint32))
    # and the touched ones did change
    for b in live:
        assert not np.array_equal(got[slots[b], rec], states[slots[b], rec])


@pytest.mark.parametrize("device_slots", [True, False])
@pytest.mark.parametrize("B,Hk,H,Dk,Dv,slots", [
    (1, 2, 4, 16, 16, [2]),              # tiny-qwen35's heads, one row
    (3, 1, 3, 8, 40, [4, 0, 2]),         # Dk != Dv, Dv over one 32-column tile, 3 value heads a key head
    (8, 2, 4, 24, 12, [7, 1, 5, 0, 3, 6, 2, 4]),  # every slot, out of order; Dk not a multiple of 4 warps' rows
    (3, 2, 2, 5, 33, [1, -1, 3]),        # a padding row in the middle; Dk < 8, Dv = 33
])
def test_step_slots_matches_numpy(B, Hk, H, Dk, Dv, slots, device_slots):
    run_case(B, Hk, H, Dk, Dv, n_slots=8, n_rec=3, rec=1, slots=slots,
             device_slots=device_slots, seed=B * 100 + Dk + Dv)


def test_step_slots_qwen3_next_heads():
    """Dk = Dv = 128 (Qwen3-Next's, 32 rows a thread in registers), 2 value heads a key
    head, the last layer of the state array."""
    run_case(2, 1, 2, 128, 128, n_slots=3, n_rec=2, rec=1, slots=[2, 0], device_slots=True,
             seed=7)


def test_step_slots_wide_dk_without_registers():
    """Dk = 160: more rows a warp than a thread keeps (the kernel's second pass reads S
    again)."""
    run_case(2, 1, 1, 160, 8, n_slots=2, n_rec=1, rec=0, slots=[1, 0], device_slots=False,
             seed=11)


def test_step_slots_strided_inputs():
    run_case(3, 2, 4, 16, 16, n_slots=4, n_rec=2, rec=0, slots=[3, -1, 1],
             device_slots=True, seed=5, strided=True)


def test_step_slots_all_padding_and_empty():
    run_case(2, 1, 2, 8, 8, n_slots=2, n_rec=1, rec=0, slots=[-1, -1], device_slots=True,
             seed=3)
    import cupy as cp

    st = cp.zeros((2, 1, 2, 8, 8), np.float32)
    z = cp.zeros((0, 1, 8), np.float32)
    o = gpu_hybrid.gated_delta_step_slots(z, z, cp.zeros((0, 2, 8), np.float32),
                                          cp.zeros((0, 2), np.float32),
                                          cp.zeros((0, 2), np.float32), st, [], 0, scale=1.0)
    assert o.shape == (0, 2, 8)


def test_step_slots_out_and_checks():
    import cupy as cp

    rng = np.random.default_rng(1)
    q, k, v, g, beta = inputs(rng, 2, 1, 2, 8, 8)
    st = cp.asarray(rng.standard_normal((3, 1, 2, 8, 8)).astype(np.float32))
    args = [cp.asarray(a) for a in (q, k, v, g, beta)]
    out = cp.zeros((2, 2, 8), np.float32)
    r = gpu_hybrid.gated_delta_step_slots(*args, st.copy(), [0, 1], 0, scale=0.5, out=out)
    assert r is out
    with pytest.raises(IndexError):
        gpu_hybrid.gated_delta_step_slots(*args, st, [0, 3], 0, scale=0.5)
    with pytest.raises(ValueError):
        gpu_hybrid.gated_delta_step_slots(*args, st, [1, 1], 0, scale=0.5)
    with pytest.raises(IndexError):
        gpu_hybrid.gated_delta_step_slots(*args, st, [0, 1], 1, scale=0.5)
    with pytest.raises(ValueError):
        gpu_hybrid.gated_delta_step_slots(*args, st[:, :, :, :4], [0, 1], 0, scale=0.5)


# --- over sequences of rows (gated_delta_seq_slots): a step with prompt chunks -----------------

def _recurrence64(q, k, v, g, beta, S, scale):
    """The delta rule token by token in float64 (value head h reads key head h % H_k)."""
    H = v.shape[1]
    kmap = np.arange(H) % q.shape[1]
    S = S.astype(np.float64).copy()
    o = np.zeros(v.shape, np.float64)
    for t in range(v.shape[0]):
        qh, kh = q[t, kmap].astype(np.float64), k[t, kmap].astype(np.float64)
        S *= np.exp(g[t].astype(np.float64))[:, None, None]
        kv = np.einsum("hi,hij->hj", kh, S)
        d = (v[t] - kv) * beta[t][:, None]
        S += kh[:, :, None] * d[:, None, :]
        o[t] = np.einsum("hi,hij->hj", qh, S) * scale
    return o, S


def run_seq_case(spans: list[tuple[int, int]], Hk: int, H: int, Dk: int, Dv: int, *,
                 seed: int, rec: int = 1, n_rec: int = 2) -> None:
    """`spans`: (rows, slot) per sequence, in row order. Checks, for the sequence kernel:
    outputs and states equal to the decode kernel's run one row at a time (bit for bit),
    within 1e-5 of the float64 recurrence, padding sequences' rows zero, and every other
    (slot, layer) state untouched."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    B = sum(n for n, _ in spans)
    n_slots = max([sl for _, sl in spans] + [0]) + 2
    q, k, v, g, beta = inputs(rng, B, Hk, H, Dk, Dv)
    states = (0.3 * rng.standard_normal((n_slots, n_rec, H, Dk, Dv))).astype(np.float32)
    scale = 1.0 / np.sqrt(Dk)
    rows, r = [], 0
    for n, sl in spans:
        rows.append((r, r + n, sl))
        r += n
    dq, dk, dv, dg, dbeta = (cp.asarray(a) for a in (q, k, v, g, beta))
    d_seq, d_steps = cp.asarray(states), cp.asarray(states)
    o = cp.asnumpy(gpu_hybrid.gated_delta_seq_slots(
        dq, dk, dv, dg, dbeta, d_seq, gpu_hybrid.seq_rows(rows, B, n_slots), rec, scale=scale))
    o_steps = np.zeros_like(o)
    for r0, r1, sl in rows:
        for t in range(r0, r1):
            o_steps[t] = cp.asnumpy(gpu_hybrid.gated_delta_step_slots(
                dq[t : t + 1], dk[t : t + 1], dv[t : t + 1], dg[t : t + 1], dbeta[t : t + 1],
                d_steps, [sl], rec, scale=scale))[0]
    got, got_steps = cp.asnumpy(d_seq), cp.asnumpy(d_steps)
    assert np.array_equal(o.view(np.uint32), o_steps.view(np.uint32)), \
        "outputs differ from the decode kernel's, row by row"
    assert np.array_equal(got.view(np.uint32), got_steps.view(np.uint32)), \
        "states differ from the decode kernel's, row by row"
    touched = np.zeros((n_slots, n_rec), bool)
    for r0, r1, sl in rows:
        if sl < 0:
            assert not o[r0:r1].any(), "a padding sequence's rows are not zero"
            continue
        if r1 == r0:
            continue
        touched[sl, rec] = True
        o64, s64 = _recurrence64(q[r0:r1], k[r0:r1], v[r0:r1], g[r0:r1], beta[r0:r1],
                                 states[sl, rec], scale)
        err = np.abs(o[r0:r1] - o64).max() / np.abs(o64).max()
        assert err <= 1e-5, f"sequence at rows {r0}..{r1}: outputs off by {err:.3g}"
        err = np.abs(got[sl, rec] - s64).max() / np.abs(s64).max()
        assert err <= 1e-5, f"sequence at rows {r0}..{r1}: state off by {err:.3g}"
    assert np.array_equal(got[~touched].view(np.uint32), states[~touched].view(np.uint32))


@pytest.mark.parametrize("Hk,H,Dk,Dv", [
    (2, 4, 16, 16),    # tiny-qwen35's heads
    (1, 3, 8, 40),     # Dv over one 32-column tile, 3 value heads a key head
    (2, 2, 5, 33),     # Dk < the 4 warps' rows, Dv = 33
])
def test_seq_slots_match_decode_steps(Hk, H, Dk, Dv):
    """Sequences of 1 row (decode rows), of 17 (over one 16-token tile) and 40; a padding
    sequence, an empty one; out of slot order."""
    run_seq_case([(1, 2), (17, 0), (3, -1), (0, 5), (40, 3), (1, 1)], Hk, H, Dk, Dv,
                 seed=Dk * 10 + Dv)


def test_seq_slots_qwen3_next_heads():
    """Dk = Dv = 128 (Qwen3-Next's and Qwen3.5's: 32 rows a thread, kept in registers across
    the sequence; tiles of 16 tokens), 2 value heads a key head."""
    run_seq_case([(20, 1), (1, 0)], 1, 2, 128, 128, seed=8)


def test_seq_slots_wide_dk_without_registers():
    """Dk = 160: the state read and written each row; tiles of 2048 // 160 = 12 tokens."""
    run_seq_case([(13, 0), (2, 1)], 1, 1, 160, 8, seed=12)


def test_seq_slots_match_the_cpu_prefill():
    """A 100-token prompt through the sequence kernel and through the CPU's chunked form
    (`gated_delta_chunked`, what a CPU prefill runs): within float32 reordering."""
    import cupy as cp

    from kvshare.ops.gated_delta import gated_delta_chunked

    rng = np.random.default_rng(21)
    T, Hk, H, Dk, Dv = 100, 2, 4, 32, 32
    q, k, v, g, beta = inputs(rng, T, Hk, H, Dk, Dv)
    s0 = (0.3 * rng.standard_normal((H, Dk, Dv))).astype(np.float32)
    s_cpu = s0.copy()
    o_cpu = gated_delta_chunked(q, k, v, g, beta, s_cpu, scale=0.125)
    st = cp.asarray(s0[None, None])
    o = cp.asnumpy(gpu_hybrid.gated_delta_seq_slots(
        *(cp.asarray(a) for a in (q, k, v, g, beta)), st, gpu_hybrid.seq_rows([(0, T, 0)], T, 1),
        0, scale=0.125))
    assert np.abs(o - o_cpu).max() <= 1e-5 * np.abs(o_cpu).max()
    assert np.abs(cp.asnumpy(st)[0, 0] - s_cpu).max() <= 1e-5 * np.abs(s_cpu).max()


def test_seq_slots_checks():
    import cupy as cp

    rng = np.random.default_rng(2)
    q, k, v, g, beta = (cp.asarray(a) for a in inputs(rng, 3, 1, 2, 8, 8))
    st = cp.zeros((2, 1, 2, 8, 8), np.float32)
    rows = gpu_hybrid.seq_rows([(0, 3, 1)], 3, 2)
    with pytest.raises(ValueError):  # rows of another step
        gpu_hybrid.gated_delta_seq_slots(q[:2], k[:2], v[:2], g[:2], beta[:2], st, rows, 0,
                                         scale=1.0)
    with pytest.raises(IndexError):
        gpu_hybrid.gated_delta_seq_slots(q, k, v, g, beta, st, rows, 1, scale=1.0)
    with pytest.raises(ValueError):  # states of other head sizes
        gpu_hybrid.gated_delta_seq_slots(q, k, v, g, beta, st[:, :, :, :4], rows, 0, scale=1.0)
    out = cp.zeros((3, 2, 8), np.float32)
    assert gpu_hybrid.gated_delta_seq_slots(q, k, v, g, beta, st, rows, 0, scale=1.0,
                                            out=out) is out


# --- qwen35's decode on the GPU ----------------------------------------------------------------

def _old_step_slots(q, k, v, g, beta, states_all, slots, rec_index, *, scale, out=None):
    """What qwen35's GPU decode did before: gather the rows' states, `step_impl` in CuPy
    array code, scatter them back."""
    import cupy as cp

    idx = cp.asarray(np.asarray(slots, np.int64))
    st = states_all[idx, rec_index]
    o = gpu_hybrid.gated_delta_step(q, k, v, g, beta, st, scale=scale)
    states_all[idx, rec_index] = st
    if out is not None:
        out[...] = o
        return out
    return o


def _qwen35_run(m):
    """Logits of: three prefills (slots 3, 1, 0), a decode step of the three, a step of a
    prefill chunk (slot 2) beside two decode rows, a single-row decode step; and the states."""
    from kvshare.model.batch import SeqChunk

    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    cache = m.new_cache(4 * 4, 16, n_state_slots=4, kv_dtype="f32")
    tables = {s: np.arange(4 * s, 4 * s + 4) for s in range(4)}
    lens = {3: 9, 1: 5, 0: 7, 2: 6}
    toks = {s: rng.integers(0, vocab, 40) for s in range(4)}
    pos = dict.fromkeys(range(4), 0)
    got = []

    def chunk(s, n):
        c = SeqChunk(toks[s][pos[s] : pos[s] + n], pos[s], tables[s], logits="all",
                     state_slot=s)
        pos[s] += n
        return c

    for s in (3, 1, 0):
        got += m.forward([chunk(s, lens[s])], cache)
    got += m.forward([chunk(3, 1), chunk(1, 1), chunk(0, 1)], cache)
    got += m.forward([chunk(1, 1), chunk(2, lens[2]), chunk(3, 1)], cache)
    got += m.forward([chunk(0, 1)], cache)
    return [np.asarray(x) for x in got], [m.backend.to_host(a) for a in cache.states]


def test_qwen35_gpu_decode_steps_states_in_place(monkeypatch):
    """tiny-qwen35 on the GPU: every decode step's delta rule is the slots kernel on
    `cache.states[SSM]`, every step with a prompt chunk the sequence kernel (never
    gathered), and the logits and states match the former gather / CuPy step / scatter path
    of the decode steps to float32 reordering (amplified a little by the f16 activations of
    the GPU's GEMMs)."""
    from kvshare.model import qwen35
    from kvshare.model.loader import load_model

    m = load_model(MODELS / "tiny-qwen35.gguf", "cuda")
    m.cuda_graphs = False  # the eager steps' calls (a graph's are recorded once, at capture)
    n_rec = m.config.n_recurrent_layers
    calls, gathered, seq_calls = [], [], []
    real_step, real_gather = gpu_hybrid.gated_delta_step_slots, qwen35.gather_states
    real_seq = gpu_hybrid.gated_delta_seq_slots

    def recording(q, k, v, g, beta, states_all, slots, rec_index, **kw):
        calls.append((list(slots), rec_index, kw.get("out") is not None))
        return real_step(q, k, v, g, beta, states_all, slots, rec_index, **kw)

    def recording_seq(q, k, v, g, beta, states_all, rows, rec_index, **kw):
        spans = list(zip(*(rows.row0.get().tolist(), rows.count.get().tolist(),
                           rows.slots.get().tolist())))
        seq_calls.append((spans, rec_index))
        return real_seq(q, k, v, g, beta, states_all, rows, rec_index, **kw)

    def gather(arr, slots, rec_index, xp):
        gathered.append(arr)
        return real_gather(arr, slots, rec_index, xp)

    monkeypatch.setattr(gpu_hybrid, "gated_delta_step_slots", recording)
    monkeypatch.setattr(gpu_hybrid, "gated_delta_seq_slots", recording_seq)
    monkeypatch.setattr(qwen35, "gather_states", gather)
    new_logits, new_states = _qwen35_run(m)
    assert not gathered, "the states were gathered"
    # decode steps take the decode kernel; the prompts and the step with a prompt chunk
    # beside two decode rows the sequence kernel, every chunk one sequence on its slot
    assert [c[0] for c in calls] == [[3, 1, 0]] * n_rec + [[0]] * n_rec
    assert all(c[2] for c in calls)
    assert sorted({c[1] for c in calls}) == list(range(n_rec))
    assert [c[0] for c in seq_calls] == ([[(0, 9, 3)]] * n_rec + [[(0, 5, 1)]] * n_rec
                                         + [[(0, 7, 0)]] * n_rec
                                         + [[(0, 1, 1), (1, 6, 2), (7, 1, 3)]] * n_rec)

    monkeypatch.setattr(gpu_hybrid, "gated_delta_step_slots", _old_step_slots)
    old_logits, old_states = _qwen35_run(m)
    assert len(new_logits) == len(old_logits)
    for i, (a, b) in enumerate(zip(new_logits, old_logits)):
        rng_ = (b.max(axis=-1) - b.min(axis=-1)).min()
        assert np.abs(a - b).max() <= 1e-3 * rng_, f"logits of forward {i}"
    for a, b in zip(new_states, old_states):
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
