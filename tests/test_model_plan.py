"""A step's plan (`model.base.make_plan`): decode steps (every chunk one token) take a
Python-integer fast path that must give the plan the general NumPy path gives, and a batch-1
step's rope rows come from a per-block table that must equal `rope_cos_sin` of the row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvshare.model import base
from kvshare.model.batch import SeqChunk
from kvshare.ops.rope import rope_cos_sin

CFG = SimpleNamespace(vocab_size=1000)
FIELDS = ("tokens", "positions", "q_starts", "start_positions", "block_tables", "slots",
          "logit_rows", "win_block_tables", "win_slots")


def _chunks(rng, n_seq, split):
    out = []
    for i in range(n_seq):
        pos = int(rng.integers(0, 200))
        table = rng.permutation(64)[: pos // 16 + 1 + int(rng.integers(0, 3))]
        win = rng.permutation(64)[: len(table)] if split else None
        out.append(SeqChunk([int(rng.integers(0, CFG.vocab_size))], pos, table,
                            logits=["last", "all", "none"][i % 3], state_slot=i,
                            win_block_table=win))
    return out


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n_seq", [1, 2, 5, 16])
def test_decode_plan_is_the_general_plan(n_seq, split):
    rng = np.random.default_rng(n_seq * 2 + split)
    for _ in range(10):
        chunks = _chunks(rng, n_seq, split)
        fast, slow = base._decode_plan(chunks, 16, CFG), base._general_plan(chunks, 16, CFG)
        for f in FIELDS:
            a, b = getattr(fast, f), getattr(slow, f)
            if b is None:
                assert a is None, f
                continue
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f
        assert fast.state_slots == slow.state_slots
        assert fast.max_seq_rows == slow.max_seq_rows == 1
    assert base.make_plan(chunks, 16, CFG).max_seq_rows == 1


@pytest.mark.parametrize("bad, err", [
    (dict(tokens=[CFG.vocab_size]), "token id out of range"),
    (dict(tokens=[5], start_pos=40, block_table=[1, 2]), "cannot hold"),
    (dict(tokens=[5], start_pos=20, block_table=[1, -1]), "does not cover"),
])
def test_decode_plan_refuses_what_the_general_plan_refuses(bad, err):
    args = dict(tokens=[5], start_pos=3, block_table=[7]) | bad
    chunk = SeqChunk(args["tokens"], args["start_pos"], args["block_table"])
    for plan in (base._decode_plan, base._general_plan):
        with pytest.raises(IndexError, match=err):
            plan([chunk], 16, CFG)


def test_rope_rows_equal_rope_cos_sin():
    model = base.DecoderModel.__new__(base.DecoderModel)
    base.DecoderModel.__init__(model, SimpleNamespace(activation="silu", n_rot=64))
    model.rope_freq_factors = np.linspace(1.0, 3.0, 32, dtype=np.float32)
    for key in [(10000.0, 1.0), (1e6, 0.25)]:
        for pos in [0, 1, 255, 256, 257, 1000, 65535, 4 * base.ROPE_BLOCK + 3]:
            cos, sin = model._rope_row(pos, key)
            want = rope_cos_sin(np.array([pos]), 64, key[0], key[1], model.rope_freq_factors)
            assert cos.shape == sin.shape == (1, 32) and cos.flags.c_contiguous
            assert np.array_equal(cos, want[0]) and np.array_equal(sin, want[1])
