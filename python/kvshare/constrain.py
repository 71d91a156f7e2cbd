"""Constrained decoding: token masks that keep each sequence inside a JSON schema, a Lark grammar
or a regex (the Rust crate kvshare-constrain over llguidance, through `kvshare._core`).

Per model, `TokenVocab.from_tokenizer` once; per request, `compile_grammar` once (reusable: one
`grammar.matcher()` per sequence, each choice of an n > 1 request its own); per step, the masks
of all constrained sequences in one `MaskBatch` (computed on a worker thread with the GIL
released, so the forward pass runs meanwhile), `apply_mask` on each logits row, then
`matcher.consume(token)` with the sampled token.

A mask is `mask_words = ceil(vocab_size / 32)` uint32 words: bit `t % 32` of word `t // 32`
set means token `t` is allowed. EOS is allowed when the output is complete (`accepting`), and is
the only token allowed once nothing can extend it (`stopped`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from kvshare._core import (
    ConstraintVocab,
    Grammar,
    GrammarError,
    Matcher,
    fill_masks,
    mask_logits,
    masked_argmax,
)

__all__ = [
    "GrammarError", "Grammar", "Matcher", "TokenVocab", "compile_grammar", "MaskBatch",
    "apply_mask", "allowed_tokens", "masked_argmax", "mask_logits", "GRAMMAR_KINDS",
    "probe_grammar",
]

GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "regex")


class _Tokenizer(Protocol):
    def __len__(self) -> int: ...
    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...


class TokenVocab:
    """A model's vocabulary for constrained decoding (build once per model: ~1.3 s for Gemma 3's
    262K tokens, most of it llguidance's token trie and its precomputed token classes)."""

    def __init__(self, core: ConstraintVocab):
        self.core = core

    @classmethod
    def from_tokenizer(cls, tokenizer: _Tokenizer, vocab_size: int,
                       eos_id: int | Sequence[int]) -> TokenVocab:
        """`vocab_size`: the logits row length (>= len(tokenizer): models pad their vocabulary;
        padding ids are never allowed). `eos_id`: the token ending the reply, or several (the
        first is the main one; all are allowed when the output is complete, and none is ever
        text: an EOS token of user-defined type, such as Gemma's `</s>`, is not produced for
        the characters "</s>").

        Control and unknown tokens (`tokenizer.is_special`: GGUF type 3 and 2, plus the ones
        llama.cpp promotes to control) are special: text can never produce them and a Lark
        grammar names them as `<|im_end|>` or `<[id]>`. User-defined tokens (type 4, e.g.
        Qwen's `<tool_call>`, Gemma's whitespace runs) are plain text, so the literal
        "<tool_call>" may be produced by that one token. Unused tokens have no text and are
        never allowed."""
        n = len(tokenizer)
        tokens = [tokenizer.token_to_bytes(i, special=True) for i in range(n)]
        special = [tokenizer.is_special(i) for i in range(n)]
        eos = [int(eos_id)] if isinstance(eos_id, (int, np.integer)) else [int(e) for e in eos_id]
        return cls(ConstraintVocab(tokens, special, eos, vocab_size))

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def mask_words(self) -> int:
        return self.core.mask_words

    @property
    def eos(self) -> list[int]:
        return self.core.eos


def compile_grammar(vocab: TokenVocab | ConstraintVocab, kind: str, source: str) -> Grammar:
    """Compile `source` as `kind` (one of GRAMMAR_KINDS; `json_object` ignores the source).
    Raises GrammarError (a ValueError) with llguidance's message, e.g. for a schema keyword
    it cannot enforce ("Unimplemented keys: [\"uniqueItems\"]", "Unknown format: ...") or
    that fails in its first steps (`probe_grammar`). GBNF is not accepted: convert it to Lark
    first."""
    core = vocab.core if isinstance(vocab, TokenVocab) else vocab
    grammar = Grammar(core, kind, source)
    probe_grammar(grammar, core.eos)
    return grammar


def probe_grammar(grammar: Grammar, eos: Sequence[int]) -> None:
    """Run a throwaway matcher's first steps (its first mask, one allowed token, the next
    mask): llguidance reports some grammars only when it computes a mask (a schema that
    allows no value, `NoExtensionBias`; an Earley row over its limit after the first token),
    which would otherwise fail the request mid-generation. Raises GrammarError."""
    m = grammar.matcher()
    mask = np.empty(m.mask_words, np.uint32)
    m.fill_mask(mask)
    if m.error is not None:
        raise GrammarError(m.error)
    stops = set(eos)
    for i in np.flatnonzero(mask):
        bits = int(mask[i])
        while bits:
            low = bits & -bits
            token = int(i) * 32 + low.bit_length() - 1
            if token not in stops:
                m.consume(token)
                m.fill_mask(mask)
                if m.error is not None:
                    raise GrammarError(m.error)
                return
            bits ^= low


_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _mask_worker() -> ThreadPoolExecutor:
    # One thread for every batch: submitting to it costs ~20 us, starting a thread ~100 us.
    # The Rust call spreads each batch over the cores itself.
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(1, thread_name_prefix="kvshare-masks")
        return _worker


class MaskBatch:
    """The masks of several matchers, computed in the background: `start()`, run the forward
    pass, then `wait()` for the `[len(matchers), mask_words]` uint32 array (row i is matcher
    i's). A matcher that fails gets an EOS-only row and its message in `errors[i]` (None for
    the others). A call on one of the matchers between `start()` and `wait()` waits for the
    batch; consume the sampled tokens after `wait()`.

    `kernel_pool`: compute in `wait()`, on the calling thread and the CPU kernels' pool (for
    a CPU engine, between forward steps, when that pool is idle); `start()` then does
    nothing."""

    def __init__(self, matchers: Sequence[Matcher], out: np.ndarray | None = None,
                 threads: int | None = None, kernel_pool: bool = False):
        self.matchers = list(matchers)
        words = self.matchers[0].mask_words if self.matchers else 0
        if out is None:
            out = np.empty((len(self.matchers), words), np.uint32)
        self.out = out
        self.threads = threads
        self.kernel_pool = kernel_pool
        self.errors: list[str | None] = []
        self._future: Future[list[str | None]] | None = None

    def start(self) -> MaskBatch:
        if self.kernel_pool:
            return self
        self._future = _mask_worker().submit(fill_masks, self.matchers, self.out, self.threads)
        return self

    def wait(self) -> np.ndarray:
        if self.kernel_pool:
            self.errors = fill_masks(self.matchers, self.out, None, True)
            return self.out
        if self._future is None:
            self.start()
        assert self._future is not None
        self.errors = self._future.result()
        return self.out


def allowed_tokens(mask_words: np.ndarray, n: int) -> np.ndarray:
    """The mask as booleans over the last axis, `n` long (ids beyond the mask: False)."""
    words = np.ascontiguousarray(mask_words, dtype="<u4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] >= n:
        return bits[..., :n].view(bool)
    pad = np.zeros(bits.shape[:-1] + (n - bits.shape[-1],), np.uint8)
    return np.concatenate([bits, pad], axis=-1).view(bool)


def apply_mask(logits_row: np.ndarray, mask_words: np.ndarray) -> np.ndarray:
    """`logits_row` with every token the mask does not allow set to -inf (a new array). Also
    works row-wise for `[n, vocab]` logits with `[n, mask_words]` masks."""
    allowed = allowed_tokens(mask_words, logits_row.shape[-1])
    return np.where(allowed, logits_row, np.array(-np.inf, logits_row.dtype))
