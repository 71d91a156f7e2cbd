"""OpenAI's `/v1/chat/completions`: the request is parsed by `parsing` (the fields every API
shares), the answer is a `chat.completion` object or `chat.completion.chunk` stream whose
assistant message carries content, `reasoning_content` and `tool_calls` (`chat_output`)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvshare.engine.api import FinishEvent, SamplingParams, TokenEvent
from kvshare.server.body import read_json
from kvshare.server.errors import APIError
from kvshare.server.pipeline import GenerationPipeline

from . import parsing as P
from .openai_options import parse_openai_options
from .output_fields import parse_output_constraint
from .base import ApiFormat, ApiRequest, CommonOptions, PromptInfo, RequestContext
from .chat_output import ChoiceOutput, OutputRules
from .openai_format import OpenAIFormat, chat_logprob_entry, finish_reason


class ChatFormat(OpenAIFormat):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid: str, model: str, opts: CommonOptions,
                 rules: OutputRules | None = None, prompt: PromptInfo | None = None,
                 system_fingerprint: str | None = None):
        super().__init__(rid, model, opts, rules, prompt, system_fingerprint)
        self._outputs: dict[int, ChoiceOutput] = {}

    def _out(self, index: int) -> ChoiceOutput:
        out = self._outputs.get(index)
        if out is None:
            out = self._outputs[index] = ChoiceOutput(self.rules)
        return out

    def _chunk(self, delta: dict, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        return self.choice_chunk({"delta": delta}, index, finish, logprobs)

    def start_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, i)
                for i in range(self.opts.n)]

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        entry = chat_logprob_entry(ev) if self.opts.logprobs else None
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
        reason = finish_reason(fin, out.has_calls)
        if reason == "tool_calls":
            self.client_finish_reason = reason
        chunks.append(self._chunk({}, fin.index, reason))
        return chunks

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        logprobs = None
        if self.opts.logprobs:
            logprobs = {"content": [e for e in map(chat_logprob_entry, events) if e]}
        message, calls = ChoiceOutput.message(self.rules, text)
        reason = finish_reason(fin, calls)
        if reason == "tool_calls":
            self.client_finish_reason = reason
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}


class ChatCompletionsApi:
    """`/v1/chat/completions` (an `Api`). `reasoning_format`: the
    default of a request that gives none; `system_fingerprint`: what responses carry."""

    endpoint, id_prefix = "chat", "chatcmpl-"

    def __init__(self, reasoning_format: str | None = None,
                 system_fingerprint: str | None = None):
        self.reasoning_format = reasoning_format
        self.system_fingerprint = system_fingerprint

    def parse(self, body: dict, ctx: RequestContext) -> ApiRequest:
        model = P.requested_model(body, ctx.model_name)
        opts = parse_openai_options(body, ctx, chat=True)
        output = parse_output_constraint(body, chat=True)
        chat = P.parse_chat(body, reasoning_format=self.reasoning_format)
        return ApiRequest(chat=chat, opts=opts, output=output, model=model)

    def parse_chat_only(self, body: dict) -> ApiRequest:
        """The chat of a request, without its generation options (token counts)."""
        chat = P.parse_chat(body, reasoning_format=self.reasoning_format)
        return ApiRequest(chat=chat, opts=CommonOptions(None, SamplingParams()))

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        return ChatFormat(rid, req.model, req.opts, rules, prompt, self.system_fingerprint)

    def error_body(self, err: APIError) -> dict:
        return err.body()


async def input_tokens(pipeline: GenerationPipeline, api: ChatCompletionsApi,
                       request: Request) -> Response:
    """llama-server's `/v1/chat/completions/input_tokens`: the prompt's token count as
    `/v1/chat/completions` would render it."""
    body = await read_json(request, pipeline.settings)
    req = api.parse_chat_only(body)
    tokens, _ = await pipeline.request_tokens(request, req)
    return JSONResponse({"input_tokens": len(tokens), "object": "response.input_tokens"})
