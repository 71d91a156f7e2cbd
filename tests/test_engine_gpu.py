"""The agent features on the GPU backend (`device="cuda"`): constrained decoding (the grammar
mask applied to logits that come from the device) and `n` choices forking from one prefill
(blocks shared and copied in device memory). Marked `gpu`: skipped without a CUDA device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams
from kvshare.engine.engine import Engine, EngineConfig
from kvshare.model.chat_template import ChatTemplate
from kvshare.model.loader import load_model
from kvshare.model.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

MODEL = Path(__file__).parent / "data" / "models" / "tiny-qwen3-chat.gguf"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "tags", "n"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}


def _engine(device: str) -> Engine:
    model = load_model(MODEL, device=device)
    tok = Tokenizer.from_gguf(MODEL)
    return Engine(model, tok, ChatTemplate.from_gguf(MODEL, tok), bytes.fromhex(model.fingerprint),
                  EngineConfig(kv_blocks=128, block_size=16, device=device))


def _run(eng: Engine, req: GenerationRequest):
    h = eng.submit(req)
    eng.run_until_idle()
    events = list(h.events(timeout=0))
    text: dict[int, str] = {}
    for e in events:
        if not isinstance(e, FinishEvent):
            text[e.index] = text.get(e.index, "") + e.text
    return text, [e for e in events if isinstance(e, FinishEvent)]


def test_constrained_n_choices_on_gpu():
    eng = _engine("cuda")
    prompt = eng.tokenize("<|im_start|>user\nGive me a record.<|im_end|>\n<|im_start|>assistant\n")
    grammar = eng.compile_grammar("json_schema", json.dumps(SCHEMA))
    text, fins = _run(eng, GenerationRequest(
        prompt_tokens=prompt, max_tokens=80, n=3, grammar=grammar,
        sampling=SamplingParams(temperature=1.0, seed=11)))
    assert sorted(f.index for f in fins) == [0, 1, 2]
    by = {f.index: f for f in fins}
    assert by[0].timings.prompt_n == len(prompt)
    for i in (1, 2):
        assert by[i].timings.cache_n == len(prompt)
    for i in range(3):
        assert by[i].reason == "stop", (by[i], text.get(i))
        value = json.loads(text[i])
        assert set(value) == {"name", "tags", "n"} and 0 <= value["n"] <= 99
    eng.pool.check_invariants()
