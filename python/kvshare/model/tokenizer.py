"""Tokenizer built from GGUF metadata, token-for-token identical to llama.cpp.

Two GGUF tokenizer models are supported:

* ``llama`` (SentencePiece-style, "SPM"): llama.cpp's ``llm_tokenizer_spm`` splits the text into
  UTF-8 characters and repeatedly merges the adjacent pair whose concatenation is a vocabulary
  token with the highest score (ties: leftmost); pieces that never became tokens fall back to
  ``<0xXX>`` byte tokens. We express exactly that as a HuggingFace ``tokenizers`` BPE model: one
  merge rule per way of writing a token as the concatenation of two tokens, ranked by the score
  of the result, with byte fallback. The BPE loop of ``tokenizers`` (lowest rank first, ties
  leftmost) then performs the same merges in the same order, in Rust.
* ``gpt2`` (byte-level BPE): the GGUF merges as a ``tokenizers`` BPE model behind the
  llama.cpp pre-tokenizer regexes of the file's ``tokenizer.ggml.pre`` and GPT-2 byte mapping.

Special tokens are split out before either model runs, as llama.cpp's
``tokenizer_st_partition`` does: control, unknown and user-defined tokens when
``parse_special`` is on, user-defined tokens only when it is off. llama.cpp processes the
special tokens longest first over the whole text; we find them with one regex (leftmost,
longest) and prove per match that the two agree, using the exact longest-first algorithm only
for the rare text where a longer special token overlaps the end of a match (see
``_SpecialSplitter``).

Decoding follows llama.cpp's ``token_to_piece`` / ``llama_detokenize``: see ``Tokenizer.decode``,
``Tokenizer.token_to_bytes`` and ``StreamDecoder``. ``docs/model.md`` describes the design and
the known theoretical differences.
"""

from __future__ import annotations

import codecs
from array import array
import functools
import logging
import re
import threading
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _hf_models
from tokenizers import normalizers as _hf_normalizers
from tokenizers import pre_tokenizers as _hf_pre

log = logging.getLogger(__name__)

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "StreamDecoder",
    "prefix_token_count",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

# GGUF `tokenizer.ggml.token_type` values.
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.cpp `llama_token_attr` bits.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_FRAGMENT_CACHE_CHARS = 4_000_000  # raw-text fragments remembered by Tokenizer.encode
_GIL_FREE_CHARS = 8192  # longer single fragments are encoded by the batch call (no GIL held)

# Token texts llama.cpp recognises (llama-vocab.cpp, `load`): end-of-turn candidates, FIM
# tokens that also end generation, and the end-of-generation list. Tokens found here that are
# not control tokens are promoted to control tokens, as llama.cpp does.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDER_TEXTS = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))

# llama.cpp pre-tokenizer regexes (llm_tokenizer_bpe) for `tokenizer.ggml.pre` values.
_RX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RX_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|"
    r"\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RX_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


class _Pre:
    """A BPE pre-tokenizer setting: regexes applied in turn, and llama.cpp's flags for it."""

    def __init__(self, regexes, ignore_merges=False, add_bos=False, clean_spaces=True):
        self.regexes = tuple(regexes)
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos
        self.clean_spaces = clean_spaces


_PRE_DEFAULT = _Pre(_RX_DEFAULT)
_PRE_LLAMA3 = _Pre((_RX_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_QWEN2 = _Pre((_RX_QWEN2,), clean_spaces=False)
_PRE_TYPES: dict[str, _Pre] = {
    "default": _PRE_DEFAULT,
    **{k: _PRE_LLAMA3 for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                "pixtral", "midm-2.0", "lfm2")},
    **{k: _Pre((_RX_LLAMA3,)) for k in ("dbrx", "smaug-bpe")},
    **{k: _PRE_QWEN2 for k in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "megrez": _Pre((_RX_QWEN2,)),
    "stablelm2": _Pre((_RX_QWEN2,)),
    "qwen35": _Pre((_RX_QWEN35,), clean_spaces=False),
    **{k: _Pre((_RX_GPT2,)) for k in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat",
                                      "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
                                      "modern-bert", "exaone4", "mpt", "olmo", "jais")},
    **{k: _Pre((r"\p{N}", _RX_GPT2)) for k in ("starcoder", "refact", "codeshell", "exaone",
                                               "minerva-7b")},
    **{k: _Pre((r"\p{N}", _RX_GPT2), clean_spaces=False) for k in ("command-r", "smollm")},
    "tekken": _Pre((
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?"
        r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True, add_bos=True, clean_spaces=False),
}


class TokenizerError(ValueError):
    """The GGUF metadata describes a tokenizer we cannot build, or a call got bad input."""


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character map (llama.cpp `unicode_byte_to_utf8`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _gpt2_byte_table()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _gpt2_decode_text(text: str) -> bytes:
    """llama.cpp `llama_decode_text`: byte-level characters back to bytes."""
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            raw = ch.encode("utf-8")
            out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


# --------------------------------------------------------------------------------------------
# special-token splitting
# --------------------------------------------------------------------------------------------


def _trie_regex(texts: Iterable[str]) -> re.Pattern[str]:
    """One regex matching any of `texts`, longest alternative first at every position."""
    trie: dict = {}
    for s in texts:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = None

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items()) if ch != ""]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return "(?:" + body + ")?" if "" in node else body

    return re.compile(build(trie))


class _SpecialSplitter:
    """llama.cpp's `tokenizer_st_partition` for one set of special tokens.

    llama.cpp takes the special tokens longest first (ties: unspecified order) and, for each,
    splits every remaining raw fragment at its non-overlapping occurrences, left to right. We
    instead scan once with a leftmost-longest regex. The two agree unless, for a match M of
    token T at [s, e), some other special token U with len(U) >= len(T) starts inside (s, e) and
    ends after e (then llama.cpp may pick U). `_danger[T]` lists every continuation Z such that
    T[k:] + Z is such a U; if the text after a match starts with one, the whole text is split
    with the exact longest-first algorithm instead. (Proof sketch in docs/model.md.)
    """

    def __init__(self, specials: Sequence[tuple[str, int]]):
        # llama.cpp order: longer first; among equal lengths we take the lower id first.
        order = sorted(specials, key=lambda t: (-len(t[0]), t[1]))
        self.ids: dict[str, int] = {}
        for text, tid in order:
            self.ids.setdefault(text, tid)
        self.exact_order = [(text, self.ids[text]) for text in self.ids]
        self.rx = _trie_regex(self.ids) if self.ids else None
        self.danger = self._danger_map(list(self.ids))

    @staticmethod
    def _danger_map(texts: list[str]) -> dict[str, tuple[str, ...]]:
        by_prefix: dict[str, list[str]] = defaultdict(list)
        for u in texts:
            for m in range(1, len(u)):
                by_prefix[u[:m]].append(u)
        danger: dict[str, tuple[str, ...]] = {}
        for t in texts:
            zs = set()
            for k in range(1, len(t)):
                s = t[k:]
                for u in by_prefix.get(s, ()):
                    if u != t and len(u) >= len(t):
                        zs.add(u[len(s):])
            if zs:
                kept: list[str] = []
                for z in sorted(zs, key=len):
                    if not any(z.startswith(k) for k in kept):
                        kept.append(z)
                danger[t] = tuple(kept)
        return danger

    def split(self, text: str) -> list[str | int]:
        """`text` as raw-text fragments (str) and special token ids (int), in order."""
        if self.rx is None:
            return [text]
        out: list[str | int] = []
        pos = 0
        ids, danger = self.ids, self.danger
        for m in self.rx.finditer(text):
            s, e = m.span()
            tok = m.group()
            z = danger.get(tok)
            if z is not None and text.startswith(z, e):
                return self.split_exact(text)
            if s > pos:
                out.append(text[pos:s])
            out.append(ids[tok])
            pos = e
        if pos < len(text):
            out.append(text[pos:])
        return out

    def split_exact(self, text: str) -> list[str | int]:
        """llama.cpp's algorithm, literally (slow; only for overlapping special tokens)."""
        buf: list[tuple[int, int] | int] = [(0, len(text))]
        for tok, tid in self.exact_order:
            if tok not in text:
                continue
            n = len(tok)
            new: list[tuple[int, int] | int] = []
            for item in buf:
                if isinstance(item, int):
                    new.append(item)
                    continue
                s, e = item
                while True:
                    m = text.find(tok, s, e)
                    if m < 0:
                        break
                    if m > s:
                        new.append((s, m))
                    new.append(tid)
                    s = m + n
                if s < e:
                    new.append((s, e))
            buf = new
        return [x if isinstance(x, int) else text[x[0]:x[1]] for x in buf]


# --------------------------------------------------------------------------------------------
# SPM -> BPE merges
# --------------------------------------------------------------------------------------------


def _splits_python(tokens: Sequence[str], vocab: Mapping[str, int]) -> tuple[np.ndarray, ...]:
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


def _splits(tokens: Sequence[str], vocab: Mapping[str, int]) -> tuple[np.ndarray, ...]:
    """All (i, a, b) with tokens[i] == tokens[a] + tokens[b] (ids as `vocab` resolves texts).

    Vectorised, one split position k at a time (memory O(vocabulary)): polynomial hashes
    (mod 2^64) of each token's k-character prefix and of the rest find candidate pairs with
    searchsorted; candidates are then verified exactly on the code points. Falls back to the
    plain loop if two distinct tokens share a hash or the vocabulary has duplicate texts.
    """
    n = len(tokens)
    if n == 0:
        return _splits_python(tokens, vocab)
    lens = np.fromiter(map(len, tokens), np.int64, n)
    width = int(lens.max())
    if width < 2 or len(vocab) != n:
        return _splits_python(tokens, vocab)
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
            return _splits_python(tokens, vocab)

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


# --------------------------------------------------------------------------------------------
# the tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A GGUF model's tokenizer, byte-exact with llama.cpp.

    Build with `Tokenizer.from_gguf(path)` or `Tokenizer.from_metadata(meta)`. Thread-safe.
    """

    def __init__(self, meta: Mapping[str, Any]):
        model = meta.get("tokenizer.ggml.model")
        if model not in ("llama", "gpt2"):
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} (supported: 'llama' (SentencePiece), "
                "'gpt2' (byte-level BPE))")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        self.model: str = model
        self.architecture: str = str(meta.get("general.architecture", ""))
        tmpl = meta.get("tokenizer.chat_template")
        self.chat_template_source: str | None = tmpl if isinstance(tmpl, str) and tmpl.strip() else None
        n = len(tokens)
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) < n:
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self._texts: list[str] = texts
        self._scores = np.asarray(scores[:n] if scores is not None else np.zeros(n), np.float64)
        self._types: list[int] = list(types[:n]) if types is not None else [TOKEN_TYPE_NORMAL] * n
        attrs = [_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in self._types]
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(texts)}  # last wins

        # flags and special ids, with llama.cpp's defaults per model
        if model == "llama":
            self.pre = "default"
            pre = None
            add_bos, add_eos, add_space_prefix, clean_spaces = True, False, True, False
            ids = {"bos": 1, "eos": 2, "unk": 0}
        else:
            self.pre = str(meta.get("tokenizer.ggml.pre") or "default")
            pre = _PRE_TYPES.get(self.pre)
            if pre is None:
                raise TokenizerError(
                    f"unsupported gpt2 pre-tokenizer {self.pre!r}; supported: "
                    + ", ".join(sorted(_PRE_TYPES)))
            add_bos, add_eos, add_space_prefix, clean_spaces = pre.add_bos, False, False, pre.clean_spaces
            ids = {"bos": 11, "eos": 11, "unk": None}
        ids = {k: (v if v is not None and v < n else None) for k, v in ids.items()}
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        for key in ("bos", "eos", "unknown", "padding", "eot", "eom", "seperator", "mask"):
            v = meta.get(f"tokenizer.ggml.{key}_token_id")
            name = {"unknown": "unk", "padding": "pad", "seperator": "sep"}.get(key, key)
            if v is not None and 0 <= int(v) < n:
                ids[name] = int(v)
            else:
                ids.setdefault(name, None)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", add_eos))
        if add_bos and ids["bos"] is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but there is no BOS token")
        if add_eos and ids["eos"] is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but there is no EOS token")

        # llama.cpp's text-based detection of EOT / EOM / FIM / EOG tokens (and the
        # promotion of such tokens to control tokens)
        tti = self._token_to_id

        def find(cands: Iterable[str]) -> int | None:
            for c in cands:
                if c in tti:
                    attrs[tti[c]] |= ATTR_CONTROL
                    return tti[c]
            return None

        if ids["eot"] is None:
            ids["eot"] = find(_EOT_TEXTS)
        if ids["eom"] is None:
            ids["eom"] = find(_EOM_TEXTS)
        fim = {k: find(v) for k, v in _FIM_TEXTS.items()}
        for k in fim:  # the GGUF's own ids win over the text-based detection
            v = meta.get(f"tokenizer.ggml.fim_{k}_token_id")
            if v is not None and 0 <= int(v) < n:
                fim[k] = int(v)
        for i, t in enumerate(texts):
            if attrs[i] & ATTR_CONTROL and "unused" in t:
                attrs[i] |= ATTR_UNUSED
        eog = {fim[k] for k in ("pad", "rep", "sep") if fim[k] is not None}
        for t in _EOG_TEXTS:
            if t in tti:
                eog.add(tti[t])
                attrs[tti[t]] |= ATTR_CONTROL
        for t in _ALWAYS_RENDER_TEXTS:
            if t in tti:
                attrs[tti[t]] = ATTR_USER_DEFINED
        eog.update(v for v in (ids["eos"], ids["eot"], ids["eom"]) if v is not None)
        eog_texts = {texts[i]: i for i in eog}
        if "<|end|>" in eog_texts and (
                ("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
                or ("<|flush|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))):
            eog.discard(eog_texts["<|end|>"])
            attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
            eog.discard(eog_texts["</s>"])
            attrs[eog_texts["</s>"]] = ATTR_NORMAL

        self._attrs: list[int] = attrs
        self.vocab_size: int = n
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.eot_id: int | None = ids["eot"]
        self.eom_id: int | None = ids["eom"]
        self.unk_id: int | None = ids["unk"]
        self.pad_id: int | None = ids["pad"]
        # fill-in-the-middle tokens ("pre", "suf", "mid", "pad", "rep", "sep" -> id or None)
        self.fim_ids: dict[str, int | None] = dict(fim)
        self.stop_ids: frozenset[int] = frozenset(eog)
        self.add_bos: bool = add_bos
        self.add_eos: bool = add_eos
        self.add_space_prefix: bool = add_space_prefix
        self._prefix_space = model == "llama" and add_space_prefix
        self.clean_spaces: bool = clean_spaces

        # special-token splitters (parse_special on / off)
        special_mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        specials = [(texts[i], i) for i in range(n) if attrs[i] & special_mask]
        self._split_special = _SpecialSplitter(specials)
        self._split_plain = _SpecialSplitter(
            [(t, i) for t, i in specials if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)])

        # pieces (llama.cpp token_to_piece with special=True, and what special=False renders)
        self._pieces: list[bytes] = self._make_pieces()
        hidden = ATTR_CONTROL | ATTR_UNKNOWN
        self._pieces_plain: list[bytes] = [
            b"" if attrs[i] & hidden else p for i, p in enumerate(self._pieces)]

        self._fake: dict[int, list[int]] = {}
        if model == "llama":
            self._hf = self._build_spm()
        else:
            self._hf = self._build_bpe(meta, pre)
        self._encode_batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        del self._token_to_id  # the HF model holds the same text -> id map
        self._prefix_cache: OrderedDict[tuple[str, bool, bool], int] = OrderedDict()
        self._frag_cache: dict[str, array] = {}
        self._frag_chars = 0
        self._frag_lock = threading.Lock()
        self._prefix_lock = threading.Lock()
        _release_freed_memory()

    # ---- construction helpers ---------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF key/values (as `kvshare.model.gguf_file.read_metadata` returns)."""
        return cls(meta)

    @classmethod
    def from_gguf(cls, path: str | Path, *, cached: bool = True) -> "Tokenizer":
        """Build from a GGUF file. With `cached` (the default) a tokenizer already built in this
        process for the same file (path, size and mtime) is returned instead: building a 262K
        vocabulary takes a few seconds, and a Tokenizer is immutable and thread-safe."""
        p = Path(path).resolve()
        if not cached:
            return cls(_read_metadata(p))
        st = p.stat()
        return _cached_tokenizer(str(p), st.st_size, st.st_mtime_ns)

    def _make_pieces(self) -> list[bytes]:
        texts, attrs = self._texts, self._attrs
        if self.model == "llama":
            out = [t.replace(SPM_SPACE, " ").encode("utf-8") for t in texts]
        else:
            out = [_gpt2_decode_text(t) for t in texts]
        special = ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED
        for i, attr in enumerate(attrs):
            if attr == ATTR_NORMAL:
                continue
            if attr & special:
                out[i] = texts[i].encode("utf-8")
            elif attr & ATTR_NORMAL:
                pass
            elif attr & ATTR_BYTE:
                try:
                    out[i] = bytes([int(texts[i][3:5], 16)])
                except ValueError:
                    out[i] = b""
            else:  # unused / undefined: llama.cpp renders nothing
                out[i] = b""
        return out

    def _byte_ids(self) -> dict[int, int] | None:
        """byte value -> `<0xXX>` token id (SPM byte fallback), or None if any is missing."""
        out = {}
        for b in range(256):
            tid = self._token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                tid = self._token_to_id.get(chr(b)) if b < 128 else None
            if tid is None:
                return None
            out[b] = tid
        return out

    def _build_spm(self) -> _HFTokenizer:
        texts, attrs, n = self._texts, self._attrs, self.vocab_size
        vocab = dict(self._token_to_id)
        byte_ids = self._byte_ids()
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
        if extra and byte_ids is None:
            raise TokenizerError("vocabulary lacks the <0xXX> byte tokens needed for fallback")
        for ch in extra:
            fid = n + len(self._fake)
            vocab[ch] = fid
            self._fake[fid] = [byte_ids[b] for b in ch.encode("utf-8")]  # type: ignore[index]
        all_texts = texts + extra
        ii, aa, bb = _splits(all_texts, vocab)
        skip = np.zeros(len(all_texts), bool)
        skip[:n] = skip_tok
        keep = ~(skip[ii] | skip[aa] | skip[bb])
        ii, aa, bb = ii[keep], aa[keep], bb[keep]
        order = np.lexsort((aa, ii, -self._scores[ii]))
        ii, aa, bb = ii[order], aa[order], bb[order]
        merged = np.flatnonzero(np.bincount(ii, minlength=n))
        ms = np.sort(self._scores[merged])
        n_tied = int((ms[1:] == ms[:-1]).sum())
        if n_tied:
            log.warning(
                "tokenizer: %d mergeable tokens share a score with another; llama.cpp breaks such "
                "ties by position, which a ranked BPE cannot, so rare texts may tokenize differently",
                n_tied)
        merges = [(all_texts[a], all_texts[b]) for a, b in zip(aa.tolist(), bb.tolist())]
        unk = self._texts[self.unk_id] if self.unk_id is not None else None
        bpe = _hf_models.BPE(vocab=vocab, merges=merges, byte_fallback=byte_ids is not None,
                             unk_token=unk, fuse_unk=False)
        hf = _HFTokenizer(bpe)
        hf.normalizer = _hf_normalizers.Replace(" ", SPM_SPACE)
        return hf

    def _build_bpe(self, meta: Mapping[str, Any], pre: _Pre) -> _HFTokenizer:
        raw_merges = meta.get("tokenizer.ggml.merges")
        if raw_merges is None:
            raise TokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
        vocab = dict(self._token_to_id)
        merges = []
        dropped = 0
        for m in raw_merges:
            pos = m.find(" ", 1)
            if pos < 0:
                dropped += 1
                continue
            a, b = m[:pos], m[pos + 1:]
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
            else:
                dropped += 1
        if dropped:
            log.warning("tokenizer: %d merges whose parts or result are not tokens were dropped", dropped)
        bpe = _hf_models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges,
                             fuse_unk=False, byte_fallback=False)
        hf = _HFTokenizer(bpe)
        steps = [_hf_pre.Split(Regex(rx), behavior="isolated") for rx in pre.regexes]
        steps.append(_hf_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
        hf.pre_tokenizer = _hf_pre.Sequence(steps)
        return hf

    # ---- vocabulary ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.vocab_size

    def token_text(self, token_id: int) -> str:
        """The token's vocabulary string (as stored in the GGUF file)."""
        return self._texts[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id of the token whose vocabulary string is `text`, or None."""
        tid = self._hf.token_to_id(text)
        return tid if tid is not None and tid < self.vocab_size else None

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._types[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens: the ones llama.cpp renders as empty text when
        special tokens are not rendered (user-defined tokens always render as their text)."""
        return bool(self._attrs[self._check_id(token_id)] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def is_eog(self, token_id: int) -> bool:
        """True if the token ends generation (llama.cpp's EOG set: EOS, EOT, ...)."""
        return token_id in self.stop_ids

    @property
    def bos_token(self) -> str:
        return self._texts[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._texts[self.eos_id] if self.eos_id is not None else ""

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return token_id

    # ---- encoding -----------------------------------------------------------------------------

    def split_special(self, text: str, parse_special: bool = True) -> list[str | int]:
        """The special-token partition of `text`: raw fragments (str) and token ids (int)."""
        if not text:
            return []
        return (self._split_special if parse_special else self._split_plain).split(text)

    def is_split_point(self, text: str, pos: int, parse_special: bool = True) -> bool:
        """True if `pos` falls between two parts of `text`'s special-token partition (or at an
        end). Tokens then never span `pos`: `encode(text[:pos])` is a prefix of `encode(text)`
        (apart from an EOS the model appends)."""
        if pos <= 0 or pos >= len(text):
            return True
        at = 0
        texts = self._texts
        for part in self.split_special(text, parse_special):
            at += len(texts[part]) if part.__class__ is int else len(part)  # type: ignore[index, arg-type]
            if at >= pos:
                return at == pos
        return False

    def prefix_length(self, prefix: str, add_special: bool = True, parse_special: bool = True) -> int:
        """`len(encode(prefix))` without a trailing EOS the model appends, memoised for the
        last 64 prefixes (agent sessions render the same system prompt + tools again and
        again)."""
        key = (prefix, add_special, parse_special)
        with self._prefix_lock:
            n = self._prefix_cache.get(key)
            if n is not None:
                self._prefix_cache.move_to_end(key)
                return n
        ids = self.encode(prefix, add_special, parse_special)
        n = len(ids) - (1 if add_special and self.add_eos and ids and ids[-1] == self.eos_id else 0)
        with self._prefix_lock:
            self._prefix_cache[key] = n
            while len(self._prefix_cache) > 64:
                self._prefix_cache.popitem(last=False)
        return n

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        `add_special` adds BOS (and EOS) as the model's metadata asks; `parse_special` turns the
        text of control tokens (e.g. "<start_of_turn>") into those tokens. User-defined tokens
        are always recognised, as in llama.cpp.
        """
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        if text:
            parts = self.split_special(text, parse_special)
            raw = [p for p in parts if p.__class__ is str]
            if self._prefix_space:
                raw = [" " + p for p in raw]
            if raw:
                it = iter(self._encode_fragments(raw))
                for p in parts:
                    if p.__class__ is int:
                        out.append(p)  # type: ignore[arg-type]
                    else:
                        out.extend(next(it))
            else:
                out.extend(parts)  # type: ignore[arg-type]
            if self._fake and out and max(out) >= self.vocab_size:
                fixed: list[int] = []
                for t in out:
                    fixed.extend(self._fake[t] if t >= self.vocab_size else (t,))
                out = fixed
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def clear_cache(self) -> None:
        """Forget remembered fragment encodings and prefix lengths (benchmarks use this)."""
        with self._frag_lock:
            self._frag_cache.clear()
            self._frag_chars = 0
        with self._prefix_lock:
            self._prefix_cache.clear()

    def _encode_fragments(self, raw: list[str]) -> list[Sequence[int]]:
        """Token ids of each raw fragment. Fragments repeat a lot in agent prompts (JSON lines
        of tool schemas, the same system prompt in every request), so each distinct fragment
        is encoded once per call and remembered across calls (FIFO, bounded by characters)."""
        cache = self._frag_cache
        local: dict[str, Sequence[int]] = {}
        missing: list[str] = []
        for r in dict.fromkeys(raw):
            hit = cache.get(r)
            if hit is None:
                missing.append(r)
            else:
                local[r] = hit
        if missing:
            try:
                encs = self._encode_raw(missing)
            except (UnicodeEncodeError, TypeError):  # lone surrogates
                encs = self._encode_raw(
                    [m.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for m in missing])
            new = {m: array("i", e) for m, e in zip(missing, encs)}
            local.update(new)
            with self._frag_lock:
                for m, ids in new.items():
                    if len(m) <= _FRAGMENT_CACHE_CHARS // 4 and m not in cache:
                        cache[m] = ids
                        self._frag_chars += len(m)
                while self._frag_chars > _FRAGMENT_CACHE_CHARS and cache:
                    oldest = next(iter(cache))
                    del cache[oldest]
                    self._frag_chars -= len(oldest)
        return [local[r] for r in raw]

    def _encode_raw(self, raw: list[str]) -> list[list[int]]:
        # `encode` holds the GIL for the whole call (~0.2 s per 250K characters of SPM text),
        # which stalls a server's event loop; the batch call releases it. Same ids.
        if len(raw) == 1 and len(raw[0]) <= _GIL_FREE_CHARS:
            return [self._hf.encode(raw[0], add_special_tokens=False).ids]
        return [e.ids for e in self._encode_batch(raw, add_special_tokens=False)]

    def encode_batch(self, texts: Sequence[str], add_special: bool = True,
                     parse_special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special, parse_special) for t in texts]

    # ---- decoding -----------------------------------------------------------------------------

    def _validate(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} out of range [0, {self.vocab_size})")

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """llama.cpp `common_token_to_piece(token, special)` as bytes. With `special` False,
        control and unknown tokens give b"". A byte token gives its single (maybe partial
        UTF-8) byte."""
        self._check_id(token_id)
        return (self._pieces if special else self._pieces_plain)[token_id]

    def token_to_piece(self, token_id: int, special: bool = True) -> str:
        """`token_to_bytes` decoded as UTF-8 (invalid bytes -> U+FFFD). llama-server's
        /tokenize `with_pieces` reports a piece that is not valid UTF-8 as a list of byte
        values: use `token_to_bytes` for that."""
        return self.token_to_bytes(token_id, special).decode("utf-8", "replace")

    def concat_pieces(self, ids: Sequence[int], special: bool = True) -> bytes:
        """The pieces of `ids` concatenated (what llama-server's /detokenize returns)."""
        self._validate(ids)
        table = self._pieces if special else self._pieces_plain
        return b"".join([table[i] for i in ids])

    def detokenize(self, ids: Sequence[int], remove_special: bool = False,
                   unparse_special: bool = True) -> bytes:
        """llama.cpp `llama_detokenize`, as bytes: drops a leading BOS / trailing EOS when
        `remove_special` (and the model adds them), strips the SentencePiece leading space of
        the first token when the model adds a space prefix, renders control tokens only when
        `unparse_special`, and applies `clean_up_tokenization_spaces` where the model asks."""
        ids = list(ids)
        self._validate(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        table = self._pieces if unparse_special else self._pieces_plain
        if not ids:
            return b""
        first = table[ids[0]]
        if remove_space and first.startswith(b" "):
            first = first[1:]
        text = first + b"".join([table[i] for i in ids[1:]])
        if self.clean_spaces:
            text = _clean_spaces(text)
        return text

    def decode(self, ids: Sequence[int], skip_special: bool = False,
               remove_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp `common_detokenize(ids, special=not skip_special)`.
        Invalid UTF-8 (e.g. a cut-off multi-byte character) becomes U+FFFD."""
        return self.detokenize(ids, remove_special, not skip_special).decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


def _release_freed_memory() -> None:
    """Hand the heap freed by construction's temporaries back to the OS (glibc only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:
        pass


def _read_metadata(path: Path) -> dict[str, Any]:
    from kvshare.model.gguf_file import read_metadata

    return read_metadata(path)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(path: str, size: int, mtime_ns: int) -> Tokenizer:
    return Tokenizer(_read_metadata(Path(path)))


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's three `clean_spaces` passes, byte for byte."""
    t = bytearray(text)
    if not t:
        return b""
    # pass 1: " ?", " !", " .", " ,"
    out = bytearray(t[:1])
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    t = out
    # pass 2: " ' " -> "'" (the space after the apostrophe is skipped and zeroed, so it no
    # longer counts as a space for the next character)
    out = bytearray(t[:1])
    n = len(t)
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()
            i += 1
            t[i] = 0
        out.append(x)
        i += 1
    t = out
    # pass 3: " 's", " 'm", " 're", " 've"
    out = bytearray(t[:1])
    n = len(t)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n:
                x2 = t[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):
                    out.pop()
        out.append(x)
    return bytes(out)


class StreamDecoder:
    """Incremental detokenizer for streaming: `feed(id)` returns the text that became complete
    (a multi-byte character split over byte tokens is held back until its last byte arrives);
    `flush()` returns whatever is left (an incomplete character becomes U+FFFD).

    With `skip_special` (the default, as llama-server streams), control tokens render as "".
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._table = tokenizer._pieces_plain if skip_special else tokenizer._pieces
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        self._tok._check_id(token_id)
        return self._dec.decode(self._table[token_id])

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in ids)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """True while an incomplete UTF-8 character is buffered."""
        return bool(self._dec.getstate()[0])


def prefix_token_count(tokenizer: Tokenizer, text: str, char_offset: int,
                       ids: Sequence[int] | None = None, *, add_special: bool = True,
                       parse_special: bool = True) -> int:
    """Token position in `encode(text)` that corresponds to the character offset `char_offset`.

    When no token can span the offset (it is a special-token split point, e.g. right after
    Gemma's "\n" token), this is the token count of `text[:char_offset]` (memoised; the whole
    text is not tokenized). Otherwise the prefix's tokens are compared with the whole text's
    (pass `ids` if you have them): their count if they are a prefix, else the length of the
    longest common prefix, the largest position at which the two tokenizations still agree.
    A trailing EOS the model appends is not counted.
    """
    if tokenizer.is_split_point(text, char_offset, parse_special):
        return tokenizer.prefix_length(text[:char_offset], add_special, parse_special)
    if ids is None:
        ids = tokenizer.encode(text, add_special, parse_special)
    pre = tokenizer.encode(text[:char_offset], add_special, parse_special)
    if add_special and tokenizer.add_eos and pre and pre[-1] == tokenizer.eos_id:
        pre = pre[:-1]
    n = min(len(pre), len(ids))
    if list(ids[:len(pre)]) == pre:
        return len(pre)
    k = 0
    while k < n and ids[k] == pre[k]:
        k += 1
    return k
