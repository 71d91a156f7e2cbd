"""OpenAI's legacy `/v1/completions`: a text or token prompt (one per request), `echo`,
`logprobs` as the legacy object, `n` choices; the answer is a `text_completion` object or
stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshare.engine.api import EngineClient, FinishEvent, TokenEvent
from kvshare.server.errors import APIError, bad_request

from . import parsing as P
from .openai_options import parse_openai_options
from .output_fields import parse_output_constraint
from .base import ApiFormat, ApiRequest, CommonOptions, PromptInfo, RequestContext
from .chat_output import OutputRules
from .openai_format import LegacyLogprobs, OpenAIFormat, finish_reason


@dataclass
class CompletionInput:
    text: str | None  # exactly one of text / tokens
    tokens: list[int] | None
    echo: bool


def parse_completion(body: dict, vocab_size: int | None) -> CompletionInput:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    p = body["prompt"]
    text = tokens = None
    if isinstance(p, str):
        text = p
    elif isinstance(p, list):
        if not p:
            raise bad_request("'prompt' must not be empty", "prompt")
        if all(P.is_int(t) for t in p):
            tokens = p
        elif len(p) == 1 and isinstance(p[0], str):
            text = p[0]
        elif len(p) == 1 and P.is_token_list(p[0]):
            tokens = p[0]
        elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            raise bad_request("multiple prompts in one request are not supported: send one "
                              "request per prompt", "prompt")
        else:
            raise bad_request("'prompt' must be a string, an array of token ids, or an array "
                              "with one string", "prompt")
    else:
        raise bad_request(f"'prompt' must be a string or an array, got {P.json_type(p)}",
                          "prompt")
    if tokens is not None:
        P.check_token_ids(tokens, vocab_size, "prompt")
    suffix = body.get("suffix")
    if suffix not in (None, ""):
        raise bad_request("'suffix' is not supported", "suffix")
    echo = P.get_bool(body, "echo", False)
    return CompletionInput(text=text, tokens=tokens, echo=echo)


class CompletionFormat(OpenAIFormat):
    object_full = object_chunk = "text_completion"

    def __init__(self, rid: str, model: str, opts: CommonOptions, echo_text: str,
                 prompt: PromptInfo, system_fingerprint: str | None = None):
        super().__init__(rid, model, opts, None, prompt, system_fingerprint)
        self.echo_text = echo_text
        self.offsets: dict[int, int] = {}

    def _chunk(self, text: str, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        return self.choice_chunk({"text": text}, index, finish, logprobs)

    def start_chunks(self) -> list[dict]:
        return [self._chunk(self.echo_text, i) for i in range(self.opts.n)] \
            if self.echo_text else []

    def token_chunks(self, ev: TokenEvent) -> list[dict]:
        lp = None
        if self.opts.logprobs:
            lp = LegacyLogprobs(self.offsets.get(ev.index, len(self.echo_text)))
            if lp.add(ev):
                self.offsets[ev.index] = lp.offset
            else:
                lp = None
        if not ev.text and lp is None:
            return []
        return [self._chunk(ev.text, ev.index, logprobs=lp.as_dict() if lp else None)]

    def finish_chunks(self, fin: FinishEvent) -> list[dict]:
        return [self._chunk("", fin.index, finish_reason(fin))]

    def choice(self, i: int, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict:
        logprobs = None
        if self.opts.logprobs:
            lp = LegacyLogprobs(len(self.echo_text))
            for e in events:
                lp.add(e)
            logprobs = lp.as_dict()
        return {"index": i, "text": self.echo_text + text, "logprobs": logprobs,
                "finish_reason": finish_reason(fin)}


@dataclass
class CompletionRequest(ApiRequest):
    """A completions request: its prompt's text (for `echo`), or None for a token prompt."""

    echo: bool = False
    text: str | None = None


class CompletionsApi:
    """`/v1/completions`. `engine`: for the echo of a token prompt (its text)."""

    endpoint, id_prefix = "completions", "cmpl-"

    def __init__(self, engine: EngineClient, system_fingerprint: str | None = None):
        self.engine = engine
        self.system_fingerprint = system_fingerprint

    def parse(self, body: dict, ctx: RequestContext) -> CompletionRequest:
        model = P.requested_model(body, ctx.model_name)
        opts = parse_openai_options(body, ctx, chat=False)
        output = parse_output_constraint(body, chat=False)
        comp = parse_completion(body, ctx.vocab_size)
        pieces: list[str | int] = list(comp.tokens) if comp.tokens is not None else [comp.text or ""]
        return CompletionRequest(chat=None, opts=opts, output=output, model=model,
                                 prompt=pieces, echo=comp.echo, text=comp.text)

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        assert isinstance(req, CompletionRequest)
        echo = ""
        if req.echo:
            echo = req.text or "" if req.text is not None else self.engine.detokenize(
                list(prompt.tokens))
        return CompletionFormat(rid, req.model, req.opts, echo, prompt, self.system_fingerprint)

    def error_body(self, err: APIError) -> dict:
        return err.body()
