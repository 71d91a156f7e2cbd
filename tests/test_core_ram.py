"""End-to-end tests of the RAM tier through _core."""

import gc

import numpy as np
import pytest

from kvshare import _core


def k(i):
    return bytes([i]) * 32


def test_put_get_copies_out_and_leaves_entry():
    ram = _core.RamTier(1000)
    payload = np.arange(100, dtype=np.float16)
    assert ram.put_block(k(1), payload) is True
    assert ram.put_block(k(1), payload) is False, "same content stored once"
    got = ram.get_block(k(1))
    assert isinstance(got, bytes) and got == payload.tobytes()
    assert ram.contains_block(k(1)), "get leaves the entry"
    payload[:] = 0  # the tier holds its own copy
    assert ram.get_block(k(1)) != payload.tobytes()
    out = np.empty(100, dtype=np.float16)
    assert ram.get_block_into(k(1), out) is True
    np.testing.assert_array_equal(out, np.arange(100, dtype=np.float16))
    ba = bytearray(200)
    assert ram.get_block_into(k(1), ba) and bytes(ba) == got
    assert ram.get_block(k(2)) is None
    assert ram.get_block_into(k(2), out) is False
    st = ram.stats()
    assert (st["hits"], st["misses"], st["entries"], st["bytes"]) == (4, 2, 1, 200)
    assert len(ram) == 1 and ram.held_bytes == 200 and ram.budget == 1000
    ram.check_invariants()


def test_lru_eviction_and_budget():
    ram = _core.RamTier(1000)
    for i in range(3):
        ram.put_block(k(i), bytes([i]) * 300)
    ram.get_block(k(0))  # k(0) becomes most recent
    assert [key for _, key in ram.lru_order()] == [k(1), k(2), k(0)]
    ram.put_block(k(3), b"3" * 300)
    assert not ram.contains_block(k(1)) and ram.contains_block(k(0))
    assert ram.held_bytes == 900 and ram.stats()["evictions"] == 1
    assert ram.match_prefix([k(2), k(0), k(1), k(3)]) == 2
    with pytest.raises(_core.OverBudget):
        ram.put_block(k(9), b"x" * 1001)
    with pytest.raises(_core.KvshareError):
        ram.put_block(k(9), b"x" * 1001)
    assert ram.held_bytes == 900, "a refused put evicts nothing"
    ram.set_budget(650)
    assert ram.held_bytes == 600 and len(ram) == 2
    assert ram.remove_block(k(0)) and not ram.remove_block(k(0))
    assert ram.held_bytes == 300
    ram.clear()
    assert len(ram) == 0 and ram.held_bytes == 0
    ram.check_invariants()


def test_argument_errors():
    ram = _core.RamTier(1000)
    ram.put_block(k(1), b"x" * 10)
    with pytest.raises(_core.InvalidArgument):
        ram.put_block(k(1), b"x" * 11)  # same key, different size
    with pytest.raises(_core.InvalidArgument):
        ram.get_block_into(k(1), np.zeros(9, dtype=np.uint8))
    with pytest.raises(_core.InvalidArgument):
        ram.put_block(b"short", b"x")
    with pytest.raises(_core.InvalidArgument):
        ram.put_block(k(2), np.zeros((4, 4))[:, 1])
    with pytest.raises(TypeError):
        ram.put_block(k(2), 42)
    with pytest.raises(TypeError):
        ram.get_block_into(k(1), b"x" * 10)


def test_checkpoints_share_the_budget_and_lru():
    acct = _core.CheckpointAccount()
    ram = _core.RamTier(100, acct)
    root = _core.root_key(b"fp", "f16", 4)
    toks = list(range(8))
    c = _core.Checkpoint.at(root, toks[:4], 4, b"c" * 60, account=acct)
    block_key = _core.hash_blocks(root, toks, 4)[0]
    assert c.key == block_key, "aligned checkpoint shares the block's key"
    assert ram.put_block(block_key, b"b" * 30)
    assert ram.put_checkpoint(c)
    assert not ram.put_checkpoint(_core.Checkpoint.at(root, toks[:4], 4, b"c" * 60, account=acct))
    assert ram.stats()["checkpoints"] == 1 and ram.stats()["blocks"] == 1
    assert ram.get_checkpoint(c.key).same(c)
    keys = _core.hash_blocks(root, toks, 4)
    assert ram.deepest_checkpoint(root, keys, toks).same(c)
    assert ram.deepest_checkpoint(root, keys, toks, max_position=3) is None
    assert ram.lru_order() == [("block", block_key), ("checkpoint", c.key)]
    ram.put_block(k(5), b"5" * 40)  # evicts the block only
    assert not ram.contains_block(block_key) and ram.contains_checkpoint(c.key)
    ram.put_block(k(6), b"6" * 50)  # then the checkpoint
    assert not ram.contains_checkpoint(c.key)
    assert ram.held_bytes == 90
    with pytest.raises(_core.OverBudget):
        ram.put_checkpoint(_core.Checkpoint.at(root, toks, 4, b"x" * 101, account=acct))
    gc.collect()
    assert acct.live_count == 1, "only our own reference to c is left"
    removed = ram.remove_checkpoint(c.key)
    assert removed is None
    ram.check_invariants()


def test_held_bytes_equal_sum_of_entries_under_random_load():
    rng = np.random.default_rng(7)
    acct = _core.CheckpointAccount()
    ram = _core.RamTier(5000, acct)
    sizes = {}
    for _step in range(400):
        i = int(rng.integers(0, 40))
        if rng.random() < 0.7:
            size = sizes.setdefault(i, int(rng.integers(0, 900)))
            ram.put_block(k(i), bytes([i]) * size)
        else:
            got = ram.get_block(k(i))
            assert got is None or got == bytes([i]) * sizes[i]
        held = sum(sizes[j] for j in sizes if ram.contains_block(k(j)))
        assert ram.held_bytes == held <= 5000
        ram.check_invariants()
    assert ram.stats()["evictions"] > 0


def test_pinned_prefix_survives_a_flood_within_its_own_budget():
    ram = _core.RamTier(1000, pin_budget_bytes=300)
    assert ram.pin_budget == 300 and _core.RamTier(1000).pin_budget == 500
    prefix = [k(i) for i in range(3)]
    for key in prefix:
        ram.put_block(key, np.full(100, 1, dtype=np.uint8))
    assert ram.pin_blocks(prefix + [k(99)]) == 3, "pins the leading held blocks"
    assert ram.pinned_bytes == 300 and all(ram.is_pinned(x) for x in prefix)
    for i in range(10, 40):  # a flood of conversation tails
        ram.put_block(k(i), np.full(100, i, dtype=np.uint8))
    assert ram.match_prefix(prefix) == 3
    st = ram.stats()
    assert (st["pinned"], st["pinned_bytes"], st["evictions"]) == (3, 300, 23)
    # A second prefix past the pin budget demotes the oldest pins, deepest block first.
    other = [k(50), k(51)]
    for key in other:
        ram.put_block(key, np.zeros(100, dtype=np.uint8))
    assert ram.pin_blocks(other) == 2
    assert [ram.is_pinned(x) for x in prefix] == [True, False, False]
    assert ram.stats()["demotions"] == 2
    assert ram.unpin(k(0)) and not ram.unpin(k(0))
    assert ram.touch_blocks(other) == 2
    ram.set_pin_budget(5000)
    assert ram.pin_budget == 1000, "capped at the budget"
    assert ram.lru_order()[-2:] == [("block", k(51)), ("block", k(50))], "pins evicted last, head last"
    ram.check_invariants()
    with pytest.raises(_core.InvalidArgument):
        ram.pin_blocks([b"short"])
