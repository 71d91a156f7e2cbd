"""llama-server's endpoints about the model: `GET /props` (and its refused `POST`),
`/apply-template` (the chat as the template renders it), `/tokenize` and `/detokenize` (its
request and response formats, under kvshare's size caps in `server.prompt_bounds`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvshare.server.body import read_json
from kvshare.server.constraints import template_caps
from kvshare.server.edge import HEAVY_BYTES, body_size, run_heavy
from kvshare.server.errors import APIError, bad_request
from kvshare.server.idle_sleep import Sleeps
from kvshare.server.pipeline import GenerationPipeline, chat_text
from kvshare.server.prompt_bounds import (DETOKENIZE_MAX_CHARS, DETOKENIZE_MAX_TOKENS,
                                          TOKENIZE_MAX_PIECES, tokenize_max_chars)

from . import parsing as P
from .base import json_bytes
from .llama_request import default_settings
from .llama_slots import llama_error


class LlamaInfoEndpoints:
    def __init__(self, pipeline: GenerationPipeline, total_slots: int, system_fingerprint: str):
        self.pipeline, self.engine = pipeline, pipeline.engine
        self.info, self.settings = pipeline.info, pipeline.settings
        self.total_slots = total_slots
        self.system_fingerprint = system_fingerprint

    async def props(self, request: Request) -> Response:
        """llama-server's `GET /props`."""
        from kvshare import __version__ as version

        info, settings = self.info, self.settings
        caps = template_caps(info, self.pipeline.tool_calls)
        return JSONResponse({
            "default_generation_settings": {
                "params": default_settings(settings.default_max_tokens,
                                           settings.sampling_defaults, settings.n_keep),
                "n_ctx": info.ctx_size},
            "total_slots": self.total_slots,
            "model_alias": (settings.aliases or [info.name])[0],
            "model_path": info.path or info.name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": settings.slots_endpoint,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "ui": False,
            "ui_settings": settings.ui_settings,
            "chat_template": info.chat_template,
            "chat_template_caps": {**caps, "supports_string_content": True},
            "chat_template_polyfills": list(info.template_polyfills),
            "bos_token": info.bos_token,
            "eos_token": info.eos_token,
            "build_info": f"kvshare-{version}",
            "is_sleeping": isinstance(self.engine, Sleeps) and self.engine.sleeping,
            "kvshare": {"version": version, "system_fingerprint": self.system_fingerprint,
                        "block_size": info.block_size},
        })

    async def post_props(self, request: Request) -> Response:
        """llama-server answers this only when started with `--props`; kvshare has no global
        properties to change."""
        return llama_error(501, "This server does not support changing global properties. "
                                "Start it with `--props`")

    async def apply_template(self, request: Request) -> Response:
        """llama-server's `/apply-template`: the chat rendered by the model's template (as the
        chat endpoints render it, assistant prefill included), not tokenized."""
        body = await read_json(request, self.settings)
        chat = P.parse_chat(body, reasoning_format=self.settings.reasoning_format)
        size, ctx = body_size(request), self.info.ctx_size
        bounds = self.pipeline.bounds
        exceed = bounds.may_exceed(size, ctx)  # a body this large: check the rendered text
        text = await run_heavy(request, size > HEAVY_BYTES or exceed, chat_text, self.engine,
                               chat)
        if exceed:
            bounds.check_text(len(text), ctx, "messages")
        return JSONResponse({"prompt": text})

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, self.settings)
        content = body.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_request("'content' must be a string", "content")
        add_special = P.get_bool(body, "add_special", False)
        parse_special = P.get_bool(body, "parse_special", True)
        with_pieces = P.get_bool(body, "with_pieces", False)
        max_chars = tokenize_max_chars(self.info.ctx_size)
        if len(content) > max_chars:
            raise APIError(413, f"'content' has {len(content)} characters; /tokenize takes at "
                                f"most {max_chars}", param="content", code="request_too_large")

        def work() -> bytes:
            ids = self.engine.tokenize(content, add_special, parse_special)
            if not with_pieces:
                return json_bytes({"tokens": list(ids)})
            if len(ids) > TOKENIZE_MAX_PIECES:
                raise bad_request(
                    f"the content has {len(ids)} tokens; 'with_pieces' returns at most "
                    f"{TOKENIZE_MAX_PIECES} (send less text, or no 'with_pieces')",
                    "with_pieces", "response_too_large")
            return json_bytes({"tokens": [{"id": t, "piece": self.engine.token_piece(t)}
                                          for t in ids]})

        return Response(await run_heavy(request, len(content) > HEAVY_BYTES, work),
                        media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.settings)
        tokens = body.get("tokens")
        if tokens is None:
            tokens = []
        P.check_token_ids(tokens, self.info.vocab_size, "tokens")
        if len(tokens) > DETOKENIZE_MAX_TOKENS:
            raise APIError(413, f"'tokens' has {len(tokens)} ids; /detokenize takes at most "
                                f"{DETOKENIZE_MAX_TOKENS}", param="tokens",
                           code="request_too_large")

        def work() -> bytes:
            text = self.engine.detokenize(tokens)
            if len(text) > DETOKENIZE_MAX_CHARS:
                raise bad_request(f"the text of these tokens has {len(text)} characters; "
                                  f"/detokenize returns at most {DETOKENIZE_MAX_CHARS}",
                                  "tokens", "response_too_large")
            return json_bytes({"content": text})

        try:
            data = await run_heavy(request, len(tokens) > 4096, work)
        except (IndexError, KeyError, ValueError) as e:
            raise bad_request(f"cannot detokenize: {e}", "tokens", "invalid_token_id") from None
        return Response(data, media_type="application/json")
