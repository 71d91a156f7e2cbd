"""Validation before generation (issue 45, item 4): request fields that can fail are refused at
parse time with a 4xx in the API's shape, and constraints are size-checked and compiled (their
first steps run) before the request is queued (kvshare/constraint_limits.py,
kvshare/constrain.py `probe_grammar`, the GBNF rule limit). Fake engine for the shapes, the tiny
qwen3 vocabulary for llguidance, a real server for the end-to-end refusals and their time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kvshare.constraint_limits import (MAX_GBNF_RULES, MAX_NESTING, MAX_PREDICTED_ITEMS,
                                       ConstraintLimitError, check_schema)
from kvshare.server.app import create_app
from kvshare.server.settings import ServerSettings
from fake_engine import FakeEngine
from tier_helpers import TINY_MODEL, Server

SELF_REF = {"$ref": "#"}
CHAIN_8000 = ("root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(8000))
              + 'r8000 ::= "x"\n')


def wide(n: int, alts: str = "abcde") -> str:
    """`n` chained rules of left-recursive alternatives: under the rule limit, but every
    alternative of every rule is predicted where the first one starts."""
    return ("root ::= r0\n" + "".join(
        f"r{i} ::= " + " | ".join(f'r{i + 1} "{c}"' for c in alts) + "\n" for i in range(n))
        + f'r{n} ::= "x"\n')


# five alternatives a rule fill an Earley row past llguidance's 2,000 items at the first token
WIDE_450 = wide(450)
# its Lark conversion, as llguidance gets it (the GBNF is refused before conversion now): the
# last two rules are terminals
WIDE_450_LARK = ("start: r0\n" + "".join(
    f"r{i}: " + " | ".join(f'{"R" if i == 448 else "r"}{i + 1} "{c}"' for c in "abcde") + "\n"
    for i in range(449)) + 'R449: R450 "a" | R450 "b" | R450 "c" | R450 "d" | R450 "e"\n'
    + 'R450: "x"\n')

def raw_post(c, path: str, text: str):
    return c.post(path, content=text, headers={"content-type": "application/json"})


# --------------------------------------------------------------------------- parse time

@pytest.fixture
def fake():
    engine = FakeEngine(ctx_size=4096)
    with TestClient(create_app(engine, ServerSettings())) as c:
        yield engine, c


@pytest.mark.parametrize("ptype", [{"a": 1}, ["input_text"], [], {}, None, 3])
def test_responses_content_part_type_must_be_a_string(fake, ptype):
    engine, c = fake
    body = {"input": [{"role": "user", "content": [{"type": ptype, "text": "hi"}]}],
            "max_output_tokens": 2}
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input[0].content[0].type" and err["code"] == "invalid_type"
    assert not engine.requests


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_in_echoed_fields(fake, value):
    engine, c = fake
    for field in ('"reasoning": {"effort": %s}', '"reasoning": {"summary": %s}',
                  '"metadata": {"a": %s}',
                  '"tools": [{"type": "function", "name": "f", "parameters": '
                  '{"type": "object", "maximum": %s}}]'):
        text = '{"input": "hi", "max_output_tokens": 2, ' + field % value + "}"
        r = raw_post(c, "/v1/responses", text)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert not engine.requests  # refused before anything was generated


def test_reasoning_values(fake):
    engine, c = fake
    for reasoning in ({"effort": "extreme"}, {"effort": 3}, {"summary": ["auto"]}):
        r = c.post("/v1/responses", json={"input": "hi", "reasoning": reasoning})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                      "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] == "low"


def test_schema_shapes_refused_before_compiling(fake):
    """The fake engine cannot compile: a 400 here comes from the checks before it."""
    engine, c = fake
    deep: dict = {"type": "string"}
    for _ in range(MAX_NESTING):
        deep = {"type": "array", "items": deep}
    for schema, words in ((SELF_REF, "without a base case"), ({"type": [[]]}, "'type'"),
                          (deep, "the limit")):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}}}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert not engine.requests


# --------------------------------------------------------------------------- the checks

@pytest.mark.parametrize("schema", [
    SELF_REF,
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
     "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
])
def test_ref_cycles_without_base_case(schema):
    with pytest.raises(ConstraintLimitError, match="cycle without a base case"):
        check_schema(schema, "response_format")


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional: stops at {}
    {"$defs": {"t": {"anyOf": [{"type": "string"}, {"type": "array",
                                                   "items": {"$ref": "#/$defs/t"}}]}},
     "$ref": "#/$defs/t"},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["kids"]},  # an empty array ends it
    {"type": "object", "properties": {"type": {"type": "string"}, "$ref": {"enum": [1]}},
     "required": ["type"], "default": {"type": 5}},
])
def test_recursive_schemas_with_base_case(schema):
    check_schema(schema, "response_format")


def test_gbnf_rule_limit_is_fast_and_named():
    from kvshare.gbnf import gbnf_to_lark

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"8002 rules; at most {MAX_GBNF_RULES}"):
        gbnf_to_lark(CHAIN_8000)
    assert time.perf_counter() - t0 < 1.0


@pytest.fixture(scope="module")
def vocab():
    from kvshare.constrain import TokenVocab
    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(Path(__file__).parent / "data" / "models" /
                              "tiny-qwen3-chat.gguf")
    return TokenVocab.from_tokenizer(tok, len(tok), [tok.token_to_id("<|im_end|>")])


def test_probe_catches_what_llguidance_reports_late(vocab):
    from kvshare.constrain import GrammarError, compile_grammar
    from kvshare.gbnf import gbnf_to_lark
    from kvshare.server.constraints import output_schema_text

    with pytest.raises(GrammarError, match="NoExtensionBias"):
        compile_grammar(vocab, "json_schema", output_schema_text({"$ref": "#"}))
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="max is 2000"):
        compile_grammar(vocab, "lark", WIDE_450_LARK)
    assert time.perf_counter() - t0 < 1.0
    compile_grammar(vocab, "json_schema", output_schema_text({"type": "object"}))
    compile_grammar(vocab, "lark", gbnf_to_lark('root ::= "a" [0-9]+'))


PREDICTION_LIMIT = f"at most {MAX_PREDICTED_ITEMS} are accepted (the limit)"


@pytest.mark.parametrize("text", [WIDE_450, wide(120, "abcdefghijklmnopqrstuvwxyz"),
                                  wide(990, "abc"),
                                  # left recursion: a rule predicts itself once
                                  "root ::= r0\n" + "".join(
                                      f"r{i} ::= r{(i + 1) % 420} \"a\" | r{i} \"b\" | "
                                      f"r{(i + 7) % 420} \"c\" | \"d\" | \"e\"\n"
                                      for i in range(420))])
def test_grammars_that_overflow_a_parser_row_are_refused_before_conversion(text):
    """Refused by the static estimate (gbnf/earley.py) with a message naming the limit, not
    after the lexeme passes by llguidance's probe (bench/constraint_refusal.py times both)."""
    from kvshare.gbnf import GBNFError, gbnf_to_lark

    with pytest.raises(GBNFError, match=f"more than {MAX_PREDICTED_ITEMS} parser items") as e:
        gbnf_to_lark(text)
    assert PREDICTION_LIMIT in str(e.value)


def test_the_prediction_estimate_leaves_real_grammars_far_below_the_limit():
    """llama.cpp's grammars and a wide grammar at half the limit pass the static check."""
    from kvshare.gbnf.analysis import analyse
    from kvshare.gbnf.earley import predicted_items
    from kvshare.gbnf.parse import Parser

    def estimate(text: str) -> int:
        p = Parser(text, None)
        p.parse()
        analyse(p.rules, p.order)
        return predicted_items(p.rules, MAX_PREDICTED_ITEMS)[0]

    found = sorted((Path(__file__).parent / "data" / "gbnf").glob("*.gbnf"))
    assert len(found) >= 8
    for path in found:
        assert estimate(path.read_text()) <= 16, path.name
    # the chain of test_gbnf.py's deep-rule test: literals first, two items a rule
    chain = 'root ::= r0 ("(" root ")")?\n' + "".join(
        f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(800)) + 'r800 ::= "z"\n'
    assert estimate(chain) < 10
    # 200 rules of five: every rule past the 32-deep terminal chain is a parser rule
    assert 800 < estimate(wide(200)) < MAX_PREDICTED_ITEMS


# --------------------------------------------------------------------------- a real server

@pytest.mark.skipif(not TINY_MODEL.exists(), reason="run tests/data/make_tiny_qwen3_chat.py")
def test_real_server_refuses_at_submit(launcher, tmp_path):
    s = Server(launcher, "--ctx-size", "1024", "--parallel", "2",
               "--slot-save-path", str(tmp_path))
    try:
        cases = [
            ("/completion", {"prompt": "x", "n_predict": 4, "json_schema": SELF_REF}, None),
            ("/completion", {"prompt": "x", "n_predict": 4, "grammar": CHAIN_8000},
             f"at most {MAX_GBNF_RULES}"),
            ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                            "$ref": "#/$defs/a"}}}}, "base case"),
        ]
        for path, body, words in cases:
            t0 = time.perf_counter()
            r = s.client.post(path, json=body)
            dt = time.perf_counter() - t0
            print(f"{path} refused in {dt * 1e3:.0f} ms: {r.json()['error']['message'][:90]}")
            assert r.status_code == 400, r.text
            assert dt < 1.0
            if words:
                assert words in r.json()["error"]["message"]
        # under the rule limit, over the parser-row limit: refused before conversion (its
        # time: bench/constraint_refusal.py)
        r = s.client.post("/completion", json={"prompt": "x", "n_predict": 4,
                                               "grammar": WIDE_450})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
        assert PREDICTION_LIMIT in r.json()["error"]["message"], r.text
        for text in ('{"input": "hi", "reasoning": {"effort": NaN}}',
                     '{"input": [{"role": "user", "content": [{"type": {"x": 1}}]}]}'):
            r = raw_post(s.client, "/v1/responses", text)
            assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        (tmp_path / "adir").mkdir()
        assert s.client.post("/completion", json={"prompt": "x", "n_predict": 1,
                                                  "id_slot": 0}).status_code == 200
        assert s.client.post("/slots/0?action=save",
                             json={"filename": "adir"}).status_code == 400
        assert s.client.post("/slots/0?action=restore",
                             json={"filename": "adir"}).status_code == 404
        r = s.client.post("/completion", json={"prompt": "x", "n_predict": 3,
                                                "json_schema": {"type": "object"}})
        assert r.status_code == 200, r.text  # a sound schema still generates
    finally:
        s.kill9()
