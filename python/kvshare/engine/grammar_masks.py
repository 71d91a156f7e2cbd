"""Grammar masks for constrained decoding, computed while the forward pass runs.

A constrained sequence (`Sequence.matcher`, a kvshare.constrain matcher) may only sample the
tokens its grammar allows next. Computing that mask walks the tokenizer's trie (tens of
microseconds to a few milliseconds per token), so the engine starts it for every sequence that
samples this step before the forward pass and collects it after: the Rust matcher releases the
GIL, so on a CPU with spare cores or a GPU backend the mask is ready when the logits are.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="kvshare-mask")
    return _pool


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """A [vocab_size] bool array from a bitmask of uint32 words (bit t of the mask = token t)."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8),
                         bitorder="little")
    return bits[:vocab_size].astype(bool)


def compute_mask(matcher, vocab_size: int) -> np.ndarray:
    """One sequence's mask, on the calling thread."""
    words = np.zeros(mask_words(vocab_size), dtype=np.uint32)
    matcher.fill_mask(words)
    return allowed_tokens(words, vocab_size)


class MaskJob:
    """The masks of several sequences, computed on a worker thread. `wait()` maps each
    sequence id to its allowed-token array, or to the exception its matcher raised (that
    sequence's fault alone)."""

    def __init__(self, seqs: list, vocab_size: int):
        self.vocab_size = vocab_size
        self._future: Future = _executor().submit(self._run, [(s.seq_id, s.matcher) for s in seqs])

    def _run(self, work: list) -> dict:
        from kvshare._core import fill_masks

        words = np.zeros((len(work), mask_words(self.vocab_size)), dtype=np.uint32)
        # one call for all: the Rust side hands the matchers to its threads one at a time
        # (a mask costs from microseconds to milliseconds depending on the grammar's state)
        errors = fill_masks([m for _, m in work], words)
        out: dict = {}
        for i, (seq_id, _) in enumerate(work):
            if errors[i] is not None:
                out[seq_id] = RuntimeError(errors[i])
            else:
                out[seq_id] = allowed_tokens(words[i], self.vocab_size)
        return out

    def wait(self) -> dict:
        return self._future.result()
