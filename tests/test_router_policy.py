"""The routing rule (python/kvshare/router/policy.py) without I/O: the ring, bounded and sticky
assignment, spill, failover, expiry, keyless requests."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvshare.router.policy import HashRing, PrefixPolicy

B = [f"http://10.0.0.{i}:8080" for i in range(1, 6)]


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_ring_moves_only_the_keys_of_an_added_backend():
    before = HashRing(B[:4])
    after = HashRing(B)
    moved = [k for k in keys(4000) if before.home(k) != after.home(k)]
    assert all(after.home(k) == B[4] for k in moved)  # only to the new backend
    assert 0.12 < len(moved) / 4000 < 0.28  # about 1/5 of the keys
    assert sorted(before.walk(b"x")) == sorted(B[:4])  # every backend once


@pytest.mark.parametrize("order", ["tenant", "session", "shuffled"])
def test_prefixes_spread_evenly_whatever_the_arrival_order(order):
    pol = PrefixPolicy(B[:2])
    jobs = [(t, s) for t in range(8) for s in range(4)]
    if order == "session":
        jobs.sort(key=lambda j: (j[1], j[0]))
    elif order == "shuffled":
        random.Random(3).shuffle(jobs)
    homes: dict[int, set[str]] = {}
    load: Counter[str] = Counter()
    for t, _ in jobs:
        c = pol.choose(f"tenant{t}".encode(), load)
        load[c.backend] += 1  # in flight: nothing finishes (the concurrent case)
        homes.setdefault(t, set()).add(c.backend)
        assert c.at_home
    assert all(len(h) == 1 for h in homes.values())  # a tenant's sessions stay together
    assert load[B[0]] == load[B[1]] == 16
    assert pol.prefix_counts() == {B[0]: 4, B[1]: 4}


def test_many_prefixes_over_five_backends_stay_within_the_bound():
    pol = PrefixPolicy(B)
    for k in keys(103):
        pol.choose(k, {})
    counts = pol.prefix_counts()
    assert max(counts.values()) <= -(-103 // 5) and sum(counts.values()) == 103


def test_an_overloaded_home_spills_without_moving_the_prefix():
    pol = PrefixPolicy(B[:2], overload_factor=1.5, spill_min=8)
    home = pol.choose(b"hot", {}).backend
    other = next(b for b in B[:2] if b != home)
    c = pol.choose(b"hot", {home: 9, other: 1})  # 9 >= ceil(1.5 * 11 / 2) = 9
    assert (c.backend, c.reason) == (other, "spill") and not c.at_home
    assert pol.assigned(b"hot") == home
    assert pol.choose(b"hot", {home: 7, other: 0}).reason == "affinity"  # under the floor
    assert pol.choose(b"hot", {home: 9, other: 5}).reason == "affinity"  # under 1.5x mean


def test_a_down_backends_prefixes_move_and_stay_moved():
    pol = PrefixPolicy(B[:3])
    home = pol.choose(b"p", {}).backend
    up = [b for b in B[:3] if b != home]
    c = pol.choose(b"p", {}, healthy=up)
    assert c.backend in up and c.reason == "ring"
    # the old home is back: the prefix's KV lives on the new one now
    assert pol.choose(b"p", {}).backend == c.backend
    assert pol.choose(b"p", {}, healthy=[]) is None


def test_prefixes_unseen_for_active_s_are_forgotten():
    pol = PrefixPolicy(B[:2], active_s=60)
    pol.choose(b"a", {}, now=0.0)
    pol.choose(b"b", {}, now=30.0)
    pol.choose(b"c", {}, now=61.0)  # expires a (last seen at 0), keeps b
    assert pol.assigned(b"a") is None and pol.assigned(b"b") is not None
    assert sum(pol.prefix_counts().values()) == 2


def test_keyless_requests_go_to_the_least_loaded_in_turn():
    pol = PrefixPolicy(B[:3])
    got = Counter(pol.choose(None, {}).backend for _ in range(9))
    assert got == {b: 3 for b in B[:3]}  # idle backends share them
    c = pol.choose(None, {B[0]: 2, B[1]: 0, B[2]: 1})
    assert (c.backend, c.reason) == (B[1], "least_loaded")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PrefixPolicy(B, load_factor=0.5)
    with pytest.raises(ValueError):
        HashRing([])
