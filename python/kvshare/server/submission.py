"""What the generation pipeline hands between its steps: `Prepared` (a request ready to
submit: the engine's request and the API's format for it) and `merge_finishes` (one request's
totals over its choices)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvshare.apis.base import ApiFormat
from kvshare.engine.api import FinishEvent, GenerationRequest, Timings


@dataclass
class Prepared:
    """A request ready to submit: the engine's request and the API's format for it."""

    greq: GenerationRequest
    fmt: ApiFormat


def merge_finishes(fins: list[FinishEvent]) -> FinishEvent:
    """One request's totals over its choices (n > 1): the prompt counted once (choice 0
    computed it, the others reused it), completion tokens summed."""
    if len(fins) == 1:
        return fins[0]
    first = min(fins, key=lambda f: f.index)
    t = first.timings
    timings = Timings(
        prompt_n=sum(f.timings.prompt_n for f in fins), cache_n=t.cache_n,
        prompt_ms=t.prompt_ms, predicted_n=sum(f.timings.predicted_n for f in fins),
        predicted_ms=max(f.timings.predicted_ms for f in fins), restore_ms=t.restore_ms)
    return replace(first, completion_tokens=sum(f.completion_tokens for f in fins),
                   timings=timings)
