"""The SentencePiece family (GGUF tokenizer model ``llama``: Llama 2, Gemma, ...).

llama.cpp's ``llm_tokenizer_spm`` splits the text into UTF-8 characters and repeatedly merges
the adjacent pair whose concatenation is a vocabulary token with the highest score (ties:
leftmost); pieces that never became tokens fall back to ``<0xXX>`` byte tokens. We express
exactly that as a HuggingFace ``tokenizers`` BPE model: one merge rule per way of writing a
token as the concatenation of two tokens, ranked by the score of the result, with byte
fallback. The BPE loop of ``tokenizers`` (lowest rank first, ties leftmost) then performs the
same merges in the same order, in Rust.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as hf_models
from tokenizers import normalizers as hf_normalizers

from kvshare.model.tokenizer.vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED,
                                           Defaults, TokenizerError)

log = logging.getLogger(__name__)

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space

# llama.cpp's defaults for SPM vocabularies
SPM_DEFAULTS = Defaults(add_bos=True, add_eos=False, add_space_prefix=True, clean_spaces=False,
                        ids={"bos": 1, "eos": 2, "unk": 0})


def spm_pieces(texts: Sequence[str]) -> list[bytes]:
    """What each token renders as when it is a normal token (the escaped space unescaped)."""
    return [t.replace(SPM_SPACE, " ").encode("utf-8") for t in texts]



def splits_python(tokens: Sequence[str], vocab: Mapping[str, int]) -> tuple[np.ndarray, ...]:
    """`splits` as a plain loop: the fallback, and the reference the vectorised version must match."""
    res_i, res_a, res_b = [], [], []
    get = vocab.get
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            a = get(t[:k])
            if a is None:
                continue
            b = get(t[k:])
            if b is None:
                continue
            res_i.append(i)
            res_a.append(a)
            res_b.append(b)
    return (np.array(res_i, np.int64), np.array(res_a, np.int64), np.array(res_b, np.int64))


def splits(tokens: Sequence[str], vocab: Mapping[str, int]) -> tuple[np.ndarray, ...]:
    """All (i, a, b) with tokens[i] == tokens[a] + tokens[b] (ids as `vocab` resolves texts).

    Vectorised, one split position k at a time (memory O(vocabulary)): polynomial hashes
    (mod 2^64) of each token's k-character prefix and of the rest find candidate pairs with
    searchsorted; candidates are then verified exactly on the code points. Falls back to the
    plain loop if two distinct tokens share a hash or the vocabulary has duplicate texts.
    """
    n = len(tokens)
    if n == 0:
        return splits_python(tokens, vocab)
    lens = np.fromiter(map(len, tokens), np.int64, n)
    width = int(lens.max())
    if width < 2 or len(vocab) != n:
        return splits_python(tokens, vocab)
    # code points, one row per character position, zero-padded past each token's end
    cp = np.ascontiguousarray(np.array(tokens, dtype=f"<U{width}").view(np.uint32).reshape(n, width).T)
    base = np.uint64(0x100000001B3)
    one = np.uint64(1)
    powers = np.ones(width + 1, np.uint64)
    full = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for k in range(1, width + 1):
            powers[k] = powers[k - 1] * base
        hk = np.zeros(n, np.uint64)
        for k in range(width):
            hk *= base
            hk += cp[k]
            hk += one
            done = lens == k + 1
            full[done] = hk[done]
        order = np.argsort(full)
        fs = full[order]
        if (fs[1:] == fs[:-1]).any():
            return splits_python(tokens, vocab)

        def lookup(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            pos = np.searchsorted(fs, q)
            pos[pos == n] = n - 1
            return fs[pos] == q, order[pos]

        res: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        hk[:] = 0
        for k in range(1, width):
            hk *= base
            hk += cp[k - 1]
            hk += one
            ii = np.flatnonzero(lens > k)
            pre = hk[ii]
            ok, aa = lookup(pre)
            ok &= lens[aa] == k
            ii, pre, aa = ii[ok], pre[ok], aa[ok]
            rest = lens[ii] - k
            ok, bb = lookup(full[ii] - pre * powers[rest])
            ok &= lens[bb] == rest
            ii, aa, bb = ii[ok], aa[ok], bb[ok]
            same = (cp[:k, ii] == cp[:k, aa]).all(0) & (cp[k:, ii] == cp[: width - k, bb]).all(0)
            res.append((ii[same], aa[same], bb[same]))
    return tuple(np.concatenate([r[j] for r in res]) for j in range(3))  # type: ignore[return-value]


def byte_ids(token_to_id: Mapping[str, int]) -> dict[int, int] | None:
    """byte value -> `<0xXX>` token id (SPM byte fallback), or None if any is missing."""
    out = {}
    for b in range(256):
        tid = token_to_id.get(f"<0x{b:02X}>")
        if tid is None:
            tid = token_to_id.get(chr(b)) if b < 128 else None
        if tid is None:
            return None
        out[b] = tid
    return out


def build_spm(texts: list[str], attrs: Sequence[int], scores: np.ndarray,
          token_to_id: Mapping[str, int], unk_id: int | None) -> tuple[HFTokenizer, dict[int, list[int]]]:
    """The `tokenizers` model, and the stand-in ids past the vocabulary with the byte tokens
    that replace each after encoding."""
    n = len(texts)
    vocab = dict(token_to_id)
    bytes_of = byte_ids(token_to_id)
    fake: dict[int, list[int]] = {}
    # Characters that occur inside tokens but are not tokens themselves: llama.cpp keeps
    # them as symbols that can still merge (e.g. "é" + "!" -> "é!" with no "é" token). They
    # get stand-in ids past the vocabulary, take part in merges like tokens, and are
    # replaced by their UTF-8 byte tokens after encoding if they survive unmerged.
    # byte tokens never take part in SPM merges (llama.cpp applies byte fallback only after
    # merging, to single leftover characters); user-defined tokens are always split out
    # before merging, so their text never reaches the merge loop
    skip_tok = np.fromiter(((a & ATTR_BYTE) != 0 or (a & (ATTR_USER_DEFINED | ATTR_CONTROL | ATTR_UNKNOWN))
                            == ATTR_USER_DEFINED for a in attrs), bool, n)
    extra = sorted(set("".join(t for t, sk in zip(texts, skip_tok.tolist()) if not sk)) - vocab.keys())
    if extra and bytes_of is None:
        raise TokenizerError("vocabulary lacks the <0xXX> byte tokens needed for fallback")
    for ch in extra:
        fid = n + len(fake)
        vocab[ch] = fid
        fake[fid] = [bytes_of[b] for b in ch.encode("utf-8")]  # type: ignore[index]
    all_texts = texts + extra
    ii, aa, bb = splits(all_texts, vocab)
    skip = np.zeros(len(all_texts), bool)
    skip[:n] = skip_tok
    keep = ~(skip[ii] | skip[aa] | skip[bb])
    ii, aa, bb = ii[keep], aa[keep], bb[keep]
    order = np.lexsort((aa, ii, -scores[ii]))
    ii, aa, bb = ii[order], aa[order], bb[order]
    merged = np.flatnonzero(np.bincount(ii, minlength=n))
    ms = np.sort(scores[merged])
    n_tied = int((ms[1:] == ms[:-1]).sum())
    if n_tied:
        log.warning(
            "tokenizer: %d mergeable tokens share a score with another; llama.cpp breaks such "
            "ties by position, which a ranked BPE cannot, so rare texts may tokenize differently",
            n_tied)
    merges = [(all_texts[a], all_texts[b]) for a, b in zip(aa.tolist(), bb.tolist())]
    unk = texts[unk_id] if unk_id is not None else None
    bpe = hf_models.BPE(vocab=vocab, merges=merges, byte_fallback=bytes_of is not None,
                        unk_token=unk, fuse_unk=False)
    hf = HFTokenizer(bpe)
    hf.normalizer = hf_normalizers.Replace(" ", SPM_SPACE)
    return hf, fake
