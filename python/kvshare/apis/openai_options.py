"""The request options OpenAI's chat and completions APIs share: `max_tokens`, `n` /
`best_of`, `logit_bias`, the sampling fields (`sampling_fields.OPENAI`, with llama.cpp's
extensions), `stop`, streaming, logprobs and `cache_salt`."""

from __future__ import annotations

from kvshare.server.errors import bad_request

from .base import CommonOptions, RequestContext
from .parsing import (MAX_TOP_LOGPROBS, get_bool, get_int, parse_cache_salt, parse_logit_bias,
                      parse_stop)
from .sampling_fields import OPENAI, parse_sampling


def parse_openai_options(body: dict, ctx: RequestContext, *, chat: bool) -> CommonOptions:
    # max_tokens: more than fits is clamped to what fits (finish_reason "length"), as
    # llama-server does -------------------------------------------------------------------
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        v = get_int(body, name, lo=1)
        if v is not None:
            max_tokens = v
            break

    # n / best_of / logit_bias ---------------------------------------------------------------
    n = get_int(body, "n", 1, lo=1)
    if n > ctx.max_n:
        raise bad_request(f"'n' is {n}; this server returns at most {ctx.max_n} choices per "
                          "request (--max-n)", "n")
    if not chat:
        best_of = get_int(body, "best_of", 1, lo=1)
        if best_of != 1 and best_of != n:
            raise bad_request("best_of other than n is not supported", "best_of")
    logit_bias = parse_logit_bias(body, ctx.vocab_size)

    sampling = parse_sampling(body, OPENAI, ctx_size=ctx.ctx_size,
                              server_defaults=ctx.sampling_defaults, logit_bias=logit_bias)

    stop = parse_stop(body)

    # streaming ---------------------------------------------------------------------------
    stream = get_bool(body, "stream", False)
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = get_bool(so, "include_usage", False)

    # logprobs ----------------------------------------------------------------------------
    if chat:
        logprobs = get_bool(body, "logprobs", False)
        top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and top > 0 and not logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        top_logprobs = top or 0
    else:
        v = body.get("logprobs")
        if v is False:
            v = None
        top = get_int({"logprobs": v}, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        logprobs = top is not None
        top_logprobs = top or 0

    cache_salt = parse_cache_salt(body)

    return CommonOptions(
        max_tokens=max_tokens, sampling=sampling, stop=stop, stream=stream,
        include_usage=include_usage, cache_salt=cache_salt,
        ignore_eos=get_bool(body, "ignore_eos", False), logprobs=logprobs,
        top_logprobs=top_logprobs, n=n,
    )
