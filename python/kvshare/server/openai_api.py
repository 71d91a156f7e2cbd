"""OpenAI's chat completions and legacy completions as front ends of the generation pipeline
(`frontend.FrontEnd` / `frontend.ApiFormat`): request parsing lives in `protocol.py`, here are
the response objects and the `data: {chunk}` ... `data: [DONE]` streams.
"""

from __future__ import annotations

import time
from typing import Any

from kvshare.engine.api import FinishEvent, TokenEvent

from . import protocol as P
from .chat_output import ChoiceOutput, OutputRules
from .errors import APIError
from .frontend import ApiFormat, ChatRequest, PromptInfo, RequestContext, sse_data


class _Format(ApiFormat):
    """Builds one OpenAI endpoint's response objects and stream chunks (every choice of a
    request: events carry their choice's `index`). A stream is `data: {chunk}` lines ending
    with `data: [DONE]`; the very last choice's finish chunk is held back so that it can carry
    the request's usage and timings."""

    object_full = object_chunk = ""
    system_fingerprint: str | None = None  # set per server (KVShareServer.system_fingerprint)

    def __init__(self, rid: str, model: str, opts: P.CommonOptions,
                 rules: OutputRules | None = None, prompt: PromptInfo | None = None):
        super().__init__(rid, model, opts, rules, prompt or PromptInfo(0))
        self.created = int(time.time())
        self._held: dict | None = None

    # ---- ApiFormat ---------------------------------------------------------------------
    def stream_start(self) -> list[bytes]:
        return [sse_data(c) for c in self.start_chunks()]

    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        return [sse_data(c) for c in self.token_chunks(ev)]

    def stream_finish(self, fin: FinishEvent) -> list[bytes]:
        chunks = self.finish_chunks(fin)
        out = [sse_data(c) for c in chunks[:-1]]
        if self._held is not None:
            out.append(sse_data(self._held))
        self._held = chunks[-1]
        return out

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        out = [sse_data(self.final_extras(total, self._held))] if self._held is not None else []
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

    def _base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}

    def final_extras(self, total: FinishEvent, chunk: dict) -> dict:
        """The last choice's finish chunk carries the request's usage and timings."""
        chunk.update(usage=P.usage(total), timings=total.timings.as_dict())
        return chunk

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        raise NotImplementedError

    def response(self, choices: dict[int, tuple[str, list[TokenEvent], FinishEvent]],
                 total: FinishEvent) -> dict:
        """The whole (non-streamed) response: each choice in index order, then the totals."""
        r = self._base(self.object_full)
        r.update(choices=[self.choice(i, *choices[i]) for i in sorted(choices)],
                 usage=P.usage(total), timings=total.timings.as_dict())
        return r

    def usage_chunk(self, fin: FinishEvent) -> dict:
        c = self._base(self.object_chunk)
        c.update(choices=[], usage=P.usage(fin), timings=fin.timings.as_dict())
        return c


class ChatFormat(_Format):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid: str, model: str, opts: P.CommonOptions,
                 rules: OutputRules | None = None, prompt: PromptInfo | None = None):
        super().__init__(rid, model, opts, rules, prompt)
        self._outputs: dict[int, ChoiceOutput] = {}

    def _out(self, index: int) -> ChoiceOutput:
        out = self._outputs.get(index)
        if out is None:
            out = self._outputs[index] = ChoiceOutput(self.rules)
        return out

    def _chunk(self, delta: dict, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        c = self._base(self.object_chunk)
        c["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]
        return c

    def start_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, i)
                for i in range(self.opts.n)]

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        entry = P.chat_logprob_entry(ev) if self.opts.logprobs else None
        deltas = self._out(ev.index).feed(ev.text)
        lp = {"content": [entry]} if entry is not None else None
        if not deltas:
            return [self._chunk({}, ev.index, logprobs=lp)] if lp is not None else []
        chunks = [self._chunk(d, ev.index) for d in deltas]
        if lp is not None:
            chunks[-1]["choices"][0]["logprobs"] = lp
        return chunks

    def finish_chunks(self, fin: FinishEvent) -> list[dict]:
        out = self._out(fin.index)
        chunks = [self._chunk(d, fin.index) for d in out.finish()]
        chunks.append(self._chunk({}, fin.index, P.finish_reason(fin, out.has_calls)))
        return chunks

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        logprobs = None
        if self.opts.logprobs:
            logprobs = {"content": [e for e in map(P.chat_logprob_entry, events) if e]}
        message, calls = ChoiceOutput.message(self.rules, text)
        return {"index": i, "message": message, "logprobs": logprobs,
                "finish_reason": P.finish_reason(fin, calls)}


class ChatCompletionsApi:
    """`/v1/chat/completions` as a front end (frontend.FrontEnd). `reasoning_format`: the
    default of a request that gives none; `system_fingerprint`: what responses carry."""

    endpoint, id_prefix = "chat", "chatcmpl-"

    def __init__(self, reasoning_format: str | None = None,
                 system_fingerprint: str | None = None):
        self.reasoning_format = reasoning_format
        self.system_fingerprint = system_fingerprint

    def parse(self, body: dict, ctx: RequestContext) -> ChatRequest:
        model = P.requested_model(body, ctx.model_name)
        opts = P.parse_common(body, ctx_size=ctx.ctx_size, chat=True, max_n=ctx.max_n,
                              vocab_size=ctx.vocab_size)
        output = P.parse_output_constraint(body, chat=True)
        chat = P.parse_chat(body, reasoning_format=self.reasoning_format)
        return ChatRequest(chat=chat, opts=opts, output=output, model=model)

    def make_format(self, rid: str, req: ChatRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        fmt = ChatFormat(rid, req.model, req.opts, rules, prompt)
        fmt.system_fingerprint = self.system_fingerprint
        return fmt

    def error_body(self, err: APIError) -> dict:
        return err.body()


class CompletionFormat(_Format):
    object_full = object_chunk = "text_completion"

    def __init__(self, rid: str, model: str, opts: P.CommonOptions, echo_text: str):
        super().__init__(rid, model, opts)
        self.echo_text = echo_text
        self.offsets: dict[int, int] = {}

    def _chunk(self, text: str, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        c = self._base(self.object_chunk)
        c["choices"] = [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]
        return c

    def start_chunks(self) -> list[dict]:
        return [self._chunk(self.echo_text, i) for i in range(self.opts.n)] \
            if self.echo_text else []

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        lp = None
        if self.opts.logprobs:
            lp = P.LegacyLogprobs(self.offsets.get(ev.index, len(self.echo_text)))
            if lp.add(ev):
                self.offsets[ev.index] = lp.offset
            else:
                lp = None
        if not ev.text and lp is None:
            return []
        return [self._chunk(ev.text, ev.index, logprobs=lp.as_dict() if lp else None)]

    def finish_chunks(self, fin: FinishEvent) -> list[dict]:
        return [self._chunk("", fin.index, P.finish_reason(fin))]

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        logprobs = None
        if self.opts.logprobs:
            lp = P.LegacyLogprobs(len(self.echo_text))
            for e in events:
                lp.add(e)
            logprobs = lp.as_dict()
        return {"index": i, "text": self.echo_text + text, "logprobs": logprobs,
                "finish_reason": P.finish_reason(fin)}
