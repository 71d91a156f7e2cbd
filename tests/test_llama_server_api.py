"""llama-server's native API on a real kvshare server (`kvshare serve` on a loopback port, the
default Gemma 3 270M model, `--parallel 2`): /completion with text, token-id and mixed
prompts, streamed and not; `n_probs` is the real top-n of the model's distribution (checked
against logits computed here with the same model); `cache_prompt: false` recomputes the
prompt; the assistant prefill continues the text; /props, /slots, /apply-template,
/chat/completions/input_tokens; slot save / restore / erase; /infill refused on a model
without fill-in-the-middle tokens (Gemma) and served on one with them (a random-weight tiny
Qwen3 whose GGUF names FIM tokens). Greedy decoding throughout, few tokens."""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from tier_helpers import Server

ROOT = Path(__file__).resolve().parents[1]
CTX = 2048
GREEDY = {"temperature": 0}
# a prompt of a few KV blocks (16 tokens each), so a cached prefix shows in cache_n
LONG = ("The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made across Europe. Scholars, merchants and clergy")


def _default_model() -> str:
    from kvshare.model.loader import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(launcher, slot_dir):
    s = Server(launcher, "--parallel", "2", "--kv-unified-per-slot", str(CTX),
               "--slot-save-path", str(slot_dir), model=_default_model())
    yield s
    s.terminate()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return server.client.post(path, json=body, **kw)


def complete(server, body: dict) -> dict:
    r = post(server, "/completion", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict, path: str = "/completion") -> list[dict]:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.split("\n\n"):
        if block:
            assert block.startswith("data: ") and block != "data: [DONE]", block
            events.append(json.loads(block[len("data: "):]))
    assert events and events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1])
    return events


def tokenize(server, text: str, add_special: bool = False) -> list[int]:
    r = post(server, "/tokenize", {"content": text, "add_special": add_special})
    return r.json()["tokens"]


def nonce() -> str:
    return uuid.uuid4().hex[:8]


# --------------------------------------------------------------------------- /completion

def test_prompt_forms_stream_and_not(server):
    """The same prompt as text, as token ids and mixed gives the same greedy completion,
    streamed or not; the stream's pieces add up to the whole."""
    text = f"Note {nonce()}: the capital of France is"
    ids = tokenize(server, text, add_special=True)
    split = text.index(" the capital")
    mixed = [*tokenize(server, text[:split], add_special=True), text[split:]]
    base = {"n_predict": 6, **GREEDY}
    ref = complete(server, {**base, "prompt": text, "return_tokens": True})
    assert ref["tokens_evaluated"] == len(ids) and ref["tokens_predicted"] == 6
    assert ref["prompt"] == "<bos>" + text and ref["stop_type"] == "limit"
    assert len(ref["tokens"]) == 6 and ref["content"]
    assert ref["tokens_cached"] == len(ids) + 6 - 1
    for prompt in (ids, mixed):
        d = complete(server, {**base, "prompt": prompt})
        assert d["content"] == ref["content"] and d["tokens_evaluated"] == len(ids)
    for prompt in (text, ids):
        events = stream(server, {**base, "prompt": prompt})
        final = events[-1]
        assert "".join(e["content"] for e in events) == ref["content"]
        assert [t for e in events[:-1] for t in e["tokens"]] == ref["tokens"]
        assert final["content"] == "" and final["tokens_predicted"] == 6
        assert final["generation_settings"]["n_predict"] == 6


def test_stop_word_and_eos(server):
    d = complete(server, {"prompt": "Count: one, two, three,", "n_predict": 12,
                          "stop": [" five"], **GREEDY})
    assert d["stop_type"] == "word" and d["stopping_word"] == " five"
    assert " five" not in d["content"]
    d = complete(server, {"prompt": "<start_of_turn>user\nSay OK.<end_of_turn>\n"
                                    "<start_of_turn>model\n", "n_predict": 40, **GREEDY})
    assert d["stop_type"] in ("eos", "limit")


@pytest.fixture(scope="module")
def model():
    from kvshare.model.loader import load_model

    return load_model(_default_model())


def _logprobs(model, ids: list[int]) -> np.ndarray:
    from kvshare.model.batch import SeqChunk

    bs = 16
    cache = model.new_cache(-(-len(ids) // bs) + 1, bs)
    (logits,) = model.forward([SeqChunk(ids, 0, np.arange(-(-len(ids) // bs)),
                                        logits="all")], cache)
    x = logits.astype(np.float64)
    return x - (x.max(axis=1, keepdims=True)
                + np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)))


def test_n_probs_are_the_models_top_n(server, model):
    """Each generated token's `top_logprobs` are the n most likely tokens of the model's
    distribution at that position, in order, with their log-probabilities; the sampled
    (greedy) token is the first; the probabilities sum to at most 1."""
    text = "The three primary colors are"
    n, k = 4, 5
    d = complete(server, {"prompt": text, "n_predict": n, "n_probs": k, "return_tokens": True,
                          **GREEDY})
    probs = d["completion_probabilities"]
    assert len(probs) == n and [p["id"] for p in probs] == d["tokens"]
    ids = tokenize(server, text, add_special=True)
    lp = _logprobs(model, ids + d["tokens"][:-1])
    for i, p in enumerate(probs):
        row = lp[len(ids) - 1 + i]
        top = p["top_logprobs"]
        assert len(top) == k
        vals = [t["logprob"] for t in top]
        assert vals == sorted(vals, reverse=True)
        assert p["id"] == top[0]["id"] and p["logprob"] == pytest.approx(vals[0])
        assert sum(np.exp(vals)) <= 1.0 + 1e-4
        want = np.argsort(-row)[:k]
        kth = row[want[-1]]
        for t in top:  # each is the model's, and among its top k (up to near-ties)
            assert t["logprob"] == pytest.approx(row[t["id"]], abs=0.05), (i, t)
            assert row[t["id"]] >= kth - 0.05
        assert top[0]["id"] == int(want[0]) or row[want[0]] - row[top[0]["id"]] < 0.05
        for t in top:
            b = bytes(t["bytes"])
            assert t["token"] == b.decode("utf-8", errors="replace") or not t["token"]
    # the same numbers stream, one token at a time
    events = stream(server, {"prompt": text, "n_predict": n, "n_probs": k, **GREEDY})
    streamed = [e["completion_probabilities"][0] for e in events[:-1]]
    assert [s["id"] for s in streamed] == [p["id"] for p in probs]
    for s, p in zip(streamed, probs):
        assert [t["id"] for t in s["top_logprobs"]] == [t["id"] for t in p["top_logprobs"]]


def test_cache_prompt_false_recomputes(server):
    prompt = f"{nonce()} {LONG}"
    body = {"prompt": prompt, "n_predict": 2, **GREEDY}
    first = complete(server, body)
    n = first["tokens_evaluated"]
    assert n >= 32
    cached = complete(server, body)
    assert cached["timings"]["cache_n"] >= 16  # full blocks reused
    assert cached["timings"]["prompt_n"] == n - cached["timings"]["cache_n"]
    fresh = complete(server, {**body, "cache_prompt": False})
    assert fresh["timings"]["cache_n"] == 0 and fresh["timings"]["prompt_n"] == n
    assert fresh["content"] == cached["content"] == first["content"]
    assert fresh["tokens_cached"] == cached["tokens_cached"] == n + 2 - 1


# --------------------------------------------------------------------------- chat

def test_assistant_prefill_continues(server):
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, **GREEDY})
    assert r.status_code == 200, r.text
    d = r.json()
    content = d["choices"][0]["message"]["content"]
    assert d["system_fingerprint"].startswith("kvshare-")
    prompt = post(server, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert prompt.endswith("<start_of_turn>model\nThe capital of France is")
    # the same continuation as the raw prompt gives: the turn is open, the reply goes on
    raw = complete(server, {"prompt": prompt, "n_predict": 5, **GREEDY})
    assert content == raw["content"]
    assert d["usage"]["prompt_tokens"] == raw["tokens_evaluated"]
    # continue_final_message false: a new turn after the assistant's
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                              "continue_final_message": False, **GREEDY})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] > raw["tokens_evaluated"]


def test_apply_template_and_input_tokens(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = post(server, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert prompt.endswith("<start_of_turn>model\n") and "Be brief." in prompt
    n = len(tokenize(server, prompt, add_special=True))
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        assert post(server, path, {"messages": msgs}).json() == {
            "input_tokens": n, "object": "response.input_tokens"}
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == n


# --------------------------------------------------------------------------- props / slots

def test_props(server):
    d = server.client.get("/props").json()
    assert d["total_slots"] == 2 and d["default_generation_settings"]["n_ctx"] == CTX
    params = d["default_generation_settings"]["params"]
    assert params["temperature"] == 0.8 and params["top_k"] == 40 and params["n_predict"] == -1
    assert d["model_path"].endswith(".gguf") and "<start_of_turn>" in d["chat_template"]
    assert d["bos_token"] == "<bos>" and d["eos_token"] == "<eos>"
    assert d["build_info"].startswith("kvshare-")
    assert post(server, "/props", {}).status_code == 501


def test_slots_while_streaming(server):
    """A streaming request holds a slot (with kvshare's figures); it is idle again after."""
    body = {"prompt": f"{nonce()} Tell me a long story about a dragon.", "n_predict": 64,
            "stream": True, **GREEDY}
    seen = None
    with server.client.stream("POST", "/completion", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            slots = server.client.get("/slots").json()
            busy = [s for s in slots if s["is_processing"]]
            if busy and "kvshare" in busy[0]:
                seen = busy[0]
                break
    assert seen is not None
    assert seen["next_token"][0]["has_next_token"] is True
    assert seen["kvshare"]["sequences"][0]["n_prompt"] == seen["n_prompt_tokens"]
    assert seen["params"]["n_predict"] == 64 and seen["n_ctx"] == CTX
    for _ in range(200):
        slots = server.client.get("/slots").json()
        if not any(s["is_processing"] for s in slots):
            break
    assert len(slots) == 2 and not any(s["is_processing"] for s in slots)


def test_interrupted_stream_frees_its_slot(server):
    """A client that goes away mid-stream: the generation is cancelled, its slot is idle and
    the engine holds none of its blocks (what kvshare's other tests can poll for instead of
    an empty /slots list, which llama-server's shape never is)."""
    import time

    body = {"prompt": f"{nonce()} Write a very long story.", "n_predict": 200, "stream": True,
            **GREEDY}
    with server.client.stream("POST", "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 60
    while True:
        slots = server.client.get("/slots").json()
        used = server.client.get("/cache").json()["pool"]["used"]
        if not any(s["is_processing"] for s in slots) and used == 0:
            break
        assert time.monotonic() < deadline, (slots, used)
        time.sleep(0.05)
    assert slots[0]["next_token"][0]["n_decoded"] < 200


def test_slot_save_restore_erase(server, slot_dir):
    prompt = f"{nonce()} {LONG}"
    d = complete(server, {"prompt": prompt, "n_predict": 3, "id_slot": 0, **GREEDY})
    assert d["id_slot"] == 0
    r = post(server, "/slots/0?action=save", {"filename": "first.json"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["n_saved"] == d["tokens_evaluated"] + 3
    data = json.loads((slot_dir / "first.json").read_text())
    assert len(data["tokens"]) == saved["n_saved"]
    # a conversation the server never saw, restored into slot 1: computed into the cache
    fresh = tokenize(server, f"{nonce()} {nonce()} {LONG} {LONG}", add_special=True)
    (slot_dir / "fresh.json").write_text(json.dumps({**data, "tokens": fresh}))
    r = post(server, "/slots/1?action=restore", {"filename": "fresh.json"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == len(fresh) and r.json()["id_slot"] == 1
    d = complete(server, {"prompt": [*fresh, *tokenize(server, " and")], "n_predict": 1})
    assert d["timings"]["cache_n"] >= len(fresh) - 16  # all its full blocks were cached
    assert post(server, "/slots/1?action=erase", {}).json() == {"id_slot": 1,
                                                                 "n_erased": len(fresh)}
    r = post(server, "/slots/0?action=save", {"filename": "../escape"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_bad_requests_keep_serving(server):
    for path, body in (("/completion", {}), ("/completion", {"prompt": ["a", []]}),
                       ("/completion", {"prompt": "x", "samplers": ["bogus"]}),
                       ("/completion", {"prompt": [10**7]}),
                       ("/completion", {"prompt": "x", "grammar": "root ::= ["}),
                       ("/completion", {"prompt": "hello " * 2100}),
                       ("/infill", {"input_prefix": "a"}),
                       ("/apply-template", {"messages": 3})):
        r = post(server, path, body)
        assert r.status_code in (400, 501), (path, body, r.text)
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"] and err["type"]
    d = complete(server, {"prompt": "Hello", "n_predict": 2, **GREEDY})
    assert d["tokens_predicted"] == 2


# --------------------------------------------------------------------------- /infill

def test_infill_refused_without_fim_tokens(server):
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": "):\n"})
    assert r.status_code == 501
    assert r.json()["error"] == {
        "code": 501, "type": "not_supported_error",
        "message": "Infill is not supported by this model: prefix token is missing. suffix "
                   "token is missing. middle token is missing. "}


FIM = {"pre": 4, "suf": 5, "mid": 6}  # byte tokens of the tiny vocabulary, named FIM tokens


@pytest.fixture(scope="module")
def fim_server(launcher, tmp_path_factory):
    """A random-weight tiny Qwen3 (scripts/make_random_gguf.py) whose GGUF names FIM
    tokens (tokenizer.ggml.fim_*_token_id)."""
    from gguf import GGUFValueType

    spec = importlib.util.spec_from_file_location("make_random_gguf",
                                                  ROOT / "scripts" / "make_random_gguf.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    fields = gen.tokenizer_fields
    gen.tokenizer_fields = lambda p: fields(p) + [
        (f"tokenizer.ggml.fim_{k}_token_id", v, GGUFValueType.UINT32, None)
        for k, v in FIM.items()]
    path = tmp_path_factory.mktemp("fim") / "fim-tiny.gguf"
    gen.write(path, "qwen3", "tiny", ROOT / "tests" / "data" / "models" /
              "tiny-qwen3-chat.gguf", seed=0)
    s = Server(launcher, "--parallel", "1", "--ctx-size", "1024", model=path)
    yield s
    s.terminate()


def test_infill(fim_server):
    s = fim_server
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(1)\n",
            "prompt": "a +", "n_predict": 3, "return_tokens": True, "cache_prompt": False,
            **GREEDY}
    r = post(s, "/infill", body)
    assert r.status_code == 200, r.text
    d = r.json()
    # llama-server's layout: BOS FIM_PRE prefix prompt FIM_SUF suffix FIM_MID (the tiny
    # context leaves no room for input_extra: n_ctx - n_batch < 0)
    want = [1, FIM["pre"], *tokenize(s, body["input_prefix"]), *tokenize(s, body["prompt"]),
            FIM["suf"], *tokenize(s, body["input_suffix"]), FIM["mid"]]
    assert d["tokens_evaluated"] == len(want)
    # (the prompt text re-tokenized would merge pieces differently: compare texts of the ids)
    assert d["prompt"] == post(s, "/detokenize", {"tokens": want}).json()["content"]
    assert d["prompt"].startswith("<s>\x04".replace("\x04", chr(1))) and "a +" in d["prompt"]
    assert d["tokens_predicted"] == 3 and len(d["tokens"]) == 3
    assert list(d)[:4] == ["index", "content", "tokens", "id_slot"]
    # streamed: the same tokens (computed afresh both times: random weights have near-ties
    # that a cached prefix's slightly different arithmetic may flip)
    events = stream(s, body, "/infill")
    assert events[-1]["tokens_evaluated"] == len(want)
    assert [t for e in events[:-1] for t in e["tokens"]] == d["tokens"]
