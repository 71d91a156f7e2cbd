"""llama-server's native API on kvshare: `/completion` (and `/completions` without `/v1`),
`/infill`, and the shapes of `/props`, `/slots` and `/slots/{id}?action=...`.

Everything here was checked field by field against llama-server (llama.cpp b1-0c1e570, the
vendored `tools/server`) running on the same GGUF.

`/completion` (`NativeCompletionApi`, a `frontend.FrontEnd`): `prompt` is a string, an array of
token ids, or a mixed array of strings and ids (one prompt; BOS before a leading string, as
llama-server); an array of strings is several prompts, refused (400: send one request per
prompt). Sampling defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05, repeat_last_n 64, repeat_penalty 1.0); `n_predict` (aliases `max_tokens`,
`max_completion_tokens`) -1 means until the context is full, absent means the server's
`--n-predict` (`settings.default_max_tokens`), 0 generates one token as llama-server does;
`cache_prompt: false` computes the whole prompt again; `n_probs` (alias `logprobs`) gives
`completion_probabilities` from the model's distribution before sampling (llama-server's
default; `post_sampling_probs: true` is refused, kvshare does not keep the filtered
distribution); `return_tokens`, `response_fields` (paths with `/` unnested, missing ones
omitted), `id_slot` (the slot to prefer), `n_indent` and `t_max_predict_ms` (code completion:
the generation stops early, as llama-server's) are honoured. `samplers` takes llama-server's
names (and aliases, or a string of sampler letters); an unknown name is a 400. kvshare applies
its samplers in one fixed order (penalties, top_k, top_p, min_p, temperature): `samplers`
turns them on or off, it cannot reorder them; dry / typ_p / xtc / top_n_sigma / infill /
adaptive_p are accepted by name and do nothing, and a non-default `mirostat`, `typical_p`,
`dry_multiplier`, `xtc_probability`, `top_n_sigma`, `dynatemp_range`, `lora`, or
`grammar_lazy` is a 400 (their samplers do not exist here). `n_cmpl` / `n` above 1 is a 400
(use `/v1/completions` with `n`). Accepted and without effect: `n_keep`, `n_discard`,
`n_cache_reuse` (kvshare reuses any cached prefix by itself), `t_max_prompt_ms` (llama-server
does not implement it either), `min_keep`, `return_progress`, `sse_ping_interval`,
`timings_per_token` (the final object carries the timings; the chunks do not), `verbose`.
`model` in responses is the request's model name or the served model's name (llama-server
answers its alias or file path; `/props` has the path).

The response is llama-server's object: `content`, `tokens`, `id_slot`, `stop`, `model`,
`tokens_predicted`, `tokens_evaluated`, `generation_settings` (the effective settings under
llama-server's names), `prompt` (the prompt's text, special tokens included), `has_new_line`,
`truncated`, `stop_type` (eos / limit / word), `stopping_word`, `tokens_cached` (as
llama-server computes it: the tokens in the sequence's cache at the end, prompt plus generated
minus the last; `timings.cache_n` is the part of the prompt that was reused), `timings`
(llama-server's fields, plus kvshare's `restore_ms`), `completion_probabilities` and `index`.
A stream is `data: {...}` per token (`content`, `tokens`, `stop: false`, `id_slot: -1`,
`tokens_predicted`, `tokens_evaluated`, and `completion_probabilities` with `n_probs`), then
one final object with `stop: true` and the final fields (empty `content` and `tokens`), and
no `[DONE]`. Errors are llama-server's `{"error": {"code", "message", "type"}}` (a prompt
that does not fit adds `n_prompt_tokens` and `n_ctx`, type `exceed_context_size_error`);
a stream that fails after it started ends with `data: {"error": {...}}`.

`/infill` (`InfillApi`): llama-server's `format_prompt_infill` with the model's FIM tokens
(`tokenizer.ggml.fim_*_token_id`, or the token texts llama.cpp recognises): the repo-level
pattern with `<FIM_REP>`/`<FIM_SEP>` when the model has them, the extra chunks before the
prefix otherwise; `[extra] [BOS] <FIM_PRE> prefix prompt <FIM_SUF> suffix <FIM_MID>`, the
prefix cut to 3/4 and the suffix to 1/4 of a 2048-token batch as llama-server does. A model
without FIM tokens gets llama-server's answer, 501 `not_supported_error`.

Slots (`SlotTable`): kvshare has no fixed slots — every sequence shares one block pool and
the prefix cache is global — so `--parallel` slots are emulated for llama-server's clients:
a request takes the lowest idle slot when it is submitted (the one `id_slot` names if that is
idle; beyond `--parallel` requests wait in order for one to free), and a slot remembers its
last request (settings, counts, prompt and generated token ids) as llama-server's does.
`GET /slots` lists them in llama-server's shape (as its GET /slots shows them: settings and
counts, no prompt text) plus `kvshare` figures of a running sequence (cached / computed prompt
tokens, blocks, blocks shared with other sequences). `POST /slots/{id}?action=save` writes the slot's token ids (its last
prompt plus what it generated) to a JSON file under `--slot-save-path` — not the KV bytes:
those live in kvshare's shared cache (and its disk tier with `--cache-dir`), addressed by
content; `restore` reads such a file and computes those tokens into the cache (one request
with one generated token, discarded), so the next request that starts with them reuses them
— the same effect as llama-server's restore, by recomputing or fetching from the tiers
instead of copying state; `erase` forgets the slot's record (waiting for it to go idle, as
llama-server does); the blocks stay in the shared cache, where other sequences may use them,
until evicted.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Callable

from kvshare.engine.api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent

from . import protocol as P
from .errors import APIError, bad_request
from .frontend import ApiFormat, ChatRequest, PromptInfo, RequestContext, sse_data

# --------------------------------------------------------------------------- llama-server

# common_params_sampling's defaults (llama-server without sampling flags)
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_LAST_N = 64
DEFAULT_REPEAT_PENALTY = 1.0
N_BATCH = 2048  # llama-server's default --batch-size (the infill prompt's budget)
MAX_N_PROBS = 100
RANDOM_SEED = 4294967295  # how llama-server reports seed -1 (LLAMA_DEFAULT_SEED)

# kvshare's sampler chain, in its one order (engine/sampling.py)
KVSHARE_SAMPLERS = ("penalties", "top_k", "top_p", "min_p", "temperature")
# llama-server's sampler names; those kvshare lacks are accepted and do nothing (their
# parameters' defaults turn them off)
_SAMPLERS = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc",
             "infill", "penalties", "adaptive_p")
_SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
                  "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill",
                  "e": "penalties", "a": "adaptive_p"}


def _sampler_aliases() -> dict[str, str]:
    out = {name: name for name in _SAMPLERS}
    for name in _SAMPLERS:
        if "_" in name:
            out[name.replace("_", "-")] = name
            out[name.replace("_", "")] = name
    out.update(nucleus="top_p", temp="temperature", typ="typ_p")
    return out


SAMPLER_NAMES = _sampler_aliases()

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 501: "not_supported_error",
               503: "unavailable_error"}


def error_object(status: int, message: str, type: str | None = None) -> dict:
    """llama-server's error object (format_error_response)."""
    t = type or ERROR_TYPES.get(status) or ("server_error" if status >= 500
                                            else "invalid_request_error")
    return {"code": status, "message": message, "type": t}


def llama_error_body(err: APIError) -> dict:
    """An `APIError` in llama-server's shape: {"error": {"code", "message", "type"}}; a prompt
    that does not fit is an `exceed_context_size_error` with `n_prompt_tokens` and `n_ctx`."""
    t = None
    if err.type not in ("invalid_request_error", "server_error"):
        t = err.type  # already one of llama-server's (not_supported_error, ...)
    details = getattr(err, "details", None) or {}
    if err.code == "context_length_exceeded":
        t = "exceed_context_size_error"
    obj = error_object(err.status, err.message, t)
    obj.update(details)
    return {"error": obj}


def not_supported(message: str) -> APIError:
    return APIError(501, message, type="not_supported_error", code="not_supported")


# --------------------------------------------------------------------------- request options

@dataclass
class NativeOptions:
    """What a native request asks beyond `CommonOptions`."""

    n_predict: int  # as reported (-1: until the context is full)
    n_probs: int = 0
    return_tokens: bool = False
    response_fields: list[str] = field(default_factory=list)
    id_slot: int = -1
    samplers: list[str] = field(default_factory=lambda: list(KVSHARE_SAMPLERS))
    n_indent: int = 0
    t_max_predict_ms: int = 0
    timings_per_token: bool = False
    grammar: str = ""
    cache_prompt: bool = True


def _num(body: dict, name: str, default: float, lo: float | None = None,
         hi: float | None = None) -> float:
    """A number llama-server clamps into [lo, hi] (its soft limits)."""
    v = P.get_float(body, name, default)
    if lo is not None:
        v = max(lo, v)
    if hi is not None:
        v = min(hi, v)
    return v


def _first(body: dict, *names: str) -> tuple[str, Any]:
    for n in names:
        if body.get(n) is not None:
            return n, body[n]
    return names[0], None


def parse_samplers(v: Any) -> list[str]:
    """`samplers`: an array of sampler names (llama-server's names and aliases, any case) or a
    string of sampler letters; unknown ones are a 400. Returns canonical names in order."""
    if isinstance(v, str):
        out = []
        for ch in v:
            name = _SAMPLER_CHARS.get(ch)
            if name is None:
                raise bad_request(f"'samplers': unknown sampler letter {ch!r} (known: "
                                  f"{''.join(_SAMPLER_CHARS)})", "samplers")
            out.append(name)
        return out
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise bad_request("'samplers' must be an array of sampler names or a string of "
                          "sampler letters", "samplers")
    out = []
    for x in v:
        name = SAMPLER_NAMES.get(x.lower())
        if name is None:
            raise bad_request(f"'samplers': unknown sampler {x!r} (known: "
                              f"{', '.join(_SAMPLERS)})", "samplers")
        out.append(name)
    return out


def _logit_bias(body: dict, vocab_size: int | None,
                tokenize: Callable[[str], list[int]] | None) -> tuple[tuple[int, float], ...]:
    """llama-server's `logit_bias`: [[token id or text, bias], ...] or {"id or text": bias};
    a bias of false bans the token; text is tokenized and every token of it biased."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = []
        for el in v:
            if not isinstance(el, list) or len(el) != 2:
                raise bad_request("'logit_bias' entries must be [token, bias] pairs",
                                  "logit_bias")
            items.append((el[0], el[1]))
    else:
        raise bad_request("'logit_bias' must be an array of [token, bias] pairs or an object",
                          "logit_bias")
    if len(items) > P.MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(items)} entries; at most "
                          f"{P.MAX_LOGIT_BIAS} are supported", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in items:
        if bias is False:
            b = -100.0  # kvshare's ban (-inf in llama-server)
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias):
            raise bad_request(f"'logit_bias' value for {key!r} must be a number or false",
                              "logit_bias")
        else:
            b = max(-100.0, min(100.0, float(bias)))
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and key.strip().lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str):
            if tokenize is None:
                raise bad_request("'logit_bias' keys must be token ids", "logit_bias")
            ids = tokenize(key)
        else:
            raise bad_request(f"'logit_bias' key {key!r} is not a token id or text",
                              "logit_bias")
        for t in ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                continue  # llama-server skips ids out of range
            out.append((t, b))
    return tuple(out[:P.MAX_LOGIT_BIAS])


def _refuse_if(cond: bool, name: str, what: str) -> None:
    if cond:
        raise bad_request(f"'{name}' {what} is not supported by kvshare (it has no such "
                          "sampler)", name)


def parse_native(body: dict, ctx: RequestContext, default_max_tokens: int | None
                 ) -> tuple[P.CommonOptions, NativeOptions, P.OutputConstraint | None]:
    """A native request's options with llama-server's defaults and names."""
    name, v = _first(body, "n_predict", "max_tokens", "max_completion_tokens")
    n_predict = P.get_int({name: v}, name, None, lo=-1, hi=2**31 - 1)
    if n_predict is None:
        n_predict = default_max_tokens if default_max_tokens and default_max_tokens > 0 else -1
    # 0 generates one token, as llama-server does (its budget check comes after a token)
    max_tokens = ctx.ctx_size if n_predict < 0 else max(1, n_predict)

    name, v = _first(body, "n_cmpl", "n")
    n_cmpl = P.get_int({name: v}, name, 1, lo=1)
    if n_cmpl != 1:
        raise bad_request(f"'{name}' above 1 is not supported on this endpoint (use "
                          "/v1/completions with 'n')", name)

    # samplers kvshare lacks: their off values only
    _refuse_if(P.get_int(body, "mirostat", 0) != 0, "mirostat", "other than 0")
    _refuse_if(P.get_float(body, "typical_p", 1.0) < 1.0, "typical_p", "below 1")
    _refuse_if(P.get_float(body, "dry_multiplier", 0.0) != 0.0, "dry_multiplier", "other than 0")
    _refuse_if(P.get_float(body, "xtc_probability", 0.0) > 0.0
               and P.get_float(body, "xtc_threshold", 0.1) <= 0.5, "xtc_probability",
               "above 0")
    _refuse_if(P.get_float(body, "top_n_sigma", -1.0) > 0.0, "top_n_sigma", "above 0")
    _refuse_if(P.get_float(body, "dynatemp_range", 0.0) > 0.0, "dynatemp_range", "above 0")
    _refuse_if(P.get_bool(body, "grammar_lazy", False), "grammar_lazy", "true")
    lora = body.get("lora")
    if lora not in (None, []):
        if not isinstance(lora, list):
            raise bad_request("'lora' must be an array", "lora")
        if any(not isinstance(x, dict) or x.get("scale", 0) not in (0, 0.0) for x in lora):
            raise bad_request("'lora': kvshare serves no LoRA adapters", "lora")
    if P.get_bool(body, "post_sampling_probs", False):
        raise bad_request("'post_sampling_probs' is not supported: kvshare reports "
                          "probabilities from the model's distribution before sampling "
                          "(post_sampling_probs false)", "post_sampling_probs")

    samplers = list(KVSHARE_SAMPLERS)
    if body.get("samplers") is not None:
        chosen = parse_samplers(body["samplers"])
        if "adaptive_p" in chosen:
            raise bad_request("'samplers': adaptive_p is not supported by kvshare", "samplers")
        samplers = [s for s in KVSHARE_SAMPLERS if s in chosen]

    temperature = _num(body, "temperature", DEFAULT_TEMPERATURE, lo=0.0)
    if temperature > 100.0:
        raise bad_request(f"'temperature' must be <= 100, got {temperature}", "temperature")
    top_k = int(_num(body, "top_k", DEFAULT_TOP_K, lo=0))
    top_p = _num(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0)
    min_p = _num(body, "min_p", DEFAULT_MIN_P, 0.0, 1.0)
    last_n = P.get_int(body, "repeat_last_n", DEFAULT_REPEAT_LAST_N, lo=-1)
    if last_n == -1:
        last_n = ctx.ctx_size
    rep = P.get_float(body, "repeat_penalty", DEFAULT_REPEAT_PENALTY, lo=0.01, hi=10.0)
    presence = P.get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
    frequency = P.get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
    tokenize = None
    if ctx.engine is not None:
        eng = ctx.engine

        def tokenize(text: str) -> list[int]:
            return list(eng.tokenize(text, False, True))
    logit_bias = _logit_bias(body, ctx.vocab_size, tokenize)
    sampling = SamplingParams(
        temperature=temperature if "temperature" in samplers else 1.0,
        top_k=top_k if "top_k" in samplers else 0,
        top_p=top_p if "top_p" in samplers else 1.0,
        min_p=min_p if "min_p" in samplers else 0.0,
        seed=P.get_seed(body),
        presence_penalty=presence if "penalties" in samplers else 0.0,
        frequency_penalty=frequency if "penalties" in samplers else 0.0,
        repetition_penalty=rep if "penalties" in samplers else 1.0,
        penalty_last_n=last_n,
        logit_bias=logit_bias,
    )

    name, v = _first(body, "n_probs", "logprobs")
    if isinstance(v, bool):
        v = None if v is False else 1
    n_probs = max(0, P.get_int({name: v}, name, 0) or 0)
    if n_probs > MAX_N_PROBS:
        raise bad_request(f"'{name}' is {n_probs}; at most {MAX_N_PROBS} are supported", name)

    rf = body.get("response_fields")
    if rf is None:
        rf = []
    if not isinstance(rf, list) or not all(isinstance(x, str) for x in rf):
        raise bad_request("'response_fields' must be an array of strings", "response_fields")

    id_slot = P.get_int(body, "id_slot", -1, lo=-1)

    # the output constraint: llama-server's `grammar` wins over `json_schema`
    output = None
    g = body.get("grammar")
    if g is not None and g != "":
        output = P.parse_output_constraint({"grammar": g}, chat=False)
    elif body.get("json_schema") is not None:
        schema = body["json_schema"]
        if schema == {}:
            schema = {"type": "object"}  # llama-server: an empty schema means any object
        output = P.parse_output_constraint({"json_schema": schema}, chat=False)

    stream = P.get_bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if isinstance(so, dict):
        include_usage = P.get_bool(so, "include_usage", False)
    cache_prompt = P.get_bool(body, "cache_prompt", True)
    opts = P.CommonOptions(
        max_tokens=max_tokens, sampling=sampling, stop=P.parse_stop(body), stream=stream,
        include_usage=include_usage, ignore_eos=P.get_bool(body, "ignore_eos", False),
        logprobs=n_probs > 0, top_logprobs=n_probs, n=1)
    native = NativeOptions(
        n_predict=n_predict, n_probs=n_probs,
        return_tokens=P.get_bool(body, "return_tokens", False), response_fields=list(rf),
        id_slot=id_slot, samplers=samplers,
        n_indent=P.get_int(body, "n_indent", 0, lo=0) or 0,
        t_max_predict_ms=max(0, P.get_int(body, "t_max_predict_ms", 0) or 0),
        timings_per_token=P.get_bool(body, "timings_per_token", False),
        grammar=g if isinstance(g, str) else "", cache_prompt=cache_prompt)
    return opts, native, output


def generation_settings(sampling: SamplingParams, *, n_predict: int, stop: list[str] = (),
                        ignore_eos: bool = False, stream: bool = False, n_probs: int = 0,
                        grammar: str = "", samplers: list[str] | tuple = KVSHARE_SAMPLERS,
                        timings_per_token: bool = False,
                        reasoning_format: str = "none") -> dict:
    """llama-server's `generation_settings` / slot `params` (task_params::to_json), with
    kvshare's effective values (samplers it lacks shown off)."""
    seed = sampling.seed
    return {
        "seed": RANDOM_SEED if seed is None else seed,
        "temperature": sampling.temperature,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.1,
        "typical_p": 1.0,
        "repeat_last_n": sampling.penalty_last_n,
        "repeat_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": 64,
        "dry_sequence_breakers": ["\n", ":", "\"", "*"],
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "adaptive_target": -1.0,
        "adaptive_decay": 0.9,
        "stop": list(stop),
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "logit_bias": [{"bias": b, "token": t} for t, b in sampling.logit_bias],
        "n_probs": n_probs,
        "min_keep": 0,
        "grammar": grammar,
        "grammar_lazy": False,
        "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only",
        "reasoning_format": reasoning_format,
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(samplers),
        "speculative.types": "none",
        "timings_per_token": timings_per_token,
        "post_sampling_probs": False,
        "backend_sampling": False,
        "lora": [],
    }


# what llama-server leaves out of settings shown in /props and /slots (to_json(only_metrics))
_NOT_METRICS = ("dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy",
                "grammar_triggers", "preserved_tokens")


def metrics_only(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in _NOT_METRICS}


def default_settings(default_max_tokens: int | None) -> dict:
    """`/props` default_generation_settings.params: a native request that sets nothing."""
    n = default_max_tokens if default_max_tokens and default_max_tokens > 0 else -1
    s = SamplingParams(temperature=DEFAULT_TEMPERATURE, top_k=DEFAULT_TOP_K,
                       top_p=DEFAULT_TOP_P, min_p=DEFAULT_MIN_P,
                       penalty_last_n=DEFAULT_REPEAT_LAST_N,
                       repetition_penalty=DEFAULT_REPEAT_PENALTY)
    return metrics_only(generation_settings(s, n_predict=n))


def request_settings(req: GenerationRequest) -> dict:
    """A slot's `params` for a request of any API (what it was submitted with)."""
    return generation_settings(req.sampling, n_predict=req.max_tokens, stop=req.stop,
                               ignore_eos=req.ignore_eos, n_probs=req.top_logprobs)


def parse_prompt(v: Any) -> list[str | int]:
    """One llama-server prompt: a string, token ids, a mixed array of strings and ids, or
    {"prompt_string": ...}. An array of strings (or of arrays) is several prompts: refused."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        if v.get("multimodal_data"):
            raise not_supported("Multimodal data provided, but model does not support "
                                "multimodal requests.")
        s = v.get("prompt_string")
        if s is None:
            raise bad_request("'prompt' object needs a 'prompt_string'", "prompt")
        return parse_prompt(s)
    if isinstance(v, list):
        if not v:
            raise bad_request("\"prompt\" must not be empty", "prompt")
        has_ids = any(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if has_ids:
            if not all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                       for x in v):
                raise bad_request("a mixed 'prompt' holds only strings and token ids",
                                  "prompt")
            return list(v)
        if len(v) == 1:
            return parse_prompt(v[0])
        raise bad_request(f"'prompt' holds {len(v)} prompts; kvshare takes one prompt per "
                          "request (send one request per prompt)", "prompt")
    raise bad_request("\"prompt\" elements must be a string, a list of tokens, a JSON object "
                      "containing a prompt string, or a list of mixed strings & tokens.",
                      "prompt")


# --------------------------------------------------------------------------- token text

def _valid_utf8_prefix(b: bytes) -> str:
    """The text of `b` without an incomplete trailing character (llama-server's
    validate_utf8); invalid bytes inside become U+FFFD."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return dec.decode(b, final=False)


class TokenText:
    """A token's bytes and text as llama-server reports them in probabilities."""

    def __init__(self, engine: Any):
        tok = getattr(engine, "tokenizer", None)
        self._bytes = getattr(tok, "token_to_bytes", None)
        self._piece = getattr(engine, "token_piece", None)

    def token_bytes(self, token_id: int, fallback: str) -> bytes:
        if self._bytes is not None:
            try:
                return bytes(self._bytes(token_id))
            except Exception:  # noqa: BLE001 - the text is all we lose
                pass
        return fallback.encode("utf-8")

    def entry(self, token_id: int, text: str, logprob: float) -> dict:
        b = self.token_bytes(token_id, text)
        return {"id": token_id, "token": _valid_utf8_prefix(b), "bytes": list(b),
                "logprob": logprob}


def probs_entry(tt: TokenText, ev: TokenEvent) -> dict | None:
    """One `completion_probabilities` item: the sampled token (its text as sent) and the
    top n of the model's distribution."""
    if ev.logprob is None or ev.token_id < 0:
        return None
    sent = ev.text.encode("utf-8")
    return {"id": ev.token_id, "token": _valid_utf8_prefix(sent), "bytes": list(sent),
            "logprob": ev.logprob.logprob,
            "top_logprobs": [tt.entry(t.token_id, t.text, t.logprob) for t in ev.top_logprobs]}


def select_fields(res: dict, paths: list[str]) -> dict:
    """llama-server's `response_fields` (json_get_nested_values): each path, `/`-separated,
    kept under the path as its key; missing ones left out."""
    if not paths:
        return res
    out = {}
    for path in paths:
        cur: Any = res
        ok = True
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


# --------------------------------------------------------------------------- the format

class NativeFormat(ApiFormat):
    """One native request's response object and stream chunks (one choice)."""

    def __init__(self, rid: str, req: ChatRequest, prompt: PromptInfo, ctx_size: int):
        super().__init__(rid, req.model, req.opts, None, prompt)
        self.native: NativeOptions = req.extra["native"]
        self.engine = req.extra.get("engine")
        self.prompt_tokens: list[int] = req.extra.get("prompt_tokens") or []
        self.slot_of: Callable[[], int] = req.extra.get("slot_of") or (lambda: -1)
        self.settings = req.extra["settings"]
        self.ctx_size = ctx_size
        self.tt = TokenText(self.engine)
        self.text = ""  # generated text (llama-server's generated_text)
        self.tokens: list[int] = []
        self.probs: list[dict] = []
        self.n_decoded = 0
        self.stop_requested = False
        self.has_new_line = False
        self._last_nl = 0
        self._t_first: float | None = None

    # ---- per token -------------------------------------------------------------------
    def watch(self, ev: TokenEvent) -> None:
        """Account one token event (both modes); sets `stop_requested` when `n_indent` or
        `t_max_predict_ms` end the generation (the pipeline then stops the request)."""
        if self.stop_requested:
            return
        if ev.token_id >= 0:
            self.n_decoded += 1
            self.tokens.append(ev.token_id)
            if self._t_first is None:
                self._t_first = time.perf_counter()
            if self.native.n_probs:
                e = probs_entry(self.tt, ev)
                if e is not None:
                    self.probs.append(e)
        self.text += ev.text
        n = self.native
        if self.has_new_line and n.n_indent > 0:  # llama-server's n_indent, as it does it
            if self._last_nl > 0:
                pos = self._last_nl
                ind = 0
                while pos < len(self.text) and self.text[pos] in " \t":
                    ind += 1
                    pos += 1
                if pos < len(self.text) and ind < n.n_indent:
                    self.text = self.text[:pos]
                    self.stop_requested = True
            nl = self.text.find("\n", self._last_nl)
            if nl >= 0:
                self._last_nl = nl + 1
        if "\n" in ev.text:
            self.has_new_line = True
            if (n.t_max_predict_ms > 0 and self._t_first is not None
                    and (time.perf_counter() - self._t_first) * 1e3 > n.t_max_predict_ms):
                self.stop_requested = True

    def _partial(self, ev: TokenEvent) -> dict:
        c = {"index": 0, "content": ev.text,
             "tokens": [ev.token_id] if ev.token_id >= 0 else [], "stop": False,
             "id_slot": -1, "tokens_predicted": self.n_decoded,
             "tokens_evaluated": self.prompt.n_tokens}
        if self.native.n_probs and ev.token_id >= 0:
            e = probs_entry(self.tt, ev)
            if e is not None:
                c["completion_probabilities"] = [e]
        return c

    # ---- ApiFormat ---------------------------------------------------------------------
    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        if self.stop_requested:
            return []
        self.watch(ev)
        if ev.token_id < 0 and not ev.text:
            return []
        return [sse_data(self._partial(ev))]

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        return [sse_data(self.final(total, stream=True))]

    def stream_error(self, err: APIError) -> list[bytes]:
        return [sse_data(llama_error_body(err))]

    def response(self, choices, total: FinishEvent) -> dict:
        return self.final(total, stream=False)

    # ---- the final object ------------------------------------------------------------
    def prompt_text(self) -> str:
        if self.engine is None or not self.prompt_tokens:
            return ""
        try:
            return self.engine.detokenize(self.prompt_tokens)
        except Exception:  # noqa: BLE001 - an echo, not worth failing the request
            return ""

    def final(self, fin: FinishEvent, *, stream: bool) -> dict:
        if self.stop_requested or fin.reason in ("length", "cancelled"):
            stop_type = "limit"
        else:
            stop_type = "word" if fin.stop_string else "eos"
        n_prompt = fin.prompt_tokens
        n_decoded = self.n_decoded if self.stop_requested else fin.completion_tokens
        in_cache = n_prompt + n_decoded - 1 if n_decoded else n_prompt
        truncated = stop_type == "limit" and n_prompt + n_decoded >= self.ctx_size
        res: dict[str, Any] = {
            "index": 0,
            "content": "" if stream else self.text,
            "tokens": self.tokens if (self.native.return_tokens and not stream) else [],
            "id_slot": self.slot_of(),
            "stop": True,
            "model": self.model,
            "tokens_predicted": n_decoded,
            "tokens_evaluated": n_prompt,
            "generation_settings": self.settings,
            "prompt": self.prompt_text(),
            "has_new_line": self.has_new_line,
            "truncated": truncated,
            "stop_type": stop_type,
            "stopping_word": fin.stop_string or "",
            "tokens_cached": in_cache,
            "timings": fin.timings.as_dict(),
        }
        if not stream and self.probs:
            probs = self.probs
            if stop_type == "word" and self.engine is not None:
                # llama-server leaves out the stop word's tokens (as many as it tokenizes to)
                n = len(self.engine.tokenize(fin.stop_string, False, False))
                probs = probs[:max(0, len(probs) - n)]
            res["completion_probabilities"] = probs
        return select_fields(res, self.native.response_fields)


# --------------------------------------------------------------------------- front ends

class NativeCompletionApi:
    """llama-server's `/completion` as a front end (frontend.FrontEnd)."""

    endpoint, id_prefix = "completion", "cmpl-"
    wants_prompt_tokens = True  # the pipeline puts the prompt's ids in ChatRequest.extra

    def __init__(self, settings: Any = None):
        self.settings = settings

    @property
    def default_max_tokens(self) -> int | None:
        return getattr(self.settings, "default_max_tokens", None)

    def _request(self, body: dict, ctx: RequestContext, prompt: list[str | int]) -> ChatRequest:
        opts, native, output = parse_native(body, ctx, self.default_max_tokens)
        settings = generation_settings(
            opts.sampling, n_predict=native.n_predict, stop=opts.stop,
            ignore_eos=opts.ignore_eos, stream=opts.stream, n_probs=native.n_probs,
            grammar=native.grammar, samplers=native.samplers,
            timings_per_token=native.timings_per_token)
        return ChatRequest(chat=None, opts=opts, output=output,
                           model=P.requested_model(body, ctx.model_name), prompt=prompt,
                           reuse_cache=native.cache_prompt,
                           extra={"native": native, "engine": ctx.engine, "settings": settings,
                                  "id_slot": native.id_slot})

    def parse(self, body: dict, ctx: RequestContext) -> ChatRequest:
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("\"prompt\" is required", "prompt")
        return self._request(body, ctx, parse_prompt(body["prompt"]))

    def make_format(self, rid: str, req: ChatRequest, rules, prompt: PromptInfo) -> ApiFormat:
        return NativeFormat(rid, req, prompt, getattr(req.extra.get("engine"), "ctx_size", 0)
                            or 0)

    def error_body(self, err: APIError) -> dict:
        return llama_error_body(err)


def fim_ids(engine: Any) -> dict[str, int | None]:
    """The model's fill-in-the-middle token ids (tokenizer.fim_ids; fakes may set
    `engine.fim_ids`)."""
    ids = getattr(engine, "fim_ids", None)
    if ids is None:
        ids = getattr(getattr(engine, "tokenizer", None), "fim_ids", None)
    return dict(ids or {})


def _bos_id(engine: Any) -> int | None:
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        return tok.bos_id if getattr(tok, "add_bos", False) else None
    return getattr(engine, "bos_id", None)


def _mixed_tokens(engine: Any, v: Any, name: str, vocab_size: int | None) -> list[int]:
    """llama-server's tokenize_mixed without special tokens: a string, or an array of
    strings and token ids."""
    if isinstance(v, str):
        return list(engine.tokenize(v, False, False))
    if isinstance(v, list) and all(isinstance(x, str) or (isinstance(x, int)
                                                         and not isinstance(x, bool))
                                   for x in v):
        out: list[int] = []
        for x in v:
            if isinstance(x, str):
                out += engine.tokenize(x, False, False)
            else:
                P.check_token_ids([x], vocab_size, name)
                out.append(x)
        return out
    raise bad_request(f"\"{name}\" must be a string or an array of strings and token ids", name)


class InfillApi(NativeCompletionApi):
    """llama-server's `/infill` (fill-in-the-middle) as a front end."""

    endpoint = "infill"

    def parse(self, body: dict, ctx: RequestContext) -> ChatRequest:
        engine = ctx.engine
        fim = fim_ids(engine)
        missing = "".join(f"{what} token is missing. " for key, what in
                          (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))
                          if fim.get(key) is None)
        if missing:
            raise not_supported(f"Infill is not supported by this model: {missing}")
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise bad_request("\"prompt\" must be a string", "prompt")
        for key in ("input_prefix", "input_suffix"):
            if key not in body:
                raise bad_request(f"\"{key}\" is required", key)
        extra = body.get("input_extra")
        if extra is None:
            extra = []
        if not isinstance(extra, list):
            raise bad_request("\"input_extra\" must be an array of {\"filename\": string, "
                              "\"text\": string}", "input_extra")
        for chunk in extra:
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                raise bad_request("extra_context chunk must contain a \"text\" field with a "
                                  "string value", "input_extra")
            if chunk.get("filename") is not None and not isinstance(chunk["filename"], str):
                raise bad_request("extra_context chunk's \"filename\" field must be a string",
                                  "input_extra")
        total = sum(len(c["text"]) for c in extra) + len(prompt or "")
        for key in ("input_prefix", "input_suffix"):
            v = body[key]
            total += len(v) if isinstance(v, str) else sum(
                len(x) for x in v if isinstance(x, str)) if isinstance(v, list) else 0
        if total > 64 * ctx.ctx_size:  # far past the context: refuse before tokenizing
            raise bad_request(f"the infill input has {total} characters; it cannot fit the "
                              f"context of {ctx.ctx_size} tokens", "input_prefix",
                              "context_length_exceeded")
        tokens = format_infill(
            engine, fim, _mixed_tokens(engine, body["input_prefix"], "input_prefix",
                                       ctx.vocab_size),
            _mixed_tokens(engine, body["input_suffix"], "input_suffix", ctx.vocab_size),
            extra, list(engine.tokenize(prompt or "", False, True)),
            n_ctx=ctx.ctx_size, n_predict=self.default_max_tokens or -1)
        return self._request(body, ctx, list(tokens))


def format_infill(engine: Any, fim: dict[str, int | None], prefix: list[int],
                  suffix: list[int], extra: list[dict], prompt: list[int], *, n_ctx: int,
                  n_predict: int = -1, n_batch: int = N_BATCH) -> list[int]:
    """llama-server's format_prompt_infill (non-SPM order): the repo-level pattern when the
    model has FIM_REP / FIM_SEP tokens, then [BOS] FIM_PRE prefix prompt FIM_SUF suffix
    FIM_MID; the prefix keeps its last 3/4 of a batch, the suffix its first 1/4 less the
    prompt, the extra context what is left of the context."""
    def tok(text: str) -> list[int]:
        return list(engine.tokenize(text, False, False))

    extra_tokens: list[int] = []
    if fim.get("rep") is not None:
        extra_tokens += [fim["rep"], *tok("myproject\n")]
    for chunk in extra:
        text = chunk.get("text", "")
        filename = chunk.get("filename") or "tmp"
        if fim.get("sep") is not None:
            extra_tokens += [fim["sep"], *tok(filename + "\n")]
        else:
            extra_tokens += tok("\n\n--- snippet ---\n\n")
        extra_tokens += tok(text)
    if fim.get("sep") is not None:
        extra_tokens += [fim["sep"], *tok("filename\n")]

    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    prefix = prefix[len(prefix) - n_prefix_take:]
    suffix = suffix[:n_suffix_take]
    head = [fim["pre"], *prefix, *prompt]
    tail = [fim["suf"], *suffix]
    bos = _bos_id(engine)
    if bos is not None:
        head.insert(0, bos)
    taken = extra_tokens[len(extra_tokens) - n_extra_take:] if n_extra_take else []
    return [*taken, *head, *tail, fim["mid"]]


# --------------------------------------------------------------------------- slots

@dataclass
class Slot:
    id: int
    rid: str | None = None  # the request it serves now
    id_task: int = -1
    n_prompt: int = 0
    n_processed: int = 0
    n_cache: int = 0
    n_decoded: int = 0
    n_remain: int = -1
    has_new_line: bool = False
    params: dict | None = None
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    idle: asyncio.Event | None = None

    @property
    def tokens(self) -> list[int]:
        """What llama-server's slot keeps: the prompt and the generated tokens."""
        return [*self.prompt, *self.generated]


class SlotTable:
    """`--parallel` slots emulated over kvshare's shared pool (see the module docstring)."""

    def __init__(self, n: int):
        self.slots = [Slot(i) for i in range(max(0, n))]
        self.by_rid: dict[str, Slot] = {}
        self.waiting: deque[tuple[str, int, Any]] = deque()
        self._pending: dict[str, tuple[GenerationRequest, dict | None]] = {}
        self._tasks = count()

    def __len__(self) -> int:
        return len(self.slots)

    def acquire(self, rid: str, req: GenerationRequest, params: dict | None = None,
                want: int = -1) -> int:
        """Give the request a slot (the one it wants if idle, else the lowest idle one), or
        queue it; returns the slot id or -1."""
        if not self.slots:
            return -1
        self._pending[rid] = (req, params)
        idle = [s for s in self.slots if s.rid is None]
        if not idle:
            self.waiting.append((rid, want, None))
            return -1
        slot = next((s for s in idle if s.id == want), idle[0])
        self._start(slot, rid)
        return slot.id

    def _start(self, slot: Slot, rid: str) -> None:
        req, params = self._pending.pop(rid)
        slot.rid = rid
        slot.id_task = next(self._tasks)
        slot.n_prompt = len(req.prompt_tokens)
        slot.n_processed = slot.n_cache = slot.n_decoded = 0
        slot.n_remain = req.max_tokens
        slot.has_new_line = False
        slot.params = params or request_settings(req)
        slot.prompt = list(req.prompt_tokens)
        slot.generated = []
        if slot.idle is not None:
            slot.idle.clear()
        self.by_rid[rid] = slot

    def slot_of(self, rid: str) -> int:
        s = self.by_rid.get(rid)
        return s.id if s is not None else -1

    def feed(self, rid: str, ev: TokenEvent) -> None:
        s = self.by_rid.get(rid)
        if s is None or ev.index != 0:
            return
        if ev.token_id >= 0:
            s.generated.append(ev.token_id)
            s.n_decoded += 1
            if s.n_remain > 0:
                s.n_remain -= 1
        if "\n" in ev.text:
            s.has_new_line = True

    def release(self, rid: str, fin: FinishEvent | None) -> None:
        self._pending.pop(rid, None)
        self.waiting = deque(w for w in self.waiting if w[0] != rid)
        s = self.by_rid.pop(rid, None)
        if s is None:
            return
        if fin is not None:
            s.n_prompt = fin.prompt_tokens
            s.n_cache = fin.timings.cache_n
            s.n_processed = fin.timings.prompt_n
            s.n_decoded = max(s.n_decoded, fin.completion_tokens)
        s.rid = None
        if s.idle is not None:
            s.idle.set()
        while self.waiting:  # the next waiting request takes the freed slot
            nrid, _, _ = self.waiting.popleft()
            if nrid in self._pending:
                self._start(s, nrid)
                break

    async def wait_idle(self, slot: Slot) -> None:
        if slot.rid is None:
            return
        if slot.idle is None:
            slot.idle = asyncio.Event()
        slot.idle.clear()
        while slot.rid is not None:
            await slot.idle.wait()
            slot.idle.clear()

    def get(self, id_slot: int) -> Slot | None:
        return self.slots[id_slot] if 0 <= id_slot < len(self.slots) else None

    def to_json(self, ctx_size: int, live: dict[str, list[dict]]) -> list[dict]:
        """llama-server's /slots array (server_slot::to_json(only_metrics), as its GET /slots
        shows it: no prompt text) with `kvshare` figures of a running slot's sequences
        (`live`: engine snapshot slots by request id)."""
        out = []
        for s in self.slots:
            d: dict[str, Any] = {"id": s.id, "n_ctx": ctx_size, "speculative": False,
                                 "is_processing": s.rid is not None}
            seqs = live.get(s.rid, []) if s.rid is not None else []
            n_cache, n_processed = s.n_cache, s.n_processed
            if seqs:
                first = seqs[0]
                n_cache = first.get("n_cached", 0)
                n_processed = max(0, min(first.get("n_computed", 0), s.n_prompt) - n_cache)
            if s.id_task >= 0:
                d["id_task"] = s.id_task
                d["n_prompt_tokens"] = s.n_prompt
                d["n_prompt_tokens_processed"] = n_processed
                d["n_prompt_tokens_cache"] = n_cache
                d["params"] = metrics_only(s.params or {})
                d["next_token"] = [{"has_next_token": s.rid is not None,
                                    "has_new_line": s.has_new_line,
                                    "n_remain": s.n_remain if s.rid is not None else -1,
                                    "n_decoded": s.n_decoded}]
            if seqs:
                d["kvshare"] = {
                    "request_id": s.rid,
                    "sequences": [{k: q.get(k) for k in (
                        "state", "n_prompt", "n_cached", "n_computed", "n_generated",
                        "blocks", "shared_blocks", "restore_ms")} for q in seqs],
                    "cached_tokens": sum(q.get("n_cached", 0) for q in seqs),
                    "shared_blocks": sum(q.get("shared_blocks", 0) for q in seqs),
                }
            out.append(d)
        return out


# --------------------------------------------------------------------------- slot files

SLOT_FILE_FORMAT = "kvshare-slot-v1"


def check_filename(name: Any) -> str:
    """llama.cpp's fs_validate_filename, in short: a plain file name (no path separators, no
    '..', no control or reserved characters, at most 255 bytes)."""
    if not isinstance(name, str) or not name:
        raise bad_request("Invalid filename", "filename")
    bad = set('/\\:*?"<>|')
    if (len(name.encode("utf-8")) > 255 or name in (".", "..") or ".." in name
            or any(ch in bad or ord(ch) < 32 or ord(ch) == 127 for ch in name)
            or name.startswith(" ") or name.endswith((" ", "."))):
        raise bad_request("Invalid filename", "filename")
    return name


def save_slot_file(path: str, tokens: list[int], model: str) -> int:
    data = json.dumps({"format": SLOT_FILE_FORMAT, "model": model, "tokens": tokens},
                      separators=(",", ":")).encode()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def load_slot_file(path: str, model: str, vocab_size: int | None) -> tuple[list[int], int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(64 * 2**20 + 1)
    except FileNotFoundError:
        raise bad_request("Unable to restore slot: no such slot save file",
                          "filename") from None
    if len(raw) > 64 * 2**20:
        raise bad_request("Unable to restore slot: the file is too large", "filename")
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("format") != SLOT_FILE_FORMAT:
        raise bad_request("Unable to restore slot: not a kvshare slot save file", "filename")
    if data.get("model") != model:
        raise bad_request("Unable to restore slot: the file was saved with another model",
                          "filename")
    tokens = data.get("tokens")
    try:
        P.check_token_ids(tokens, vocab_size, "tokens")
    except APIError:
        raise bad_request("Unable to restore slot: Invalid tokens in slot save file",
                          "filename") from None
    return tokens, len(raw)
