"""The causal conv's decode step as one kernel on the cache's states by slot
(`kvshare.ops.gpu_hybrid.causal_conv1d_step_slots`, kernels/short_conv.cu) against NumPy's
`conv_step_impl` (`kvshare.ops.short_conv.causal_conv1d_step` on the CPU) run on the gathered
states: the outputs and the shifted states bit for bit (the kernel adds the rounded products in
NumPy's order), the other slots and the other layers of the state array untouched bit for bit,
padding rows (slot < 0) giving zeros and touching nothing; K = 2, 3, 4, C not a multiple of a
CTA's threads, strided inputs (a view of a fused projection), device and host slots, and
lfm2's and qwen35's decode on the GPU taking it on `cache.states[CONV]` with no gather or
scatter of that state. The conv over a step's sequences of rows (`causal_conv1d_seq_slots`:
prompt chunks beside decode rows) against NumPy's `conv_impl` on each sequence, bit for bit
(outputs and states). Marked `gpu`: skipped without a CUDA device; runs on the CPU emulator
(tests/gpu_emu).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.ops import gpu_hybrid
from kvshare.ops.short_conv import causal_conv1d_step

pytestmark = pytest.mark.gpu

MODELS = Path(__file__).resolve().parent / "data" / "models"


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def run_case(B: int, C: int, K: int, *, n_slots: int, n_rec: int, rec: int, slots: list[int],
             device_slots: bool, seed: int, strided: bool = False,
             with_out: bool = False) -> None:
    import cupy as cp

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    states = rng.standard_normal((n_slots, n_rec, K - 1, C)).astype(np.float32)
    live = [b for b in range(B) if slots[b] >= 0]
    # the reference: NumPy's step on the live rows' gathered states
    st_ref = states[[slots[b] for b in live], rec].copy()
    o_ref = np.zeros((B, C), np.float32)
    if live:
        o_ref[live] = causal_conv1d_step(x[live], w, st_ref)
    want = states.copy()
    for i, b in enumerate(live):
        want[slots[b], rec] = st_ref[i]

    d_states = cp.asarray(states)
    if strided:  # x as the middle columns of a wider row (qwen35's qkv_in of its projection)
        fused = cp.asarray(np.concatenate([np.ones((B, 5), np.float32), x,
                                           np.ones((B, 3), np.float32)], axis=1))
        dx = fused[:, 5 : 5 + C]
        assert dx.strides[0] == (C + 8) * 4
    else:
        dx = cp.asarray(x)
    s_arg = cp.asarray(np.asarray(slots, np.int32)) if device_slots else slots
    if with_out:
        big = cp.full((B, C + 4), 7.0, np.float32)
        out = big[:, 2 : 2 + C]  # a strided output view
        r = gpu_hybrid.causal_conv1d_step_slots(dx, cp.asarray(w), d_states, s_arg, rec,
                                                out=out)
        assert r is out
        edges = cp.asnumpy(big)
        assert (edges[:, :2] == 7.0).all() and (edges[:, 2 + C :] == 7.0).all()
    else:
        r = gpu_hybrid.causal_conv1d_step_slots(dx, cp.asarray(w), d_states, s_arg, rec)
    o = cp.asnumpy(r)
    got = cp.asnumpy(d_states)
    np.testing.assert_array_equal(bits(o), bits(o_ref))  # padding rows: +0.0 as o_ref's
    # every state bit for bit: the touched ones shifted as NumPy's, the others as they were
    np.testing.assert_array_equal(bits(got), bits(want))
    for b in live:  # and the touched ones did change
        assert not np.array_equal(got[slots[b], rec], states[slots[b], rec])


@pytest.mark.parametrize("device_slots", [True, False])
@pytest.mark.parametrize("B,C,K,slots", [
    (1, 16, 3, [2]),                         # one row (lfm2's L = 3)
    (3, 300, 4, [4, 0, 2]),                  # qwen35's K = 4, C over one 256-thread CTA
    (8, 37, 2, [7, 1, 5, 0, 3, 6, 2, 4]),    # K = 2 (one state column), every slot, out of order
    (3, 257, 3, [1, -1, 3]),                 # a padding row in the middle
])
def test_step_slots_matches_numpy(B, C, K, slots, device_slots):
    run_case(B, C, K, n_slots=8, n_rec=3, rec=1, slots=slots, device_slots=device_slots,
             seed=B * 100 + C + K)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_step_slots_strided_x_and_out(K):
    run_case(3, 70, K, n_slots=4, n_rec=2, rec=0, slots=[3, -1, 1], device_slots=True,
             seed=5 + K, strided=True, with_out=True)


def test_step_slots_last_layer_and_repeated_steps():
    """Four steps in a row on the last layer of the state array: the shifted states carry
    over bit for bit (each step's inputs leave the state after K-1 more)."""
    import cupy as cp

    rng = np.random.default_rng(9)
    B, C, K, n_slots, n_rec = 2, 50, 4, 3, 2
    w = rng.standard_normal((C, K)).astype(np.float32)
    states = rng.standard_normal((n_slots, n_rec, K - 1, C)).astype(np.float32)
    d_states, dw = cp.asarray(states), cp.asarray(w)
    slots = [2, 0]
    st = states[slots, n_rec - 1].copy()
    for t in range(4):
        x = rng.standard_normal((B, C)).astype(np.float32)
        o_ref = causal_conv1d_step(x, w, st)
        o = gpu_hybrid.causal_conv1d_step_slots(cp.asarray(x), dw, d_states, slots, n_rec - 1)
        np.testing.assert_array_equal(bits(cp.asnumpy(o)), bits(o_ref), err_msg=f"step {t}")
    got = cp.asnumpy(d_states)
    np.testing.assert_array_equal(bits(got[slots, n_rec - 1]), bits(st))
    np.testing.assert_array_equal(bits(got[:, 0]), bits(states[:, 0]))
    np.testing.assert_array_equal(bits(got[1]), bits(states[1]))


def test_step_slots_all_padding_and_empty():
    run_case(2, 20, 3, n_slots=2, n_rec=1, rec=0, slots=[-1, -1], device_slots=True, seed=3)
    import cupy as cp

    st = cp.zeros((2, 1, 2, 8), np.float32)
    o = gpu_hybrid.causal_conv1d_step_slots(cp.zeros((0, 8), np.float32),
                                            cp.zeros((8, 3), np.float32), st, [], 0)
    assert o.shape == (0, 8)


def test_step_slots_checks():
    import cupy as cp

    rng = np.random.default_rng(1)
    x = cp.asarray(rng.standard_normal((2, 8)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((8, 3)).astype(np.float32))
    st = cp.asarray(rng.standard_normal((3, 2, 2, 8)).astype(np.float32))
    before = cp.asnumpy(st)
    with pytest.raises(IndexError):  # a slot out of range
        gpu_hybrid.causal_conv1d_step_slots(x, w, st, [0, 3], 0)
    with pytest.raises(ValueError):  # two rows on one slot
        gpu_hybrid.causal_conv1d_step_slots(x, w, st, [1, 1], 0)
    with pytest.raises(IndexError):  # a layer out of range
        gpu_hybrid.causal_conv1d_step_slots(x, w, st, [0, 1], 2)
    with pytest.raises(ValueError):  # states of another K
        gpu_hybrid.causal_conv1d_step_slots(x, w, st[:, :, :1], [0, 1], 0)
    with pytest.raises(ValueError):  # states of another C
        gpu_hybrid.causal_conv1d_step_slots(x, w, st[..., :4], [0, 1], 0)
    with pytest.raises(ValueError):  # states on the host
        gpu_hybrid.causal_conv1d_step_slots(x, w, cp.asnumpy(st), [0, 1], 0)
    with pytest.raises(ValueError):  # a weight of another C
        gpu_hybrid.causal_conv1d_step_slots(x, w[:4], st, [0, 1], 0)
    with pytest.raises(ValueError):  # K = 1
        gpu_hybrid.causal_conv1d_step_slots(x, w[:, :1], st, [0, 1], 0)
    with pytest.raises(ValueError):  # slots for another batch
        gpu_hybrid.causal_conv1d_step_slots(x, w, st, [0], 0)
    with pytest.raises(ValueError):  # an out of another shape
        gpu_hybrid.causal_conv1d_step_slots(x, w, st, [0, 1], 0,
                                            out=cp.zeros((2, 9), np.float32))
    assert np.array_equal(bits(before), bits(cp.asnumpy(st)))  # the refused calls touched nothing


# --- over sequences of rows (causal_conv1d_seq_slots): a step with prompt chunks ---------------

def run_seq_case(spans: list[tuple[int, int]], C: int, K: int, *, seed: int, n_rec: int = 2,
                 rec: int = 1, strided: bool = False) -> None:
    """`spans`: (rows, slot) per sequence, in row order. The reference: NumPy's
    `conv_impl` on each sequence's rows and its slot's state (CPU prefill's op)."""
    import cupy as cp

    from kvshare.ops.short_conv_xp import conv_impl

    rng = np.random.default_rng(seed)
    B = sum(n for n, _ in spans)
    n_slots = max([sl for _, sl in spans] + [0]) + 2
    x = rng.standard_normal((B, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    states = rng.standard_normal((n_slots, n_rec, K - 1, C)).astype(np.float32)
    want, o_ref = states.copy(), np.zeros((B, C), np.float32)
    rows, r = [], 0
    for n, sl in spans:
        rows.append((r, r + n, sl))
        if sl >= 0 and n:
            st = want[sl, rec].copy()
            o_ref[r : r + n] = conv_impl(np, x[r : r + n], w, st)
            want[sl, rec] = st
        r += n
    d_states = cp.asarray(states)
    if strided:
        fused = cp.asarray(np.concatenate([np.ones((B, 3), np.float32), x], axis=1))
        dx = fused[:, 3:]
    else:
        dx = cp.asarray(x)
    o = cp.asnumpy(gpu_hybrid.causal_conv1d_seq_slots(
        dx, cp.asarray(w), d_states, gpu_hybrid.seq_rows(rows, B, n_slots), rec))
    assert np.array_equal(bits(o), bits(o_ref)), "outputs differ from NumPy's conv"
    assert np.array_equal(bits(cp.asnumpy(d_states)), bits(want)), \
        "states differ from NumPy's (or a state of another slot or layer changed)"


@pytest.mark.parametrize("K", [2, 3, 4])
def test_seq_slots_match_numpy(K):
    """Sequences of 1 row (a decode row), fewer rows than the state holds (K - 1), exactly
    K - 1, longer; a padding sequence; an empty one; out of slot order."""
    run_seq_case([(1, 2), (2, 0), (K - 1, 5), (9, 1), (3, -1), (0, 3), (17, 4)], C=37, K=K,
                 seed=K)


def test_seq_slots_strided_and_wide():
    run_seq_case([(5, 1), (1, 0)], C=300, K=4, seed=9, strided=True)


def test_seq_one_row_sequences_equal_the_step_kernel():
    """A step of decode rows through the sequence kernels is the decode kernel's, bit for
    bit (outputs and states)."""
    import cupy as cp

    rng = np.random.default_rng(4)
    C, K = 40, 4
    x = cp.asarray(rng.standard_normal((3, C)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((C, K)).astype(np.float32))
    st = rng.standard_normal((4, 1, K - 1, C)).astype(np.float32)
    a, b = cp.asarray(st), cp.asarray(st)
    o1 = gpu_hybrid.causal_conv1d_step_slots(x, w, a, [2, 0, 3], 0)
    o2 = gpu_hybrid.causal_conv1d_seq_slots(
        x, w, b, gpu_hybrid.seq_rows([(0, 1, 2), (1, 2, 0), (2, 3, 3)], 3, 4), 0)
    assert np.array_equal(bits(cp.asnumpy(o1)), bits(cp.asnumpy(o2)))
    assert np.array_equal(bits(cp.asnumpy(a)), bits(cp.asnumpy(b)))


def test_seq_rows_checks():
    import cupy as cp

    with pytest.raises(ValueError, match="overlap"):
        gpu_hybrid.seq_rows([(0, 3, 0), (2, 4, 1)], 4, 2)
    with pytest.raises(ValueError, match="in no sequence"):
        gpu_hybrid.seq_rows([(0, 2, 0), (3, 4, 1)], 4, 2)
    with pytest.raises(ValueError, match="outside"):
        gpu_hybrid.seq_rows([(0, 5, 0)], 4, 2)
    with pytest.raises(IndexError):
        gpu_hybrid.seq_rows([(0, 4, 2)], 4, 2)
    with pytest.raises(ValueError, match="distinct"):
        gpu_hybrid.seq_rows([(0, 2, 1), (2, 4, 1)], 4, 2)
    rows = gpu_hybrid.seq_rows([(0, 2, 1), (2, 4, -1)], 4, 2)
    assert rows.n_seq == 2 and rows.n_rows == 4
    assert cp.asnumpy(rows.row_seq).tolist() == [0, 0, 1, 1]
    # any negative slot is a padding sequence's (-1 on the device, not wrapped into a live
    # int32 slot), and two padding sequences are fine
    wide = gpu_hybrid.seq_rows([(0, 1, -(2**32) + 1), (1, 2, -7), (2, 4, 0)], 4, 2)
    assert cp.asnumpy(wide.slots).tolist() == [-1, -1, 0]
    x = cp.zeros((4, 8), np.float32)
    w = cp.zeros((8, 3), np.float32)
    st = cp.zeros((2, 1, 2, 8), np.float32)
    with pytest.raises(ValueError):  # rows of another step
        gpu_hybrid.causal_conv1d_seq_slots(x[:3], w, st, rows, 0)
    with pytest.raises(IndexError):
        gpu_hybrid.causal_conv1d_seq_slots(x, w, st, rows, 1)
    with pytest.raises(ValueError, match="must not be x"):
        gpu_hybrid.causal_conv1d_seq_slots(x, w, st, rows, 0, out=x)


# --- lfm2's and qwen35's decode on the GPU -----------------------------------------------------

def _old_step_slots(x, weight, states_all, slots, rec_index, *, out=None):
    """What the models' GPU decode did before: gather the rows' states, `conv_step_impl` in
    CuPy array code, scatter them back."""
    import cupy as cp

    idx = cp.asarray(np.asarray(slots, np.int64))
    st = states_all[idx, rec_index]
    o = gpu_hybrid.causal_conv1d_step(x, weight, st)
    states_all[idx, rec_index] = st
    if out is not None:
        out[...] = o
        return out
    return o


def _run(m):
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


@pytest.mark.parametrize("name,module", [("tiny-lfm2", "lfm2"), ("tiny-qwen35", "qwen35")])
def test_model_gpu_decode_conv_states_in_place(monkeypatch, name, module):
    """On the GPU every decode step's conv is the slots kernel on `cache.states[CONV]`,
    every step with a prompt chunk the sequence kernels (never gathered), and the logits and
    states match the former gather / CuPy step / scatter path of the decode steps (the same
    conv bits; the rest within the GPU path's float32 reordering)."""
    import importlib

    from kvshare.model.loader import load_model

    mod = importlib.import_module(f"kvshare.model.{module}")
    m = load_model(MODELS / f"{name}.gguf", "cuda")
    m.cuda_graphs = False  # the eager steps' calls (a graph's are recorded once, at capture)
    n_rec = m.config.n_recurrent_layers
    calls, gathered, seq_calls = [], [], []
    real_step, real_gather = gpu_hybrid.causal_conv1d_step_slots, mod.gather_states
    real_seq = gpu_hybrid.causal_conv1d_seq_slots

    def recording(x, weight, states_all, slots, rec_index, **kw):
        calls.append((list(slots), rec_index, kw.get("out") is not None))
        return real_step(x, weight, states_all, slots, rec_index, **kw)

    def recording_seq(x, weight, states_all, rows, rec_index, **kw):
        spans = list(zip(*(rows.row0.get().tolist(), rows.count.get().tolist(),
                           rows.slots.get().tolist())))
        seq_calls.append(spans)
        return real_seq(x, weight, states_all, rows, rec_index, **kw)

    def gather(arr, slots, rec_index, xp):
        gathered.append(arr)
        return real_gather(arr, slots, rec_index, xp)

    monkeypatch.setattr(gpu_hybrid, "causal_conv1d_step_slots", recording)
    monkeypatch.setattr(gpu_hybrid, "causal_conv1d_seq_slots", recording_seq)
    monkeypatch.setattr(mod, "gather_states", gather)
    new_logits, new_states = _run(m)
    assert not gathered, "the states were gathered"
    # decode steps take the decode kernel; the prompts and the step with a prompt chunk
    # beside two decode rows the sequence kernels, every chunk one sequence on its slot
    assert [c[0] for c in calls] == [[3, 1, 0]] * n_rec + [[0]] * n_rec
    assert all(c[2] for c in calls)
    assert sorted({c[1] for c in calls}) == list(range(n_rec))
    assert seq_calls == ([[(0, 9, 3)]] * n_rec + [[(0, 5, 1)]] * n_rec + [[(0, 7, 0)]] * n_rec
                         + [[(0, 1, 1), (1, 6, 2), (7, 1, 3)]] * n_rec)

    monkeypatch.setattr(gpu_hybrid, "causal_conv1d_step_slots", _old_step_slots)
    old_logits, old_states = _run(m)
    assert len(new_logits) == len(old_logits)
    for i, (a, b) in enumerate(zip(new_logits, old_logits)):
        rng_ = (b.max(axis=-1) - b.min(axis=-1)).min()
        assert np.abs(a - b).max() <= 1e-3 * rng_, f"logits of forward {i}"
    for a, b in zip(new_states, old_states):
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
