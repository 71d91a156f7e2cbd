"""llama-server's reasoning budget (`--reasoning-budget N`, a request's
`reasoning_budget_tokens`): after N tokens inside a thinking block the end of thinking is
forced, token by token, and the model then writes the answer.

The state machine is llama.cpp's sampler of common/reasoning-budget.cpp:

    IDLE -> COUNTING -> (WAITING_UTF8) -> FORCING -> DONE

- IDLE: watching the generated tokens for the start sequence (`<think>`); a prompt whose
  generation prompt already opened the block (DeepSeek-R1, QwQ) starts COUNTING, as llama.cpp
  feeds the generation prompt's tokens to the sampler first.
- COUNTING: each generated token spends one of the budget; an end sequence (`</think>`)
  written by the model ends it (DONE). When the budget is spent, FORCING, or WAITING_UTF8
  first while the last token left a UTF-8 character unfinished.
- FORCING: the next tokens are `forced` (the budget message's tokens, then the end tag), one a
  step: every other token's logit is -inf.
- DONE: passthrough, until the start sequence appears again (a new block, a new budget).

A budget of 0 forces the end as soon as the block opens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = ("idle", "counting", "waiting_utf8", "forcing",
                                               "done")


@dataclass(frozen=True)
class ReasoningBudget:
    """What a request's budget needs, as token ids: the start sequence, the end sequences (the
    first is the one forced), the forced sequence (message + first end), the budget, and
    whether the prompt already opened the block."""

    start: tuple[int, ...]
    ends: tuple[tuple[int, ...], ...]
    forced: tuple[int, ...]
    budget: int
    opened: bool = False

    def state(self, utf8_complete: Callable[[int], bool] | None = None) -> "BudgetState":
        return BudgetState(self, utf8_complete)


class _TailMatcher:
    """Which of `seqs` the tokens seen so far end with (the longest), restarting after each
    match, as llama.cpp's token_matcher (an Aho-Corasick automaton over the sequences)."""

    def __init__(self, seqs: tuple[tuple[int, ...], ...]):
        self.seqs = [s for i, s in enumerate(seqs) if s and s not in seqs[:i]]
        self.longest = max((len(s) for s in self.seqs), default=0)
        self.buf: list[int] = []

    def advance(self, token: int) -> int:
        """The index of the sequence ending at `token`, or -1."""
        self.buf.append(token)
        del self.buf[:-self.longest or None]
        best = -1
        for i, s in enumerate(self.seqs):
            if len(s) <= len(self.buf) and tuple(self.buf[-len(s):]) == s and (
                    best < 0 or len(s) > len(self.seqs[best])):
                best = i
        if best >= 0:
            self.buf.clear()
        return best

    def reset(self) -> None:
        self.buf.clear()


class BudgetState:
    """One sequence's budget (each choice of a request has its own)."""

    def __init__(self, spec: ReasoningBudget,
                 utf8_complete: Callable[[int], bool] | None = None):
        self.spec = spec
        self.utf8_complete = utf8_complete
        self.start = _TailMatcher((spec.start,))
        self.end = _TailMatcher(spec.ends)
        self.remaining = spec.budget
        self.force_pos = 0
        self.state = IDLE
        self.thinking_tokens = 0  # tokens generated inside blocks, forced ones aside
        if spec.opened:
            self._open()

    def _open(self) -> None:
        self.remaining = self.spec.budget
        self.end.reset()
        self.state = COUNTING
        if self.remaining <= 0:
            self._force()

    def _force(self) -> None:
        self.state = FORCING
        self.force_pos = 0
        self.end.reset()
        if not self.spec.forced:
            self.state = DONE

    def forced_token(self) -> int | None:
        """The token the next step must produce, or None (sample as usual)."""
        if self.state == FORCING and self.force_pos < len(self.spec.forced):
            return self.spec.forced[self.force_pos]
        return None

    def accept(self, token: int) -> None:
        """The token the sequence produced this step."""
        if self.state in (IDLE, DONE):
            if self.start.advance(token) >= 0:
                self._open()
            return
        if self.state == FORCING:
            self.end.advance(token)
            self.force_pos += 1
            if self.force_pos >= len(self.spec.forced):
                self.state = DONE
            return
        # COUNTING or WAITING_UTF8
        self.thinking_tokens += 1
        if self.end.advance(token) >= 0:
            self.state = DONE
            return
        complete = self.utf8_complete(token) if self.utf8_complete is not None else True
        if self.state == WAITING_UTF8:
            if complete:
                self._force()
            return
        self.remaining -= 1
        if self.remaining <= 0:
            if complete:
                self._force()
            else:
                self.state = WAITING_UTF8
                self.end.reset()


def utf8_is_complete(piece: bytes) -> bool:
    """Whether `piece` ends on a whole UTF-8 character (llama.cpp's common_utf8_is_complete:
    the last lead byte within 4 bytes of the end has all its bytes; all continuation bytes:
    incomplete)."""
    if not piece:
        return True
    for back in range(1, min(4, len(piece)) + 1):
        c = piece[-back]
        if c & 0xC0 != 0x80:
            need = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return back >= need
    return False
