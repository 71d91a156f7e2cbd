"""Continuous batching: which sequences run this step and how many tokens each computes.

Every running sequence that is decoding computes its one pending token each step; the rest of
a per-step token budget goes to prefill chunks of sequences in admission order, so a long
prefill never stalls other sessions' decoding. When the pool runs out of blocks, the youngest
running sequence is preempted (its blocks released, it goes back to the front of the queue and
later resumes by re-attaching to whatever of its prefix is still cached) instead of failing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvshare import _core
from kvshare.engine.cache_manager import CacheManager
from kvshare.engine.sequence import Sequence, SeqState


@dataclass
class Planned:
    seq: Sequence
    start: int
    end: int

    @property
    def wants_logits(self) -> bool:
        return self.end == len(self.seq.tokens)


class Scheduler:
    def __init__(self, cache: CacheManager, max_running: int, prefill_budget: int):
        self.cache = cache
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.n_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            reused = self.cache.attach(seq)
            if seq.preemptions == 0:
                seq.n_cached = reused
            seq.state = SeqState.PREFILL
            self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        self.cache.release(seq)
        seq.n_computed = 0
        seq.preemptions += 1
        self.n_preemptions += 1
        seq.state = SeqState.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.cache.release(seq)
        seq.state = SeqState.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> tuple[list[Planned], list[Sequence]]:
        """Plan one step. Returns the planned chunks and sequences that cannot run at all
        (too large for the whole pool), which the caller fails."""
        self._admit()
        plan: list[Planned] = []
        budget = self.prefill_budget
        for seq in self.running:
            if seq.state == SeqState.DECODE:
                plan.append(Planned(seq, seq.n_computed, len(seq.tokens)))
        pending: set[bytes] = set()  # keys of prompt blocks that earlier sequences will compute
        for seq in self.running:
            if seq.state != SeqState.PREFILL:
                continue
            gained = self.cache.reattach(seq)
            if seq.preemptions == 0:
                seq.n_cached += gained
            nxt = self.cache.next_key(seq)
            if budget > 0 and not (nxt is not None and nxt in pending):
                n = min(len(seq.tokens) - seq.n_computed, budget)
                # Hybrids: prefill pauses at each planned checkpoint position.
                stops = [p for p in seq.checkpoint_at if seq.n_computed < p < seq.n_computed + n]
                if stops:
                    n = stops[0] - seq.n_computed
                budget -= n
                plan.append(Planned(seq, seq.n_computed, seq.n_computed + n))
            # else: an earlier session is computing this very block; wait and attach to it.
            pending.update(self.cache.uncomputed_keys(seq))
        return self._allocate(plan)

    def _allocate(self, plan: list[Planned]) -> tuple[list[Planned], list[Sequence]]:
        unrunnable: list[Sequence] = []
        kept: list[Planned] = []
        for item in plan:
            while item.seq in self.running:
                try:
                    self.cache.allocate_for(item.seq, item.end)
                    kept.append(item)
                    break
                except _core.OutOfBlocks:
                    victim = self._victim(item.seq)
                    if victim is None:
                        unrunnable.append(item.seq)
                        break
                    kept = [k for k in kept if k.seq is not victim]
                    self.preempt(victim)
        return kept, unrunnable

    def _victim(self, needy: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not needy:
                return seq
        return None
