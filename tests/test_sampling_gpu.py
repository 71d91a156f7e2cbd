"""Sampling on the device (kernels/sampling.cu, ops/gpu_sampling.py, engine/device_sampling.py)
against the host's `Sampler` (the oracle): greedy bit for bit, seeded draws with the same
random stream, logprobs, errors, the rows handed back to the host, and the engine on cuda with
device sampling on vs off. Marked `gpu`: skipped without a CUDA device (run on the CPU
emulator: tests/gpu_emu)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.backend import get_backend
from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.device_sampling import row_spec
from kvshare.engine.faults import SamplingError
from kvshare.engine.sampling import Sampler, top_logprobs
from kvshare.ops import gpu_sampling as gs

pytestmark = pytest.mark.gpu

MODEL = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"


@pytest.fixture(scope="module")
def cp():
    return get_backend("cuda").xp


def _sampler(params: SamplingParams, history=(), generated=()) -> Sampler:
    s = Sampler(params, list(history))
    for t in generated:
        s.history.append(t)
        s.generated[t] += 1
    return s


def _twins(params, history=(), generated=()):
    """Two samplers in the same state: one for the host, one for the device."""
    return _sampler(params, history, generated), _sampler(params, history, generated)


def _device(cp, rows: np.ndarray, samplers, masks, n_tops=None):
    """The device's results for host rows `rows` with each sampler (its u taken here)."""
    d = cp.asarray(np.ascontiguousarray(rows, dtype=np.float32))
    n_tops = n_tops or [-1] * len(rows)
    specs = [row_spec(s, d[i], m, n) for i, (s, m, n) in enumerate(zip(samplers, masks, n_tops))]
    return specs, gs.sample_rows(specs)


def _host(sampler, row, mask):
    try:
        return sampler.sample(row, mask)
    except SamplingError as exc:
        return str(exc)


def _random_mask(rng, vocab, p):
    bits = rng.random(vocab) < p
    words = np.zeros(-(-vocab // 32), dtype=np.uint32)
    for t in np.flatnonzero(bits):
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


def test_greedy_equals_the_host_bit_for_bit(cp):
    rng = np.random.default_rng(0)
    V = 3000
    rows, samplers, hosts, masks = [], [], [], []

    def add(row, params, mask=None, history=(), generated=()):
        h, d = _twins(params, history, generated)
        rows.append(row.astype(np.float32))
        hosts.append(h)
        samplers.append(d)
        masks.append(mask)

    g = SamplingParams(temperature=0.0)
    base = (rng.standard_normal(V) * 3).astype(np.float32)
    add(base, g)
    tie = base.copy()
    tie[[100, 7, 2500]] = base.max() + 1  # ties: the lowest index wins, as np.argmax
    add(tie, g)
    m = _random_mask(rng, V, 0.3)
    add(tie, g, m)
    t2 = base.copy()
    allowed = [t for t in range(V) if m[t // 32] >> (t % 32) & 1]
    t2[allowed[5]] = t2[allowed[40]] = 50.0
    add(t2, g, m)
    add(base, g, m[: len(m) // 2])  # a short mask: the tokens past it are not allowed
    hist = [int(t) for t in np.argsort(base)[-30:]]
    neg = base.copy()
    neg[hist[:10]] = -np.abs(neg[hist[:10]])  # repetition multiplies negative logits
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.25, penalty_last_n=20,
                         logit_bias=((int(np.argmin(base)), 40.0), (3, -2.5), (V + 5, 1.0)))
    add(neg, pen, None, hist, hist[-12:] + hist[-3:])
    add(neg, pen, m, hist, hist[-12:])
    add(base, SamplingParams(temperature=0.0, repetition_penalty=0.7, penalty_last_n=-1),
        None, hist)
    specs, res = _device(cp, np.stack(rows), samplers, masks)
    for i, (h, r) in enumerate(zip(hosts, res)):
        assert r.status == gs.STATUS_OK, i
        assert r.token == h.sample(rows[i], masks[i]), i


def test_greedy_on_a_qwen_sized_row(cp):
    rng = np.random.default_rng(1)
    V = 151_936
    row = (rng.standard_normal(V) * 4).astype(np.float32)
    row[[151_000, 9]] = row.max() + 0.5
    h, d = _twins(SamplingParams(temperature=0.0))
    _, (r,) = _device(cp, row[None], [d], [None], [5])
    assert r.status == gs.STATUS_OK and r.token == h.sample(row) == 9
    lp, top = top_logprobs(row, r.token, 5)
    assert abs(r.logprob - lp) <= 1e-5
    assert [t for t, _ in r.top] == [t for t, _ in top]
    assert np.allclose([v for _, v in r.top], [v for _, v in top], atol=1e-5, rtol=0)


def _draw_params(rng, i):
    return SamplingParams(
        temperature=float(rng.choice([0.5, 0.8, 1.0, 1.3])),
        top_k=int(rng.choice([0, 0, 1, 20, 200])),
        top_p=float(rng.choice([1.0, 0.95, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])),
        repetition_penalty=float(rng.choice([1.0, 1.1])),
        presence_penalty=float(rng.choice([0.0, 0.3])),
        seed=1000 + i)


def test_seeded_draws_follow_the_host(cp):
    """300 draws over varied parameters: the device's token (or, for a row it hands back,
    the host's with the uniform it took) is the CPU sampler's in >= 99% of them, and in all
    where the draw has one candidate (top_k = 1: its probability is exactly 1)."""
    rng = np.random.default_rng(2)
    V, per_launch = 2000, 30
    same = device_rows = 0
    for launch in range(300 // per_launch):
        rows = (rng.standard_normal((per_launch, V)) * 4).astype(np.float32)
        hosts, devs, masks, params = [], [], [], []
        for i in range(per_launch):
            p = _draw_params(rng, launch * per_launch + i)
            hist = [int(t) for t in rng.integers(0, V, 40)]
            h, d = _twins(p, hist, hist[-8:])
            hosts.append(h)
            devs.append(d)
            masks.append(_random_mask(rng, V, 0.5) if i % 3 == 0 else None)
            params.append(p)
        specs, res = _device(cp, rows, devs, masks)
        for i, r in enumerate(res):
            want = hosts[i].sample(rows[i], masks[i])
            if r.status == gs.STATUS_HOST:
                got = devs[i].sample(rows[i], masks[i], u=specs[i].u)
            else:
                assert r.status == gs.STATUS_OK
                got = r.token
                device_rows += 1
                if params[i].top_k == 1:
                    assert got == want
            same += got == want
    assert same >= 297, same
    assert device_rows >= 200, device_rows  # the device decided most rows


def test_logprobs_match_top_logprobs(cp):
    rng = np.random.default_rng(3)
    V = 3000
    rows = (rng.standard_normal((4, V)) * 3).astype(np.float32)
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=50, seed=5),
          SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=40, seed=6)]
    n_tops = [0, 1, 5, 20]
    devs = [Sampler(p, []) for p in ps]
    _, res = _device(cp, rows, devs, [None] * 4, n_tops)
    for row, r, n in zip(rows, res, n_tops):
        assert r.status == gs.STATUS_OK
        lp, top = top_logprobs(row, r.token, n)
        assert abs(r.logprob - lp) <= 1e-5
        assert r.top is not None and [t for t, _ in r.top] == [t for t, _ in top]
        assert np.allclose([v for _, v in r.top], [v for _, v in top], atol=1e-5, rtol=0)


def test_errors_are_the_rows_own(cp):
    """A mask allowing nothing, a non-finite logit, a bias that makes a score infinite: each
    row gets the host path's SamplingError message; the other rows of the launch are sampled."""
    rng = np.random.default_rng(4)
    V = 1500
    rows = (rng.standard_normal((5, V)) * 2).astype(np.float32)
    rows[1, 17] = np.nan
    rows[2, 3] = np.inf
    none = np.zeros(-(-V // 32), dtype=np.uint32)
    ps = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.7, seed=2),
          SamplingParams(temperature=0.0, logit_bias=((4, float("inf")),)),
          SamplingParams(temperature=0.0)]
    masks = [none, None, None, None, None]
    hosts = [Sampler(p, []) for p in ps]
    _, res = _device(cp, rows, [Sampler(p, []) for p in ps], masks)
    for i, r in enumerate(res):
        want = _host(hosts[i], rows[i], masks[i])
        if i == 4:
            assert r.status == gs.STATUS_OK and r.token == want
        else:
            assert isinstance(want, str) and gs.ERROR_MESSAGES.get(r.status) == want, (i, want)


def test_rows_handed_back_to_the_host(cp):
    """The candidates miss mass (flat logits, no top_k), more values in the gathered bins than
    the kernel sorts, top_k or top logprobs past the kernel's limits."""
    rng = np.random.default_rng(5)
    V = 5000
    flat = (rng.standard_normal(V) * 0.01).astype(np.float32)
    equal = np.zeros(V, dtype=np.float32)
    ps = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0, top_k=10,
                                                                  seed=4)]
    hosts = [Sampler(p, []) for p in ps]
    devs = [Sampler(p, []) for p in ps]
    rows = np.stack([flat, equal])
    specs, res = _device(cp, rows, devs, [None, None])
    assert [r.status for r in res] == [gs.STATUS_HOST, gs.STATUS_HOST]
    for i in range(2):  # the host, with the uniform the device path took: the CPU's token
        assert devs[i].sample(rows[i], None, u=specs[i].u) == hosts[i].sample(rows[i])
    d = cp.asarray(flat)
    assert not gs.takes(row_spec(Sampler(SamplingParams(top_k=2000), []), d, None, -1), V)
    assert not gs.takes(row_spec(Sampler(SamplingParams(), []), d, None, 21), V)


# --- the engine -------------------------------------------------------------------------------

def _engine(monkeypatch, on: bool):
    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.loader import load_model
    from kvshare.model.tokenizer import Tokenizer

    monkeypatch.setenv("KVSHARE_DEVICE_SAMPLING", "1" if on else "0")
    model = load_model(MODEL, device="cuda")
    tok = Tokenizer.from_gguf(MODEL)
    eng = Engine(model, tok, ChatTemplate.from_gguf(MODEL, tok), bytes.fromhex(model.fingerprint),
                 EngineConfig(kv_blocks=64, block_size=16, device="cuda"))
    assert (eng.device_sampling is not None) == on
    return eng


def _events(eng, reqs):
    handles = [eng.submit(r) for r in reqs]
    eng.run_until_idle()
    return [[e for e in h.events(timeout=0) if not isinstance(e, FinishEvent)] for h in handles]


def test_engine_device_sampling_equals_host(monkeypatch):
    on_eng = _engine(monkeypatch, True)
    off_eng = _engine(monkeypatch, False)
    prompt = on_eng.tokenize("<|im_start|>user\nName three colours.<|im_end|>\n"
                             "<|im_start|>assistant\n")
    grammar = on_eng.compile_grammar("regex", "(red|green|blue)( (red|green|blue)){0,3}")

    def reqs(eng):
        g = eng.compile_grammar("regex", "(red|green|blue)( (red|green|blue)){0,3}")
        return [
            GenerationRequest(prompt_tokens=prompt, max_tokens=6, logprobs=True, top_logprobs=3,
                              sampling=SamplingParams(temperature=0.0)),
            GenerationRequest(prompt_tokens=prompt, max_tokens=6, logprobs=True, top_logprobs=2,
                              sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7,
                                                      repetition_penalty=1.1)),
            GenerationRequest(prompt_tokens=prompt, max_tokens=6, grammar=g,
                              sampling=SamplingParams(temperature=1.0, seed=8)),
        ]
    assert grammar is not None
    on, off = _events(on_eng, reqs(on_eng)), _events(off_eng, reqs(off_eng))
    assert on_eng.device_sampling.rows_device > 0
    for a, b in zip(on, off):
        assert [e.token_id for e in a] == [e.token_id for e in b]
        for x, y in zip(a, b):
            if y.logprob is None:
                continue
            assert abs(x.logprob.logprob - y.logprob.logprob) <= 1e-4
            assert [t.token_id for t in x.top_logprobs] == [t.token_id for t in y.top_logprobs]
            assert np.allclose([t.logprob for t in x.top_logprobs],
                               [t.logprob for t in y.top_logprobs], atol=1e-4, rtol=0)
