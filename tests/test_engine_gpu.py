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


def test_greedy_tokens_with_cuda_graphs_equal_eager():
    """Three requests decoding together (a batch of 3, the graph of 4) and one alone: the
    greedy tokens with decode steps as CUDA graphs are those of eager steps."""
    from kvshare.engine.api import TokenEvent  # noqa: PLC0415
    from kvshare.model import gpu_graphs  # noqa: PLC0415

    got = {}
    for graphs in (False, True):
        eng = _engine("cuda")
        eng.model.cuda_graphs = graphs
        handles = []
        for q in ("Name three colours.", "Count to five.", "Say hi."):
            prompt = eng.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
            handles.append(eng.submit(GenerationRequest(
                prompt_tokens=prompt, max_tokens=12, ignore_eos=True,
                sampling=SamplingParams(temperature=0.0))))
        eng.run_until_idle()
        got[graphs] = [[e.token_id for e in h.events(timeout=0)
                        if isinstance(e, TokenEvent) and e.token_id >= 0] for h in handles]
        if graphs:
            r = gpu_graphs.runner(eng.model)
            assert r is not None and not r.failures and r.replays > 0
    assert got[True] == got[False]
    assert all(len(t) == 12 for t in got[True])


def test_a_started_engine_captures_the_agent_shapes_before_its_first_request():
    """The engine's thread captures the step graphs an agent server meets first
    (`Model.warm_up`) before it takes a request; the greedy replies are the eager engine's."""
    from kvshare.engine.api import TokenEvent  # noqa: PLC0415
    from kvshare.model import gpu_graphs  # noqa: PLC0415
    from kvshare.model.base import make_plan  # noqa: PLC0415

    got = {}
    for graphs in (False, True):
        model = load_model(MODEL, device="cuda")
        model.cuda_graphs = graphs
        tok = Tokenizer.from_gguf(MODEL)
        cfg = EngineConfig(kv_blocks=128, block_size=16, device="cuda", prefill_chunk=64)
        eng = Engine(model, tok, ChatTemplate.from_gguf(MODEL, tok),
                     bytes.fromhex(model.fingerprint), cfg)
        eng.start()
        try:
            handles = []
            for q in ("Name three colours.", "Count to five."):
                prompt = eng.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
                handles.append(eng.submit(GenerationRequest(
                    prompt_tokens=prompt, max_tokens=6, ignore_eos=True,
                    sampling=SamplingParams(temperature=0.0))))
            got[graphs] = [[e.token_id for e in h.events(timeout=120)
                            if isinstance(e, TokenEvent) and e.token_id >= 0] for h in handles]
        finally:
            eng.shutdown()
        r = gpu_graphs.runner(model)
        if not graphs:
            assert r is None
            continue
        steps = gpu_graphs.warm_up_steps(eng.kv, cfg.parallel, cfg.prefill_chunk)
        shapes = {r.step_shape(s, eng.kv, make_plan(s, eng.kv.block_size, model.config))
                  for s in steps}
        assert len(shapes) == 10 and shapes <= set(r.graphs) and not r.failures
        assert r.replays > 0
    assert got[True] == got[False] and all(len(t) == 6 for t in got[True])
