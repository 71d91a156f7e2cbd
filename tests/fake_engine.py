"""A fake engine for the HTTP layer's tests: it implements `EngineClient` (the same contract
the real engine does), so the API tests that check shapes, errors and limits run without a
model; the tests that check behaviour use the real engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from kvshare.engine.api import (FinishEvent, GenerationRequest, ModelInfo, RenderedChat,
                                Timings, TokenEvent, TokenLogprob, check_request)

BOS = 1
REPLY = "Hello from the fake engine."


class FakeHandle:
    def __init__(self, engine: "FakeEngine", req: GenerationRequest, cache_n: int):
        self.engine, self.req, self.cache_n = engine, req, cache_n
        self.request_id = req.request_id
        self._cancel = threading.Event()
        self.cancelled = False
        self.finished = False

    def cancel(self) -> None:  # like the engine: the sequence is freed whoever still listens
        self.cancelled = True
        self._cancel.set()
        self.engine.running.discard(self)

    def __aiter__(self):
        return self._events()

    def _finish(self, reason: str, n: int, t0: float, error: str | None = None) -> FinishEvent:
        self.finished = True
        self.engine.running.discard(self)
        p = len(self.req.prompt_tokens)
        return FinishEvent(reason=reason, prompt_tokens=p, completion_tokens=n,
                           timings=Timings(prompt_n=p - self.cache_n, cache_n=self.cache_n,
                                           prompt_ms=1.5, predicted_n=n,
                                           predicted_ms=2.0 * n),
                           time_to_first_token_s=0.002 if n else 0.0, error=error)

    async def _events(self):
        t0 = time.perf_counter()
        if self.engine.fail_with is not None:
            yield self._finish("error", 0, t0, self.engine.fail_with)
            return
        reply = self.engine.reply
        n = 0
        for ch in reply:
            if n >= self.req.max_tokens:
                break
            await asyncio.sleep(self.engine.delay)
            if self._cancel.is_set():
                yield self._finish("cancelled", n, t0)
                return
            n += 1
            tid = ord(ch)
            lp = tops = None
            if self.req.logprobs:
                lp = TokenLogprob(tid, ch, -0.25)
                tops = tuple(TokenLogprob(tid + i, chr(tid + i), -0.25 - i)
                             for i in range(self.req.top_logprobs))
            yield TokenEvent(tid, ch, lp, tops or ())
        if self._cancel.is_set():
            yield self._finish("cancelled", n, t0)
            return
        yield self._finish("length" if n < len(reply) else "stop", n, t0)


class FakeEngine:
    """Byte-level 'tokenizer' (BOS = 1, '<bos>' is special), a fixed reply one char per token,
    and a prefix cache that reuses the longest common prefix of earlier prompts. Implements
    `kvshare.engine.api.EngineClient` (tests/test_fake_engine.py checks it)."""

    model_name = "fake-model"
    vocab_size = 256

    def __init__(self, ctx_size: int = 128, delay: float = 0.0, **info):
        self.ctx_size = ctx_size
        info.setdefault("parallel", 0)  # no llama-server slots unless a test asks for them
        self.info = ModelInfo(name=self.model_name, ctx_size=ctx_size,
                              vocab_size=self.vocab_size, bos_token="<bos>", bos_id=BOS,
                              **info)
        self.delay = delay
        self.reply = REPLY
        self.fail_with: str | None = None
        self.submit_error: Exception | None = None
        self.started = self.stopped = False
        self.requests: list[GenerationRequest] = []
        self.handles: list[FakeHandle] = []
        self.running: set[FakeHandle] = set()
        self.template_calls: list[tuple] = []
        self.seen: list[list[int]] = []

    def start(self) -> None:
        self.started = True

    def shutdown(self, timeout: float = 10.0) -> None:
        for h in list(self.running):
            h.cancel()
        self.stopped = True

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True):
        ids = [BOS] if add_special else []
        parts = text.split("<bos>") if parse_special else [text]
        for i, part in enumerate(parts):
            if i:
                ids.append(BOS)
            ids.extend(part.encode())
        return ids

    def detokenize(self, ids):
        return bytes(t for t in ids if t != BOS).decode(errors="replace")

    def token_piece(self, token_id: int) -> str:
        return "<bos>" if token_id == BOS else bytes([token_id]).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == BOS else bytes([token_id])

    def stalled_for(self) -> float:
        return 0.0

    def warming_up(self) -> bool:
        return False

    def compile_grammar(self, kind: str, source: str) -> object:
        raise NotImplementedError("the fake engine has no grammar compiler")

    def render_chat(self, messages, tools=None, *, add_generation_prompt=True,
                    template_kwargs=None, continue_final=False) -> str:
        kwargs = dict(template_kwargs or {})
        if continue_final:
            kwargs["continue_final"] = True
        return self.apply_chat_template(messages, tools, add_generation_prompt, **kwargs)[0]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        self.template_calls.append((messages, tools, add_generation_prompt, kwargs))
        if any(m["content"] == "RAISE" for m in messages):
            raise ValueError("Conversation roles must alternate user/assistant")
        text = "<bos>"
        if tools:
            text += "<tools>" + json.dumps(tools)
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return text, 3

    def chat_prompt(self, messages, tools=None, *, add_generation_prompt=True,
                    template_kwargs=None, cache_after=None, continue_final=False) -> RenderedChat:
        """As the engine does: render, tokenize once, one BOS (the template writes '<bos>' and
        the tokenizer adds one: the same double BOS real templates give)."""
        kwargs = dict(template_kwargs or {})
        if continue_final:
            kwargs["continue_final"] = True
        text, boundary = self.apply_chat_template(messages, tools, add_generation_prompt,
                                                  **kwargs)
        ids = self.tokenize(text, True, True)
        if ids[:2] == [BOS, BOS]:
            ids, boundary = ids[1:], boundary - 1
        point = None
        if cache_after is not None:
            point = len(self.tokenize(text.split("\n")[0], True, True)) - 1 \
                if cache_after == -1 else boundary
        return RenderedChat(ids, boundary, point)

    def submit(self, req: GenerationRequest) -> FakeHandle:
        if self.submit_error is not None:
            raise self.submit_error
        check_request(req, self.info)  # what the real engine accepts
        self.requests.append(req)
        best = 0
        for old in self.seen:
            k = 0
            while k < min(len(old), len(req.prompt_tokens)) and old[k] == req.prompt_tokens[k]:
                k += 1
            best = max(best, k)
        self.seen.append(list(req.prompt_tokens))
        h = FakeHandle(self, req, min(best, len(req.prompt_tokens) - 1))
        self.handles.append(h)
        self.running.add(h)
        return h

    def snapshot(self) -> dict:
        used = 2 * len(self.running)
        return {
            "slots": [{"id": h.request_id, "state": "decoding",
                       "n_prompt": len(h.req.prompt_tokens), "n_cached": h.cache_n,
                       "n_generated": 0, "blocks": 2, "shared_blocks": 0}
                      for h in self.running],
            "pool": {"total": 64, "used": used, "free": 64 - used, "cached": 5, "shared": 1,
                     "tokens_used": 16 * used, "block_size": 16},
            "counters": {"prompt_tokens_total": 100, "prompt_tokens_cached_total": 40,
                         "generated_tokens_total": 7},
        }
