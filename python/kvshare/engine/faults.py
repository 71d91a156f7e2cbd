"""Faults that belong to one sequence, and the test hook that injects them.

Anything that goes wrong for one sequence (its sampling, its allocation, its tier restore or
save, its part of a forward step) fails or falls back for that sequence alone; the engine
keeps stepping the others. `SequenceFault` carries what the client is told: an HTTP status, a
short machine-readable cause and a message naming it.

Fault injection (tests only): with `KVSHARE_FAULT_INJECTION=1` in the server's environment, a
request may name one injection point in the `X-Kvshare-Fault` header; the engine then fails
that request's sequence at that point (see `POINTS`). Without the variable the header is
ignored, so a production server never honours it.
"""

from __future__ import annotations

import os

ENV = "KVSHARE_FAULT_INJECTION"
HEADER = "x-kvshare-fault"

# Where a fault can be injected, and what the engine does there.
POINTS = {
    "forward": "raise after the batched forward step that included the sequence",
    "logits_nan": "replace the sequence's logits with NaN before sampling",
    "restore": "raise inside the sequence's tier restore (recomputed instead)",
    "save": "raise inside the sequence's tier save (the reply is unaffected)",
    "cow": "no free block for the copy-on-write of a shared partial block at admission",
}


def injection_enabled() -> bool:
    return os.environ.get(ENV, "").strip() == "1"


class InjectedFault(RuntimeError):
    """Raised at an injection point (tests)."""


def injected(request, point: str) -> bool:
    return getattr(request, "fault", None) == point


def maybe_inject(request, point: str) -> None:
    if injected(request, point):
        raise InjectedFault(f"injected fault at {point!r}")


class SequenceFault(Exception):
    """One sequence cannot go on. `status` is the HTTP status its request should end with,
    `cause` a short name for metrics and the error body's code, `retry_after_s` (503s) how long
    the client should wait before retrying."""

    def __init__(self, message: str, *, status: int = 500, cause: str = "internal",
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.cause = cause
        self.retry_after_s = retry_after_s


class SamplingError(SequenceFault):
    """The sampler met non-finite scores or probabilities for this sequence."""

    def __init__(self, message: str):
        super().__init__(message, status=500, cause="non_finite_logits")
