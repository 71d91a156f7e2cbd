"""The host's per-token emission, deferred so it overlaps the device's next step.

Each sampled token's host work has two halves. DECIDE is what the next schedule needs: the
token itself, the reasoning budget, the grammar matcher, stop token ids, max_tokens, the
context limit, the token appended to the sequence. EMIT is what only the client sees: the
text (detokenizing, stop strings), the logprob entries, the TokenEvent put on the handle.

On a GPU the model's forward returns once the step's kernels are launched, so the EMIT half of
step N can run while the device computes step N+1: the engine queues it here in step N and
runs the queue right after step N+1's launch (`Engine._forward`), before step N+1's sampling.
Whatever else puts an event (a finish, a failure, a cancellation) runs the queue first, and so
do the idle engine and its shutdown, so each handle's events keep their order.

A queued token whose text completes a stop string finishes its sequence when the queue runs;
the sequence was already planned into the next step with that token appended, and the engine
skips it in that step's post-processing (its blocks, with the KV just written, are released).
A token after which the sequence ends or its context shifts is emitted at once, so that a
stop string in it still wins as without overlap.

On by default only where the model runs on a GPU (on the CPU the forward pass is synchronous
and nothing would overlap); `EngineConfig.emit_overlap` or `KVSHARE_EMIT_OVERLAP` ("0"/"1")
says so explicitly.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvshare.engine.sequence import Sequence

ENV = "KVSHARE_EMIT_OVERLAP"


def wanted(model: Any, configured: bool | None) -> bool:
    """Overlap the emission: as configured, else as the environment says, else where the model
    runs on a GPU."""
    if configured is not None:
        return configured
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    return bool(getattr(model.backend, "is_gpu", False))


@dataclass
class PendingEmit:
    """One token's EMIT half. `logprobs`: (chosen, top) as numbers, computed at DECIDE while
    the step's logits row and the sampler's state were the token's own."""

    seq: Sequence
    token: int
    logprobs: tuple[float, list[tuple[int, float]]] | None


class EmitQueue:
    """Queued EMIT halves, run in the order they were queued."""

    def __init__(self) -> None:
        self._items: deque[PendingEmit] = deque()
        self._running = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: PendingEmit) -> None:
        self._items.append(item)

    def run(self, emit: Callable[[PendingEmit], None]) -> bool:
        """`emit` each queued item in order; True when any ran. A call from inside `emit` (an
        item that finishes its sequence) does nothing: the items after it follow it in turn."""
        if self._running or not self._items:
            return False
        self._running = True
        try:
            while self._items:
                emit(self._items.popleft())
        finally:
            self._running = False
        return True
