"""End-to-end tests of chain hashing and the block pool through kvshare._core."""

import ast
import pathlib
import random

import numpy as np
import pytest

from kvshare import _core

BS = 4


def root(salt=None):
    return _core.root_key(b"model-fp", "f16", BS, salt)


def fill(pool, tokens, r=None):
    """Write `tokens` into fresh blocks like the engine does; returns the block table."""
    r = r or root()
    keys = _core.hash_blocks(r, tokens, BS)
    table, parent = [], r
    for i in range(0, len(tokens), BS):
        b = pool.allocate(parent)
        pool.append_tokens(b, tokens[i : i + BS])
        if i + BS <= len(tokens):
            assert pool.register(b, keys[i // BS]) == b
            parent = keys[i // BS]
        table.append(b)
    return table


# ---------------------------------------------------------------- hashing


def test_root_key_separates_every_field():
    base = _core.root_key(b"fp", "f16", 16)
    assert isinstance(base, bytes) and len(base) == 32
    assert base == _core.root_key(b"fp", "f16", 16, None)
    others = [
        _core.root_key(b"fp2", "f16", 16),
        _core.root_key(b"fp", "bf16", 16),
        _core.root_key(b"fp", "f16", 32),
        _core.root_key(b"fp", "f16", 16, b""),
        _core.root_key(b"fp", "f16", 16, b"tenant-a"),
        _core.root_key(b"fp", "f16", 16, b"tenant-b"),
    ]
    assert len({base, *others}) == 7


def test_hash_blocks_chain_and_prefix_keys_agree():
    r = root()
    toks = list(range(11))
    keys = _core.hash_blocks(r, toks, BS)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert keys[0] == _core.chain_key(r, toks[:4])
    assert keys[1] == _core.chain_key(keys[0], toks[4:8])
    assert _core.prefix_key(r, [], BS) == r
    assert _core.prefix_key(r, toks[:8], BS) == keys[1]
    partial = _core.prefix_key(r, toks, BS)
    assert partial not in keys and partial != _core.prefix_key(r, toks[:10], BS)
    # hashing a continuation from the last key gives the same chain
    assert _core.hash_blocks(keys[0], toks[4:8], BS) == [keys[1]]
    # extra is mixed into every block
    assert _core.hash_blocks(r, toks, BS, b"img")[0] != keys[0]
    assert _core.hash_blocks(r, toks, BS, b"") == keys


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint16, np.int16, np.uint64])
def test_numpy_token_arrays_hash_like_lists(dtype):
    r = root()
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    expect = _core.hash_blocks(r, toks, BS)
    arr = np.array(toks, dtype=dtype)
    assert _core.hash_blocks(r, arr, BS) == expect
    assert _core.prefix_key(r, arr, BS) == _core.prefix_key(r, toks, BS)
    # non-contiguous views work too (through tolist)
    wide = np.zeros(2 * len(toks), dtype=dtype)
    wide[::2] = toks
    assert _core.hash_blocks(r, wide[::2], BS) == expect


def test_large_token_ids_and_tuple_input():
    r = root()
    toks = (0, 2**32 - 1, 70000, 5)
    assert _core.hash_blocks(r, toks, BS) == _core.hash_blocks(r, list(toks), BS)
    assert _core.hash_blocks(r, np.array(toks, dtype=np.uint32), BS) == _core.hash_blocks(r, toks, BS)


def test_hash_input_errors():
    r = root()
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r, [1, -1, 2, 3], BS)
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r, [2**32], BS)
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r, np.array([1, -5], dtype=np.int64), BS)
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r[:31], [1, 2, 3, 4], BS)
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r, [1, 2, 3, 4], 0)
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r, "abcd", BS)
    with pytest.raises(_core.InvalidArgument):
        _core.hash_blocks(r, np.ones(4, dtype=np.float32), BS)
    with pytest.raises(TypeError):
        _core.hash_blocks("not bytes", [1], BS)


# ---------------------------------------------------------------- pool


def test_attach_flow_prefix_match_extend_and_cow():
    pool = _core.BlockPool(8, BS)
    prompt = list(range(10))  # 2 full blocks + [8, 9]
    table = fill(pool, prompt)
    assert pool.stats()["tokens_held"] == 10
    pool.release(table)
    assert pool.lru_order() == table[::-1]
    assert pool.stats() == {"total": 8, "used": 0, "free": 5, "cached": 3, "shared": 0, "tokens_held": 0}

    other = list(range(9)) + [50, 51]
    keys = _core.hash_blocks(root(), other, BS)
    ids, n = pool.match_prefix(keys)
    assert (ids, n) == (table[:2], 8)
    pool.acquire(ids)
    assert [pool.state(i) for i in ids] == ["used", "used"]
    src, m = pool.extend_match(keys[1], other[8:])
    assert (src, m) == (table[2], 1)
    dst = pool.cow(src, m)
    assert dst != src and pool.tokens(dst) == [8] and pool.tokens(src) == [8, 9]
    assert pool.parent(dst) == keys[1]
    pool.append_tokens(dst, np.array([50, 51]))
    assert pool.tokens(dst) == [8, 50, 51]
    assert pool.key(dst) is None and pool.key(ids[0]) == keys[0]
    assert pool.lookup(keys[1]) == ids[1]
    pool.check_invariants()


def test_release_order_protects_shared_prefix():
    pool = _core.BlockPool(6, BS)
    prompt = list(range(12))
    a = fill(pool, prompt)
    keys = _core.hash_blocks(root(), prompt, BS)
    pool.acquire(a[:2])
    b3 = pool.allocate(keys[1])
    pool.append_tokens(b3, [7, 7])
    b = a[:2] + [b3]
    assert pool.stats()["shared"] == 2
    pool.release(a)
    pool.release(b)
    assert pool.lru_order() == [a[2], b3, a[1], a[0]]
    victims = [pool.allocate(root()) for _ in range(6)]
    # two free blocks first, then the LRU head onwards
    assert victims[2:] == [a[2], b3, a[1], a[0]]
    assert pool.match_prefix(keys) == ([], 0)
    pool.check_invariants()


def test_acquire_prefix_is_match_plus_acquire():
    pool = _core.BlockPool(6, BS)
    prompt = list(range(10))
    table = fill(pool, prompt)
    pool.release(table)
    keys = _core.hash_blocks(root(), prompt, BS)
    assert pool.match_prefix(keys) == (table[:2], 8)
    assert all(pool.ref_count(b) == 0 for b in table), "match_prefix is a peek"
    ids, n = pool.acquire_prefix(keys)
    assert (ids, n) == (table[:2], 8)
    assert [pool.ref_count(b) for b in table] == [1, 1, 0]
    assert pool.lru_order() == [table[2]]
    pool.release(ids)
    pool.check_invariants()


def test_duplicate_register_and_swap():
    pool = _core.BlockPool(4, BS)
    toks = [5, 6, 7, 8]
    k = _core.chain_key(root(), toks)
    a = pool.allocate(root())
    pool.append_tokens(a, toks)
    assert pool.register(a, k) == a
    b = pool.allocate(root())
    pool.append_tokens(b, toks)
    assert pool.register(b, k) == a
    pool.acquire([a])
    pool.release([b])
    assert pool.state(b) == "free"
    assert pool.ref_count(a) == 2
    pool.check_invariants()


def test_exceptions_are_typed():
    pool = _core.BlockPool(2, BS)
    a = pool.allocate(root())
    for call in [
        lambda: pool.acquire([99]),
        lambda: pool.acquire([-1]),
        lambda: pool.acquire([1]),  # free block
        lambda: pool.release([a, a]),  # double free
        lambda: pool.append_tokens(a, [0] * (BS + 1)),  # overflow
        lambda: pool.register(a, b"\0" * 32),  # not full
        lambda: pool.register(a, b"short"),
        lambda: pool.allocate(b"short"),
        lambda: pool.cow(a, 1),  # more tokens than held
        lambda: pool.ref_count(7),
        lambda: _core.BlockPool(4, 0),
    ]:
        with pytest.raises(_core.InvalidArgument) as ei:
            call()
        assert isinstance(ei.value, _core.KvshareError)
    pool.acquire([a])
    with pytest.raises(_core.InvalidArgument, match="shared"):
        pool.append_tokens(a, [1])
    pool.release([a])
    pool.allocate(root())
    with pytest.raises(_core.OutOfBlocks):
        pool.allocate(root())
    assert pool.stats()["used"] == 2
    with pytest.raises(_core.KvshareError):
        pool.allocate(root())
    pool.check_invariants()


def test_random_operations_against_a_reference_model():
    """Random alloc / share / append+CoW / release through the binding, checked against a
    small Python model after every step (ref counts, LRU order, stats, token contents)."""
    rng = random.Random(1234)
    n_blocks = 10
    pool = _core.BlockPool(n_blocks, BS)
    refs = [0] * n_blocks
    toks = [[] for _ in range(n_blocks)]
    keyed = [False] * n_blocks
    lru = []
    seqs = []  # list of block tables (last block may be partial / shared)
    hits = {"evict": 0, "cow": 0, "out_of_blocks": 0, "revive": 0}

    def m_release(table):
        for b in reversed(table):
            refs[b] -= 1
            if refs[b] == 0:
                if keyed[b] or 0 < len(toks[b]) < BS:
                    lru.append(b)
                else:
                    toks[b] = []

    def m_alloc(got, pinned=None):
        free = [i for i in range(n_blocks) if refs[i] == 0 and i not in lru]
        if free:
            assert got in free
        else:
            victim = next(i for i in lru if i != pinned)
            assert got == victim
            hits["evict"] += 1
            lru.remove(victim)
            keyed[victim] = False
        refs[got], toks[got] = 1, []

    for _step in range(600):
        op = rng.random()
        try:
            if op < 0.05 and lru:
                b = rng.choice(lru)  # attach to a cached block: it leaves the LRU
                pool.acquire([b])
                lru.remove(b)
                refs[b] = 1
                hits["revive"] += 1
                seqs.append([b])
            elif op < 0.3 or not seqs:
                b = pool.allocate(root())
                m_alloc(b)
                seqs.append([b])
            elif op < 0.45:
                t = rng.choice(seqs)
                share = t[: rng.randint(1, len(t))]
                pool.acquire(share)
                for b in share:
                    refs[b] += 1
                seqs.append(list(share))
            elif op < 0.75:
                t = rng.choice(seqs)
                last = t[-1]
                if len(toks[last]) == BS:
                    continue
                if refs[last] > 1:
                    with pytest.raises(_core.InvalidArgument):
                        pool.append_tokens(last, [1])
                    new = pool.cow(last, len(toks[last]))
                    hits["cow"] += 1
                    m_alloc(new, pinned=last)
                    toks[new] = list(toks[last])
                    pool.release([last])
                    m_release([last])
                    t[-1] = last = new
                n = rng.randint(1, BS - len(toks[last]))
                add = [rng.randrange(3) for _ in range(n)]
                pool.append_tokens(last, add)
                toks[last] += add
            else:
                t = seqs.pop(rng.randrange(len(seqs)))
                pool.release(t)
                m_release(t)
        except _core.OutOfBlocks:
            hits["out_of_blocks"] += 1
            # only when nothing is free and nothing is evictable
            assert all(r > 0 for r in refs) and not lru
        # checks after every step
        entries = [b for t in seqs for b in t]
        assert sum(pool.ref_count(i) for i in range(n_blocks)) == len(entries)
        for i in range(n_blocks):
            assert pool.ref_count(i) == refs[i] == entries.count(i)
            assert pool.tokens(i) == toks[i]
        assert all(pool.state(b) == "used" for b in entries)
        assert pool.lru_order() == lru
        st = pool.stats()
        assert st["used"] == sum(r > 0 for r in refs)
        assert st["shared"] == sum(r > 1 for r in refs)
        assert st["cached"] == len(lru)
        assert st["tokens_held"] == sum(len(toks[i]) for i in range(n_blocks) if refs[i])
        pool.check_invariants()
    assert all(v >= 3 for v in hits.values()), hits
    for t in seqs:
        pool.release(t)
    pool.evict_all_cached()
    assert pool.stats()["free"] == n_blocks


def test_repr_and_properties():
    pool = _core.BlockPool(3, 16)
    assert (pool.n_blocks, pool.block_size, pool.available()) == (3, 16, 3)
    assert "BlockPool(" in repr(pool)


def test_stub_lists_what_the_module_has():
    """Every class, method and function stubbed in our section of _core.pyi exists at runtime."""
    pyi = pathlib.Path(_core.__file__).with_name("_core.pyi")
    if not pyi.exists():
        pyi = pathlib.Path(__file__).parents[1] / "python" / "kvshare" / "_core.pyi"
    tree = ast.parse(pyi.read_text())
    checked = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            assert hasattr(_core, node.name), node.name
            checked += 1
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            if any(isinstance(b, ast.Name) and b.id == "TypedDict" for b in node.bases):
                continue
            cls = getattr(_core, node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    assert hasattr(cls, item.name), f"{node.name}.{item.name}"
                    checked += 1
    assert checked > 60
