"""Routing across replicas, simulated (issue 16): what prefix-aware routing and a shared tier buy.

A seeded synthetic agent trace is replayed against N = 1..32 simulated kvshare replicas with
finite prefix caches, under three routing policies, each with and without the shared (Redis)
tier: six configurations per N. This is how the design is judged at a scale that cannot run
here; the prefix-aware policy is the router's own code (`kvshare.router.policy.PrefixPolicy`,
driven with the simulated in-flight loads and clock), not a copy.

The trace (deterministic for a --seed):
- `--tenants` agents, each with its *prefix* (tools + system prompt, 5K-30K tokens, uniform),
  picked with Zipf(`--zipf`) popularity (the default 200 at 1.1: the top tenant has 21% of the
  sessions, the top 20 68%);
- sessions arrive as a Poisson process (`--session-rate` per second for `--duration` seconds);
  each runs 2-8 turns; a turn re-sends the whole conversation (prefix + earlier turns) plus
  100-400 new user tokens and gets a 100-300-token reply; exponential think time (mean
  `--think` s) between a reply and the next turn;
- a request is in flight for computed/`--prefill-tps` + restored/`--restore-tps` +
  reply/`--decode-tps` seconds, so the in-flight loads the bounded-load policy sees are real
  (the defaults: 50-60 requests in flight, 3-4 per replica at N = 16).

A replica's cache is kvshare's RAM tier (`kvshare_core::ram_tier`) at chain-block granularity
(16 tokens): a block is (tenant, index) inside the tenant's prefix (shared by all its sessions)
and (session, index) after it (a conversation is private); a request hits the longest prefix
of its blocks that is held, and at finish its prompt + reply full blocks are stored (as kvshare
saves at finish). LRU under `--replica-cache` tokens, with the tier's two classes: prefix blocks
are *pinned* within a sub-budget (`--pin-fraction`, kvshare's default half; past it the least
recently used pins are demoted to the normal class, keeping their age) and evicted only when no
normal block is left; a chain is refreshed deepest block first, so eviction takes a
conversation's deep blocks before its head. Every hit or store refreshes all of an owner's
(tenant's, session's) held blocks at once, so they are kept as one run per owner: exact for
this LRU (tests/test_replica_sim.py checks it against a per-block model) and O(1) per request.
The default 128K tokens is ~7 mean prefixes (16 GiB at 128 KiB of KV per token, an 8B model in
bf16); at N = 16 the replicas together hold ~57% of the 3.7M tokens of tenant prefixes.

The shared tier is Redis as `engine/remote_tier.py` uses it (`allkeys-lru`, one value per
block, `--shared-cache` tokens of `maxmemory`, default 2M: as much as the 16 replicas): lookups
fall through local -> shared, continuing from where the local run stopped (as the tier manager
does); a block read (GETEX) is *restored* (counted apart from recomputed tokens) and refreshed;
every finished request offers its blocks and the missing ones are written (EXISTS, then SET
NX); a probe does not refresh a block (EXISTS does not touch) but a skipped write does (the
writer TOUCHes what it skips), so a prefix that every replica holds locally stays in Redis.

Policies (routing key: the tenant's prefix key, a hash as the router computes one):
- `round_robin`: request i goes to replica i mod N;
- `consistent_hash`: `HashRing.home(key)`, no load bound;
- `prefix_aware`: `PrefixPolicy.choose(key, in-flight per replica, healthy = all, now = clock)`
  with the policy's defaults (prefixes spread by a bound on active prefixes per replica,
  sticky, spill to the least loaded replica past 1.5x the mean in-flight load and at least
  32 requests in flight).

Metrics per (policy, shared tier, N): prefix hit rate (prompt tokens served from a cache, local
or shared), recomputed tokens (prompt tokens computed), restored tokens (what crossed the
network from Redis), max/mean load over replicas (requests, computed tokens), and recomputed /
recomputed(round_robin, no shared tier) at the same N; the header gives the floor (unbounded
caches: each prefix computed once, each turn only its new tokens). Acceptance (issue 16): at
N = 16, prefix_aware + shared recomputes <= 1/8 of round_robin without (`--check`: exit 1 if
not). The ratio depends on the capacities: a shared tier much smaller than the prefixes' working
set cannot meet it (try `--shared-cache 1048576`).

Left out: the device block pool and the disk tier as levels of their own (fold them into
`--replica-cache`), prefill batching and queueing (a replica serves any number of requests at
once at full speed: latency does not grow with load, only the in-flight count does, so an
imbalanced policy's cost shows only in the max/mean columns), blocks attached by a concurrent
session while another still computes them (a request's blocks become hits when it finishes),
chat-template tokens, the remote writer's 10-minute memory of keys it knows are in Redis (here
every save re-checks), TTLs, Redis's sampled LRU (exact LRU here; one tick per pipelined batch,
deepest blocks first within a tick), failures and replica changes. Tokens, not seconds, are the
measure: a restored token costs a transfer, not a prefill.

    python bench/replica_sim.py [--quick] [--replicas 1,2,4,8,16,32] [--check] [--jobs 2]
        [--replica-cache 131072] [--shared-cache 2097152] [...: --help]

Writes bench/out/replica_sim.json (`--out`) and bench/out/replica_sim.png (`--png`: recomputed
tokens and hit rate vs N; needs matplotlib: `pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvshare.router.policy import HashRing, PrefixPolicy

BLOCK = 16  # tokens per chain block, as kvshare
POLICIES = ("round_robin", "consistent_hash", "prefix_aware")
BASELINE = ("round_robin", False)
TARGET = ("prefix_aware", True)
TARGET_N, TARGET_RATIO = 16, 1 / 8
OUT = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class Params:
    seed: int = 0
    tenants: int = 200
    zipf: float = 1.1
    prefix_min: int = 5_000
    prefix_max: int = 30_000
    session_rate: float = 2.0  # sessions per second
    duration: float = 3600.0  # seconds of session arrivals
    turns_min: int = 2
    turns_max: int = 8
    user_min: int = 100
    user_max: int = 400
    reply_min: int = 100
    reply_max: int = 300
    think: float = 15.0  # mean think time between a reply and the next turn, s
    prefill_tps: float = 8_000.0  # computed prompt tokens per second, per request
    restore_tps: float = 20_000.0  # tokens restored from the shared tier per second
    decode_tps: float = 40.0  # reply tokens per second, per request
    replica_cache: int = 131_072  # tokens per replica (its RAM tier, disk folded in)
    pin_fraction: float = 0.5  # the pinned sub-budget, as a fraction of replica_cache
    shared_cache: int = 2_097_152  # tokens in the shared tier (Redis maxmemory)


QUICK = {"tenants": 100, "duration": 900.0}


@dataclass
class Trace:
    prefix_len: list[int]  # per tenant
    keys: list[bytes]  # per tenant: the routing key
    start: list[float]  # per session: arrival of its first turn
    tenant: list[int]  # per session
    user: list[list[int]]  # per session, per turn
    reply: list[list[int]]
    think: list[list[float]]

    @property
    def requests(self) -> int:
        return sum(len(u) for u in self.user)


def make_trace(p: Params) -> Trace:
    rng = np.random.default_rng(p.seed)
    prefix_len = rng.integers(p.prefix_min, p.prefix_max + 1, size=p.tenants).tolist()
    keys = [hashlib.blake2b(f"tenant-{t}".encode(), digest_size=16).digest()
            for t in range(p.tenants)]
    weights = 1.0 / np.arange(1, p.tenants + 1) ** p.zipf
    popularity = weights / weights.sum()
    gaps = rng.exponential(1.0 / p.session_rate, size=int(p.session_rate * p.duration * 1.5) + 16)
    starts = np.cumsum(gaps)
    starts = starts[starts < p.duration]
    n = len(starts)
    tenant = rng.choice(p.tenants, size=n, p=popularity).tolist()
    turns = rng.integers(p.turns_min, p.turns_max + 1, size=n)
    user, reply, think = [], [], []
    for k in turns.tolist():
        user.append(rng.integers(p.user_min, p.user_max + 1, size=k).tolist())
        reply.append(rng.integers(p.reply_min, p.reply_max + 1, size=k).tolist())
        think.append(rng.exponential(p.think, size=k).tolist())
    return Trace(prefix_len, keys, starts.tolist(), tenant, user, reply, think)


class BlockLRU:
    """A block cache under `capacity` blocks, LRU, with kvshare's pinned class for tenant
    prefixes (`pin_budget` blocks; 0: no pinning). Held blocks are one run per owner, from the
    owner's first block: key t (0 <= t < n_tenants) is tenant t's prefix (pinned class when
    pinning), key -t-1 its demoted deep blocks (normal class, right after the pinned run), key
    n_tenants + s session s's conversation blocks (normal class)."""

    def __init__(self, capacity: int, pin_budget: int, n_tenants: int):
        self.cap = capacity
        self.pin_cap = pin_budget
        self.pinning = pin_budget > 0
        self.n_tenants = n_tenants
        self.size: dict[int, int] = {}
        self.tick: dict[int, int] = {}
        self.clock = 0
        self.normal: list[tuple[int, int]] = []  # (tick, key), lazily invalidated
        self.pinned: list[tuple[int, int]] = []
        self.held = 0
        self.held_pinned = 0
        self.evicted = 0

    def tenant_held(self, t: int) -> int:
        size = self.size
        return size.get(t, 0) + size.get(-t - 1, 0)

    def _refresh(self, key: int, pinned: bool) -> None:
        self.clock += 1
        self.tick[key] = self.clock
        heapq.heappush(self.pinned if pinned else self.normal, (self.clock, key))

    def touch(self, t: int, skey: int | None) -> None:
        """A hit: the held blocks of the session (if given) and the tenant, deepest first."""
        size = self.size
        if skey is not None and skey in size:
            self._refresh(skey, False)
        if -t - 1 in size:
            self._refresh(-t - 1, False)
        if t in size:
            self._refresh(t, self.pinning)

    def put(self, t: int, prefix_blocks: int, skey: int, session_blocks: int) -> None:
        """A finished request stores its chain: the session's blocks, then the tenant's (so the
        head is the most recent); the tenant's prefix is whole again (and pinned)."""
        size = self.size
        if session_blocks > 0:
            old = size.get(skey, 0)
            size[skey] = max(old, session_blocks)
            self.held += size[skey] - old
            self._refresh(skey, False)
        tail = size.pop(-t - 1, 0)
        if tail:
            del self.tick[-t - 1]
            self.held -= tail
        old = size.get(t, 0)
        size[t] = prefix_blocks
        self.held += prefix_blocks - old
        if self.pinning:
            self.held_pinned += prefix_blocks - old
        self._refresh(t, self.pinning)
        self._enforce()

    def _lru(self, heap: list[tuple[int, int]]) -> int | None:
        tick, size = self.tick, self.size
        while heap:
            tk, key = heap[0]
            if key in size and tick[key] == tk:
                return key
            heapq.heappop(heap)
        return None

    def _enforce(self) -> None:
        size, tick = self.size, self.tick
        while self.held_pinned > self.pin_cap:  # demote the least recent pins' deep blocks
            t = self._lru(self.pinned)
            amount = min(self.held_pinned - self.pin_cap, size[t])
            size[t] -= amount
            self.held_pinned -= amount
            tail = -t - 1
            if tail in size:
                size[tail] += amount
            else:
                size[tail] = amount
                tick[tail] = tick[t]
                heapq.heappush(self.normal, (tick[t], tail))
            if size[t] == 0:
                del size[t], tick[t]
        while self.held > self.cap:
            key = self._lru(self.normal)
            pinned = key is None
            if pinned:
                key = self._lru(self.pinned)
            amount = min(self.held - self.cap, size[key])
            size[key] -= amount
            self.held -= amount
            self.evicted += amount
            if pinned:
                self.held_pinned -= amount
            if size[key] == 0:
                del size[key], tick[key]
        for name in ("normal", "pinned"):
            heap = getattr(self, name)
            if len(heap) > 4 * len(size) + 4096:
                pin = name == "pinned"
                heap[:] = [(tick[k], k) for k in size
                           if (self.pinning and 0 <= k < self.n_tenants) == pin]
                heapq.heapify(heap)


class SharedLRU:
    """The shared tier as `engine/remote_tier.py` uses Redis (`allkeys-lru`, one value per
    block): a probe (EXISTS) does not refresh a block; a read (GETEX) does; a write stores the
    blocks missing (EXISTS, then SET NX) and refreshes those already there (TOUCH). One
    pipelined batch is one LRU tick (Redis's LRU clock has a 1 s resolution); within a tick the
    deepest blocks go first. An owner's held blocks (absolute block indices) are a few disjoint
    runs, each with its tick: a chain whose head was evicted keeps its deep blocks (unreachable
    until evicted, as in Redis)."""

    def __init__(self, capacity: int):
        self.cap = capacity
        self.held = 0
        self.clock = 0
        self.evicted = 0
        self.runs: dict[int, dict[int, list[int]]] = {}  # owner -> {start: [end, tick]}
        self.heap: list[tuple[int, int, int]] = []  # (tick, -owner, -start), lazily invalidated

    def present(self, owner: int, pos: int, limit: int) -> int:
        """How many blocks from `pos` (up to `limit`) are held, one after another."""
        runs = self.runs.get(owner)
        if not runs:
            return 0
        i = pos
        while i < limit:
            end = next((e for s, (e, _) in runs.items() if s <= i < e), None)
            if end is None:
                break
            i = end
        return min(i, limit) - pos

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def refresh(self, owner: int, a: int, b: int, tick: int) -> None:
        """Blocks [a, b) (all held) were read."""
        self._rebuild(owner, a, b, tick, fill=False)

    def write(self, owner: int, a: int, b: int, tick: int) -> None:
        """Blocks [a, b) were offered: the missing ones are stored and the held ones refreshed
        (the writer TOUCHes what it skips: this replica still uses it)."""
        if a < b:
            self._rebuild(owner, a, b, tick, fill=False)
            self._rebuild(owner, a, b, tick, fill=True)

    def _rebuild(self, owner: int, a: int, b: int, tick: int, fill: bool) -> None:
        runs = self.runs.setdefault(owner, {})
        old = sorted((s, e, t) for s, (e, t) in runs.items())
        new: list[list[int]] = []

        def add(s: int, e: int, t: int) -> None:
            if s >= e:
                return
            if new and new[-1][1] == s and new[-1][2] == t:
                new[-1][1] = e
            else:
                new.append([s, e, t])

        pos = a  # fill: next block of [a, b) not yet covered
        for s, e, t in old:
            if fill:
                if s > pos and pos < b:
                    gap_end = min(s, b)
                    self.held += gap_end - pos
                    add(pos, gap_end, tick)
                add(s, e, t)
                pos = max(pos, e)
            else:
                add(s, min(e, a), t)
                add(max(s, a), min(e, b), tick)
                add(max(s, b), e, t)
        if fill and pos < b:
            self.held += b - pos
            add(pos, b, tick)
        before = {(s, t) for s, _, t in old}
        runs.clear()
        for s, e, t in new:
            runs[s] = [e, t]
            if (s, t) not in before:
                heapq.heappush(self.heap, (t, -owner, -s))
        self._evict()

    def _evict(self) -> None:
        heap, all_runs = self.heap, self.runs
        while self.held > self.cap:
            t, neg_owner, neg_start = heap[0]
            runs = all_runs.get(-neg_owner)
            run = runs.get(-neg_start) if runs else None
            if run is None or run[1] != t:
                heapq.heappop(heap)
                continue
            amount = min(self.held - self.cap, run[0] + neg_start)
            run[0] -= amount
            self.held -= amount
            self.evicted += amount
            if run[0] == -neg_start:
                heapq.heappop(heap)
                del runs[-neg_start]
                if not runs:
                    del all_runs[-neg_owner]
        if len(heap) > 8 * len(all_runs) + 4096:  # owners hold a few runs each
            heap[:] = [(t, -o, -s) for o, runs in all_runs.items() for s, (_, t) in runs.items()]
            heapq.heapify(heap)


def simulate(trace: Trace, p: Params, n: int, policy: str, shared: bool) -> dict:
    backends = [f"http://replica-{i}:8080" for i in range(n)]
    index = {b: i for i, b in enumerate(backends)}
    T = len(trace.prefix_len)
    cap = p.replica_cache // BLOCK
    caches = [BlockLRU(cap, int(cap * min(1.0, p.pin_fraction)), T) for _ in range(n)]
    tier = SharedLRU(p.shared_cache // BLOCK) if shared else None
    inflight = dict.fromkeys(backends, 0)
    prefix_policy = PrefixPolicy(backends) if policy == "prefix_aware" else None
    ring = HashRing(backends) if policy == "consistent_hash" else None
    homes: dict[int, int] = {}
    reasons: dict[str, int] = {}
    rr = 0
    req = [0] * n
    computed_by = [0] * n
    peak = [0] * n
    prompt_tokens = local_tokens = restored_tokens = computed_tokens = 0
    busy_total = 0.0
    conv = [0] * len(trace.start)  # tokens of the conversation after the prefix, so far
    events = [(start, s, 0, s, 0, -1, 0) for s, start in enumerate(trace.start)]
    heapq.heapify(events)
    seq = len(events)
    plen, tenants, users, replies, thinks = (trace.prefix_len, trace.tenant, trace.user,
                                             trace.reply, trace.think)
    while events:
        now, _, kind, s, k, r, prompt = heapq.heappop(events)
        t = tenants[s]
        skey = T + s
        pb = plen[t] // BLOCK
        if kind == 0:  # a turn arrives
            prompt = plen[t] + conv[s] + users[s][k]
            if policy == "round_robin":
                r = rr % n
                rr += 1
            elif ring is not None:
                r = homes.get(t)
                if r is None:
                    r = homes[t] = index[ring.home(trace.keys[t])]
            else:
                choice = prefix_policy.choose(trace.keys[t], inflight, None, now)
                r = index[choice.backend]
                reasons[choice.reason] = reasons.get(choice.reason, 0) + 1
            # local tiers: the longest held prefix of the chain (tenant prefix, then session)
            cache = caches[r]
            room = (prompt - 1) // BLOCK - pb  # session blocks usable: the last token computes
            lt = min(cache.tenant_held(t), pb)
            ls = min(cache.size.get(skey, 0), room) if lt == pb else 0
            if lt:
                cache.touch(t, skey if ls else None)
            # then the shared tier, from where the local run stopped
            rt = rs = 0
            if tier is not None:
                if lt < pb:
                    rt = tier.present(t, lt, pb)
                    if lt + rt == pb:
                        rs = tier.present(skey, pb, pb + room)
                else:
                    rs = tier.present(skey, pb + ls, pb + room)
                if rt or rs:
                    tick = tier.tick()
                    if rs:
                        tier.refresh(skey, pb + ls, pb + ls + rs, tick)  # ls: 0 if lt < pb
                    if rt:
                        tier.refresh(t, lt, lt + rt, tick)
            local = (lt + ls) * BLOCK
            restored = (rt + rs) * BLOCK
            computed = prompt - local - restored
            prompt_tokens += prompt
            local_tokens += local
            restored_tokens += restored
            computed_tokens += computed
            req[r] += 1
            computed_by[r] += computed
            b = backends[r]
            inflight[b] += 1
            if inflight[b] > peak[r]:
                peak[r] = inflight[b]
            busy = (computed / p.prefill_tps + restored / p.restore_tps
                    + replies[s][k] / p.decode_tps)
            busy_total += busy
            seq += 1
            heapq.heappush(events, (now + busy, seq, 1, s, k, r, prompt))
        else:  # its reply is done: store the chain, schedule the next turn
            inflight[backends[r]] -= 1
            total = prompt + replies[s][k]
            session_blocks = total // BLOCK - pb
            caches[r].put(t, pb, skey, session_blocks)
            if tier is not None:
                tick = tier.tick()
                tier.write(skey, pb, pb + session_blocks, tick)
                tier.write(t, 0, pb, tick)
            conv[s] += users[s][k] + replies[s][k]
            if k + 1 < len(users[s]):
                seq += 1
                heapq.heappush(events, (now + thinks[s][k], seq, 0, s, k + 1, -1, 0))
    mean_req = sum(req) / n
    mean_tok = sum(computed_by) / n
    return {
        "policy": policy, "shared": shared, "replicas": n, "requests": sum(req),
        "prompt_tokens": prompt_tokens, "local_tokens": local_tokens,
        "restored_tokens": restored_tokens, "recomputed_tokens": computed_tokens,
        "hit_rate": (local_tokens + restored_tokens) / prompt_tokens,
        "requests_max_over_mean": max(req) / mean_req if mean_req else 0.0,
        "computed_max_over_mean": max(computed_by) / mean_tok if mean_tok else 0.0,
        "requests_per_replica": req, "computed_per_replica": computed_by,
        "peak_inflight_per_replica": peak, "mean_inflight": busy_total / now,
        "reasons": reasons,
        "evicted_tokens": sum(c.evicted for c in caches) * BLOCK,
        "shared_evicted_tokens": tier.evicted * BLOCK if tier is not None else 0,
    }


_TRACE: tuple[Params, Trace] | None = None


def _run(job: tuple[Params, int, str, bool]) -> dict:
    global _TRACE
    p, n, policy, shared = job
    if _TRACE is None or _TRACE[0] != p:
        _TRACE = (p, make_trace(p))
    return simulate(_TRACE[1], p, n, policy, shared)


def run_all(p: Params, replicas: list[int], jobs: int = 1) -> list[dict]:
    """Every configuration at every N, with ratios to round_robin without the shared tier."""
    work = [(p, n, policy, shared) for n in replicas for policy in POLICIES
            for shared in (False, True)]
    # longest first (more replicas: a dearer policy walk), for the pool's sake
    order = sorted(range(len(work)), key=lambda i: -work[i][1])
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            done = dict(zip(order, pool.map(_run, [work[i] for i in order])))
    else:
        done = {i: _run(work[i]) for i in order}
    rows = [done[i] for i in range(len(work))]
    base = {r["replicas"]: r["recomputed_tokens"] for r in rows
            if (r["policy"], r["shared"]) == BASELINE}
    for r in rows:
        r["vs_round_robin"] = r["recomputed_tokens"] / base[r["replicas"]]
    return rows


def verdict(rows: list[dict]) -> tuple[bool, str] | None:
    got = [r for r in rows if r["replicas"] == TARGET_N and (r["policy"], r["shared"]) == TARGET]
    if not got:
        return None
    ratio = got[0]["vs_round_robin"]
    ok = ratio <= TARGET_RATIO
    return ok, (f"N={TARGET_N}: prefix_aware + shared tier recomputes {ratio:.4f} "
                f"(1/{1 / ratio:.1f}) of round_robin without; target <= 1/8: "
                f"{'PASS' if ok else 'FAIL'}")


def table(rows: list[dict]) -> str:
    head = (f"{'N':>3}  {'policy':<16}{'shared':<8}{'hit rate':>9}{'recomputed':>13}"
            f"{'restored':>12}{'vs rr':>8}{'req max/mean':>14}{'tok max/mean':>14}")
    lines = [head, "-" * len(head)]
    last = None
    for r in sorted(rows, key=lambda r: (r["replicas"], POLICIES.index(r["policy"]),
                                          r["shared"])):
        if last is not None and r["replicas"] != last:
            lines.append("")
        last = r["replicas"]
        lines.append(f"{r['replicas']:>3}  {r['policy']:<16}{'yes' if r['shared'] else 'no':<8}"
                     f"{r['hit_rate']:>9.1%}{r['recomputed_tokens'] / 1e6:>12.2f}M"
                     f"{r['restored_tokens'] / 1e6:>11.2f}M{r['vs_round_robin']:>8.3f}"
                     f"{r['requests_max_over_mean']:>14.2f}{r['computed_max_over_mean']:>14.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, floor: int | None = None, title: str = "") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: PNG skipped (pip install -e .[bench])")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"round_robin": "tab:red", "consistent_hash": "tab:blue",
              "prefix_aware": "tab:green"}
    for policy in POLICIES:
        for shared in (False, True):
            got = sorted((r for r in rows if r["policy"] == policy and r["shared"] == shared),
                         key=lambda r: r["replicas"])
            ns = [r["replicas"] for r in got]
            label = f"{policy}{' + shared' if shared else ''}"
            kw = {"color": styles[policy], "linestyle": "-" if shared else "--", "marker": "o",
                  "label": label}
            ax1.plot(ns, [r["recomputed_tokens"] / 1e6 for r in got], **kw)
            ax2.plot(ns, [100 * r["hit_rate"] for r in got], **kw)
    ns = sorted({r["replicas"] for r in rows})
    if floor is not None:
        ax1.axhline(floor / 1e6, color="gray", linestyle=":", label="floor (unbounded caches)")
    for ax, ylabel in ((ax1, "recomputed prompt tokens (M)"), (ax2, "prefix hit rate (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("replicas (N)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax2.set_ylim(0, 100)
    ax1.legend(fontsize=8)
    fig.suptitle("kvshare replicas, simulated: routing policy x shared tier" + title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def params_from(args: argparse.Namespace) -> Params:
    p = Params(**QUICK) if args.quick else Params()
    fields = {f: getattr(args, f) for f in asdict(p) if getattr(args, f, None) is not None}
    return replace(p, **fields)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"a smaller trace (for tests): {QUICK}")
    ap.add_argument("--replicas", default="1,2,4,8,16,32", help="comma-separated N values")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="worker processes")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 unless N={TARGET_N} meets the acceptance ratio")
    ap.add_argument("--out", type=Path, default=OUT / "replica_sim.json")
    ap.add_argument("--png", type=Path, default=OUT / "replica_sim.png")
    defaults = Params()
    for name, value in asdict(defaults).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                        help=f"default {value}")
    args = ap.parse_args(argv)
    p = params_from(args)
    replicas = sorted({int(x) for x in args.replicas.split(",") if x.strip()})
    t0 = time.perf_counter()
    trace = make_trace(p)
    print(f"trace: {len(trace.start)} sessions, {trace.requests} requests, {p.tenants} tenants "
          f"(Zipf {p.zipf}, prefixes {p.prefix_min}-{p.prefix_max} tokens); caches: "
          f"{p.replica_cache} tokens per replica ({p.pin_fraction:.0%} pinnable), shared tier "
          f"{p.shared_cache} tokens", flush=True)
    floor = simulate(trace, replace(p, replica_cache=1 << 40), 1, "round_robin", False)
    print(f"floor (unbounded caches): {floor['recomputed_tokens'] / 1e6:.2f}M of "
          f"{floor['prompt_tokens'] / 1e6:.2f}M prompt tokens recomputed", flush=True)
    rows = run_all(p, replicas, max(1, args.jobs))
    print(table(rows))
    elapsed = time.perf_counter() - t0
    v = verdict(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "params": asdict(p), "replicas": replicas, "sessions": len(trace.start),
        "requests": trace.requests, "floor_tokens": floor["recomputed_tokens"],
        "seconds": round(elapsed, 1), "rows": rows,
        "verdict": None if v is None else {"pass": v[0], "line": v[1]},
    }, indent=1) + "\n")
    print(f"wrote {args.out} ({elapsed:.1f} s)")
    title = (f"\n{p.tenants} tenants, Zipf {p.zipf}, {trace.requests} requests; "
             f"{p.replica_cache} tokens per replica, shared tier {p.shared_cache}")
    if plot(rows, args.png, floor["recomputed_tokens"], title):
        print(f"wrote {args.png}")
    if v is None:
        print(f"verdict: N={TARGET_N} not simulated (--replicas): no acceptance check")
        return 1 if args.check else 0
    print("verdict: " + v[1])
    return 1 if args.check and not v[0] else 0


if __name__ == "__main__":
    sys.exit(main())
