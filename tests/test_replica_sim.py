"""bench/replica_sim.py (issue 16): the replica simulation on its --quick trace, and its cache
models against per-block reference models.

- acceptance: at N = 16, prefix-aware routing + the shared tier recomputes <= 1/8 of what
  round-robin without a shared tier recomputes;
- adding the shared tier never increases the recomputed tokens (same policy, same N);
- at N = 1 every policy sends everything to the one replica: identical results;
- `BlockLRU` (a replica's RAM tier, one run per owner) and `SharedLRU` (Redis, runs with ticks)
  hold exactly the blocks that a block-by-block model of the same rules holds.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "replica_sim.py"


def _load():
    spec = importlib.util.spec_from_file_location("replica_sim", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("replica_sim", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sim = _load()


@pytest.fixture(scope="module")
def rows():
    p = sim.Params(**sim.QUICK)
    return sim.run_all(p, [1, 16], jobs=1)


def _row(rows, policy, shared, n):
    (r,) = [r for r in rows if (r["policy"], r["shared"], r["replicas"]) == (policy, shared, n)]
    return r


def test_acceptance_at_16(rows):
    target = _row(rows, "prefix_aware", True, 16)
    base = _row(rows, "round_robin", False, 16)
    assert target["recomputed_tokens"] <= base["recomputed_tokens"] / 8, sim.table(rows)
    ok, line = sim.verdict(rows)
    assert ok and "PASS" in line


def test_shared_tier_never_adds_recompute(rows):
    for n in (1, 16):
        for policy in sim.POLICIES:
            without = _row(rows, policy, False, n)["recomputed_tokens"]
            with_ = _row(rows, policy, True, n)["recomputed_tokens"]
            assert with_ <= without, (policy, n, sim.table(rows))


def test_one_replica_all_policies_equal(rows):
    keys = ("requests", "prompt_tokens", "local_tokens", "restored_tokens", "recomputed_tokens")
    for shared in (False, True):
        got = {p: tuple(_row(rows, p, shared, 1)[k] for k in keys) for p in sim.POLICIES}
        assert len(set(got.values())) == 1, got


def test_consistent_hash_is_sticky(rows):
    # no load bound: every request of a tenant lands on its ring home
    r = _row(rows, "consistent_hash", False, 16)
    assert r["requests_max_over_mean"] > 1.5  # Zipf: the hot tenants' homes carry more
    assert r["hit_rate"] > _row(rows, "round_robin", False, 16)["hit_rate"]


# ---- the cache models against block-by-block references --------------------------------

class RefRam:
    """The RAM tier's rules block by block: LRU by tick, pinned prefix blocks evicted only when
    no normal block is left, pins past the sub-budget demoted (least recent first, keeping their
    tick), a chain refreshed deepest block first."""

    def __init__(self, cap: int, pin_cap: int):
        self.cap, self.pin_cap = cap, pin_cap
        self.blocks: dict[tuple, list] = {}  # block -> [tick, pinned]
        self.clock = 0

    def run(self, owner: tuple, start: int) -> int:
        i = start
        while (*owner, i) in self.blocks:
            i += 1
        return i - start

    def _refresh(self, chain: list[tuple], pin: set) -> None:
        for b in reversed(chain):
            self.clock += 1
            e = self.blocks.setdefault(b, [0, False])
            e[0] = self.clock
            if b in pin:
                e[1] = True

    def touch(self, t: int, pb: int, s: int, with_session: bool) -> None:
        lt = self.run(("t", t), 0)
        chain = [("t", t, i) for i in range(lt)]
        if with_session:
            chain += [("s", s, pb + i) for i in range(self.run(("s", s), pb))]
        self._refresh(chain, set())

    def put(self, t: int, pb: int, s: int, n_session: int) -> None:
        head = [("t", t, i) for i in range(pb)]
        self._refresh(head + [("s", s, pb + i) for i in range(n_session)], set(head))
        pinned = [b for b, e in self.blocks.items() if e[1]]
        while len(pinned) > self.pin_cap:
            b = min(pinned, key=lambda b: self.blocks[b][0])
            self.blocks[b][1] = False
            pinned.remove(b)
        while len(self.blocks) > self.cap:
            normal = [b for b, e in self.blocks.items() if not e[1]]
            b = min(normal or list(self.blocks), key=lambda b: self.blocks[b][0])
            del self.blocks[b]


def _ram_blocks(m, n_tenants: int, prefix_blocks: list[int]) -> set:
    out = set()
    for t in range(n_tenants):
        out |= {("t", t, i) for i in range(m.tenant_held(t))}
    for key, n in m.size.items():
        if key >= n_tenants:
            s = key - n_tenants
            pb = prefix_blocks[_SESSION_TENANT[s]]
            out |= {("s", s, pb + i) for i in range(n)}
    return out


_SESSION_TENANT: dict[int, int] = {}


@pytest.mark.parametrize("seed", range(6))
def test_block_lru_matches_block_model(seed):
    rng = random.Random(seed)
    n_tenants, n_sessions = 4, 10
    prefix_blocks = [rng.randint(3, 12) for _ in range(n_tenants)]
    cap = rng.randint(20, 60)
    pin_cap = rng.choice([0, cap // 4, cap // 2, cap])
    _SESSION_TENANT.clear()
    _SESSION_TENANT.update({s: rng.randrange(n_tenants) for s in range(n_sessions)})
    grown = [0] * n_sessions
    model = sim.BlockLRU(cap, pin_cap, n_tenants)
    ref = RefRam(cap, pin_cap)  # pin_cap 0: every pin is demoted at once, as no pinning
    for _ in range(400):
        s = rng.randrange(n_sessions)
        t, pb, skey = _SESSION_TENANT[s], prefix_blocks[_SESSION_TENANT[s]], n_tenants + s
        # a lookup as the simulation does it, then the request's store at finish
        lt = min(model.tenant_held(t), pb)
        assert lt == ref.run(("t", t), 0)
        ls = model.size.get(skey, 0) if lt == pb else 0
        if lt == pb:
            assert ls == ref.run(("s", s), pb)
        if lt:
            model.touch(t, skey if ls else None)
            ref.touch(t, pb, s, bool(ls))
        if rng.random() < 0.8:
            grown[s] += rng.randint(0, 4)
            model.put(t, pb, skey, grown[s])
            ref.put(t, pb, s, grown[s])
        assert _ram_blocks(model, n_tenants, prefix_blocks) == set(ref.blocks)
        assert model.held == len(ref.blocks) <= cap
        assert model.held_pinned == sum(e[1] for e in ref.blocks.values())


class RefRedis:
    """allkeys-lru block by block: ties in a tick go deepest first (then higher owner ids)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.blocks: dict[tuple[int, int], int] = {}

    def present(self, owner, pos, limit):
        i = pos
        while i < limit and (owner, i) in self.blocks:
            i += 1
        return i - pos

    def refresh(self, owner, a, b, tick):
        for i in range(a, b):
            self.blocks[(owner, i)] = tick

    def write(self, owner, a, b, tick):
        for i in range(a, b):
            self.blocks[(owner, i)] = tick
        while len(self.blocks) > self.cap:
            k = min(self.blocks, key=lambda k: (self.blocks[k], -k[0], -k[1]))
            del self.blocks[k]


@pytest.mark.parametrize("seed", range(6))
def test_shared_lru_matches_block_model(seed):
    rng = random.Random(100 + seed)
    cap = rng.randint(15, 50)
    model, ref = sim.SharedLRU(cap), RefRedis(cap)
    for _ in range(500):
        owner = rng.randrange(5)
        a = rng.randrange(12)
        b = a + rng.randint(0, 10)
        tick = model.tick()
        if rng.random() < 0.4:
            n = model.present(owner, a, b)
            assert n == ref.present(owner, a, b)
            if n:
                model.refresh(owner, a, a + n, tick)
                ref.refresh(owner, a, a + n, tick)
        else:
            model.write(owner, a, b, tick)
            ref.write(owner, a, b, tick)
        held = {(o, i) for o, runs in model.runs.items() for s, (e, _) in runs.items()
                for i in range(s, e)}
        assert held == set(ref.blocks)
        ticks = {(o, i): t for o, runs in model.runs.items() for s, (e, t) in runs.items()
                 for i in range(s, e)}
        assert ticks == ref.blocks
        assert model.held == len(ref.blocks) <= cap
