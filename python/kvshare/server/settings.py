"""Server settings that are not engine settings (those are `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .server_tools.config import ToolsConfig

if TYPE_CHECKING:  # pragma: no cover
    from .tenancy import ApiKey, PublicPrefix

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServerSettings:
    # `Authorization: Bearer <key>` (or `X-Api-Key: <key>`) required on every path but /health.
    api_key: str | None = None
    # More keys (`--api-key` lists, `--api-key-file`), each with an optional tenant name.
    api_keys: "list[ApiKey]" = field(default_factory=list)
    # Who shares cached prefixes (server/tenancy.py, docs/security.md): "global", "key" or
    # "salt"; None: "key" when any API key is set, else "global".
    cache_scope: str | None = None
    # Operator-marked prefixes every tenant may share (`--public-prefix FILE`).
    public_prefixes: "list[PublicPrefix]" = field(default_factory=list)
    # Mount prefix when served behind a reverse proxy (e.g. "/kvshare"). Requests may arrive with
    # the prefix (it is stripped for routing) or without it (the proxy stripped it).
    root_path: str = ""
    # Request bodies larger than this get 413 without being read into memory.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A body over the limit is read and discarded up to this many bytes before the 413 is sent,
    # so that HTTP/1.1 clients that write the whole body before reading see the 413 instead of a
    # connection reset; beyond it the connection is closed. Memory use stays constant.
    max_discard_bytes: int = 256 * 1024 * 1024
    # Edge limits (server/limits.py): seconds a client gets to send a request's headers, and
    # the longest gap while it sends a body (the whole body: 10x this); then 408 and the
    # connection closed. Idle keep-alive connections close after it too. None: no deadline.
    body_timeout: float | None = 30.0
    # Requests in progress at once (/health, /metrics not counted); beyond: 503 + Retry-After.
    max_connections: int = 1024
    # Names /v1/models lists for the loaded model (`--alias`, repeatable); requests may name
    # any model and are served by the loaded one. Empty: the model file's name.
    aliases: list[str] = field(default_factory=list)
    # `--tags`: informative labels /v1/models lists for the model (llama-server's).
    tags: list[str] = field(default_factory=list)
    # Tool-call format (kvshare.toolcalls: hermes, qwen35, lfm2, llama3); None: detected from
    # the model's chat template.
    tool_parser: str | None = None
    # Most calls a forced reply (tool_choice required, or any reply in the generic format)
    # may hold when parallel calls are allowed (`--max-parallel-tool-calls`); the grammar
    # ends the turn after the last.
    max_parallel_tool_calls: int = 8
    # Seconds a stored Responses API response (`store`, `previous_response_id`) lives
    # (`--cache-ttl`); None or 0: until evicted by count.
    response_ttl_s: float | None = 259200.0
    # Request bodies over 1 MiB buffered at once, all requests together; more wait unread.
    body_budget_bytes: int = 256 * 1024 * 1024
    # llama-server `-n/--n-predict`: max_tokens of a request that gives none (max_tokens,
    # max_completion_tokens, n_predict, max_output_tokens); None (-1): until the context is
    # full. A request's own limit always wins.
    default_max_tokens: int | None = None
    # llama-server `--keep`: n_keep of a request that gives none (prompt tokens a context
    # shift keeps, BOS aside; -1: the whole prompt).
    n_keep: int = 0
    # Sampling defaults of requests that leave a field out, by SamplingParams name
    # (llama-server's --temp, --top-k, --seed, ...; apis/sampling_fields.py); each API's own
    # defaults apply to the fields not given here.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # llama-server `--reasoning-format`: reasoning_format of a request that gives none
    # ("none", "auto", "deepseek" or "deepseek-legacy").
    reasoning_format: str = "auto"
    # llama-server `--reasoning-budget N` / `--reasoning-budget-message`: tokens a thinking
    # block may take before its end is forced (-1: unlimited), and the text forced before the
    # end tag; a request's reasoning_budget_tokens / reasoning_budget_message win
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    # CORS (server/cors.py): origins allowed besides the loopback ones (`--cors-origins`;
    # "*": any), the methods a preflight allows, the headers it allows (None: those the
    # browser asks for), and whether allowed origins get `Access-Control-Allow-Credentials`.
    cors_origins: list[str] = field(default_factory=list)
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str | None = None
    cors_credentials: bool = True
    # GET /slots served (`--slots`, the default) or 501 (`--no-slots`), as llama-server.
    slots_endpoint: bool = True
    # The page at `/` and its state endpoint `/webui/state` (server/webui.py, docs/webui.md);
    # False (`--no-webui`, llama-server's flag): neither is served, `/` is a 404.
    webui: bool = True
    # llama-server `--slot-save-path`: directory of `POST /slots/{id}?action=save|restore`
    # files; None: those actions are refused.
    slot_save_path: str | None = None
    # llama-server's server tools (`--tools`, `--mcp-servers-*`, `--ui-mcp-proxy`, `-ag`;
    # server/server_tools): what /tools and /cors-proxy serve; all off by default (403).
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    # llama-server `--ui-config JSON` / `--ui-config-file PATH`: its web UI's default settings,
    # any JSON value, served as-is as /props' `ui_settings` ({}: none given).
    ui_settings: Any = field(default_factory=dict)
