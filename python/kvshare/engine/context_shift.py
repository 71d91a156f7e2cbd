"""Context shift (llama-server's `--context-shift`): a generating sequence whose context is full
drops part of its past and goes on generating instead of ending with `length`.

llama-server (tools/server/server-context.cpp, `pre_decode`) keeps the first `n_keep` tokens
(the request's `n_keep`, -1: the whole prompt; plus one for BOS when the model adds it; at most
n_ctx - 4), discards the next `n_discard` (the request's `n_discard`, 0: half of what follows
the kept tokens) and slides the rest down: its cache removes the discarded cells and rotates
the K of the later ones to their new positions (`seq_add`).

kvshare cannot rotate cached K in place: a block is shared between sequences and named by the
chain hash of every token before it and in it (engine/cache/keys.py), so a block is only ever
the KV of one token prefix at its own positions. A shift therefore rewrites the sequence's
token list (what `shift_tokens` does here) and the engine re-admits it like a new prompt of
that list: the full blocks of the kept prefix are found in the pool under their unchanged
keys and shared as they are, everything after them is computed again at its new positions in
fresh blocks. The result is exactly what a cold prefill of the shifted token list gives (no
RoPE re-rotation error), at the price of recomputing about (n_ctx - n_keep) / 2 tokens per
shift, which llama-server's rotation does not pay. Shared blocks are never written: the
sequence only lets go of its references (copy-on-write as for any admission).

Models with recurrent state (hybrids) cannot be shifted this way without recomputing the state
from the start; as llama-server (whose recurrent and hybrid caches cannot shift), the engine
turns the shift off for them and their generation ends at the context limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvshare.engine.sequence import Sequence


class ChainKeys(Protocol):
    """The chain-key bookkeeping a shift must correct (engine/cache/keys.py BlockKeys)."""

    block_size: int

    def chain(self, seq: Sequence) -> tuple[bytes, int, bytes | None]: ...

    def root_key(self, salt: bytes | None) -> bytes: ...


@dataclass(frozen=True)
class Shift:
    """One shift: tokens[n_keep:n_keep + n_discard] go."""

    n_keep: int
    n_discard: int


def plan_shift(n_past: int, n_prompt: int, n_ctx: int, n_keep: int = 0, n_discard: int = 0,
               add_bos: bool = True) -> Shift:
    """llama-server's arithmetic: `n_past` tokens are in the context (n_ctx - 1 when it is
    full), `n_keep` / `n_discard` are the request's (n_keep -1: the whole prompt; n_discard 0:
    half of what follows the kept tokens). A `n_discard` of 0 in the result means nothing can
    be discarded (the kept tokens fill the context)."""
    keep = n_prompt if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = max(0, min(n_ctx - 4, keep))
    n_left = n_past - keep
    discard = n_discard if n_discard > 0 else n_left // 2
    # llama.cpp PR 24786: at least one token after the kept ones stays
    discard = min(max(discard, 0), max(0, n_left - 1))
    return Shift(keep, discard)


def shift_tokens(seq: Sequence, shift: Shift, keys: ChainKeys) -> None:
    """Drop tokens[n_keep:n_keep + n_discard] from a sequence that holds no blocks (released)
    and correct what was derived from its old token list: its chain keys past the kept full
    blocks, and its chain's start when the kept tokens end inside the public prefix (the
    tokens sliding into it are not public: they must chain from the salted root, so the
    whole list is keyed with the salt from block 0)."""
    start, end = shift.n_keep, shift.n_keep + shift.n_discard
    bs = keys.block_size
    _, p, _ = keys.chain(seq)
    del seq.tokens[start:end]
    if p * bs > start:
        seq.chain = (keys.root_key(seq.request.cache_salt), 0, None)
        seq.block_keys = []
    else:
        del seq.block_keys[start // bs:]
    seq.n_discarded += shift.n_discard
