"""Continuous batching: which sequences run this step and how many tokens each computes.

Every running sequence that is decoding computes its one pending token each step; the rest of
a per-step token budget goes to prefill chunks of sequences in admission order, so a long
prefill never stalls other sessions' decoding. A step that finishes a prompt stops taking
prompts once it holds `FINISHED_STEP_TOKENS` of them, so concurrent short prompts get their
first tokens one after another rather than all at the end of one large step. When the pool runs out of blocks, the youngest
running sequence is preempted (its blocks released, it goes back to the front of the queue and
later resumes by re-attaching to whatever of its prefix is still cached) instead of failing.
The youngest may be the sequence asking. Either way the preempted one waits at the head of the
queue (nothing behind it is admitted) until another sequence gives its blocks back, so it is
not re-admitted into the same shortage every step.

Nothing here raises out of a step because of one sequence: a sequence whose admission or
planning fails is handed back to the engine, which fails it alone (`Schedule.failed`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvshare.engine.cache import KVCacheManager
from kvshare.engine.sequence import Sequence, SeqState

log = logging.getLogger("kvshare.scheduler")

# A step in which a prompt finishes takes no further prompt once it holds this many prompt
# tokens: the rest of the budget waits for the next step. Several agent sessions sending their
# next turn (~150 new tokens each on a cached prefix) at once then get their first tokens one
# step after another (the first after ~1/4 of the work) instead of all at the end of one big
# step; below this size a step's fixed cost (the layer loop) would dominate, so short prompts
# still share steps.
FINISHED_STEP_TOKENS = 128


@dataclass
class Planned:
    seq: Sequence
    start: int
    end: int
    # a row of a step launched ahead that its sequence no longer needs (engine/step_ahead.py)
    void: bool = False

    @property
    def wants_logits(self) -> bool:
        return self.end == len(self.seq.tokens)


@dataclass
class Schedule:
    """One step's plan. `failed`: sequences whose admission or planning raised (the engine
    fails each alone); `out_of_room`: running sequences that cannot get a block even with the
    pool to themselves (the engine ends them)."""

    planned: list[Planned] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)
    out_of_room: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, cache: KVCacheManager, max_running: int, prefill_budget: int):
        self.cache = cache
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.n_preemptions = 0
        # Counts sequences that gave their blocks back (finished); one that waits for room
        # is admitted again once it moves.
        self.released = 0

    def add(self, seq: Sequence) -> None:
        seq.queued_since = time.perf_counter()
        self.waiting.append(seq)

    def add_front(self, seq: Sequence) -> None:
        """A forked choice (n > 1): admitted before anything else, while the prompt's blocks
        it attaches to are certainly still in the pool."""
        seq.queued_since = time.perf_counter()
        self.waiting.appendleft(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self, failed: list[tuple[Sequence, Exception]]) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.waits_for_room == self.released:
                break  # first in line and no room yet: nothing behind it may take its place
            self.waiting.popleft()
            seq.waits_for_room = None
            try:
                reused = self.cache.admit(seq)
            except Exception as exc:  # noqa: BLE001 - this sequence's fault alone
                self._drop(seq)
                failed.append((seq, exc))
                continue
            if seq.preemptions == 0:
                seq.n_cached = reused
            seq.state = SeqState.PREFILL
            self.running.append(seq)

    def _drop(self, seq: Sequence) -> None:
        """Give back whatever a failed sequence holds; the engine finishes it."""
        try:
            self.cache.release(seq)
        except Exception:  # noqa: BLE001 - never let one sequence's cleanup stop the step
            log.exception("releasing the blocks of %s failed", seq.request.request_id)
        if seq in self.running:
            self.running.remove(seq)

    def preempt(self, seq: Sequence, waits_for_room: bool = False) -> None:
        self.cache.release(seq)
        seq.n_computed = 0
        seq.preemptions += 1
        self.n_preemptions += 1
        seq.state = SeqState.WAITING
        seq.queued_since = time.perf_counter()
        seq.waits_for_room = self.released if waits_for_room else None
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def commit(self, item: Planned) -> None:
        """Post-process: the forward pass wrote the item's chunk; the cache records it."""
        self.cache.commit(item.seq, item.start, item.end)

    def finish(self, seq: Sequence, save: bool = True) -> None:
        """The sequence ended: the cache saves it to the tiers (`save`) and releases it."""
        self.cache.finish(seq, save)
        seq.state = SeqState.FINISHED
        self.released += 1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def expired(self, now: float, timeout_s: float) -> list[Sequence]:
        """Waiting sequences that have been queued longer than `timeout_s` (the engine ends
        them with a 503)."""
        return [s for s in self.waiting if now - s.queued_since > timeout_s]

    def schedule(self) -> Schedule:
        """Plan one step."""
        out = Schedule()
        self._admit(out.failed)
        suspects = [s for s in self.running if s.suspect]
        # after a failed batch: one suspect alone per step finds the culprit
        candidates = suspects[:1] if suspects else self.running
        plan: list[Planned] = []
        budget = self.prefill_budget
        for seq in candidates:
            if seq.state == SeqState.DECODE:
                plan.append(Planned(seq, seq.n_computed, len(seq.tokens)))
        pending: set[bytes] = set()  # keys of prompt blocks that earlier sequences will compute
        # Prefills furthest along first (admission order among equals): a session that shares
        # a prefix with one further along always finds that one's blocks pending and waits for
        # them, whichever was admitted first (a request that reaches the server a moment
        # before its donor, or a donor re-admitted after a preemption).
        prefills = sorted((s for s in candidates if s.state == SeqState.PREFILL),
                          key=lambda s: -s.n_computed)
        prompt_tokens, finished = 0, False
        for seq in prefills:
            if finished and prompt_tokens >= FINISHED_STEP_TOKENS:
                break
            try:
                budget = self._plan_prefill(seq, budget, pending, plan)
            except Exception as exc:  # noqa: BLE001 - this sequence's fault alone
                self._drop(seq)
                out.failed.append((seq, exc))
                continue
            if plan and plan[-1].seq is seq and seq.state == SeqState.PREFILL:
                prompt_tokens += plan[-1].end - plan[-1].start
                finished = finished or plan[-1].wants_logits
        out.planned = self._allocate(plan, out)
        return out

    def _plan_prefill(self, seq: Sequence, budget: int, pending: set[bytes],
                      plan: list[Planned]) -> int:
        gained = self.cache.reattach(seq)
        if seq.preemptions == 0 and not seq.n_discarded:  # a shift's re-prefill is no prompt
            seq.n_cached += gained
        nxt = self.cache.next_key(seq)
        if budget > 0 and not (nxt is not None and nxt in pending):
            n = min(len(seq.tokens) - seq.n_computed, budget)
            n = self._align_chunk(seq, n, pending)
            # Hybrids: prefill pauses at each planned checkpoint position.
            stops = [p for p in seq.checkpoint_at if seq.n_computed < p < seq.n_computed + n]
            if stops:
                n = stops[0] - seq.n_computed
            budget -= n
            plan.append(Planned(seq, seq.n_computed, seq.n_computed + n))
        # else: an earlier session is computing this very block; wait and attach to it.
        pending.update(self.cache.uncomputed_keys(seq))
        return budget

    def _align_chunk(self, seq: Sequence, n: int, pending: set[bytes]) -> int:
        """A sequence that attached to part of a block (the copy-on-write of a partial match)
        computes from the middle of that block. Its chunks would then all end mid-block, and
        a sequence mid-block can neither attach to a block another session is computing
        (`next_key`) nor pick up blocks that appeared since (`reattach`): two concurrent
        sessions on one new prefix would each compute all of it. So a chunk that starts
        mid-block ends on a block boundary (unless it ends the prompt), and ends with that
        very block when an earlier session is computing the next one (or has computed it), so
        that this sequence then waits for it (or attaches to it) instead of computing it too."""
        cache = self.cache
        bs = cache.block_size
        start = seq.n_computed
        if not start % bs or not cache.waits_for_donors:
            return n
        end = start + n
        if end < len(seq.tokens) and end % bs and end - end % bs > start:
            end -= end % bs
        ahead = cache.uncomputed_keys(seq)  # [the block being completed, the next, ...]
        # the next block is being computed by an earlier session, or is already there (a
        # donor finished it): end with this block, then wait for it or attach to it
        if len(ahead) > 1 and (ahead[1] in pending or cache.has_block(ahead[1])):
            end = min(end, start - start % bs + bs)
        return end - start

    def _allocate(self, plan: list[Planned], out: Schedule) -> list[Planned]:
        """Blocks for every planned chunk. Without room, the youngest running sequence is
        preempted (possibly the one asking) and waits until another sequence gives blocks
        back; a sequence alone in the pool that still finds no room never will
        (`out_of_room`)."""
        kept: list[Planned] = []
        for item in plan:
            while item.seq in self.running:
                try:
                    ok = self.cache.allocate(item.seq, item.end)
                except Exception as exc:  # noqa: BLE001 - this sequence's fault alone
                    self._drop(item.seq)
                    out.failed.append((item.seq, exc))
                    break
                if ok:
                    kept.append(item)
                    break
                victim = self.running[-1]
                if len(self.running) == 1:
                    self.running.remove(victim)
                    out.out_of_room.append(victim)
                    break
                kept = [k for k in kept if k.seq is not victim]
                self.preempt(victim, waits_for_room=True)
        return kept
