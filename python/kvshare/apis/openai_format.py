"""What OpenAI's chat completions and completions answers share: the response object's head
(`id`, `object`, `created`, `model`, `system_fingerprint`), `usage` with `cached_tokens`,
llama-server's `timings`, finish reasons, logprobs, and the `data: {chunk}` ... `data: [DONE]`
stream in which the last choice's finish chunk carries the request's usage and timings."""

from __future__ import annotations

import time
from typing import Any

from kvshare.engine.api import FinishEvent, TokenEvent
from kvshare.server.errors import APIError

from .base import ApiFormat, CommonOptions, PromptInfo, sse_data
from .chat_output import OutputRules


def usage(fin: FinishEvent) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.timings.cache_n},
    }


def finish_reason(fin: FinishEvent, tool_calls: bool = False) -> str:
    if fin.reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _lp_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprob_entry(ev: TokenEvent) -> dict | None:
    if ev.logprob is None or ev.token_id < 0:
        return None
    entry = _lp_entry(ev.logprob.text, ev.logprob.logprob)
    entry["top_logprobs"] = [_lp_entry(t.text, t.logprob) for t in ev.top_logprobs]
    return entry


class LegacyLogprobs:
    """The /v1/completions `logprobs` object: tokens, token_logprobs, top_logprobs,
    text_offset."""

    def __init__(self, offset: int = 0):
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict] = []
        self.text_offset: list[int] = []

    def add(self, ev: TokenEvent) -> bool:
        if ev.logprob is None or ev.token_id < 0:
            return False
        self.tokens.append(ev.logprob.text)
        self.token_logprobs.append(ev.logprob.logprob)
        self.top_logprobs.append({t.text: t.logprob for t in ev.top_logprobs})
        self.text_offset.append(self.offset)
        self.offset += len(ev.logprob.text)
        return True

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


class OpenAIFormat(ApiFormat):
    """Builds one OpenAI endpoint's response objects and stream chunks (every choice of a
    request: events carry their choice's `index`). A stream is `data: {chunk}` lines ending
    with `data: [DONE]`; the very last choice's finish chunk is held back so that it can carry
    the request's usage and timings."""

    object_full = object_chunk = ""
    def __init__(self, rid: str, model: str, opts: CommonOptions,
                 rules: OutputRules | None = None, prompt: PromptInfo | None = None,
                 system_fingerprint: str | None = None):
        super().__init__(rid, model, opts, rules, prompt or PromptInfo(0))
        self.system_fingerprint = system_fingerprint
        self.created = int(time.time())
        self.held: dict | None = None

    # ---- ApiFormat ---------------------------------------------------------------------
    def stream_start(self) -> list[bytes]:
        return [sse_data(c) for c in self.start_chunks()]

    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        return [sse_data(c) for c in self.token_chunks(ev)]

    def stream_finish(self, fin: FinishEvent) -> list[bytes]:
        chunks = self.finish_chunks(fin)
        out = [sse_data(c) for c in chunks[:-1]]
        if self.held is not None:
            out.append(sse_data(self.held))
        self.held = chunks[-1]
        return out

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        out = [sse_data(self.final_extras(total, self.held))] if self.held is not None else []
        if self.opts.include_usage:
            out.append(sse_data(self.usage_chunk(total)))
        return [*out, b"data: [DONE]\n\n"]

    def stream_error(self, err: APIError) -> list[bytes]:
        return [sse_data(err.body()), b"data: [DONE]\n\n"]

    # ---- chunks --------------------------------------------------------------------------
    def start_chunks(self) -> list[dict]:
        return []

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        raise NotImplementedError

    def finish_chunks(self, fin: FinishEvent) -> list[dict]:
        raise NotImplementedError

    def base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}

    def choice_chunk(self, fields: dict, index: int, finish: str | None,
                     logprobs: Any) -> dict:
        """One chunk of one choice: its `fields` (chat: `delta`; completions: `text`)."""
        c = self.base(self.object_chunk)
        c["choices"] = [{"index": index, **fields, "logprobs": logprobs, "finish_reason": finish}]
        return c

    def final_extras(self, total: FinishEvent, chunk: dict) -> dict:
        """The last choice's finish chunk carries the request's usage and timings."""
        chunk.update(usage=usage(total), timings=total.timings.as_dict())
        return chunk

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        raise NotImplementedError

    def response(self, choices: dict[int, tuple[str, list[TokenEvent], FinishEvent]],
                 total: FinishEvent) -> dict:
        """The whole (non-streamed) response: each choice in index order, then the totals."""
        r = self.base(self.object_full)
        r.update(choices=[self.choice(i, *choices[i]) for i in sorted(choices)],
                 usage=usage(total), timings=total.timings.as_dict())
        return r

    def usage_chunk(self, fin: FinishEvent) -> dict:
        c = self.base(self.object_chunk)
        c.update(choices=[], usage=usage(fin), timings=fin.timings.as_dict())
        return c


def system_fingerprint(weights_fingerprint: str) -> str:
    """`system_fingerprint` of OpenAI responses: kvshare's version and the model weights'
    fingerprint (what decides the outputs), e.g. "kvshare-0.1.0-3f2a9c1b"."""
    from kvshare import __version__

    return f"kvshare-{__version__}" + (f"-{weights_fingerprint[:8]}" if weights_fingerprint
                                       else "")
