"""What the web UI's cache view shows of the requests themselves: the recent sessions, the
prefix tree their prompts form, and the tokens sharing saved over time, per tenant.

`SessionBoard` follows every submitted request through the pipeline's request observer
(`RequestObserver`, the hook llama-server's slot table uses; `ObserverTee` feeds both). The
engine's snapshot says what the pool and the tiers hold in total, but not which sessions share
which prefix: that is read here from the prompts, as chains of KV-block-sized token runs keyed
like the cache keys them (salt, public prefix), so two sessions share a node exactly when the
engine could share those blocks between them. Only block digests are kept, never token ids or
text, unless the operator asks for prompt text (`keep_tokens`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvshare import _core
from kvshare.engine.api import FinishEvent, GenerationRequest, TokenEvent

from .request_log import RequestObserver

# the chains' root: the view's digests are its own, never the cache's keys
WEBUI_ROOT = b"kvshare/webui/v1"
# Sessions remembered after they end (the view's "recent" list and the tree's finished leaves).
MAX_SESSIONS = 256
# A finished session leaves the view this many seconds after it ended.
SESSION_TTL_S = 900.0
# The savings history: one bucket per BUCKET_S seconds, HISTORY_BUCKETS of them (15 minutes).
BUCKET_S = 10.0
HISTORY_BUCKETS = 90


def block_chain(tokens: list[int], block_size: int, salt: bytes | None,
                public_tokens: int) -> list[bytes]:
    """One digest per full KV block of `tokens`, each over its parent's digest and its own
    tokens: equal digests mean an equal prefix under an equal salt. Blocks wholly inside the
    public prefix chain from an unsalted root and the rest from the salt, as the cache's chain
    keys do (`BlockKeys.chain`), so tenants meet only in public blocks. Hashed in the Rust
    core (`hash_blocks`, as the cache's keys): on the event loop, for every request."""
    n = len(tokens) // block_size
    root = _core.root_key(WEBUI_ROOT, "webui", block_size, None)
    if salt is None:
        return _core.hash_blocks(root, tokens, block_size)
    public_blocks = min(public_tokens // block_size, n)
    out = _core.hash_blocks(root, tokens[:public_blocks * block_size], block_size)
    salted = _core.root_key(out[-1] if out else root, "webui", block_size, salt)
    return out + _core.hash_blocks(salted, tokens[public_blocks * block_size:n * block_size],
                                   block_size)


@dataclass
class Session:
    """One generation request as the view shows it."""

    id: str
    tenant: str | None  # tenancy.Tenant.name; None without API keys
    n_prompt: int
    chain: list[bytes]
    cache_store: bool
    started: float = field(default_factory=time.time)
    tokens: list[int] | None = None  # only when prompt text is shown
    ended: float | None = None
    finish: FinishEvent | None = None
    restored_from: list[str] = field(default_factory=list)  # tiers it restored blocks from

    @property
    def running(self) -> bool:
        return self.ended is None

    def as_json(self) -> dict:
        fin = self.finish
        d: dict[str, Any] = {"id": self.id, "tenant": self.tenant, "running": self.running,
                             "prompt_tokens": self.n_prompt, "started": round(self.started, 3)}
        if fin is not None:
            d.update(cached_tokens=fin.timings.cache_n, completion_tokens=fin.completion_tokens,
                     ttft_ms=round(fin.time_to_first_token_s * 1e3, 1),
                     restore_ms=round(fin.timings.restore_ms, 1), finish_reason=fin.reason,
                     restored_from=self.restored_from)
        return d


@dataclass
class Savings:
    """Requests and prompt tokens seen, and the tokens reused."""

    requests: int = 0
    hits: int = 0  # requests that reused at least one token
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, fin: FinishEvent) -> None:
        t = fin.timings
        self.requests += 1
        self.hits += t.cache_n > 0
        self.prompt_tokens += fin.prompt_tokens
        self.cached_tokens += t.cache_n

    def merge(self, other: "Savings") -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    def as_json(self, seconds_per_token: float) -> dict:
        return {"requests": self.requests, "hits": self.hits,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "request_hit_rate": self.hits / self.requests if self.requests else 0.0,
                # what the reused tokens would have cost at the measured prefill rate
                "seconds_saved": round(self.cached_tokens * seconds_per_token, 3)}


class SessionBoard:
    """The sessions and savings the web UI shows; fed from the event loop, read by polls."""

    def __init__(self, block_size: int, keep_tokens: bool = False,
                 clock: Callable[[], float] = time.time):
        self.block_size = max(1, block_size)
        self.keep_tokens = keep_tokens
        self.clock = clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.totals: dict[str | None, Savings] = {}
        # (bucket start, tenant) -> Savings, oldest first
        self.history: deque[tuple[float, dict[str | None, Savings]]] = deque()
        self.version = 0  # bumped on every change: the tree is rebuilt only when it moves
        self.lock = threading.Lock()
        self.restored_pending: list[Session] = []  # restored, tier not yet attributed
        self.served: dict[str, int] = {}  # each tier's tokens_served at the last poll

    # ------------------------------------------------------------------ the observer
    def acquire(self, rid: str, req: GenerationRequest, params: dict | None = None,
                want: int = -1, tenant: Any = None) -> int:
        chain = block_chain(req.prompt_tokens, self.block_size, req.cache_salt,
                            req.public_prefix_tokens)
        s = Session(rid, getattr(tenant, "name", None), len(req.prompt_tokens), chain,
                    req.cache_store, started=self.clock(),
                    tokens=list(req.prompt_tokens) if self.keep_tokens else None)
        with self.lock:
            self.sessions[rid] = s
            self._trim()
            self.version += 1
        return -1

    def feed(self, rid: str, ev: TokenEvent) -> None:
        pass

    def release(self, rid: str, fin: FinishEvent | None) -> None:
        with self.lock:
            s = self.sessions.get(rid)
            if s is None or s.ended is not None:
                return
            s.ended, s.finish = self.clock(), fin
            if fin is not None:
                self.totals.setdefault(s.tenant, Savings()).add(fin)
                self._bucket().setdefault(s.tenant, Savings()).add(fin)
                if fin.timings.restore_ms > 0 and fin.timings.cache_n > 0:
                    self.restored_pending.append(s)
            self.version += 1

    def slot_of(self, rid: str) -> int:
        return -1

    # ------------------------------------------------------------------ bookkeeping
    def _bucket(self) -> dict[str | None, Savings]:
        now = self.clock()
        start = now - now % BUCKET_S
        if not self.history or self.history[-1][0] != start:
            self.history.append((start, {}))
            while len(self.history) > HISTORY_BUCKETS:
                self.history.popleft()
        return self.history[-1][1]

    def _trim(self) -> None:
        """Forget finished sessions past their time, and the oldest past MAX_SESSIONS."""
        now = self.clock()
        for rid in [r for r, s in self.sessions.items()
                    if s.ended is not None and now - s.ended > SESSION_TTL_S]:
            del self.sessions[rid]
        while len(self.sessions) > MAX_SESSIONS:
            rid = next((r for r, s in self.sessions.items() if s.ended is not None),
                       next(iter(self.sessions)))
            del self.sessions[rid]

    def attribute_restores(self, served: dict[str, int]) -> None:
        """Names the tiers restored sessions read from: those whose `tokens_served` grew since
        the last poll (exact with one tier; with several, each that served in the interval)."""
        with self.lock:
            grown = [t for t, n in served.items() if n > self.served.get(t, 0)]
            self.served = dict(served)
            for s in self.restored_pending:
                s.restored_from = grown
            self.restored_pending = []

    def visible(self, tenant: str | None, all_tenants: bool) -> list[Session]:
        with self.lock:
            self._trim()
            return [s for s in self.sessions.values() if all_tenants or s.tenant == tenant]

    def savings(self, tenant: str | None, all_tenants: bool) -> tuple[Savings, list[dict]]:
        """Totals since start and the history's buckets (oldest first) for one tenant, or for
        all of them."""
        def pick(by: dict[str | None, Savings]) -> Savings:
            out = Savings()
            for t, s in by.items():
                if all_tenants or t == tenant:
                    out.merge(s)
            return out

        with self.lock:
            total = pick(self.totals)
            hist = [(start, pick(by)) for start, by in self.history]
        buckets = [{"t": start, "cached_tokens": s.cached_tokens, "prompt_tokens": s.prompt_tokens,
                    "requests": s.requests} for start, s in hist]
        return total, buckets


def prefix_tree(sessions: list[Session], block_size: int, saved_to: list[str],
                text: Callable[[list[int]], str] | None = None) -> list[dict]:
    """The sessions' prompts as a tree of shared prefixes: each node is a run of full blocks
    that the same sessions hold (`start`, `tokens`, `sessions`), its children where they part.
    `held`: `pool` while a running session holds the blocks, plus the tiers (`saved_to`) a
    finished session that may store its blocks saved them to. `text(tokens)` adds the run's
    text (operator's choice)."""
    roots: list[dict] = []
    # (sessions of the group, depth in blocks, list to append the node to)
    todo: list[tuple[list[Session], int, list[dict]]] = [(sessions, 0, roots)]
    while todo:
        group, depth, out = todo.pop()
        by_key: dict[bytes, list[Session]] = {}
        for s in group:
            if len(s.chain) > depth:
                by_key.setdefault(s.chain[depth], []).append(s)
        for members in by_key.values():
            first = members[0].chain
            if len(members) == 1:  # a leaf: the rest of its chain, nothing to compare
                end = len(first)
            else:
                end = depth + 1
                while (end < len(first) and all(len(m.chain) > end and m.chain[end] == first[end]
                                                for m in members)):
                    end += 1
            held = ["pool"] if any(m.running for m in members) else []
            if any(not m.running and m.cache_store for m in members):
                held += [t for t in saved_to if t not in held]
            node: dict[str, Any] = {
                "start": depth * block_size, "tokens": (end - depth) * block_size,
                "sessions": [m.id for m in members], "held": held, "children": []}
            if text is not None and members[0].tokens is not None:
                node["text"] = text(members[0].tokens[depth * block_size:end * block_size])
            out.append(node)
            todo.append((members, end, node["children"]))
    return roots


class ObserverTee:
    """Two request observers as one: the slot table (whose slot numbers the APIs report) and
    the web UI's board."""

    def __init__(self, first: RequestObserver, second: RequestObserver):
        self.first, self.second = first, second

    def acquire(self, rid: str, req: GenerationRequest, params: dict | None = None,
                want: int = -1, tenant: Any = None) -> int:
        slot = self.first.acquire(rid, req, params, want, tenant)
        self.second.acquire(rid, req, params, want, tenant)
        return slot

    def feed(self, rid: str, ev: TokenEvent) -> None:
        self.first.feed(rid, ev)

    def release(self, rid: str, fin: FinishEvent | None) -> None:
        self.first.release(rid, fin)
        self.second.release(rid, fin)

    def slot_of(self, rid: str) -> int:
        return self.first.slot_of(rid)
