"""The server's own small endpoints: `/v1/models`, `/health`, `/metrics` and `/cache`."""

from __future__ import annotations

import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvshare.apis.llama_request import error_object

from .constraints import template_caps
from .metrics import ServerMetrics
from .pipeline import GenerationPipeline

# /health answers 503 while one engine step has run longer than this (a hung read or device).
STALL_LIMIT_S = 60.0


class ServerEndpoints:
    def __init__(self, pipeline: GenerationPipeline, metrics: ServerMetrics):
        self.pipeline, self.engine = pipeline, pipeline.engine
        self.info, self.settings = pipeline.info, pipeline.settings
        self.metrics = metrics
        self.started = int(time.time())

    async def models(self, request: Request) -> Response:
        """llama-server's single-model list: one model named by the first `--alias` (else the
        model's own name) with every alias in `aliases` and every `--tags` label in `tags`,
        beside the Ollama-style `models` entry llama-server also sends."""
        info = self.info
        name = (self.settings.aliases or [info.name])[0]
        return JSONResponse({
            "models": [{
                "name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": list(self.settings.tags) or [""],
                "capabilities": ["completion"], "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "",
                            "families": [""], "parameter_size": "",
                            "quantization_level": ""}}],
            "object": "list",
            "data": [{
                "id": name, "aliases": list(self.settings.aliases),
                "tags": list(self.settings.tags),
                "object": "model", "created": self.started, "owned_by": "kvshare", "meta": {
                    "n_ctx": info.ctx_size, "n_vocab": info.vocab_size,
                    "chat_template_caps": template_caps(info, self.pipeline.tool_calls),
                    "chat_template_polyfills": list(info.template_polyfills)}}]})

    async def health(self, request: Request) -> Response:
        """llama-server's /health ({"status": "ok"}; a 503 carries its error object: while the
        engine prepares a GPU model's steps, "Loading model"), with kvshare's reasons to be
        unhealthy (shutting down, an engine step that hangs) and the
        remote tier's state (`tiers.remote.state`: `ok` or `degraded`)."""
        if self.pipeline.shutting_down:
            return JSONResponse({"status": "shutting down", "error": error_object(
                503, "The server is shutting down")}, status_code=503)
        if self.engine.warming_up():
            # as llama-server answers while its model loads: a router or a readiness probe
            # waits, where a request would queue behind the start-up work
            return JSONResponse({"status": "loading model", "error": error_object(
                503, "Loading model")}, status_code=503)
        stalled = self.engine.stalled_for()
        if stalled > STALL_LIMIT_S:  # one step should take well under a second or two
            return JSONResponse({"status": "engine stalled", "step_seconds": round(stalled, 1),
                                 "error": error_object(
                                     503, f"An engine step has run for {stalled:.0f} s")},
                                status_code=503)
        body: dict = {"status": "ok"}
        # A shared tier that is down or slow makes its lookups misses: the replica still
        # answers every request correctly, so it stays healthy (200, and a router keeps
        # sending to it) and says which tier is degraded.
        # (The snapshot is a few dict copies: cheap enough for the event loop, and a busy
        # thread pool cannot delay /health.)
        remote = (self.engine.snapshot().get("tiers") or {}).get("remote")
        if remote is not None:
            body["tiers"] = {"remote": remote["health"]}
        return JSONResponse(body)

    async def metrics_endpoint(self, request: Request) -> Response:
        """The Prometheus text, with llama-server's `Process-Start-Time-Unix` header (when
        the server started, Unix seconds: a scraper tells a restart from a counter reset)."""
        data = await run_in_threadpool(self.metrics.render)
        return Response(data, media_type=self.metrics.content_type,
                        headers={"Process-Start-Time-Unix": str(self.started)})

    async def cache(self, request: Request) -> Response:
        snap = await run_in_threadpool(self.engine.snapshot)
        return JSONResponse({k: v for k, v in snap.items() if k != "slots"})
