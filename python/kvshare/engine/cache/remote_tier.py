"""The shared tier: KV blocks and hybrid checkpoints in Redis (or Valkey), behind RAM and disk.

Replicas of one model that point at one Redis share what any of them computed: a session that
lands on a replica that never saw its tool prefix restores the prefix's blocks from Redis
instead of recomputing them, and a replica restarted with empty local tiers still finds them.

Keys and values:
- A block lives under `<namespace>:<model>:b:<hex chain key>`, a checkpoint under
  `<namespace>:<model>:c:<hex chain key of the block it ends at>`. Chain keys already bind the
  model fingerprint, KV dtype, block size and cache salt (`keys.BlockKeys.root_key`): another
  tenant's salt or another model can never name the same key.
- Values are `kvshare_core::remote` values: checksummed and bound to the fingerprint and the
  key. A value that fails its checks is deleted and counted; the restore stops there and the
  rest is recomputed. One value per block (not one per conversation, as on disk), so replicas
  share a prefix whatever conversation wrote it and fetch only what they lack.
- Every value has a TTL (`--cache-ttl`), refreshed when read (GETEX); beyond that Redis's own
  eviction (`maxmemory` + `allkeys-lru`) bounds the store.

Never slower, never wrong, never an error to a client:
- Writes are queued (bounded in bytes; a full queue drops the write and counts it) and sent by
  one writer thread; a pipelined EXISTS first skips blocks another replica already wrote (and
  refreshes their LRU age and TTL: this replica still uses them).
- Reads are pipelined: one round trip probes how many leading blocks Redis holds, then chunks
  of them are fetched. They run on a fetch thread before the request is queued
  (`prefetch.py`), never on the engine thread, which only installs what was fetched.
- Every call has a deadline (`timeout_s`) for the whole of it, connecting, sending and
  reading every reply (`resp_client.py`: a reply trickling in a byte at a time misses it like
  one that never comes), and no retries. Failures feed a circuit breaker: a missed deadline
  opens it at once (a slow Redis would hold every request that needs it for a full deadline
  per call), and `breaker_failures` other failures in a row (refused, reset,
  an error reply) open it too. While it is open every read is a miss and every write is
  dropped without touching the network; every `breaker_cooldown_s` the prober thread sends a
  PING under the same deadline, and the first answer closes it. No request ever waits on a
  probe, so a Redis that is down, slow or full costs a request at most one deadline now and
  then, and the local tiers carry on.
- Damage is healed where it is found: every value of a read that fails its checks is
  deleted, and so is a key holding another Redis type (a list, a hash: someone else's data
  under our name); both count as corrupt, not as failures of Redis.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvshare import _core
from kvshare.engine.cache.resp_client import (Arg, DeadlineExceeded, RemoteError, Reply,
                                              ReplyError, RespClient)

log = logging.getLogger("kvshare.remote")

# Blocks per write pipeline (Gemma 270M f16: 288 KiB a block, ~4.6 MiB a pipeline).
WRITE_BATCH = 16
# Keys known to be in Redis (written or read by this replica) are not offered to the writer
# again for this long; after it, a save re-checks them (one EXISTS each) in case Redis evicted
# them or restarted empty.
KNOWN_TTL_S = 600.0
KNOWN_MAX = 1 << 18


class RemoteUnavailable(Exception):
    """Redis did not answer (down, slow, refused) or the breaker is open: treat as a miss."""


@dataclass
class RemoteStats:
    hits: int = 0  # blocks and checkpoints read back
    misses: int = 0  # lookups that found nothing past the local tiers
    corrupt: int = 0  # values that failed their checks (deleted; recomputed)
    failures: int = 0  # commands that failed or timed out
    breaker_trips: int = 0
    blocks_written: int = 0
    blocks_skipped: int = 0  # already in Redis (another replica wrote them)
    checkpoints_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    dropped_writes: int = 0  # queue full or breaker open


class CircuitBreaker:
    """Closed: calls go through. `failures` failures in a row, or one `trip`, open it for
    `cooldown_s`; while open no call goes through. Once the cooldown has passed, `probe_due`
    hands out one probe (the tier's prober thread, never a request); its success closes the
    breaker, its failure opens it for another cooldown."""

    def __init__(self, failures: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold, self.cooldown_s, self.clock = max(1, failures), cooldown_s, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half_open" if self.clock() >= self._open_until else "open"

    def allow(self) -> bool:
        with self._lock:
            return self._open_until is None

    def probe_due(self) -> float | None:
        """None while closed; else seconds until a probe is due, 0.0 when this caller got it."""
        with self._lock:
            if self._open_until is None:
                return None
            if self._probing:  # one probe at a time
                return self.cooldown_s
            wait = self._open_until - self.clock()
            if wait > 0:
                return wait
            self._probing = True
            return 0.0

    def success(self) -> None:
        with self._lock:
            self._failures, self._open_until, self._probing = 0, None, False

    def failure(self, trip: bool = False) -> bool:
        """Count a failure (`trip`: open at once); True when this one opened a closed breaker
        (a failed probe opens it again: the same outage, not a new trip)."""
        with self._lock:
            self._failures += 1
            was_open = self._open_until is not None
            if trip or self._probing or self._failures >= self.threshold:
                self._open_until = self.clock() + self.cooldown_s
                self._probing = False
                return not was_open
            return False


class RemoteTier:
    def __init__(self, url: str, fingerprint: bytes, ttl_s: float | None,
                 namespace: str = "kvshare", timeout_s: float = 0.5, max_queue_mib: float = 256,
                 breaker_failures: int = 3, breaker_cooldown_s: float = 5.0):
        self.url = url
        self.fingerprint = fingerprint
        self.ttl_s = int(ttl_s) if ttl_s and ttl_s > 0 else None
        self.timeout_s = timeout_s
        self._r = RespClient(url, timeout_s)
        self._prefix = f"{namespace}:{fingerprint[:8].hex()}:".encode()
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self.stats_ = RemoteStats()
        self._known: OrderedDict[bytes, float] = OrderedDict()  # key -> when seen in Redis
        self._known_lock = threading.Lock()
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._max_queue = int(max_queue_mib * 2**20)
        self._cv = threading.Condition()
        self._busy = False
        self._closing = False
        self._last_warning = 0.0
        self._last_error = ""  # why the breaker last opened (for /health)
        self._opened_at: float | None = None
        self._stop = threading.Event()
        self._tripped = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="kvshare-remote-writer",
                                        daemon=True)
        self._writer.start()
        self._prober = threading.Thread(target=self._probe_loop, name="kvshare-remote-probe",
                                        daemon=True)
        self._prober.start()

    # ---- keys --------------------------------------------------------------------------
    def _block_key(self, key: bytes) -> bytes:
        return self._prefix + b"b:" + key.hex().encode()

    def _ckpt_key(self, block_key: bytes) -> bytes:
        return self._prefix + b"c:" + block_key.hex().encode()

    def _remember(self, keys) -> None:
        now = time.monotonic()
        with self._known_lock:
            for k in keys:
                self._known[k] = now
                self._known.move_to_end(k)
            while len(self._known) > KNOWN_MAX:
                self._known.popitem(last=False)

    def first_unknown(self, keys: list[bytes]) -> int:
        """Index of the first of `keys` not known (recently) to be in Redis."""
        cutoff = time.monotonic() - KNOWN_TTL_S
        with self._known_lock:
            for i, k in enumerate(keys):
                seen = self._known.get(k)
                if seen is None or seen < cutoff:
                    return i
        return len(keys)

    # ---- calls through the breaker -----------------------------------------------------
    def _run(self, commands: Sequence[Sequence[Arg]]) -> list[Reply | ReplyError]:
        """Send `commands` as one pipeline under the deadline; RemoteUnavailable on any
        failure. Error replies come back in place when they say WRONGTYPE (the caller heals
        the key); any other error reply (e.g. OOM under `noeviction`) fails the call."""
        if not self.breaker.allow():
            raise RemoteUnavailable("circuit breaker open")
        try:
            out = self._r.call(commands)
            for r in out:
                if isinstance(r, ReplyError) and not r.wrong_type:
                    raise RemoteError(f"error reply: {r}")
        except RemoteError as exc:
            self._failed(exc)
            raise RemoteUnavailable(str(exc)) from exc
        self.breaker.success()
        return out

    def _failed(self, exc: RemoteError) -> None:
        self.stats_.failures += 1
        missed = isinstance(exc, DeadlineExceeded)
        if self.breaker.failure(trip=missed):
            self.stats_.breaker_trips += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._opened_at = time.monotonic()
            with self._known_lock:  # it may come back empty
                self._known.clear()
            self._tripped.set()
            log.warning("Redis at %s failed (%s: %s): the shared tier is off; probing every "
                        "%.0f s", self.display_url, type(exc).__name__, exc,
                        self.breaker.cooldown_s)
        else:
            self._warn(exc)

    def _probe_loop(self) -> None:
        """While the breaker is open: a PING every cooldown; the first answer closes it."""
        while not self._stop.is_set():
            wait = self.breaker.probe_due()
            if wait is None:
                self._tripped.wait(1.0)
                self._tripped.clear()
                continue
            if wait > 0:
                self._stop.wait(wait)
                continue
            try:
                self._r.call([["PING"]])
            except RemoteError as exc:
                self.breaker.failure()
                self._last_error = f"{type(exc).__name__}: {exc}"
                continue
            self.breaker.success()
            self._opened_at = None
            log.warning("Redis at %s answers again: the shared tier is back", self.display_url)

    def _warn(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            log.warning("Redis at %s: %s: %s (reads are misses, writes dropped)", self.display_url,
                        type(exc).__name__, exc)

    # ---- reads -------------------------------------------------------------------------
    def present(self, keys: list[bytes]) -> int:
        """How many leading `keys` Redis holds (one pipelined round trip). 0 when unavailable."""
        if not keys:
            return 0
        try:
            got = self._run([[b"EXISTS", self._block_key(k)] for k in keys])
        except RemoteUnavailable:
            return 0
        n = 0
        while n < len(got) and got[n] == 1:
            n += 1
        if n == 0:
            self.stats_.misses += 1
        return n

    def present_each(self, keys: list[bytes]) -> list[bool]:
        """Whether Redis holds each of `keys` (one pipelined round trip); all False when
        unavailable."""
        if not keys:
            return []
        try:
            got = self._run([[b"EXISTS", self._block_key(k)] for k in keys])
        except RemoteUnavailable:
            return [False] * len(keys)
        return [g == 1 for g in got]

    def read_blocks(self, keys: list[bytes], staging: np.ndarray) -> int:
        """Fetch `keys` (pipelined) into `staging[i]` (one block each); returns how many leading
        blocks were read and verified. Every damaged value among them is deleted (the read
        ends at the first one)."""
        try:
            values = self._run([self._get(self._block_key(k)) for k in keys])
        except RemoteUnavailable:
            return 0
        n_ok: int | None = None
        damaged: list[bytes] = []
        for i, (key, value) in enumerate(zip(keys, values)):
            rkey = self._block_key(key)
            if value is None:
                n_ok = i if n_ok is None else n_ok
                continue
            out = staging[i].reshape(-1).view(np.uint8)
            if not self._decode_into(value, "block", key, rkey, out, damaged):
                n_ok = i if n_ok is None else n_ok
                continue
            if n_ok is None:
                assert isinstance(value, bytes)
                self.stats_.hits += 1
                self.stats_.bytes_read += len(value)
                self._remember([key])
        self._drop_corrupt(damaged)
        return len(keys) if n_ok is None else n_ok

    def _get(self, rkey: bytes) -> list[Arg]:
        if self.ttl_s:
            return [b"GETEX", rkey, b"EX", self.ttl_s]  # a read refreshes the TTL
        return [b"GET", rkey]

    def _decode_into(self, value: Reply | ReplyError, kind: Literal["block", "checkpoint"],
                     key: bytes, rkey: bytes,
                     out: Any, damaged: list[bytes]) -> bool:
        """Verify `value` into `out`; a damaged one (or a key of another Redis type) is added
        to `damaged`."""
        if not isinstance(value, bytes):  # WRONGTYPE: another type under our key
            self._count_corrupt(rkey, damaged, f"a Redis {type(value).__name__}, not a string")
            return False
        try:
            _core.remote_value_into(value, kind, self.fingerprint, key, out)
            return True
        except _core.FingerprintMismatch:
            return False  # not ours: a miss (it cannot be, keys bind the model; never used)
        except _core.CorruptEntry as exc:
            self._count_corrupt(rkey, damaged, str(exc))
            return False

    def _count_corrupt(self, rkey: bytes, damaged: list[bytes], why: str) -> None:
        self.stats_.corrupt += 1
        damaged.append(rkey)
        log.warning("damaged value in Redis (%s): deleted, recomputing", why)

    def _drop_corrupt(self, rkeys: list[bytes]) -> None:
        if rkeys:
            with contextlib.suppress(RemoteUnavailable):
                self._run([[b"DEL", *rkeys]])

    def find_checkpoint(self, candidates: list[tuple[int, bytes]]) -> tuple[int, bytes] | None:
        """The deepest `(position, block key)` among `candidates` with a checkpoint in Redis."""
        if not candidates:
            return None
        try:
            got = self._run([[b"EXISTS", self._ckpt_key(k)] for _, k in candidates])
        except RemoteUnavailable:
            return None
        best = None
        for (pos, key), there in zip(candidates, got):
            if there == 1 and (best is None or pos > best[0]):
                best = (pos, key)
        return best

    def read_checkpoint(self, block_key: bytes, position: int) -> tuple[str, bytes] | None:
        """(layout, state bytes) of the checkpoint at `position` ending at `block_key`,
        verified; None if missing, damaged (deleted) or unavailable."""
        rkey = self._ckpt_key(block_key)
        try:
            value = self._run([self._get(rkey)])[0]
        except RemoteUnavailable:
            return None
        if value is None:
            return None
        damaged: list[bytes] = []
        try:
            if not isinstance(value, bytes):
                self._count_corrupt(rkey, damaged, "a checkpoint key of another Redis type")
                return None
            try:
                pos, layout, data = _core.remote_value_open(value, "checkpoint",
                                                            self.fingerprint, block_key)
            except _core.FingerprintMismatch:
                return None
            except _core.CorruptEntry as exc:
                self._count_corrupt(rkey, damaged, str(exc))
                return None
            if pos != position:
                self._count_corrupt(rkey, damaged, f"checkpoint at {pos}, expected {position}")
                return None
        finally:
            self._drop_corrupt(damaged)
        self.stats_.hits += 1
        self.stats_.bytes_read += len(value)
        return layout, data

    # ---- writes ------------------------------------------------------------------------
    def submit(self, keys: list[bytes], blocks: np.ndarray | None,
               checkpoints: Sequence[tuple[bytes, int, str, Any]] = ()) -> bool:
        """Queue `blocks[i]` (host copies, one per key) and `checkpoints` ((block key, position,
        layout, data) each) for writing. False if dropped (queue full or Redis off)."""
        nbytes = (blocks.nbytes if blocks is not None else 0) + sum(
            np.asarray(c[3]).nbytes for c in checkpoints)
        if not keys and not checkpoints:
            return True
        with self._cv:
            if (self._closing or self.breaker.state == "open"
                    or self._queued_bytes + nbytes > self._max_queue):
                self.stats_.dropped_writes += 1
                return False
            self._queue.append((list(keys), blocks, list(checkpoints), nbytes))
            self._queued_bytes += nbytes
            self._cv.notify()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                keys, blocks, cks, nbytes = self._queue.popleft()
                self._busy = True
            try:
                self._write(keys, blocks, cks)
            except RemoteUnavailable:
                self.stats_.dropped_writes += 1
            except Exception:  # noqa: BLE001 - a failed write costs a future hit, nothing else
                log.exception("writing to the shared tier failed")
            finally:
                with self._cv:
                    self._queued_bytes -= nbytes
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, keys: list[bytes], blocks: Any, cks: list) -> None:
        ex: list[Arg] = [b"EX", self.ttl_s] if self.ttl_s else []
        for b0 in range(0, len(keys), WRITE_BATCH):
            batch = keys[b0:b0 + WRITE_BATCH]
            there = self._run([[b"EXISTS", self._block_key(k)] for k in batch])
            todo = [(b0 + i, k) for i, (k, t) in enumerate(zip(batch, there)) if t != 1]
            held = [self._block_key(k) for k, t in zip(batch, there) if t == 1]
            self.stats_.blocks_skipped += len(held)
            values = [(self._block_key(k), _core.remote_value(
                "block", self.fingerprint, k, blocks[j])) for j, k in todo]
            commands: list[list[Arg]] = [[b"SET", rk, v, *ex, b"NX"] for rk, v in values]
            # EXISTS does not count as a use for Redis's LRU: a prefix that every replica
            # holds locally is never read from Redis and would age out there, just when a
            # replica without it needs it. Refresh what this replica still uses.
            if held:
                commands.append([b"TOUCH", *held])
                if self.ttl_s:
                    commands += [[b"EXPIRE", rk, self.ttl_s] for rk in held]
            if commands:
                self._run(commands)
            self.stats_.blocks_written += len(values)
            self.stats_.bytes_written += sum(len(v) for _, v in values)
            self._remember(batch)
        for key, position, layout, data in cks:
            value = _core.remote_value("checkpoint", self.fingerprint, key, data,
                                       int(position), layout)
            self._run([[b"SET", self._ckpt_key(key), value, *ex, b"NX"]])
            self.stats_.checkpoints_written += 1
            self.stats_.bytes_written += len(value)

    def queued(self) -> int:
        """Writes queued or in progress."""
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write was sent (or dropped). False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # ---- introspection and lifecycle ---------------------------------------------------
    @property
    def display_url(self) -> str:
        """The URL without its password."""
        from urllib.parse import urlsplit, urlunsplit

        u = urlsplit(self.url)
        if u.password is None:
            return self.url
        netloc = u.netloc.rsplit("@", 1)[1]
        user = f"{u.username}:***@" if u.username else ":***@"
        return urlunsplit((u.scheme, user + netloc, u.path, u.query, u.fragment))

    def ping(self) -> bool:
        """One PING under the deadline (start-up's report); a failure counts as any other."""
        try:
            self._run([[b"PING"]])
            return True
        except RemoteUnavailable:
            return False

    def stats(self) -> dict:
        with self._cv:
            queued, qbytes = len(self._queue) + (1 if self._busy else 0), self._queued_bytes
        state = self.breaker.state
        return {**vars(self.stats_), "queued": queued, "queued_bytes": qbytes,
                "breaker": state, "breaker_open": int(state != "closed"),
                "health": self.health()}

    def health(self) -> dict:
        """`{"state": "ok"}` while the breaker is closed; otherwise the tier is `degraded`
        (reads are misses, writes are dropped: the replica serves from its local tiers), with
        the failure that opened it and for how long."""
        if self.breaker.allow():
            return {"state": "ok"}
        opened = self._opened_at
        return {"state": "degraded", "error": self._last_error,
                "seconds": round(time.monotonic() - opened, 1) if opened is not None else 0.0}

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout=2.0)
        self._stop.set()
        self._tripped.set()
        self._prober.join(timeout=2.0 + self.timeout_s)
        self._r.close()
