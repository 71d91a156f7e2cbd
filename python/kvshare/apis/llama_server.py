"""llama-server's native API on kvshare: `/completion` (and `/completions` without `/v1`),
and `/infill`.

Everything here was checked field by field against llama-server (llama.cpp b1-0c1e570, the
vendored `tools/server`) running on the same GGUF.

`/completion` (`NativeCompletionApi`, an `Api`): `prompt` is a string, an array of
token ids, or a mixed array of strings and ids (one prompt; BOS before a leading string, as
llama-server); an array of strings or of arrays is several prompts (`prompt_list`), each
generated as its own sequence: the answer is an array of one result per prompt, each with
its `index`, and a stream interleaves the prompts' chunks, each carrying its `index`. Sampling defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05, repeat_last_n 64, repeat_penalty 1.0); `n_predict` (aliases `max_tokens`,
`max_completion_tokens`) -1 means until the context is full, absent means the server's
`--n-predict` (`settings.default_max_tokens`), 0 generates one token as llama-server does;
`cache_prompt: false` computes the whole prompt again; `n_probs` (alias `logprobs`) gives
`completion_probabilities` from the model's distribution before sampling (llama-server's
default), or with `post_sampling_probs: true` from the distribution the token was drawn from,
after the sampler chain, as probabilities (`prob`, `top_probs`; tokens the chain removed are
left out, so fewer than `n_probs` may come back); `return_tokens`, `response_fields` (paths with `/` unnested, missing ones
omitted), `id_slot` (the slot to prefer), `n_indent` and `t_max_predict_ms` (code completion:
the generation stops early, as llama-server's) are honoured. `samplers` takes llama-server's
names (and aliases, or a string of sampler letters); an unknown name is a 400. kvshare applies
its samplers in one fixed order (penalties, top_k, top_p, min_p, temperature): `samplers`
turns them on or off, it cannot reorder them; dry / typ_p / xtc / top_n_sigma / infill /
adaptive_p are accepted by name and do nothing, and a non-default `mirostat`, `typical_p`,
`dry_multiplier`, `xtc_probability`, `top_n_sigma`, `dynatemp_range`, `lora`, or
`grammar_lazy` is a 400 (their samplers do not exist here). `n_cmpl` / `n` above 1 is a 400
(use `/v1/completions` with `n`). `n_keep` (default `--keep`) and `n_discard` are honoured
when the server runs with `--context-shift` (engine/context_shift.py; a shift makes the
response `truncated`). Accepted and without effect: `n_cache_reuse` (kvshare reuses any cached prefix by itself), `t_max_prompt_ms` (llama-server
does not implement it either), `min_keep`, `return_progress`, `sse_ping_interval`,
`timings_per_token` (the final object carries the timings; the chunks do not), `verbose`.
`model` in responses is the request's model name or the served model's first `--alias`, else
its name (llama-server answers its alias or file path; `/props` has the path).

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

Slots, `/slots` and slot files: `llama_slots`; request options and errors: `llama_request`.
"""

from __future__ import annotations

import codecs
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvshare.engine.api import EngineClient, FinishEvent, TokenEvent
from kvshare.server.errors import APIError, bad_request

from . import parsing as P
from .base import ApiFormat, ApiRequest, PromptInfo, RequestContext, sse_data
from .chat_output import OutputRules
from .prompt_list import PromptListRequest, check_count, split_prompts
from .llama_request import (N_BATCH, NativeOptions, error_object, generation_settings,
                            llama_error_body, not_supported, parse_native, parse_prompt)

__all__ = ["InfillApi", "NativeCompletionApi", "NativeFormat", "NativeRequest", "error_object",
           "format_infill", "llama_error_body", "select_fields"]

# --------------------------------------------------------------------------- token text

def _valid_utf8_prefix(b: bytes) -> str:
    """The text of `b` without an incomplete trailing character (llama-server's
    validate_utf8); invalid bytes inside become U+FFFD."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return dec.decode(b, final=False)


class TokenText:
    """A token's bytes and text as llama-server reports them in probabilities."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def token_bytes(self, token_id: int, fallback: str) -> bytes:
        try:
            return bytes(self.engine.token_bytes(token_id))
        except Exception:  # noqa: BLE001 - the text is all we lose
            return fallback.encode("utf-8")

    def entry(self, token_id: int, text: str, logprob: float, post: bool = False) -> dict:
        b = self.token_bytes(token_id, text)
        return {"id": token_id, "token": _valid_utf8_prefix(b), "bytes": list(b),
                **_prob(logprob, post)}


def _prob(logprob: float, post: bool) -> dict:
    """llama-server's probability field: `logprob`, or after the sampler chain `prob`."""
    return {"prob": math.exp(logprob)} if post else {"logprob": logprob}


def probs_entry(tt: TokenText, ev: TokenEvent, post: bool = False) -> dict | None:
    """One `completion_probabilities` item: the sampled token (its text as sent) and the
    top n of the model's distribution (`post`: of the distribution after the sampler
    chain, as probabilities, llama-server's `post_sampling_probs`)."""
    if ev.logprob is None or ev.token_id < 0:
        return None
    sent = ev.text.encode("utf-8")
    return {"id": ev.token_id, "token": _valid_utf8_prefix(sent), "bytes": list(sent),
            **_prob(ev.logprob.logprob, post),
            "top_probs" if post else "top_logprobs": [
                tt.entry(t.token_id, t.text, t.logprob, post) for t in ev.top_logprobs]}


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

    def __init__(self, rid: str, req: NativeRequest, prompt: PromptInfo,
                 engine: EngineClient):
        super().__init__(rid, req.model, req.opts, None, prompt)
        self.native = req.native
        self.engine = engine
        self.prompt_tokens = list(prompt.tokens)
        self.index_base = req.index  # this prompt's place in the request's list of prompts
        self.slot_of = prompt.slot_of
        self.settings = req.slot_params
        self.ctx_size = engine.info.ctx_size
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
                e = probs_entry(self.tt, ev, self.native.post_sampling_probs)
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
        c = {"index": self.index_base, "content": ev.text,
             "tokens": [ev.token_id] if ev.token_id >= 0 else [], "stop": False,
             "id_slot": -1, "tokens_predicted": self.n_decoded,
             "tokens_evaluated": self.prompt.n_tokens}
        if self.native.n_probs and ev.token_id >= 0:
            e = probs_entry(self.tt, ev, self.native.post_sampling_probs)
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
        if not self.prompt_tokens:
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
        # a context shift discarded tokens: they left the cache, and the reply is truncated
        # whatever ended it (llama-server's slot.truncated)
        in_cache = (n_prompt + n_decoded - 1 if n_decoded else n_prompt) - fin.n_discarded
        truncated = bool(fin.n_discarded) or (stop_type == "limit"
                                              and n_prompt + n_decoded >= self.ctx_size)
        res: dict[str, Any] = {
            "index": self.index_base,
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
            if stop_type == "word":
                # llama-server leaves out the stop word's tokens (as many as it tokenizes to)
                n = len(self.engine.tokenize(fin.stop_string or "", False, False))
                probs = probs[:max(0, len(probs) - n)]
            res["completion_probabilities"] = probs
        return select_fields(res, self.native.response_fields)


# --------------------------------------------------------------------------- front ends

@dataclass
class NativeRequest(PromptListRequest):
    """A native request: llama-server's own options (`llama_request.NativeOptions`); with
    several prompts, one request per prompt in `parts`."""

    native: NativeOptions = field(default_factory=lambda: NativeOptions(n_predict=-1))


class NativeCompletionApi:
    """llama-server's `/completion` (an `Api`). `default_max_tokens`: `--n-predict`, which
    the response reports as the request's `n_predict` when it gives none."""

    endpoint, id_prefix = "completion", "cmpl-"

    def __init__(self, engine: EngineClient, default_max_tokens: int | None = None):
        self.engine = engine
        self.default_max_tokens = default_max_tokens

    def tokenize_text(self, text: str) -> list[int]:
        """Text in a request field (e.g. a `logit_bias` key): special tokens parsed, no BOS."""
        return list(self.engine.tokenize(text, False, True))

    def request(self, body: dict, ctx: RequestContext, prompt: list[str | int]
                ) -> NativeRequest:
        opts, native, output = parse_native(body, ctx, self.default_max_tokens,
                                            self.tokenize_text)
        settings = generation_settings(
            opts.sampling, n_predict=native.n_predict, stop=opts.stop,
            ignore_eos=opts.ignore_eos, stream=opts.stream, n_probs=native.n_probs,
            grammar=native.grammar, samplers=native.samplers,
            timings_per_token=native.timings_per_token,
            post_sampling_probs=native.post_sampling_probs, n_keep=native.n_keep,
            n_discard=native.n_discard)
        return NativeRequest(chat=None, opts=opts, output=output,
                             model=P.requested_model(body, ctx.model_name), prompt=prompt,
                             reuse_cache=native.cache_prompt, id_slot=native.id_slot,
                             slot_params=settings, native=native, n_keep=native.n_keep,
                             n_discard=native.n_discard)

    def parse(self, body: dict, ctx: RequestContext) -> NativeRequest:
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("\"prompt\" is required", "prompt")
        prompts = [parse_prompt(p) for p in split_prompts(body["prompt"])]
        check_count(len(prompts), 1, ctx.max_n)
        req = self.request(body, ctx, prompts[0])
        if len(prompts) > 1:
            req.parts = [replace(req, prompt=p, index=i) for i, p in enumerate(prompts)]
        return req

    def make_format(self, rid: str, req: ApiRequest, rules: OutputRules | None,
                    prompt: PromptInfo) -> ApiFormat:
        assert isinstance(req, NativeRequest)
        return NativeFormat(rid, req, prompt, self.engine)

    def error_body(self, err: APIError) -> dict:
        return llama_error_body(err)


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
    """llama-server's `/infill` (fill-in-the-middle)."""

    endpoint = "infill"

    def parse(self, body: dict, ctx: RequestContext) -> NativeRequest:
        engine = self.engine
        fim = dict(engine.info.fim_ids)
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
            n_ctx=ctx.ctx_size, n_predict=self.default_max_tokens or -1,
            bos_id=engine.info.bos_id)
        return self.request(body, ctx, list(tokens))


def format_infill(engine: Any, fim: dict[str, int | None], prefix: list[int],
                  suffix: list[int], extra: list[dict], prompt: list[int], *, n_ctx: int,
                  n_predict: int = -1, n_batch: int = N_BATCH,
                  bos_id: int | None = None) -> list[int]:
    """llama-server's format_prompt_infill (non-SPM order): the repo-level pattern when the
    model has FIM_REP / FIM_SEP tokens, then [BOS] FIM_PRE prefix prompt FIM_SUF suffix
    FIM_MID; the prefix keeps its last 3/4 of a batch, the suffix its first 1/4 less the
    prompt, the extra context what is left of the context."""
    pre, suf, mid = fim.get("pre"), fim.get("suf"), fim.get("mid")
    rep, sep = fim.get("rep"), fim.get("sep")
    assert pre is not None and suf is not None and mid is not None, "checked by the caller"

    def tok(text: str) -> list[int]:
        return list(engine.tokenize(text, False, False))

    extra_tokens: list[int] = []
    if rep is not None:
        extra_tokens += [rep, *tok("myproject\n")]
    for chunk in extra:
        text = chunk.get("text", "")
        filename = chunk.get("filename") or "tmp"
        if sep is not None:
            extra_tokens += [sep, *tok(filename + "\n")]
        else:
            extra_tokens += tok("\n\n--- snippet ---\n\n")
        extra_tokens += tok(text)
    if sep is not None:
        extra_tokens += [sep, *tok("filename\n")]

    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    prefix = prefix[len(prefix) - n_prefix_take:]
    suffix = suffix[:n_suffix_take]
    head = [pre, *prefix, *prompt]
    tail = [suf, *suffix]
    if bos_id is not None:
        head.insert(0, bos_id)
    taken = extra_tokens[len(extra_tokens) - n_extra_take:] if n_extra_take else []
    return [*taken, *head, *tail, mid]
