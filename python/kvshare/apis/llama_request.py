"""llama-server's request options (`/completion`, `/infill`): its sampling names, defaults
and soft limits, `samplers`, `n_predict`, `n_probs`, `logit_bias` by text, prompts of mixed
strings and token ids; the `generation_settings` object its answers and `/props` / `/slots`
show; and its error shape (`{"error": {"code", "message", "type"}}`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.server.errors import APIError, bad_request

from . import parsing as P
from .output_fields import parse_output_constraint
from .base import CommonOptions, OutputConstraint, RequestContext
from .prompt_list import is_token_id
from .sampling_fields import LLAMA_SERVER
from .sampling_fields import parse_sampling as _sampling

# --------------------------------------------------------------------------- llama-server

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
    that does not fit is an `exceed_context_size_error` with `n_prompt_tokens` and `n_ctx` and
    llama-server's message."""
    t = None
    if err.type not in ("invalid_request_error", "server_error"):
        t = err.type  # already one of llama-server's (not_supported_error, ...)
    details = err.details or {}
    message = err.message
    if err.code == "context_length_exceeded":
        t = "exceed_context_size_error"
        if "n_prompt_tokens" in details and "n_ctx" in details:  # server_context's wording
            message = (f"request ({details['n_prompt_tokens']} tokens) exceeds the available "
                       f"context size ({details['n_ctx']} tokens), try increasing it")
    obj = error_object(err.status, message, t)
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
    post_sampling_probs: bool = False  # n_probs as probabilities after the sampler chain
    # context shift: prompt tokens kept (-1: all; the request's, else --keep) and tokens
    # discarded (0: half of the rest)
    n_keep: int = 0
    n_discard: int = 0


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


def _bias_items(v: Any) -> list[tuple[Any, Any]]:
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
    return items


def _bias_value(key: Any, bias: Any) -> float:
    if bias is False:
        return -100.0  # kvshare's ban (-inf in llama-server)
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise bad_request(f"'logit_bias' value for {key!r} must be a number or false",
                          "logit_bias")
    return max(-100.0, min(100.0, float(bias)))


def _bias_ids(key: Any, tokenize: Callable[[str], list[int]] | None) -> list[int]:
    if isinstance(key, int) and not isinstance(key, bool):
        return [key]
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return [int(key)]
    if isinstance(key, str):
        if tokenize is None:
            raise bad_request("'logit_bias' keys must be token ids", "logit_bias")
        return tokenize(key)
    raise bad_request(f"'logit_bias' key {key!r} is not a token id or text", "logit_bias")


def parse_logit_bias(body: dict, vocab_size: int | None,
                     tokenize: Callable[[str], list[int]] | None) -> tuple[tuple[int, float], ...]:
    """llama-server's `logit_bias`: [[token id or text, bias], ...] or {"id or text": bias};
    a bias of false bans the token; text is tokenized and every token of it biased."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    out: list[tuple[int, float]] = []
    for key, bias in _bias_items(v):
        b = _bias_value(key, bias)
        for t in _bias_ids(key, tokenize):
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                continue  # llama-server skips ids out of range
            out.append((t, b))
    return tuple(out[:P.MAX_LOGIT_BIAS])


def _refuse_if(cond: bool, name: str, what: str) -> None:
    if cond:
        raise bad_request(f"'{name}' {what} is not supported by kvshare (it has no such "
                          "sampler)", name)


def _refuse_missing_samplers(body: dict) -> None:
    """Samplers kvshare lacks: only their off values are accepted."""
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


def _samplers(body: dict) -> list[str]:
    if body.get("samplers") is None:
        return list(KVSHARE_SAMPLERS)
    chosen = parse_samplers(body["samplers"])
    if "adaptive_p" in chosen:
        raise bad_request("'samplers': adaptive_p is not supported by kvshare", "samplers")
    return [s for s in KVSHARE_SAMPLERS if s in chosen]


def parse_sampling(body: dict, samplers: list[str], ctx: RequestContext,
                   tokenize: Callable[[str], list[int]] | None) -> SamplingParams:
    """llama-server's sampling fields with its defaults and soft limits (clamped); a sampler
    that `samplers` leaves out is off."""
    return _sampling(body, LLAMA_SERVER, ctx_size=ctx.ctx_size,
                     server_defaults=ctx.sampling_defaults, samplers=samplers,
                     logit_bias=parse_logit_bias(body, ctx.vocab_size, tokenize))


def _output(body: dict) -> OutputConstraint | None:
    """llama-server's `grammar` (wins) or `json_schema`."""
    g = body.get("grammar")
    if g is not None and g != "":
        return parse_output_constraint({"grammar": g}, chat=False)
    if body.get("json_schema") is not None:
        schema = body["json_schema"]
        if schema == {}:
            schema = {"type": "object"}  # llama-server: an empty schema means any object
        return parse_output_constraint({"json_schema": schema}, chat=False)
    return None


def _n_probs(body: dict) -> int:
    name, v = _first(body, "n_probs", "logprobs")
    if isinstance(v, bool):
        v = None if v is False else 1
    n_probs = max(0, P.get_int({name: v}, name, 0) or 0)
    if n_probs > MAX_N_PROBS:
        raise bad_request(f"'{name}' is {n_probs}; at most {MAX_N_PROBS} are supported", name)
    return n_probs


def parse_native(body: dict, ctx: RequestContext, default_max_tokens: int | None,
                 tokenize: Callable[[str], list[int]] | None = None
                 ) -> tuple[CommonOptions, NativeOptions, OutputConstraint | None]:
    """A native request's options with llama-server's defaults and names. `max_tokens` is
    None when the request sets no `n_predict` (the pipeline applies `--n-predict`);
    `default_max_tokens` only fills in the `n_predict` the response reports."""
    name, v = _first(body, "n_predict", "max_tokens", "max_completion_tokens")
    n_predict = P.get_int({name: v}, name, None, lo=-1, hi=2**31 - 1)
    max_tokens = None
    if n_predict is None:
        n_predict = default_max_tokens if default_max_tokens and default_max_tokens > 0 else -1
    else:  # 0 generates one token, as llama-server does (its budget check comes after one)
        max_tokens = ctx.ctx_size if n_predict < 0 else max(1, n_predict)

    name, v = _first(body, "n_cmpl", "n")
    if P.get_int({name: v}, name, 1, lo=1) != 1:
        raise bad_request(f"'{name}' above 1 is not supported on this endpoint (use "
                          "/v1/completions with 'n')", name)
    _refuse_missing_samplers(body)
    samplers = _samplers(body)
    sampling = parse_sampling(body, samplers, ctx, tokenize)
    n_probs = _n_probs(body)
    rf = body.get("response_fields")
    if rf is None:
        rf = []
    if not isinstance(rf, list) or not all(isinstance(x, str) for x in rf):
        raise bad_request("'response_fields' must be an array of strings", "response_fields")
    stream = P.get_bool(body, "stream", False)
    so = body.get("stream_options")
    post = P.get_bool(body, "post_sampling_probs", False)
    opts = CommonOptions(
        max_tokens=max_tokens, sampling=sampling, stop=P.parse_stop(body), stream=stream,
        include_usage=isinstance(so, dict) and P.get_bool(so, "include_usage", False),
        ignore_eos=P.get_bool(body, "ignore_eos", False), logprobs=n_probs > 0,
        top_logprobs=n_probs, post_sampling_probs=post, n=1,
        cache_salt=P.parse_cache_salt(body))
    g = body.get("grammar")
    native = NativeOptions(
        n_predict=n_predict, n_probs=n_probs,
        return_tokens=P.get_bool(body, "return_tokens", False), response_fields=list(rf),
        id_slot=P.get_int(body, "id_slot", -1, lo=-1), samplers=samplers,
        n_indent=P.get_int(body, "n_indent", 0, lo=0) or 0,
        t_max_predict_ms=max(0, P.get_int(body, "t_max_predict_ms", 0) or 0),
        timings_per_token=P.get_bool(body, "timings_per_token", False),
        grammar=g if isinstance(g, str) else "",
        cache_prompt=P.get_bool(body, "cache_prompt", True), post_sampling_probs=post,
        n_keep=P.get_int(body, "n_keep", ctx.n_keep),
        n_discard=max(0, P.get_int(body, "n_discard", 0)))  # below 0: the default half
    return opts, native, _output(body)


def generation_settings(sampling: SamplingParams, *, n_predict: int, stop: Sequence[str] = (),
                        ignore_eos: bool = False, stream: bool = False, n_probs: int = 0,
                        grammar: str = "", samplers: list[str] | tuple = KVSHARE_SAMPLERS,
                        timings_per_token: bool = False,
                        reasoning_format: str = "none",
                        post_sampling_probs: bool = False, n_keep: int = 0,
                        n_discard: int = 0) -> dict:
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
        "n_keep": n_keep,
        "n_discard": n_discard,
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
        "post_sampling_probs": post_sampling_probs,
        "backend_sampling": False,
        "lora": [],
    }


# what llama-server leaves out of settings shown in /props and /slots (to_json(only_metrics))
_NOT_METRICS = ("dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy",
                "grammar_triggers", "preserved_tokens")


def metrics_only(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in _NOT_METRICS}


def default_settings(default_max_tokens: int | None,
                     sampling_defaults: Mapping[str, float | int] | None = None,
                     n_keep: int = 0) -> dict:
    """`/props` default_generation_settings.params: a native request that sets nothing
    (`n_keep`: the server's --keep)."""
    n = default_max_tokens if default_max_tokens and default_max_tokens > 0 else -1
    s = _sampling({}, LLAMA_SERVER, ctx_size=0, server_defaults=sampling_defaults)
    return metrics_only(generation_settings(s, n_predict=n, n_keep=n_keep))


def request_settings(req: GenerationRequest) -> dict:
    """A slot's `params` for a request of any API (what it was submitted with)."""
    return generation_settings(req.sampling, n_predict=req.max_tokens, stop=req.stop,
                               ignore_eos=req.ignore_eos, n_probs=req.top_logprobs,
                               post_sampling_probs=req.post_sampling_probs,
                               n_keep=req.n_keep, n_discard=req.n_discard)


def parse_prompt(v: Any) -> list[str | int]:
    """One llama-server prompt: a string, token ids, a mixed array of strings and ids, or
    {"prompt_string": ...} (a request's list of several prompts is split first:
    `prompt_list.split_prompts`)."""
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
        if all(isinstance(x, str) or is_token_id(x) for x in v):
            return list(v)
    raise bad_request("\"prompt\" elements must be a string, a list of tokens, a JSON object "
                      "containing a prompt string, or a list of mixed strings & tokens.",
                      "prompt")
