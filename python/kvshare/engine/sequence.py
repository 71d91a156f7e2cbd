"""A sequence: one request's tokens, its block table and its progress through prefill and
decode. Owned by the engine thread; the server only sees its events."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvshare.engine.api import GenerationRequest
from kvshare.engine.sampling import Sampler

if TYPE_CHECKING:
    from kvshare._core import Checkpoint, Matcher
    from kvshare.engine.reasoning_budget import BudgetState


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: GenerationRequest
    sampler: Sampler
    arrival: float = field(default_factory=time.perf_counter)
    state: SeqState = SeqState.WAITING
    # Prompt + generated tokens. tokens[:n_computed] have KV in the pool.
    tokens: list[int] = field(default_factory=list)
    n_prompt: int = 0
    n_computed: int = 0
    n_cached: int = 0  # prompt tokens reused from the cache at admission (llama-server cache_n)
    block_table: list[int] = field(default_factory=list)
    # Chain keys of this sequence's full blocks, in order (block i covers tokens[i*bs:(i+1)*bs]).
    block_keys: list[bytes] = field(default_factory=list)
    # The sliding-window group's table (engine/cache/sliding_window.py): the null block before
    # the window.
    win_table: list[int] = field(default_factory=list)
    # How this sequence's chain of keys starts (engine/cache/keys.py, BlockKeys.chain): (root
    # of block 0, index of its first private block, that block's parent key); set on first use.
    chain: tuple[bytes, int, bytes | None] | None = None
    generated: list[int] = field(default_factory=list)
    # Tokens context shifts discarded from the middle of `tokens` (engine/context_shift.py);
    # positions past the kept ones are then n_discarded lower than the tokens' count so far.
    n_discarded: int = 0
    # Hybrid models: the sequence's own recurrent-state slot, the positions where prefill
    # pauses to save a checkpoint, and the checkpoints it holds (shared, never copied).
    state_slot: int | None = None
    checkpoint_at: list[int] = field(default_factory=list)
    held_checkpoints: list[Checkpoint] = field(default_factory=list)
    # With tiers: the state at the reply's latest block boundary (`tail_position`), as a
    # snapshot on the state's device (`KVArrays.snapshot_state`, overwritten at each boundary)
    # until the sequence ends, then as a checkpoint in the store.
    tail_snapshot: list[Any] | None = None
    tail_position: int = 0
    tail_checkpoint: Checkpoint | None = None
    # The prompt's prefix entry (full blocks before its first user message) was pinned in RAM.
    prefix_pinned: bool = False
    cancelled: bool = False
    # OpenAI `n`: which choice of its request this sequence is. Choice 0 computes the prompt;
    # the others fork from it once its logits exist (Engine._fork) and reuse its blocks.
    choice: int = 0
    # Constrained decoding: this sequence's grammar matcher (kvshare.constrain), or None.
    matcher: Matcher | None = None
    # The request's reasoning budget as this sequence spends it, or None.
    budget: BudgetState | None = None
    preemptions: int = 0
    # When the sequence (re)entered the waiting queue (perf_counter s): --queue-timeout.
    queued_since: float = field(default_factory=time.perf_counter)
    # Preempted for lack of blocks: it waits until the scheduler's `released` count moves
    # past this value (another sequence gave blocks back) before it is admitted again.
    waits_for_room: int | None = None
    # Part of a batch whose forward step failed: it runs alone until a step succeeds, so the
    # sequence that caused the failure is found and fails by itself.
    suspect: bool = False
    # Timing marks (perf_counter seconds). prefill_started is set at admission, before any
    # tier restore, so a restore counts in prompt_ms; restore_s is the restore's own share.
    prefill_started: float | None = None
    restore_s: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def key(self) -> str:
        """The engine's name for this sequence: its request id, plus `#choice` for a fork."""
        rid = self.request.request_id
        return rid if self.choice == 0 else f"{rid}#{self.choice}"

    @property
    def n_generated(self) -> int:
        return len(self.generated)

    @property
    def prompt_done(self) -> bool:
        return self.n_computed >= len(self.tokens) - 1 and self.state == SeqState.DECODE


def recomputes(seq: Sequence) -> bool:
    """The request asked to compute its prompt afresh (llama-server `cache_prompt: false`); its
    other choices (n > 1) still fork from the first one's prompt."""
    return not seq.request.reuse_cache and seq.choice == 0
