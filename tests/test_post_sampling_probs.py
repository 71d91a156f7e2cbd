"""llama-server's `post_sampling_probs`: `n_probs` reported from the distribution the token was
drawn from, after the sampler chain, as probabilities (`prob`, `top_probs`): the sampler's
record of its last draw (engine/sampling.py) and the native API's shape (fake engine)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from starlette.testclient import TestClient

from kvshare.engine.api import SamplingParams
from kvshare.engine.sampling import Sampler
from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings

from fake_engine import FakeEngine

LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05], dtype=np.float32))


def probs(sampler: Sampler, chosen: int, n: int) -> tuple[float, dict[int, float]]:
    lp, top = sampler.post_sampling_logprobs(chosen, n)
    return math.exp(lp), {t: math.exp(v) for t, v in top}


def test_top_k_renormalizes_over_the_kept_tokens():
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1), [])
    tok = s.sample(LOGITS)
    p, top = probs(s, tok, 10)
    assert list(top) == [1, 2]  # most likely first, only what top-k kept
    assert top[1] == pytest.approx(0.5 / 0.8, rel=1e-5) and top[2] == pytest.approx(0.3 / 0.8,
                                                                                    rel=1e-5)
    assert p == pytest.approx(top[tok])


def test_temperature_and_min_p_shape_the_distribution():
    s = Sampler(SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.15, seed=3), [])
    tok = s.sample(LOGITS)
    _, top = probs(s, tok, 10)
    assert set(top) == {1, 2, 3}  # min_p 0.15 x 0.5 drops the 0.05 tokens
    w = np.array([0.5, 0.3, 0.1]) ** 2  # temperature 0.5 squares the probabilities
    assert [top[t] for t in (1, 2, 3)] == pytest.approx(list(w / w.sum()), rel=1e-4)
    assert sum(top.values()) == pytest.approx(1.0)


def test_greedy_puts_all_mass_on_the_token():
    s = Sampler(SamplingParams(temperature=0.0), [])
    tok = s.sample(LOGITS)
    assert tok == 1 and probs(s, tok, 5) == (1.0, {1: 1.0})


def test_n_limits_the_list():
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2), [])
    tok = s.sample(LOGITS)
    _, top = probs(s, tok, 2)
    assert list(top) == [1, 2]


@pytest.fixture
def client_engine():
    engine = FakeEngine()
    with TestClient(create_app(engine, ServerSettings())) as c:
        yield c, engine


def test_native_shape(client_engine):
    c, engine = client_engine
    body = c.post("/completion", json={"prompt": "x", "n_predict": 3, "n_probs": 2,
                                       "post_sampling_probs": True}).json()
    assert engine.requests[-1].post_sampling_probs is True
    assert body["generation_settings"]["post_sampling_probs"] is True
    for e in body["completion_probabilities"]:
        assert set(e) == {"id", "token", "bytes", "prob", "top_probs"}
        assert e["prob"] == pytest.approx(math.exp(-0.25))
        assert len(e["top_probs"]) == 2
        assert all(set(t) == {"id", "token", "bytes", "prob"} for t in e["top_probs"])
    r = c.post("/completion", json={"prompt": "x", "n_predict": 2, "n_probs": 1,
                                    "post_sampling_probs": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    entries = [e for ch in chunks if not ch["stop"] for e in ch["completion_probabilities"]]
    assert len(entries) == 2 and all("prob" in e and "top_probs" in e for e in entries)


def test_default_stays_logprobs(client_engine):
    c, engine = client_engine
    body = c.post("/completion", json={"prompt": "x", "n_predict": 1, "n_probs": 1}).json()
    assert engine.requests[-1].post_sampling_probs is False
    [e] = body["completion_probabilities"]
    assert "logprob" in e and "top_logprobs" in e and "prob" not in e
