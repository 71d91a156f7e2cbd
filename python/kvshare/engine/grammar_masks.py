"""Grammar masks for constrained decoding, computed while the forward pass runs.

A constrained sequence (`Sequence.matcher`, a kvshare.constrain matcher) may only sample the
tokens its grammar allows next. Computing that mask walks the tokenizer's trie (tens of
microseconds to a few milliseconds per token), so the engine starts it for every sequence that
samples this step before the forward pass and collects it after: `kvshare.constrain.MaskBatch`
computes them in one Rust call with the GIL released, on a worker thread.
"""

from __future__ import annotations

import numpy as np

from kvshare.constrain import MaskBatch, allowed_tokens


def compute_mask(matcher, vocab_size: int) -> np.ndarray:
    """One sequence's mask as a [vocab_size] bool array, on the calling thread."""
    words = np.zeros(matcher.mask_words, dtype=np.uint32)
    matcher.fill_mask(words)
    return allowed_tokens(words, vocab_size)


class MaskJob:
    """The masks of several sequences, started at once. `wait()` maps each sequence id to its
    allowed-token array, or to the error its matcher reported (that sequence's fault alone)."""

    def __init__(self, seqs: list, vocab_size: int):
        self.vocab_size = vocab_size
        self._ids = [s.seq_id for s in seqs]
        self._batch = MaskBatch([s.matcher for s in seqs]).start()

    def wait(self) -> dict:
        words = self._batch.wait()
        return {seq_id: (RuntimeError(err) if err is not None
                         else allowed_tokens(words[i], self.vocab_size))
                for i, (seq_id, err) in enumerate(zip(self._ids, self._batch.errors))}
