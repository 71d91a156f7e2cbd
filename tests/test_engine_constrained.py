"""Constrained decoding in the engine (default Gemma model): constrained and unconstrained
sequences share a batch, the constrained ones follow their grammar, the others are untouched
(token for token what they produce alone), and a grammar that ends ends its sequence."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import default_model_path, load_model
from kvshare.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"enum": ["metric", "imperial"]}},
    "required": ["city", "days", "units"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@pytest.fixture(scope="module")
def parts():
    path = default_model_path()
    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    return model, tok, ChatTemplate.from_gguf(path, tok), bytes.fromhex(model.fingerprint)


def make_engine(parts) -> Engine:
    model, tok, tmpl, fp = parts
    # f32 KV: "the free sequence is exactly what it is alone" holds bit for bit in f32; with
    # the default f16 pool a K/V value computed in another batch can round the other way,
    # and a token sampled at temperature 0.9 may then differ
    return Engine(model, tok, tmpl, fp, EngineConfig(kv_blocks=256, block_size=16,
                                                     kv_dtype="f32"))


def prompt(parts, user: str) -> list[int]:
    _, tok, tmpl, _ = parts
    return tok.encode(tmpl.render([{"role": "user", "content": user}]))


def collect(handle):
    events = list(handle.events(timeout=0))
    fin = [e for e in events if isinstance(e, FinishEvent)][0]
    return "".join(e.text for e in events if not isinstance(e, FinishEvent)), \
        [e.token_id for e in events if not isinstance(e, FinishEvent) and e.token_id >= 0], fin


def test_constrained_and_free_sequences_share_a_batch(parts):
    eng = make_engine(parts)
    grammar = eng.compile_grammar("json_schema", json.dumps(SCHEMA))
    free_prompt = prompt(parts, "Tell me about the sea.")
    json_prompt = prompt(parts, "Weather in Oslo for 3 days, as JSON.")
    sampling = SamplingParams(temperature=0.9, seed=4)
    handles = [
        eng.submit(GenerationRequest(prompt_tokens=json_prompt, max_tokens=60, grammar=grammar,
                                     sampling=sampling)),
        eng.submit(GenerationRequest(prompt_tokens=free_prompt, max_tokens=12, ignore_eos=True,
                                     sampling=sampling)),
        eng.submit(GenerationRequest(prompt_tokens=json_prompt, max_tokens=60, grammar=grammar,
                                     sampling=SamplingParams(temperature=0.0))),
    ]
    eng.run_until_idle()
    (t0, _, f0), (_, free_ids, _), (t2, _, f2) = map(collect, handles)
    for text, fin in ((t0, f0), (t2, f2)):
        assert fin.reason == "stop", (fin, text)  # the grammar ended the sequence
        jsonschema.validate(json.loads(text), SCHEMA)
    # the unconstrained sequence is exactly what it is alone
    solo = make_engine(parts)
    h = solo.submit(GenerationRequest(prompt_tokens=free_prompt, max_tokens=12, ignore_eos=True,
                                      sampling=sampling))
    solo.run_until_idle()
    assert collect(h)[1] == free_ids
    eng.pool.check_invariants()


def test_grammar_masks_every_sampler_setting(parts):
    """The mask comes before top-k/top-p/min-p/penalties: even filters that would keep only
    tokens the grammar forbids draw from the allowed ones."""
    eng = make_engine(parts)
    grammar = eng.compile_grammar("regex", "(yes|no)")
    for sampling in (SamplingParams(temperature=2.0, top_k=1, seed=1),
                     SamplingParams(temperature=1.0, top_p=0.01, min_p=0.9, seed=2),
                     SamplingParams(temperature=1.0, repetition_penalty=5.0, seed=3)):
        h = eng.submit(GenerationRequest(prompt_tokens=prompt(parts, "Hi"), max_tokens=8,
                                         grammar=grammar, sampling=sampling))
        eng.run_until_idle()
        text, _, fin = collect(h)
        assert text in ("yes", "no") and fin.reason == "stop", (text, fin)
