"""Where a request goes: consistent hashing of its prefix with bounded load, sticky per prefix.

No I/O here: the proxy (`router/app.py`) and the replica simulation (`bench/replica_sim.py`)
both drive this one policy, so what the simulation measures is what the router does.

- `HashRing`: each backend owns `vnodes` points on a 64-bit ring (blake2b of its URL and the
  point's index); a key's *home* is the first backend clockwise from the key's hash. Adding or
  removing a backend moves only the keys between its points.
- `PrefixPolicy.choose`: a request with a prefix key (the hash of the part agents share: tools
  and system prompt) goes where that prefix already lives, so its KV is computed once in the
  cluster and every later session attaches to it:
  1. *affinity*: the backend this prefix was assigned to, while it is healthy and not
     overloaded (at least `spill_min` requests in flight and above `overload_factor` x the
     mean; another backend then takes the request without moving the prefix). The floor
     keeps a burst of sessions together: a replica runs several sequences at once and queues
     the rest, and queueing there costs less than computing the prefix again elsewhere;
  2. *ring*: otherwise (first sight, or its backend is down) the prefix is assigned by walking
     the ring from its hash to the first healthy, not overloaded backend that holds fewer than
     ceil(`load_factor` x (active prefixes + 1) / n) active prefixes (Mirrokni et al.,
     "Consistent Hashing with Bounded Loads", with prefixes as the balls: the default factor
     1.0 spreads the tenants evenly, which matters most when there are few of them). The
     assignment sticks, so a tenant's concurrent sessions do not scatter while its first one
     is still computing the prefix; a prefix not seen for `active_s` is forgotten;
  3. *least_loaded*: no prefix key (or every backend over its bound): the least-loaded healthy
     backend (ties: ring order of the key; without a key, in turn).
  In-flight load is what the caller reports (the router: requests in flight per backend).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing of keys onto backends (`vnodes` points per backend)."""

    def __init__(self, backends: Iterable[str], vnodes: int = 160):
        self.backends = list(dict.fromkeys(backends))
        if not self.backends:
            raise ValueError("a hash ring needs at least one backend")
        points = sorted((_point(f"{b}#{i}".encode()), b)
                        for b in self.backends for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [b for _, b in points]

    def walk(self, key: bytes) -> Iterator[str]:
        """Every backend once, in ring order starting at `key`'s home."""
        start = bisect.bisect_left(self._hashes, _point(key))
        seen: set[str] = set()
        n = len(self._hashes)
        for i in range(n):
            b = self._owners[(start + i) % n]
            if b not in seen:
                seen.add(b)
                yield b
                if len(seen) == len(self.backends):
                    return

    def home(self, key: bytes) -> str:
        return next(self.walk(key))


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str  # "affinity" | "ring" | "spill" | "least_loaded"

    @property
    def at_home(self) -> bool:
        """Routed where its prefix lives (or is now assigned): a prefix-cache hit is likely."""
        return self.reason in ("affinity", "ring")


class PrefixPolicy:
    def __init__(self, backends: Iterable[str], load_factor: float = 1.0,
                 overload_factor: float = 1.5, spill_min: int = 32, active_s: float = 600.0,
                 vnodes: int = 160, max_prefixes: int = 65536):
        if load_factor < 1.0 or overload_factor < 1.0 or spill_min < 1:
            raise ValueError("load_factor and overload_factor must be >= 1, spill_min >= 1")
        self.ring = HashRing(backends, vnodes)
        self.load_factor = load_factor
        self.overload_factor = overload_factor
        self.spill_min = spill_min
        self.active_s = active_s
        self.max_prefixes = max_prefixes
        # active prefix key -> (backend, last seen); oldest first
        self._assigned: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._prefixes: Counter[str] = Counter()  # backend -> active prefixes assigned to it
        self._turn = 0

    @property
    def backends(self) -> list[str]:
        return self.ring.backends

    def assigned(self, key: bytes) -> str | None:
        got = self._assigned.get(key)
        return got[0] if got else None

    def prefix_counts(self) -> dict[str, int]:
        return {b: self._prefixes.get(b, 0) for b in self.backends}

    @staticmethod
    def _bound(factor: float, loads: Mapping[str, int], among: list[str]) -> int:
        total = sum(loads.get(b, 0) for b in among)
        return max(1, math.ceil(factor * (total + 1) / len(among)))

    def choose(self, key: bytes | None, inflight: Mapping[str, int],
               healthy: Iterable[str] | None = None, now: float = 0.0) -> Choice | None:
        """The backend for a request with prefix `key` (None: no shared prefix). `inflight`
        maps backend -> requests in flight there; `healthy` (default: all) are the backends
        that may be used; `now` is the caller's clock in seconds (prefixes not seen for
        `active_s` are forgotten). None when no backend is healthy."""
        self._expire(now)
        allowed = set(self.backends if healthy is None else healthy)
        ok = [b for b in self.backends if b in allowed]
        if not ok:
            return None
        order = [b for b in (self.ring.walk(key) if key is not None else self.backends)
                 if b in allowed]

        def least_loaded() -> str:
            low = min(inflight.get(b, 0) for b in order)
            ties = [b for b in order if inflight.get(b, 0) == low]
            if key is not None:
                return ties[0]  # ring order: the same prefix prefers the same backend
            self._turn += 1  # no key: rotate among equals, so idle backends all get work
            return ties[self._turn % len(ties)]

        if key is None:
            return Choice(least_loaded(), "least_loaded")
        overload = max(self.spill_min, self._bound(self.overload_factor, inflight, ok))
        home = self.assigned(key)
        if home in allowed:
            self._assigned[key] = (home, now)
            self._assigned.move_to_end(key)
            if inflight.get(home, 0) < overload:
                return Choice(home, "affinity")
            return Choice(least_loaded(), "spill")  # the prefix stays assigned to `home`
        bound = self._bound(self.load_factor, self._prefixes, ok)
        for b in order:
            if self._prefixes.get(b, 0) < bound and inflight.get(b, 0) < overload:
                self._assign(key, b, now)
                return Choice(b, "ring")
        return Choice(least_loaded(), "least_loaded")

    def _assign(self, key: bytes, backend: str, now: float) -> None:
        old = self._assigned.pop(key, None)
        if old is not None:
            self._prefixes[old[0]] -= 1
        self._assigned[key] = (backend, now)
        self._prefixes[backend] += 1
        while len(self._assigned) > self.max_prefixes:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (b, _) = self._assigned.popitem(last=False)
        self._prefixes[b] -= 1

    def _expire(self, now: float) -> None:
        while self._assigned:
            _, (_, seen) = next(iter(self._assigned.items()))
            if now - seen <= self.active_s:
                return
            self._drop_oldest()

    def forget_backend(self, backend: str) -> int:
        """Drop the assignments to `backend` (e.g. it was removed): its prefixes are assigned
        again on their next request. Returns how many were dropped."""
        gone = [k for k, (b, _) in self._assigned.items() if b == backend]
        for k in gone:
            del self._assigned[k]
        self._prefixes[backend] = 0
        return len(gone)
