"""The `Tokenizer` itself: builds the family's model from GGUF metadata, then encodes (special
tokens split out, raw fragments through the family's model, memoised) and decodes, as
llama.cpp's ``llama_tokenize`` / ``llama_detokenize`` do; and `prefix_token_count`."""

from __future__ import annotations

import functools
import threading
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvshare.model.tokenizer.bpe import bpe_defaults, bpe_pieces, build_bpe, pre_tokenizer
from kvshare.model.tokenizer.decode import StreamDecoder, clean_up_tokenization_spaces, piece_tables
from kvshare.model.tokenizer.special import splitters
from kvshare.model.tokenizer.spm import SPM_DEFAULTS, build_spm, spm_pieces
from kvshare.model.tokenizer.vocab import (ATTR_CONTROL, ATTR_UNKNOWN, TokenizerError, read_specials,
                                           read_vocabulary)

FRAGMENT_CACHE_CHARS = 4_000_000  # raw-text fragments remembered by Tokenizer.encode
GIL_FREE_CHARS = 8192  # longer single fragments are encoded by the batch call (no GIL held)


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
        texts, scores, types = read_vocabulary(meta)
        self.model: str = model
        self.architecture: str = str(meta.get("general.architecture", ""))
        tmpl = meta.get("tokenizer.chat_template")
        self.chat_template_source: str | None = tmpl if isinstance(tmpl, str) and tmpl.strip() else None
        self._texts: list[str] = texts
        self._scores = scores
        self._types: list[int] = types
        token_to_id = {t: i for i, t in enumerate(texts)}  # last wins

        # flags and special ids, with llama.cpp's defaults per family
        pre = None
        if model == "llama":
            self.pre = "default"
            defaults = SPM_DEFAULTS
        else:
            self.pre = str(meta.get("tokenizer.ggml.pre") or "default")
            pre = pre_tokenizer(self.pre)
            defaults = bpe_defaults(pre)
        specials = read_specials(meta, texts, types, token_to_id, defaults)
        attrs = specials.attrs
        self._attrs: list[int] = attrs
        self.vocab_size: int = len(texts)
        self.bos_id: int | None = specials.ids["bos"]
        self.eos_id: int | None = specials.ids["eos"]
        self.eot_id: int | None = specials.ids["eot"]
        self.eom_id: int | None = specials.ids["eom"]
        self.unk_id: int | None = specials.ids["unk"]
        self.pad_id: int | None = specials.ids["pad"]
        # fill-in-the-middle tokens ("pre", "suf", "mid", "pad", "rep", "sep" -> id or None)
        self.fim_ids: dict[str, int | None] = dict(specials.fim)
        self.stop_ids: frozenset[int] = frozenset(specials.eog)
        self.add_bos: bool = specials.add_bos
        self.add_eos: bool = specials.add_eos
        self.add_space_prefix: bool = specials.add_space_prefix
        self._prefix_space = model == "llama" and specials.add_space_prefix
        self.clean_spaces: bool = defaults.clean_spaces

        # special-token splitters (parse_special on / off)
        self._split_special, self._split_plain = splitters(texts, attrs)

        # pieces (llama.cpp token_to_piece with special=True, and what special=False renders)
        normal = spm_pieces(texts) if model == "llama" else bpe_pieces(texts)
        self._pieces, self._pieces_plain = piece_tables(normal, texts, attrs)

        # stand-in ids past the vocabulary -> the byte tokens that replace them (SPM only)
        self._fake: dict[int, list[int]] = {}
        if pre is None:
            self._hf, self._fake = build_spm(texts, attrs, scores, token_to_id, self.unk_id)
        else:
            self._hf = build_bpe(meta, token_to_id, pre)
        self._encode_batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        del token_to_id  # the HF model holds the same text -> id map
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

    # ---- vocabulary ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.vocab_size

    def token_text(self, token_id: int) -> str:
        """The token's vocabulary string (as stored in the GGUF file)."""
        return self._texts[self.check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id of the token whose vocabulary string is `text`, or None."""
        tid = self._hf.token_to_id(text)
        return tid if tid is not None and tid < self.vocab_size else None

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._types[self.check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens: the ones llama.cpp renders as empty text when
        special tokens are not rendered (user-defined tokens always render as their text)."""
        return bool(self._attrs[self.check_id(token_id)] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def is_eog(self, token_id: int) -> bool:
        """True if the token ends generation (llama.cpp's EOG set: EOS, EOT, ...)."""
        return token_id in self.stop_ids

    @property
    def bos_token(self) -> str:
        return self._texts[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._texts[self.eos_id] if self.eos_id is not None else ""

    def check_id(self, token_id: int) -> int:
        """`token_id`, or TokenizerError if it is not in the vocabulary."""
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
                    if len(m) <= FRAGMENT_CACHE_CHARS // 4 and m not in cache:
                        cache[m] = ids
                        self._frag_chars += len(m)
                while self._frag_chars > FRAGMENT_CACHE_CHARS and cache:
                    oldest = next(iter(cache))
                    del cache[oldest]
                    self._frag_chars -= len(oldest)
        return [local[r] for r in raw]

    def _encode_raw(self, raw: list[str]) -> list[list[int]]:
        # `encode` holds the GIL for the whole call (~0.2 s per 250K characters of SPM text),
        # which stalls a server's event loop; the batch call releases it. Same ids.
        if len(raw) == 1 and len(raw[0]) <= GIL_FREE_CHARS:
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
        self.check_id(token_id)
        return (self._pieces if special else self._pieces_plain)[token_id]

    def piece_table(self, special: bool = True) -> Sequence[bytes]:
        """Every token's `token_to_bytes(id, special)`, indexed by id (read-only)."""
        return self._pieces if special else self._pieces_plain

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
            text = clean_up_tokenization_spaces(text)
        return text

    def decode(self, ids: Sequence[int], skip_special: bool = False,
               remove_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp `common_detokenize(ids, special=not skip_special)`.
        Invalid UTF-8 (e.g. a cut-off multi-byte character) becomes U+FFFD."""
        return self.detokenize(ids, remove_special, not skip_special).decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def incremental_decoder(self, skip_special: bool = False) -> StreamDecoder | None:
        """A `StreamDecoder` whose output, fed `ids` one by one and flushed, is exactly
        `decode(ids, skip_special)` at every prefix (a streamed reply then costs O(1) a token
        instead of decoding the whole reply again); None where `decode` is not a plain
        concatenation of pieces (`clean_spaces`: a token can change the text before it)."""
        if self.clean_spaces:
            return None
        return StreamDecoder(self, skip_special, strip_space_prefix=self.add_space_prefix)


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
