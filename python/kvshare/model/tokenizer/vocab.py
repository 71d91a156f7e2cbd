"""The vocabulary as GGUF metadata describes it, shared by every tokenizer family: token types,
llama.cpp's token attributes, the special token ids, and llama.cpp's text-based detection of
end-of-turn, fill-in-the-middle and end-of-generation tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np

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

TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}

# Token texts llama.cpp recognises (llama-vocab.cpp, `load`): end-of-turn candidates, FIM
# tokens that also end generation, and the end-of-generation list. Tokens found here that are
# not control tokens are promoted to control tokens, as llama.cpp does.
EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
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
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
ALWAYS_RENDER_TEXTS = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))

# `tokenizer.ggml.<key>_token_id` keys and the names the tokenizer uses for them (the GGUF key
# "seperator" is spelled that way)
_ID_KEYS = {"bos": "bos", "eos": "eos", "unknown": "unk", "padding": "pad", "eot": "eot",
            "eom": "eom", "seperator": "sep", "mask": "mask"}


class TokenizerError(ValueError):
    """The GGUF metadata describes a tokenizer we cannot build, or a call got bad input."""


class Defaults(NamedTuple):
    """llama.cpp's defaults for one tokenizer family, before the metadata overrides them."""

    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    ids: Mapping[str, int | None]  # "bos", "eos", "unk"


@dataclass
class Specials:
    """The special tokens of a vocabulary, as llama.cpp settles them at load time."""

    attrs: list[int]  # llama.cpp attribute bits per token id
    ids: dict[str, int | None]  # "bos", "eos", "unk", "pad", "eot", "eom", "sep", "mask"
    fim: dict[str, int | None]  # "pre", "suf", "mid", "pad", "rep", "sep"
    eog: set[int]  # the tokens that end generation
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


def read_vocabulary(meta: Mapping[str, Any]) -> tuple[list[str], np.ndarray, list[int]]:
    """Token texts (an empty text becomes "[EMPTY_<id>]", as in llama.cpp), scores and GGUF
    token types from the metadata."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    n = len(tokens)
    texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) < n:
        raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and len(types) < n:
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    score_array = np.asarray(scores[:n] if scores is not None else np.zeros(n), np.float64)
    type_list = list(types[:n]) if types is not None else [TOKEN_TYPE_NORMAL] * n
    return texts, score_array, type_list


def read_specials(meta: Mapping[str, Any], texts: list[str], types: list[int],
                  token_to_id: Mapping[str, int], defaults: Defaults) -> Specials:
    """Special token ids, BOS / EOS / space-prefix flags and token attributes: the family's
    `defaults`, overridden by the metadata, then llama.cpp's text-based detection."""
    n = len(texts)
    attrs = [TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in types]
    ids = {k: (v if v is not None and v < n else None) for k, v in defaults.ids.items()}
    for key, name in _ID_KEYS.items():
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None and 0 <= int(v) < n:
            ids[name] = int(v)
        else:
            ids.setdefault(name, None)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", defaults.add_space_prefix))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", defaults.add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", defaults.add_eos))
    if add_bos and ids["bos"] is None:
        raise TokenizerError("tokenizer.ggml.add_bos_token is true but there is no BOS token")
    if add_eos and ids["eos"] is None:
        raise TokenizerError("tokenizer.ggml.add_eos_token is true but there is no EOS token")
    fim = _detect_by_text(meta, texts, attrs, ids, token_to_id)
    eog = _eog_set(texts, attrs, ids, fim, token_to_id)
    return Specials(attrs, ids, fim, eog, add_bos, add_eos, add_space_prefix)


def _detect_by_text(meta: Mapping[str, Any], texts: list[str], attrs: list[int],
                    ids: dict[str, int | None], tti: Mapping[str, int]) -> dict[str, int | None]:
    """llama.cpp's text-based detection of EOT, EOM and FIM tokens (filling `ids` where the
    metadata names none, and promoting the tokens found to control tokens); the FIM ids."""
    n = len(texts)

    def find(cands: Iterable[str]) -> int | None:
        for c in cands:
            if c in tti:
                attrs[tti[c]] |= ATTR_CONTROL
                return tti[c]
        return None

    if ids["eot"] is None:
        ids["eot"] = find(EOT_TEXTS)
    if ids["eom"] is None:
        ids["eom"] = find(EOM_TEXTS)
    fim = {k: find(v) for k, v in FIM_TEXTS.items()}
    for k in fim:  # the GGUF's own ids win over the text-based detection
        v = meta.get(f"tokenizer.ggml.fim_{k}_token_id")
        if v is not None and 0 <= int(v) < n:
            fim[k] = int(v)
    for i, t in enumerate(texts):
        if attrs[i] & ATTR_CONTROL and "unused" in t:
            attrs[i] |= ATTR_UNUSED
    return fim


def _eog_set(texts: list[str], attrs: list[int], ids: Mapping[str, int | None],
             fim: Mapping[str, int | None], tti: Mapping[str, int]) -> set[int]:
    """llama.cpp's end-of-generation set (adjusting `attrs` as llama.cpp does)."""
    eog = {fim[k] for k in ("pad", "rep", "sep") if fim[k] is not None}
    for t in EOG_TEXTS:
        if t in tti:
            eog.add(tti[t])
            attrs[tti[t]] |= ATTR_CONTROL
    for t in ALWAYS_RENDER_TEXTS:
        if t in tti:
            attrs[tti[t]] = ATTR_USER_DEFINED
    eog.update(v for v in (ids["eos"], ids["eot"], ids["eom"]) if v is not None)
    eog_texts = {texts[i]: i for i in eog}
    # where a vocabulary also has "<|return|>" or "<|flush|>" and a call token, "<|end|>" ends
    # a message, not the generation
    calls = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    if "<|end|>" in eog_texts and calls and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
    if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = ATTR_NORMAL
    return eog
