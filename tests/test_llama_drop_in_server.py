"""llama-server's request shapes on a real kvshare server (`kvshare serve` on a loopback
port, the tiny test model, `--alias`): a list of prompts gives each prompt's own greedy
result (the same as sending it alone), streamed with each chunk's `index`;
`post_sampling_probs` reports the distribution after the sampler chain; the alias names
the model in every answer."""

from __future__ import annotations

import json

import pytest

from tier_helpers import Server

GREEDY = {"temperature": 0}
PROMPTS = ["Once upon a time", "The capital of France is", [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def server(launcher):
    s = Server(launcher, "--parallel", "4", "--ctx-size", "512", "--alias", "tiny-alias,other")
    yield s
    s.terminate()


def completion(server, body: dict, path: str = "/completion"):
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def test_list_of_prompts_matches_each_prompt_alone(server):
    alone = [completion(server, {"prompt": p, "n_predict": 6, **GREEDY}) for p in PROMPTS]
    together = completion(server, {"prompt": PROMPTS, "n_predict": 6, **GREEDY})
    assert [r["index"] for r in together] == [0, 1, 2]
    for a, t in zip(alone, together):
        assert t["content"] == a["content"] and t["tokens_evaluated"] == a["tokens_evaluated"]
        assert t["model"] == "tiny-alias"


def test_list_of_prompts_streamed(server):
    alone = [completion(server, {"prompt": p, "n_predict": 5, **GREEDY})["content"]
             for p in PROMPTS[:2]]
    r = server.client.post("/completion", json={"prompt": PROMPTS[:2], "n_predict": 5,
                                                "stream": True, **GREEDY})
    evs = events(r.text)
    for i, want in enumerate(alone):
        mine = [e for e in evs if e["index"] == i]
        assert "".join(e["content"] for e in mine) == want
        assert mine[-1]["stop"] is True and mine[-1]["model"] == "tiny-alias"


def test_v1_completions_prompts_times_n(server):
    body = completion(server, {"prompt": PROMPTS[:2], "max_tokens": 4, "n": 2, **GREEDY},
                      "/v1/completions")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's n agree
    assert body["model"] == "tiny-alias"
