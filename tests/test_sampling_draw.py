"""`Sampler.uniform` + `sample(u=)` (the draw the device makes, or the host's when the device
hands a row back) against `sample` alone: the same tokens from the same seed, and `record`
keeps the history `sample` would."""

from __future__ import annotations

import numpy as np

from kvshare.engine.api import SamplingParams
from kvshare.engine.sampling import Sampler, choice_at


def test_uniform_then_sample_at_u_is_sample():
    rng = np.random.default_rng(0)
    for i in range(200):
        row = (rng.standard_normal(3000) * 3).astype(np.float32)
        p = SamplingParams(temperature=float(rng.uniform(0.3, 1.5)),
                           top_k=int(rng.choice([0, 1, 40, 500])),
                           top_p=float(rng.choice([1.0, 0.9, 0.5])),
                           min_p=float(rng.choice([0.0, 0.05])), seed=i)
        a, b = Sampler(p, []), Sampler(p, [])
        assert b.sample(row, u=b.uniform()) == a.sample(row)
        assert a.rng.random() == b.rng.random()  # the streams stay in step


def test_choice_at_is_numpys_choice():
    rng = np.random.default_rng(1)
    for i in range(300):
        p = rng.random(int(rng.integers(1, 50))).astype(np.float32) ** 4
        p /= p.sum()
        g1, g2 = np.random.default_rng(i), np.random.default_rng(i)
        assert choice_at(p, g2.random()) == g1.choice(len(p), p=p)


def test_record_keeps_the_history():
    p = SamplingParams(temperature=0.0, seed=1)
    a, b = Sampler(p, [1, 2]), Sampler(p, [1, 2])
    row = np.arange(10, dtype=np.float32)
    t = a.sample(row)
    b.record(t, greedy=True)
    assert (a.history, a.generated) == (b.history, b.generated)
    assert list(b.last_ids) == [t]
