"""Tokenizer built from GGUF metadata, token-for-token identical to llama.cpp.

Two GGUF tokenizer models (families) are supported, one module each:

* ``llama`` (SentencePiece-style, "SPM"), `spm`: llama.cpp's merge-by-score loop expressed as a
  HuggingFace ``tokenizers`` BPE model with byte fallback.
* ``gpt2`` (byte-level BPE), `bpe`: the GGUF merges as a ``tokenizers`` BPE model behind the
  llama.cpp pre-tokenizer regexes of the file's ``tokenizer.ggml.pre`` and GPT-2 byte mapping.

Shared by both: `vocab` (token types and attributes, special token ids, llama.cpp's text-based
end-of-generation detection), `special` (special tokens are split out before either model
runs, as llama.cpp's ``tokenizer_st_partition`` does: control, unknown and user-defined tokens
when ``parse_special`` is on, user-defined tokens only when it is off; see `SpecialSplitter`)
and `decode` (llama.cpp's ``token_to_piece`` / ``llama_detokenize`` clean-up and
`StreamDecoder`). `core` holds `Tokenizer`, which builds the family's model and encodes and
decodes, and `prefix_token_count`. ``docs/model.md`` describes the design and the known
theoretical differences.
"""

from kvshare.model.tokenizer.core import Tokenizer, prefix_token_count
from kvshare.model.tokenizer.decode import StreamDecoder
from kvshare.model.tokenizer.vocab import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    TokenizerError,
)

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
