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
  are fetched on the tier manager's reader threads while the engine installs earlier ones.
- Every command has a socket timeout and no retries. Failures feed a circuit breaker: after
  `breaker_failures` in a row it opens for `breaker_cooldown_s`, during which every read is a
  miss and every write is dropped without touching the network; then one probe is let through.
  A Redis that is down, slow or full therefore costs at most a timeout now and then, and the
  local tiers carry on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from kvshare import _core

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
    """Closed: calls go through. `failures` failures in a row open it for `cooldown_s`; then
    one call (the probe) goes through while the others are refused; its success closes it, its
    failure opens it again."""

    def __init__(self, failures: int = 3, cooldown_s: float = 5.0, clock=time.monotonic):
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
            if self._open_until is None:
                return True
            if self.clock() < self._open_until or self._probing:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures, self._open_until, self._probing = 0, None, False

    def failure(self) -> bool:
        """Count a failure; True when this one opened a closed breaker (a failed probe opens
        it again: the same outage, not a new trip)."""
        with self._lock:
            self._failures += 1
            was_open = self._open_until is not None
            if self._probing or self._failures >= self.threshold:
                self._open_until = self.clock() + self.cooldown_s
                self._probing = False
                return not was_open
            return False


class RemoteTier:
    def __init__(self, url: str, fingerprint: bytes, ttl_s: float | None,
                 namespace: str = "kvshare", timeout_s: float = 0.5, max_queue_mib: float = 256,
                 breaker_failures: int = 3, breaker_cooldown_s: float = 5.0):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.fingerprint = fingerprint
        self.ttl_s = int(ttl_s) if ttl_s and ttl_s > 0 else None
        self._redis_errors = (redis.RedisError, OSError)
        self._r = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
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
        self._writer = threading.Thread(target=self._write_loop, name="kvshare-remote-writer",
                                        daemon=True)
        self._writer.start()

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
    def _run(self, build):
        """Run the pipeline `build(pipe)` fills; RemoteUnavailable on any failure."""
        if not self.breaker.allow():
            raise RemoteUnavailable("circuit breaker open")
        try:
            pipe = self._r.pipeline(transaction=False)
            build(pipe)
            out = pipe.execute()
        except self._redis_errors as exc:
            self.stats_.failures += 1
            if self.breaker.failure():
                self.stats_.breaker_trips += 1
                with self._known_lock:  # it may come back empty
                    self._known.clear()
                log.warning("Redis at %s failed (%s: %s): the shared tier is off for %.0f s",
                            self.display_url, type(exc).__name__, exc, self.breaker.cooldown_s)
            else:
                self._warn(exc)
            raise RemoteUnavailable(str(exc)) from exc
        self.breaker.success()
        return out

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
            got = self._run(lambda p: [p.exists(self._block_key(k)) for k in keys])
        except RemoteUnavailable:
            return 0
        n = 0
        while n < len(got) and got[n]:
            n += 1
        if n == 0:
            self.stats_.misses += 1
        return n

    def read_blocks(self, keys: list[bytes], staging: np.ndarray) -> int:
        """Fetch `keys` (pipelined) into `staging[i]` (one block each); returns how many leading
        blocks were read and verified. A damaged value is deleted and ends the read there."""
        try:
            values = self._run(lambda p: [self._get(p, self._block_key(k)) for k in keys])
        except RemoteUnavailable:
            return 0
        for i, (key, value) in enumerate(zip(keys, values)):
            if value is None:
                return i
            out = staging[i].reshape(-1).view(np.uint8)
            if not self._decode_into(value, "block", key, self._block_key(key), out):
                return i
            self.stats_.hits += 1
            self.stats_.bytes_read += len(value)
            self._remember([key])
        return len(keys)

    def _get(self, pipe, rkey: bytes) -> None:
        if self.ttl_s:
            pipe.getex(rkey, ex=self.ttl_s)  # a read refreshes the TTL
        else:
            pipe.get(rkey)

    def _decode_into(self, value: bytes, kind: str, key: bytes, rkey: bytes, out) -> bool:
        try:
            _core.remote_value_into(value, kind, self.fingerprint, key, out)
            return True
        except _core.FingerprintMismatch:
            return False  # not ours: a miss (it cannot be, keys bind the model; never used)
        except _core.CorruptEntry as exc:
            self._drop_corrupt(rkey, exc)
            return False

    def _drop_corrupt(self, rkey: bytes, exc: Exception) -> None:
        self.stats_.corrupt += 1
        log.warning("damaged value in Redis (%s): deleted, recomputing", exc)
        with contextlib.suppress(RemoteUnavailable):
            self._run(lambda p: p.delete(rkey))

    def find_checkpoint(self, candidates: list[tuple[int, bytes]]) -> tuple[int, bytes] | None:
        """The deepest `(position, block key)` among `candidates` with a checkpoint in Redis."""
        if not candidates:
            return None
        try:
            got = self._run(lambda p: [p.exists(self._ckpt_key(k)) for _, k in candidates])
        except RemoteUnavailable:
            return None
        best = None
        for (pos, key), there in zip(candidates, got):
            if there and (best is None or pos > best[0]):
                best = (pos, key)
        return best

    def read_checkpoint(self, block_key: bytes, position: int) -> tuple[str, bytes] | None:
        """(layout, state bytes) of the checkpoint at `position` ending at `block_key`,
        verified; None if missing, damaged (deleted) or unavailable."""
        rkey = self._ckpt_key(block_key)
        try:
            value = self._run(lambda p: self._get(p, rkey))[0]
        except RemoteUnavailable:
            return None
        if value is None:
            return None
        try:
            pos, layout, data = _core.remote_value_open(value, "checkpoint", self.fingerprint,
                                                        block_key)
        except _core.FingerprintMismatch:
            return None
        except _core.CorruptEntry as exc:
            self._drop_corrupt(rkey, exc)
            return None
        if pos != position:
            self._drop_corrupt(rkey, ValueError(f"checkpoint at {pos}, expected {position}"))
            return None
        self.stats_.hits += 1
        self.stats_.bytes_read += len(value)
        return layout, data

    # ---- writes ------------------------------------------------------------------------
    def submit(self, keys: list[bytes], blocks: np.ndarray | None,
               checkpoints: list[tuple[bytes, int, str, object]] = ()) -> bool:
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

    def _write(self, keys: list[bytes], blocks, cks) -> None:
        ex = self.ttl_s
        for b0 in range(0, len(keys), WRITE_BATCH):
            batch = keys[b0:b0 + WRITE_BATCH]
            there = self._run(lambda p, batch=batch: [p.exists(self._block_key(k)) for k in batch])
            todo = [(b0 + i, k) for i, (k, t) in enumerate(zip(batch, there)) if not t]
            held = [self._block_key(k) for k, t in zip(batch, there) if t]
            self.stats_.blocks_skipped += len(held)
            values = [(self._block_key(k), _core.remote_value(
                "block", self.fingerprint, k, blocks[j])) for j, k in todo]

            def fill(p, values=values, held=held) -> None:
                for rk, v in values:
                    p.set(rk, v, ex=ex, nx=True)
                # EXISTS does not count as a use for Redis's LRU: a prefix that every replica
                # holds locally is never read from Redis and would age out there, just when a
                # replica without it needs it. Refresh what this replica still uses.
                if held:
                    p.touch(*held)
                    if ex:
                        for rk in held:
                            p.expire(rk, ex)

            if values or held:
                self._run(fill)
            self.stats_.blocks_written += len(values)
            self.stats_.bytes_written += sum(len(v) for _, v in values)
            self._remember(batch)
        for key, position, layout, data in cks:
            value = _core.remote_value("checkpoint", self.fingerprint, key, data,
                                       int(position), layout)
            rkey = self._ckpt_key(key)
            self._run(lambda p, rkey=rkey, value=value: p.set(rkey, value, ex=ex, nx=True))
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
        try:
            self._run(lambda p: p.ping())
            return True
        except RemoteUnavailable:
            return False

    def stats(self) -> dict:
        with self._cv:
            queued, qbytes = len(self._queue) + (1 if self._busy else 0), self._queued_bytes
        state = self.breaker.state
        return {**vars(self.stats_), "queued": queued, "queued_bytes": qbytes,
                "breaker": state, "breaker_open": int(state == "open")}

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout=2.0)
        with contextlib.suppress(Exception):  # closing a dead connection
            self._r.close()
