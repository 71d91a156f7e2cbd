"""Grammar masks for constrained decoding, computed once per step for every constrained
sequence that samples.

A constrained sequence (`Sequence.matcher`, a kvshare.constrain matcher) may only sample the
tokens its grammar allows next. Computing that mask walks the tokenizer's trie (tens of
microseconds to a few milliseconds per token); `kvshare.constrain.MaskBatch` computes all of a
step's masks in one Rust call with the GIL released, spread over the cores. Where it runs
depends on the backend:

- GPU: started before the forward pass, on a worker thread, so the CPU computes masks while
  the device computes logits.
- CPU: after the forward pass, on the kernels' own thread pool. The forward pass already keeps
  every core busy (its pool's workers spin between kernels); a mask thread running beside it
  preempts one half of a split matmul and stalls the other half at the join, costing more
  than the masks themselves (measured: bench/constrained.py).

Masks stay in their packed form (uint32 words); the sampler applies them in one pass.
"""

from __future__ import annotations

import numpy as np

from kvshare.constrain import MaskBatch


def compute_mask(matcher) -> np.ndarray:
    """One sequence's mask (uint32 words), on the calling thread."""
    words = np.zeros(matcher.mask_words, dtype=np.uint32)
    matcher.fill_mask(words)
    return words


class MaskJob:
    """The masks of several sequences. `overlap`: start them now, on a worker thread (while a
    GPU runs the forward pass); otherwise they are computed in `wait()` on the kernel pool.
    `wait()` maps each sequence id to its mask, or to the error its matcher reported (that
    sequence's fault alone)."""

    def __init__(self, seqs: list, overlap: bool):
        self._ids = [s.seq_id for s in seqs]
        self._batch = MaskBatch([s.matcher for s in seqs], kernel_pool=not overlap)
        if overlap:
            self._batch.start()

    def wait(self) -> dict:
        words = self._batch.wait()
        return {seq_id: (RuntimeError(err) if err is not None else words[i])
                for i, (seq_id, err) in enumerate(zip(self._ids, self._batch.errors))}
