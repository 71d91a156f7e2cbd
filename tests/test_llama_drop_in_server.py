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
    s = Server(launcher, "--parallel", "4", "--kv-unified-per-slot", "512", "--alias", "tiny-alias,other")
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


def test_post_sampling_probs_are_the_chain_distribution(server):
    body = completion(server, {"prompt": PROMPTS[0], "n_predict": 5, "n_probs": 10,
                               "temperature": 1.0, "top_k": 3, "seed": 7,
                               "post_sampling_probs": True})
    probs = body["completion_probabilities"]
    assert len(probs) == 5
    for e in probs:
        assert 0.0 < e["prob"] <= 1.0 and "logprob" not in e
        top = e["top_probs"]
        assert 1 <= len(top) <= 3  # top_k 3: the chain keeps at most three
        assert all(0.0 < t["prob"] <= 1.0 for t in top)
        assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
        assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-4)
        assert e["prob"] == pytest.approx(next(t["prob"] for t in top if t["id"] == e["id"]))
    greedy = completion(server, {"prompt": PROMPTS[0], "n_predict": 3, "n_probs": 5,
                                 "post_sampling_probs": True, **GREEDY})
    for e in greedy["completion_probabilities"]:
        assert e["prob"] == 1.0 and [t["id"] for t in e["top_probs"]] == [e["id"]]
