"""OpenAI request validation and response shapes.

Parsing is strict about types (a bool is not a number, a float is not an int) and lenient about
unknown fields (OpenAI clients send `user`, `metadata`, `store`, ... which are ignored). Every
problem raises `APIError` (400 unless stated) naming the offending field in `param`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from kvshare.engine.api import FinishEvent, SamplingParams, TokenEvent

from .errors import APIError, bad_request

MAX_STOP_STRINGS = 16
# Every generated token is checked against every stop string, and text that could still become
# one is held back (engine/output.py): the cost per token grows with their lengths, on the
# engine thread that decodes for everyone (twelve 1 MiB stop strings slowed other users 8x).
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOTAL_CHARS = 1024  # all of them together
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


# --------------------------------------------------------------------------- typed accessors

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(body: dict, name: str, default: int | None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)  # JSON writers sometimes emit 16.0 for 16
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {_json_type(v)}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_float(body: dict, name: str, default: float | None = None, *, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number, got {_json_type(v)}", name)
    v = float(v)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad_request(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_json_type(v)}", name)
    return v


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {_json_type(v)}", name)
    return v


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number" if math.isfinite(v) else str(v)
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def is_token_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_int(t) for t in v)


def check_token_ids(tokens: list, vocab_size: int | None, param: str) -> list[int]:
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise bad_request(f"'{param}' must be an array of integer token ids", param)
    for t in tokens:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise bad_request(f"token id {t} in '{param}' is out of range{bound}", param,
                              "invalid_token_id")
    return tokens


# --------------------------------------------------------------------------- common options

@dataclass
class CommonOptions:
    max_tokens: int | None  # None: until the context is full
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: bytes | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def check_model(body: dict, model_name: str) -> None:
    """A missing or empty `model` means the served model; any other name is a 404."""
    model = body.get("model")
    if model is None or model == "":
        return
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {_json_type(model)}", "model")
    if model != model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{model_name}'", param="model", code="model_not_found")


def parse_common(body: dict, *, ctx_size: int, chat: bool) -> CommonOptions:
    # max_tokens ------------------------------------------------------------------------
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        v = get_int(body, name, lo=1)
        if v is not None:
            if v > ctx_size:
                raise bad_request(f"'{name}' is {v}, more than the model's context size "
                                  f"({ctx_size} tokens)", name, "context_length_exceeded")
            max_tokens = v
            break

    # n / best_of / logit_bias: accepted only at their neutral values -------------------------
    n = get_int(body, "n", 1, lo=1)
    if n != 1:
        raise bad_request("n > 1 is not supported: send one request per choice", "n")
    if not chat:
        best_of = get_int(body, "best_of", 1, lo=1)
        if best_of != 1:
            raise bad_request("best_of > 1 is not supported", "best_of")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise bad_request("'logit_bias' must be an object", "logit_bias")
        if logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    # sampling --------------------------------------------------------------------------
    top_k = get_int(body, "top_k", 0, lo=-1)
    seed = get_int(body, "seed")
    if seed is not None and seed == -1:
        seed = None  # llama-server: -1 = random
    rep_name = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    last_n_name = "repeat_last_n" if body.get("repeat_last_n") is not None else "penalty_last_n"
    last_n = get_int(body, last_n_name, 64, lo=-1)
    if last_n == -1:
        last_n = ctx_size
    sampling = SamplingParams(
        temperature=get_float(body, "temperature", 1.0, lo=0.0, hi=100.0),
        top_k=max(top_k, 0),
        top_p=get_float(body, "top_p", 1.0, lo=0.0, hi=1.0),
        min_p=get_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        seed=seed,
        presence_penalty=get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        # >= 0.01: a smaller divisor overflows float32 logits (1e-300 made every score
        # infinite); the sampler still fails the one sequence if scores turn non-finite.
        repetition_penalty=get_float(body, rep_name, 1.0, lo=0.01, hi=10.0),
        penalty_last_n=last_n,
    )

    # stop --------------------------------------------------------------------------------
    stop_v = body.get("stop")
    if stop_v is None:
        stop: list[str] = []
    elif isinstance(stop_v, str):
        stop = [stop_v]
    elif isinstance(stop_v, list) and all(isinstance(s, str) for s in stop_v):
        stop = list(stop_v)
    else:
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad_request(f"a stop string has {longest} characters; at most "
                          f"{MAX_STOP_CHARS} are supported", "stop")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise bad_request(f"the stop strings have {total} characters together; at most "
                          f"{MAX_STOP_TOTAL_CHARS} are supported", "stop")
    stop = [s for s in stop if s]

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

    # cache salt --------------------------------------------------------------------------
    salt = body.get("cache_salt")
    cache_salt = None
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
        cache_salt = hashlib.sha256(salt.encode("utf-8")).digest()

    return CommonOptions(
        max_tokens=max_tokens, sampling=sampling, stop=stop, stream=stream,
        include_usage=include_usage, cache_salt=cache_salt,
        ignore_eos=get_bool(body, "ignore_eos", False), logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


# --------------------------------------------------------------------------- chat

@dataclass
class ChatInput:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict


def _content_text(content: Any, i: int) -> str | None:
    param, where = "messages", f"messages[{i}].content"
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, dict):
                raise bad_request(f"'{where}[{j}]' must be an object", param)
            ptype = part.get("type")
            if ptype in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"'{where}[{j}].text' must be a string", param)
                parts.append(text)
            else:
                raise bad_request(f"content part type {ptype!r} is not supported (text only)",
                                  param)
        return "\n".join(parts)
    raise bad_request(f"'{where}' must be a string, an array of content parts or null",
                      param)


def parse_chat(body: dict) -> ChatInput:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array, got {_json_type(messages)}", "messages")
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"'messages[{i}].role' is required and must be a string",
                              "messages")
        if role not in CHAT_ROLES:
            raise bad_request(f"'messages[{i}].role' {role!r} is not one of "
                              f"{sorted(CHAT_ROLES)}", "messages")
        msg = dict(m)
        content = _content_text(m.get("content"), i)
        if content is None:
            if role in ("user", "system", "developer"):
                raise bad_request(f"'messages[{i}].content' is required for role {role!r}",
                                  "messages")
            content = ""
        msg["content"] = content
        if role == "developer":
            msg["role"] = "system"
        if "tool_calls" in msg and msg["tool_calls"] is not None:
            if not isinstance(msg["tool_calls"], list):
                raise bad_request(f"'messages[{i}].tool_calls' must be an array", "messages")
        out.append(msg)

    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be an array", "tools")
        for j, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if (not isinstance(t, dict) or t.get("type", "function") != "function"
                    or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
                raise bad_request(f"'tools[{j}]' must be {{\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ..., ...}}}}", "tools")
        tools = tools or None

    tc = body.get("tool_choice")
    if tc is not None and tc not in ("none", "auto", "required"):
        if not (isinstance(tc, dict) and isinstance(tc.get("function"), dict)):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")

    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad_request("'response_format' must be an object", "response_format")
        if rf.get("type", "text") != "text":
            raise bad_request(f"response_format type {rf.get('type')!r} is not supported",
                              "response_format")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools")}
    return ChatInput(messages=out, tools=tools, template_kwargs=kwargs)


# --------------------------------------------------------------------------- completions

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
        if all(_is_int(t) for t in p):
            tokens = p
        elif len(p) == 1 and isinstance(p[0], str):
            text = p[0]
        elif len(p) == 1 and is_token_list(p[0]):
            tokens = p[0]
        elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            raise bad_request("multiple prompts in one request are not supported: send one "
                              "request per prompt", "prompt")
        else:
            raise bad_request("'prompt' must be a string, an array of token ids, or an array "
                              "with one string", "prompt")
    else:
        raise bad_request(f"'prompt' must be a string or an array, got {_json_type(p)}",
                          "prompt")
    if tokens is not None:
        check_token_ids(tokens, vocab_size, "prompt")
    suffix = body.get("suffix")
    if suffix not in (None, ""):
        raise bad_request("'suffix' is not supported", "suffix")
    echo = get_bool(body, "echo", False)
    return CompletionInput(text=text, tokens=tokens, echo=echo)


# --------------------------------------------------------------------------- responses

def usage(fin: FinishEvent) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.timings.cache_n},
    }


def finish_reason(fin: FinishEvent) -> str:
    return "length" if fin.reason == "length" else "stop"


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
