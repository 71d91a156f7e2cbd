"""llama-server's reasoning budget (`--reasoning-budget N`, a request's
`reasoning_budget_tokens` / `thinking_budget_tokens`, `--reasoning-budget-message`): after N
tokens inside a `<think>` block the end of thinking is forced and the answer follows, as
llama.cpp's common/reasoning-budget.cpp sampler does (engine/reasoning_budget.py). The state
machine alone, then a real server on the tiny model with the QwQ template (its generation
prompt opens `<think>`, so counting starts with the reply)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kvshare.apis.parsing import parse_chat
from kvshare.engine.reasoning_budget import (COUNTING, DONE, FORCING, IDLE, WAITING_UTF8,
                                             ReasoningBudget, utf8_is_complete)
from kvshare.server import cli
from kvshare.server.errors import APIError
from tier_helpers import ROOT, TINY_MODEL, _clean_env, served_url, wait_healthy

START, END, MSG = (1, 2), (3, 4), (9,)


def _run(state, tokens):
    """Feed `tokens` as llama.cpp's sampler sees them: a forced token replaces the drawn one."""
    out = []
    for t in tokens:
        forced = state.forced_token()
        t = forced if forced is not None else t
        state.accept(t)
        out.append(t)
    return out


# --------------------------------------------------------------------------- the state machine

def test_counts_from_the_start_tag_then_forces_the_end():
    s = ReasoningBudget(start=START, ends=(END,), forced=END, budget=3).state()
    assert _run(s, [7, 1, 2]) == [7, 1, 2] and s.state == COUNTING  # a two-token start tag
    assert _run(s, [5, 6]) == [5, 6] and s.state == COUNTING
    assert _run(s, [8]) == [8] and s.state == FORCING  # the third thinking token
    assert _run(s, [5, 5, 5]) == [3, 4, 5]  # the end tag forced, then free again
    assert s.state == DONE and s.thinking_tokens == 3


def test_a_natural_end_stops_counting_and_a_new_block_gets_a_fresh_budget():
    s = ReasoningBudget(start=START, ends=(END,), forced=END, budget=4).state()
    assert _run(s, [1, 2, 5, 3, 4, 6]) == [1, 2, 5, 3, 4, 6] and s.state == DONE
    assert _run(s, [1, 2, 5, 5, 5, 5, 7, 7, 7]) == [1, 2, 5, 5, 5, 5, 3, 4, 7]


def test_opened_by_the_prompt_zero_budget_and_message():
    s = ReasoningBudget(start=START, ends=(END,), forced=MSG + END, budget=2,
                        opened=True).state()
    assert s.state == COUNTING
    assert _run(s, [5, 6, 7, 7, 7, 7]) == [5, 6, 9, 3, 4, 7]
    zero = ReasoningBudget(start=START, ends=(END,), forced=END, budget=0).state()
    assert _run(zero, [1, 2, 5, 5, 5]) == [1, 2, 3, 4, 5]
    assert ReasoningBudget(start=START, ends=(END,), forced=END, budget=0,
                           opened=True).state().forced_token() == 3
    assert ReasoningBudget(start=START, ends=(END,), forced=END, budget=5).state().state == IDLE


def test_waits_for_a_whole_utf8_character_before_forcing():
    # token 20 is a lead byte of a two-byte character, 21 its continuation
    pieces = {20: b"\xc3", 21: b"\xa9", 5: b"a"}
    s = ReasoningBudget(start=START, ends=(END,), forced=END, budget=2, opened=True).state(
        lambda t: utf8_is_complete(pieces[t]))
    assert _run(s, [5, 20]) == [5, 20] and s.state == WAITING_UTF8
    # llama.cpp judges each token's own piece: a lone continuation byte is not whole either,
    # so the next whole piece (5) is the last thinking token
    assert _run(s, [21, 5, 6, 6, 6]) == [21, 5, 3, 4, 6]


@pytest.mark.parametrize("piece,complete", [
    (b"", True), (b"a", True), (b"\xc3\xa9", True), (b"\xc3", False), (b"\xe2\x82", False),
    (b"\xe2\x82\xac", True), (b"\xf0\x9f\x98", False), (b"\xf0\x9f\x98\x80", True),
    (b"\x82\xac", False),
])
def test_utf8_completeness_as_llama_cpp(piece, complete):
    assert utf8_is_complete(piece) is complete


# --------------------------------------------------------------------------- request and flags

def test_request_fields():
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(msgs).reasoning_budget == -1
    assert parse_chat({**msgs, "reasoning_budget_tokens": 5}).reasoning_budget == 5
    assert parse_chat({**msgs, "thinking_budget_tokens": 7}).reasoning_budget == 7
    chat = parse_chat({**msgs, "reasoning_budget_tokens": 0, "thinking_budget_tokens": 7,
                       "reasoning_budget_message": "Enough."})
    assert (chat.reasoning_budget, chat.reasoning_budget_message) == (0, "Enough.")
    with pytest.raises(APIError):
        parse_chat({**msgs, "reasoning_budget_tokens": -2})
    with pytest.raises(APIError):
        parse_chat({**msgs, "reasoning_budget_message": 3})


def test_flags_and_environment():
    a = cli.parse_args(["serve", "--reasoning-budget", "256", "--reasoning-budget-message",
                        "Time's up."], {})
    kw = cli.llama_settings_kwargs(a)
    assert (kw["reasoning_budget"], kw["reasoning_budget_message"]) == (256, "Time's up.")
    a = cli.parse_args(["serve"], {"LLAMA_ARG_THINK_BUDGET": "64",
                                   "LLAMA_ARG_THINK_BUDGET_MESSAGE": "Done."})
    assert (a.reasoning_budget, a.reasoning_budget_message) == (64, "Done.")
    # the budget renders nothing differently (llama-server's sampler forces the end)
    assert cli.chat_template_override(cli.parse_args(["serve", "--reasoning-budget", "0"],
                                                     {})) is None


# --------------------------------------------------------------------------- a real server

QWQ = ROOT / "tests" / "data" / "templates" / "thinking" / "Qwen-QwQ-32B.jinja"
MSGS = [{"role": "user", "content": "What is 2+2?"}]


@contextmanager
def _kvshare(extra: list[str], log: Path) -> Iterator[httpx.Client]:
    argv = ["-m", str(TINY_MODEL), "--port", "0", "--offline", "--no-webui",
            "--cache-ram", "0", "-c", "2048", "--temp", "0", "--chat-template-file", str(QWQ),
            *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvshare.server.cli", *argv],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_clean_env(), cwd=ROOT)
    try:
        with httpx.Client(base_url=served_url(proc, log), timeout=120) as c:
            wait_healthy(c, proc, log)
            yield c
    finally:
        proc.terminate()
        proc.wait(30)


def _chat(c: httpx.Client, **fields) -> dict:
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 40, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _tokens(choice: dict) -> list[str]:
    return [t["token"] for t in choice["logprobs"]["content"]]


def test_thinking_is_cut_after_n_tokens_and_the_answer_follows(tmp_path):
    """Greedy replies: with a budget of N the first N tokens are the unlimited reply's, then
    `</think>` is forced (the tiny model spells it in 8 tokens), then the model goes on with
    the answer; reasoning_content is the N tokens' text and content what follows. The
    server's --reasoning-budget is the default of requests that give none (or -1)."""
    with _kvshare([], tmp_path / "free.log") as c:
        free = _tokens(_chat(c, logprobs=True, reasoning_format="none"))
        # N: a whole character ends the N-th token, so the end is forced right after it
        n = next(i for i in range(8, 30) if free[i - 1].isascii() and free[i - 1].isprintable()
                 and "".join(free[:i]).find("</think>") < 0)
        cut = _chat(c, logprobs=True, reasoning_format="none", reasoning_budget_tokens=n)
        toks = _tokens(cut)
        assert toks[:n] == free[:n], (toks, free)
        assert "".join(toks[n:n + 8]) == "</think>" and toks[:n + 8] != free[:n + 8]
        assert len(toks) == 40 and cut["finish_reason"] == "length"  # the answer follows
        split = _chat(c, reasoning_budget_tokens=n)["message"]
        text = cut["message"]["content"]
        assert split["reasoning_content"] == text[:text.index("</think>")].strip()
        assert split["content"] == text[text.index("</think>") + len("</think>"):].strip()
        assert split["content"]
        # thinking_budget_tokens (Anthropic's budget_tokens arrive so) and a message
        also = _tokens(_chat(c, logprobs=True, reasoning_format="none",
                             thinking_budget_tokens=n))
        assert also == toks
        msg = _chat(c, reasoning_format="none", reasoning_budget_tokens=n,
                    reasoning_budget_message=" Enough.")["message"]["content"]
        assert msg.startswith("".join(free[:n])[:1]) and " Enough.</think>" in msg
        # streamed, and each of n choices (each spends its own budget)
        r = c.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 40, "stream": True, "reasoning_format": "none",
            "reasoning_budget_tokens": n})
        deltas = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas
                       if d["choices"]) == text
        r = c.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 40, "n": 2, "reasoning_format": "none",
            "reasoning_budget_tokens": n})
        assert [ch["message"]["content"] for ch in r.json()["choices"]] == [text, text]
        # -1 and no field: unlimited on this server
        assert _tokens(_chat(c, logprobs=True, reasoning_format="none",
                             reasoning_budget_tokens=-1)) == free
        # a raw prompt has no chat template, so no budget (as llama-server's /completion)
        r = c.post("/completion", json={"prompt": "hi", "n_predict": 4,
                                        "reasoning_budget_tokens": 0})
        assert r.status_code == 200, r.text
    with _kvshare(["--reasoning-budget", str(n)], tmp_path / "flag.log") as c:
        assert _tokens(_chat(c, logprobs=True, reasoning_format="none")) == toks
        assert _tokens(_chat(c, logprobs=True, reasoning_format="none",
                             reasoning_budget_tokens=-1)) == toks  # -1: the server's
        zero = _chat(c, reasoning_format="none",
                     reasoning_budget_tokens=0)["message"]["content"]
        assert zero.startswith("</think>"), zero  # 0: the end at once
