"""`GET /tools`, `POST /tools` and `/cors-proxy`, as llama-server serves them (server.cpp,
server-tools.cpp server_tools::setup): the registry of the built-in tools `--tools` turned
on and the MCP servers' tools (`<server>_<tool>`; one whose name is taken is skipped), the
call endpoint in llama-server's request and response shapes, and 403 `feature_disabled`
where the flags left a feature off. The API key guards these paths like every other (the
auth middleware is outside them)."""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any, Iterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..body import read_json
from .builtin import BadParams, Tool, builtin_tools
from .config import ToolsConfig, describe
from .cors_proxy import proxy
from .mcp import McpManager, McpToolDef

log = logging.getLogger("kvshare.server.tools")

# header-derived parameters: a client sets them by header only, never in params
_HEADER_PARAMS = ("cwd", "runtime", "resp_type")


def _error(status: int, message: str, type_: str, code: int | None = None) -> JSONResponse:
    """llama-server's format_error_response body; `code` differs from the HTTP status where
    llama-server's does (an unknown tool: 404 with code 400)."""
    return JSONResponse({"error": {"code": code or status, "message": message, "type": type_}},
                        status_code=status)


async def feature_disabled(request: Request) -> Response:
    return JSONResponse({"error": {"message": "this feature is disabled",
                                   "type": "feature_disabled"}}, status_code=403)


class McpTool(Tool):
    """One MCP server's tool, called through the manager."""
    kind, uses_cwd = "mcp", False

    def __init__(self, d: McpToolDef, manager: McpManager):
        self.d, self.manager = d, manager
        self.name = self.display_name = f"{d.server}_{d.name}"

    def definition(self) -> dict:
        schema = self.d.input_schema if isinstance(self.d.input_schema, dict) else {}
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.d.description,
                                                 "parameters": schema}}

    def invoke(self, params: dict, on_chunk: Any = None) -> dict:
        args = {k: v for k, v in params.items() if k not in _HEADER_PARAMS}
        return self.manager.call_tool(self.d.server, self.d.name, args)


class ServerTools:
    """The tools the flags turned on; `start()` lists the MCP servers' tools (spawning each
    once), `shutdown()` stops every MCP server."""

    def __init__(self, config: ToolsConfig, settings: Any):
        self.config = config
        self.settings = settings  # ServerSettings: the request body limits
        self.mcp = McpManager(config.mcp_servers)
        self.tools: list[Tool] = builtin_tools(config.tools)

    def start(self) -> None:
        if not self.config.mcp_servers:
            return
        self.mcp.start()
        seen = {t.name for t in self.tools}
        for d in self.mcp.registry:
            t = McpTool(d, self.mcp)
            if t.name in seen:
                log.warning('MCP tool "%s" from server "%s" collides with an existing tool, '
                            "skipping", t.name, d.server)
                continue
            seen.add(t.name)
            self.tools.append(t)
        log.info("server tools: %s", describe(self.config))

    def shutdown(self) -> None:
        self.mcp.shutdown()

    def find(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    async def list_tools(self, request: Request) -> Response:
        return JSONResponse([t.to_json() for t in self.tools])

    async def call_tool(self, request: Request) -> Response:
        # kvshare serve's body reader: the size limit, the body deadline, a JSON object (its
        # errors are the server's 4xx in llama-server's shape)
        body = await read_json(request, self.settings)
        if not isinstance(body.get("tool"), str):
            return _error(400, "\"tool\" (a string) is required", "invalid_request_error")
        params = body.get("params", {})
        stream = body.get("stream", False)
        if not isinstance(params, dict) or not isinstance(stream, bool):
            return _error(400, "\"params\" must be an object and \"stream\" a boolean",
                          "invalid_request_error")
        params = {k: v for k, v in params.items() if k not in _HEADER_PARAMS}
        runtime = request.headers.get("x-tool-runtime", "")
        if runtime:  # llama-server's isolates; refused rather than run on the host
            return _error(500, f"unknown tool runtime: {runtime} (kvshare runs tools on the "
                               "host only)", "server_error")
        for header, key in (("x-tool-cwd", "cwd"), ("x-resp-type", "resp_type")):
            if request.headers.get(header):
                params[key] = request.headers[header]
        name = body["tool"]
        tool = self.find(name)
        if tool is None:
            return _error(404, f'unknown tool "{name}"', "invalid_request_error", code=400)
        if stream and not tool.support_stream:
            return _error(404, f'tool "{name}" does not support stream = true',
                          "invalid_request_error", code=400)
        if stream:
            return StreamingResponse(self._stream(tool, params), media_type="text/event-stream")
        try:
            result = await run_in_threadpool(tool.invoke, params)
        except BadParams as e:
            return _error(400, str(e), "invalid_request_error")
        except Exception as e:  # noqa: BLE001 - llama-server's 500 with the message
            log.exception("tool %s failed", name)
            return _error(500, str(e), "server_error")
        return JSONResponse(result)

    def _stream(self, tool: Tool, params: dict) -> Iterator[str]:
        """SSE: `data: {"chunk": ...}` as output arrives, then `data: {"done": true}` (with
        `error` when the call failed). The call runs in its own thread; a client that goes
        away ends the generator, and the next chunk kills the command."""
        chunks: queue.Queue[str | None] = queue.Queue()
        gone = threading.Event()
        failure: list[str] = []

        def on_chunk(text: str) -> bool:
            if text:
                chunks.put(text)
            return not gone.is_set()

        def work() -> None:
            try:
                tool.invoke(params, on_chunk)
            except Exception as e:  # noqa: BLE001 - reported in the final event
                failure.append(str(e) or "An unknown error occurred")
            chunks.put(None)

        threading.Thread(target=work, daemon=True, name=f"tool-{tool.name}").start()
        try:
            while (text := chunks.get()) is not None:
                yield "data: " + json.dumps({"chunk": text}) + "\n\n"
            done: dict[str, Any] = {"done": True}
            if failure:
                done["error"] = failure[0]
            yield "data: " + json.dumps(done) + "\n\n"
        finally:
            gone.set()

    async def cors_proxy(self, request: Request) -> Response:
        return await proxy(request, self.settings.max_body_bytes)

    def routes(self) -> list[Route]:
        tools_get, tools_post = ((self.list_tools, self.call_tool) if self.config.tools_endpoint
                                 else (feature_disabled, feature_disabled))
        cors = self.cors_proxy if self.config.ui_mcp_proxy else feature_disabled
        return [Route("/tools", tools_get, methods=["GET"]),
                Route("/tools", tools_post, methods=["POST"]),
                Route("/cors-proxy", cors, methods=["GET", "POST"])]
