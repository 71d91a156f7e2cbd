"""OpenAI's legacy `/v1/completions`: a text or token prompt, or a list of them (llama-server's
and OpenAI's several prompts, `prompt_list`: prompt i's choices have indices i*n .. i*n+n-1),
`echo`, `logprobs` as the legacy object, `n` choices; the answer is a `text_completion`
object or stream."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvshare.engine.api import EngineClient, FinishEvent, TokenEvent
from kvshare.server.errors import APIError, bad_request

from . import parsing as P
from .openai_options import parse_openai_options
from .output_fields import parse_output_constraint
from .base import ApiFormat, ApiRequest, CommonOptions, PromptInfo, RequestContext
from .chat_output import OutputRules
from .openai_format import LegacyLogprobs, OpenAIFormat, finish_reason
from .prompt_list import PromptListRequest, check_count, split_prompts


@dataclass
class CompletionInput:
    text: str | None  # exactly one of text / tokens
    tokens: list[int] | None
    echo: bool


def _one_prompt(p: object, vocab_size: int | None, echo: bool) -> CompletionInput:
    if isinstance(p, str):
        return CompletionInput(text=p, tokens=None, echo=echo)
    if isinstance(p, list) and p and all(P.is_int(t) for t in p):
        P.check_token_ids(p, vocab_size, "prompt")
        return CompletionInput(text=None, tokens=list(p), echo=echo)
    if isinstance(p, list) and not p:
        raise bad_request("'prompt' must not be empty", "prompt")
    raise bad_request("'prompt' must be a string, an array of token ids, or an array of "
                      f"those (one prompt each), got {P.json_type(p)}", "prompt")


def parse_completion(body: dict, vocab_size: int | None) -> list[CompletionInput]:
    """The request's prompts: a string, token ids, or an array of strings and id arrays
    (several prompts)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    p = body["prompt"]
    if not isinstance(p, (str, list)):
        raise bad_request(f"'prompt' must be a string or an array, got {P.json_type(p)}",
                          "prompt")
    suffix = body.get("suffix")
    if suffix not in (None, ""):
        raise bad_request("'suffix' is not supported", "suffix")
    echo = P.get_bool(body, "echo", False)
    return [_one_prompt(x, vocab_size, echo) for x in split_prompts(p)]


class CompletionFormat(OpenAIFormat):
    object_full = object_chunk = "text_completion"

    def __init__(self, rid: str, model: str, opts: CommonOptions, echo_text: str,
                 prompt: PromptInfo, system_fingerprint: str | None = None,
                 index_base: int = 0):
        super().__init__(rid, model, opts, None, prompt, system_fingerprint)
        self.echo_text = echo_text
        self.offsets: dict[int, int] = {}
        self.index_base = index_base  # the first choice's index (prompt i of a list: i * n)

    def _chunk(self, text: str, index: int = 0, finish: str | None = None,
               logprobs: Any = None) -> dict:
        return self.choice_chunk({"text": text}, index, finish, logprobs)

    def start_chunks(self) -> list[dict]:
        first = self.index_base
        return [self._chunk(self.echo_text, i) for i in range(first, first + self.opts.n)] \
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
class CompletionRequest(PromptListRequest):
    """A completions request: its prompt's text (for `echo`), or None for a token prompt;
    with several prompts, one request per prompt in `parts`."""

    echo: bool = False
    text: str | None = None
    merged_choices = True


def _pieces(c: CompletionInput) -> list[str | int]:
    return list(c.tokens) if c.tokens is not None else [c.text or ""]


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
        prompts = parse_completion(body, ctx.vocab_size)
        check_count(len(prompts), opts.n, ctx.max_n)
        parts = [CompletionRequest(chat=None, opts=opts, output=output, model=model,
                                   prompt=_pieces(c), echo=c.echo, text=c.text, index=i)
                 for i, c in enumerate(prompts)]
        return replace(parts[0], parts=list[ApiRequest](parts)) if len(parts) > 1 else parts[0]

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        assert isinstance(req, CompletionRequest)
        echo = ""
        if req.echo:
            echo = req.text or "" if req.text is not None else self.engine.detokenize(
                list(prompt.tokens))
        return CompletionFormat(rid, req.model, req.opts, echo, prompt, self.system_fingerprint,
                                req.index * req.opts.n)

    def error_body(self, err: APIError) -> dict:
        return err.body()
