"""End-to-end tests of checkpoints, the checkpoint store and byte accounting through _core."""

import gc

import numpy as np
import pytest

from kvshare import _core

BS = 4


def root(salt=None):
    return _core.root_key(b"model-fp", "f16", BS, salt)


def test_checkpoint_fields_follow_chain_hashing():
    acct = _core.CheckpointAccount()
    toks = list(range(10))
    state = np.arange(6, dtype=np.float32)
    c = _core.Checkpoint.at(root(), toks, BS, state, layout='{"ssm": [6]}', account=acct)
    keys = _core.hash_blocks(root(), toks, BS)
    assert c.position == 10
    assert c.key == _core.prefix_key(root(), toks, BS)
    assert c.anchor == keys[1]
    assert c.anchor_position == 8
    assert c.tail == [8, 9]
    assert c.layout == '{"ssm": [6]}'
    assert c.nbytes == 24
    assert c.data == state.tobytes()
    aligned = _core.Checkpoint.at(root(), toks[:8], BS, b"x", account=acct)
    assert aligned.key == aligned.anchor == keys[1] and aligned.tail == []
    empty = _core.Checkpoint.at(root(), [], BS, b"", account=acct)
    assert empty.key == root() and empty.position == 0
    assert acct.live_count == 3 and acct.live_bytes == 25
    assert "Checkpoint(position=10" in repr(c)


def test_explicit_constructor_and_errors():
    acct = _core.CheckpointAccount()
    c = _core.Checkpoint(5, b"k" * 32, b"a" * 32, [1], bytearray(b"abc"), account=acct)
    assert (c.position, c.key, c.anchor, c.tail, c.data) == (5, b"k" * 32, b"a" * 32, [1], b"abc")
    with pytest.raises(_core.InvalidArgument):
        _core.Checkpoint(1, b"k" * 32, b"a" * 32, [1, 2], b"", account=acct)  # tail > position
    with pytest.raises(_core.InvalidArgument):
        _core.Checkpoint(1, b"short", b"a" * 32, [], b"", account=acct)
    with pytest.raises(_core.InvalidArgument):
        _core.Checkpoint.at(root(), [1, 2], 0, b"", account=acct)
    with pytest.raises(TypeError):
        _core.Checkpoint.at(root(), [1, 2], BS, 12345, account=acct)
    assert acct.live_count == 1, "failed constructions registered nothing"


def test_numpy_view_is_zero_copy_and_keeps_checkpoint_alive():
    acct = _core.CheckpointAccount()
    state = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    c = _core.Checkpoint.at(root(), [1, 2, 3], BS, state, account=acct)
    v1 = np.asarray(c)
    v2 = np.asarray(c)
    assert v1.dtype == np.uint8 and v1.shape == (4000,)
    assert np.shares_memory(v1, v2), "both views alias the checkpoint's bytes"
    assert not v1.flags.writeable
    with pytest.raises(ValueError):
        v1[0] = 1
    np.testing.assert_array_equal(v1.view(np.float32), state)
    del c
    gc.collect()
    assert acct.live_count == 1, "the view keeps the checkpoint alive"
    np.testing.assert_array_equal(v1.view(np.float32), state)
    del v1, v2
    gc.collect()
    assert acct.live_count == 0 and acct.live_bytes == 0


def test_read_into_destinations():
    acct = _core.CheckpointAccount()
    state = np.arange(8, dtype=np.int16)
    c = _core.Checkpoint.at(root(), [1], BS, state, account=acct)
    out = np.zeros(8, dtype=np.int16)
    c.read_into(out)
    np.testing.assert_array_equal(out, state)
    ba = bytearray(16)
    c.read_into(ba)
    assert bytes(ba) == state.tobytes()
    with pytest.raises(_core.InvalidArgument):
        c.read_into(np.zeros(7, dtype=np.int16))
    ro = np.zeros(8, dtype=np.int16)
    ro.flags.writeable = False
    with pytest.raises(_core.InvalidArgument):
        c.read_into(ro)
    with pytest.raises(_core.InvalidArgument):
        c.read_into(np.zeros((8, 2), dtype=np.int16)[:, 0])  # not contiguous
    with pytest.raises(TypeError):
        c.read_into(b"immutable bytes")


def test_payload_sources_are_equivalent():
    acct = _core.CheckpointAccount()
    raw = bytes(range(32))
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(4, 8)
    sources = [raw, bytearray(raw), memoryview(raw), arr, arr.astype(np.uint8).view(np.float32)]
    for src in sources:
        assert _core.Checkpoint.at(root(), [1], BS, src, account=acct).data == raw
    with pytest.raises(_core.InvalidArgument):
        _core.Checkpoint.at(root(), [1], BS, arr[:, ::2], account=acct)  # not contiguous


def test_accounting_counts_each_distinct_checkpoint_once():
    acct = _core.CheckpointAccount()
    store = _core.CheckpointStore(acct)
    ram = _core.RamTier(1 << 20, acct)
    a = _core.Checkpoint.at(root(), list(range(6)), BS, b"a" * 1000, account=acct)
    b = _core.Checkpoint.at(root(), list(range(5)), BS, b"b" * 500, account=acct)
    kept = store.insert(a)
    assert kept.same(a)
    ram.put_checkpoint(a)
    ram.put_checkpoint(b)
    holders = [a, a, b, store.get(a.key), ram.get_checkpoint(b.key)]
    assert (acct.live_count, acct.live_bytes) == (2, 1500)
    assert store.unique_bytes == 1000
    assert ram.held_bytes == 1500
    del a, b, kept, holders
    gc.collect()
    assert acct.live_bytes == 1500, "still held by the store and the RAM tier"
    ram.clear()
    assert (acct.live_count, acct.live_bytes) == (1, 1000)
    del store
    gc.collect()
    assert (acct.live_count, acct.live_bytes) == (0, 0)


def test_default_account_and_stats_function():
    before = _core.checkpoint_account_stats()
    c = _core.Checkpoint.at(root(), [1, 2], BS, b"z" * 123)
    after = _core.checkpoint_account_stats()
    assert after["count"] == before["count"] + 1
    assert after["bytes"] == before["bytes"] + 123
    assert _core.CheckpointAccount.default().live_bytes == after["bytes"]
    assert _core.CheckpointStore().account.live_bytes == after["bytes"]
    del c
    gc.collect()
    assert _core.checkpoint_account_stats() == before


def test_store_insert_keeps_existing_checkpoint():
    acct = _core.CheckpointAccount()
    store = _core.CheckpointStore(acct)
    toks = list(range(7))
    restored = store.insert(_core.Checkpoint.at(root(), toks, BS, b"x" * 10, account=acct))
    again = _core.Checkpoint.at(root(), toks, BS, b"x" * 10, account=acct)
    got = store.insert(again)
    assert got.same(restored) and not got.same(again)
    assert len(store) == 1 and restored.key in store
    del again, got
    gc.collect()
    assert acct.live_count == 1
    removed = store.remove(restored.key)
    assert removed.same(restored)
    assert store.remove(restored.key) is None and store.get(restored.key) is None
    assert len(store) == 0 and store.unique_bytes == 0
    store.check_invariants()


def test_deepest_checkpoint_along_a_prompt():
    acct = _core.CheckpointAccount()
    store = _core.CheckpointStore(acct)
    toks = np.arange(20, dtype=np.int64)
    for n in [0, 4, 6, 13, 19]:
        store.insert(_core.Checkpoint.at(root(), toks[:n], BS, bytes([n]), account=acct))
    keys = _core.hash_blocks(root(), toks, BS)
    r0 = root()

    def deepest(max_position=None, t=toks, r=r0):
        c = store.deepest(r, _core.hash_blocks(r, t, BS), t, max_position)
        return None if c is None else c.position

    assert deepest() == 19
    assert [deepest(m) for m in [18, 12, 5, 3]] == [13, 6, 4, 0]
    diverged = toks.copy()
    diverged[10] = 999
    assert deepest(t=diverged) == 6
    in_tail = toks[:14].copy()
    in_tail[12] = 999
    assert deepest(t=in_tail) == 6
    assert deepest(r=root(b"other-tenant")) is None
    c = store.deepest(root(), keys, toks)
    assert c.data == bytes([19]) and c.key == _core.prefix_key(root(), toks[:19], BS)
    with pytest.raises(_core.InvalidArgument):
        store.deepest(root(), [b"x"], toks)
    store.check_invariants()
