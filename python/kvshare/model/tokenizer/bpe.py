"""The byte-level BPE family (GGUF tokenizer model ``gpt2``: Llama 3, Qwen, LFM2, ...).

The GGUF merges become a ``tokenizers`` BPE model behind the llama.cpp pre-tokenizer regexes
of the file's ``tokenizer.ggml.pre`` and GPT-2's byte -> character mapping.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from kvshare.model.tokenizer.vocab import Defaults, TokenizerError

log = logging.getLogger(__name__)

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


class PreTokenizer:
    """A BPE pre-tokenizer setting: regexes applied in turn, and llama.cpp's flags for it."""

    def __init__(self, regexes, ignore_merges=False, add_bos=False, clean_spaces=True):
        self.regexes = tuple(regexes)
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos
        self.clean_spaces = clean_spaces


_PRE_DEFAULT = PreTokenizer(_RX_DEFAULT)
_PRE_LLAMA3 = PreTokenizer((_RX_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_QWEN2 = PreTokenizer((_RX_QWEN2,), clean_spaces=False)
_PRE_TYPES: dict[str, PreTokenizer] = {
    "default": _PRE_DEFAULT,
    **{k: _PRE_LLAMA3 for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                "pixtral", "midm-2.0", "lfm2")},
    **{k: PreTokenizer((_RX_LLAMA3,)) for k in ("dbrx", "smaug-bpe")},
    **{k: _PRE_QWEN2 for k in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "megrez": PreTokenizer((_RX_QWEN2,)),
    "stablelm2": PreTokenizer((_RX_QWEN2,)),
    "qwen35": PreTokenizer((_RX_QWEN35,), clean_spaces=False),
    **{k: PreTokenizer((_RX_GPT2,)) for k in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat",
                                              "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
                                              "modern-bert", "exaone4", "mpt", "olmo", "jais")},
    **{k: PreTokenizer((r"\p{N}", _RX_GPT2)) for k in ("starcoder", "refact", "codeshell",
                                                       "exaone", "minerva-7b")},
    **{k: PreTokenizer((r"\p{N}", _RX_GPT2), clean_spaces=False)
       for k in ("command-r", "smollm")},
    "tekken": PreTokenizer((
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?"
        r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True, add_bos=True, clean_spaces=False),
}


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


BYTE_TO_CHAR = _gpt2_byte_table()
_CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


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


def pre_tokenizer(name: str) -> PreTokenizer:
    """The setting for a `tokenizer.ggml.pre` value."""
    pre = _PRE_TYPES.get(name)
    if pre is None:
        raise TokenizerError(
            f"unsupported gpt2 pre-tokenizer {name!r}; supported: " + ", ".join(sorted(_PRE_TYPES)))
    return pre


def bpe_defaults(pre: PreTokenizer) -> Defaults:
    """llama.cpp's defaults for a byte-level BPE vocabulary with this pre-tokenizer."""
    return Defaults(add_bos=pre.add_bos, add_eos=False, add_space_prefix=False,
                    clean_spaces=pre.clean_spaces, ids={"bos": 11, "eos": 11, "unk": None})


def bpe_pieces(texts: Sequence[str]) -> list[bytes]:
    """What each token renders as when it is a normal token (its byte-level text as bytes)."""
    return [_gpt2_decode_text(t) for t in texts]


def build_bpe(meta: Mapping[str, Any], token_to_id: Mapping[str, int], pre: PreTokenizer) -> HFTokenizer:
    """The `tokenizers` model: the GGUF merges whose parts and result are tokens, behind `pre`."""
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges is None:
        raise TokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
    vocab = dict(token_to_id)
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
    bpe = hf_models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges,
                        fuse_unk=False, byte_fallback=False)
    hf = HFTokenizer(bpe)
    steps = [hf_pre.Split(Regex(rx), behavior="isolated") for rx in pre.regexes]
    steps.append(hf_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
    hf.pre_tokenizer = hf_pre.Sequence(steps)
    return hf
