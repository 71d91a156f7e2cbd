"""The web UI: the page at `/` (plain files from `kvshare/webui`, served without a key) and the
JSON it polls, `GET /webui/state` (behind the same auth and CORS as the API).

The state is the engine's snapshot (pool, tiers, checkpoints: server-wide, as `/cache` shows
them) plus what `SessionBoard` saw of the requests: sessions, their prefix tree and the tokens
sharing saved, each tenant's own only. No prompt text unless the operator starts the server
with `KVSHARE_WEBUI_PROMPTS=1`; never keys or salts (the tree's digests are not sent either).
docs/webui.md describes the page.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvshare.engine.api import EngineClient

from .middleware import route_path
from .request_log import RequestObserver
from .tenancy import KeyRing, Tenant
from .webui_sessions import BUCKET_S, ObserverTee, SessionBoard, prefix_tree

PAGE_DIR = Path(__file__).resolve().parent.parent / "webui"
STATE_PATH = "/webui/state"
PROMPTS_ENV = "KVSHARE_WEBUI_PROMPTS"
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml",
          ".png": "image/png", ".ico": "image/x-icon"}
# The page loads only its own files and talks only to its own server.
_PAGE_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The tiers' own names as the page labels them.
_TIER_NAMES = {"ram": "RAM", "disk": "disk", "remote": "Redis"}
# Each tier's figures the page shows, by the snapshot's key.
_TIER_KEYS = ("entries", "blocks", "bytes", "bytes_on_disk", "budget", "budget_bytes",
              "pinned", "pinned_bytes", "hits", "misses", "restores", "tokens_served",
              "queued", "errors")


def prompts_shown(environ: dict[str, str] | None = None) -> bool:
    """The operator's choice to show prompt text on the page (`KVSHARE_WEBUI_PROMPTS=1`)."""
    return (environ if environ is not None else os.environ).get(PROMPTS_ENV, "") == "1"


def page_files(root: Path = PAGE_DIR) -> dict[str, Path]:
    """The page's files by the path they are served at: `/` and `/webui/<name>`. Read from
    the package once, so no request path ever reaches the file system."""
    files = {f"/webui/{p.name}": p for p in sorted(root.iterdir())
             if p.is_file() and p.suffix in _TYPES and p.name != "index.html"}
    # only at /: the page names its files relative to itself
    files["/"] = root / "index.html"
    return files


class WebUIPages:
    """Serves the page's files (GET and HEAD) before auth: the page itself holds no data and
    asks for the key when the server has one. Everything else goes on to the app."""

    def __init__(self, app: ASGIApp, files: dict[str, Path]):
        self.app = app
        self.bodies = {path: (p.read_bytes(), _TYPES[p.suffix]) for path, p in files.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD"):
            found = self.bodies.get(route_path(scope))
            if found is not None:
                body, kind = found
                resp = Response(body if scope["method"] == "GET" else b"", media_type=kind,
                                headers={**_PAGE_HEADERS, "Content-Length": str(len(body))})
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def _tier_view(name: str, stats: dict) -> dict:
    out: dict[str, Any] = {"name": _TIER_NAMES.get(name, name)}
    out.update({k: stats[k] for k in _TIER_KEYS if isinstance(stats.get(k), (int, float))})
    used = stats.get("bytes", stats.get("bytes_on_disk"))
    budget = stats.get("budget", stats.get("budget_bytes"))
    out["used_bytes"], out["budget_bytes"] = used, budget or None
    looked = (stats.get("hits") or 0) + (stats.get("misses") or 0)
    out["hit_rate"] = (stats.get("hits") or 0) / looked if looked else None
    return out


def _pool_view(pool: dict) -> dict:
    bb = pool.get("block_bytes") or 0
    return {"name": "pool", "blocks": pool["total"], "used_blocks": pool["used"],
            "cached_blocks": pool["cached"], "shared_blocks": pool["shared"],
            "used_bytes": pool.get("kv_bytes_held", pool["used"] * bb),
            "cached_bytes": pool["cached"] * bb, "budget_bytes": pool["total"] * bb or None,
            "tokens_used": pool.get("tokens_used"), "block_size": pool.get("block_size")}


def prefill_seconds_per_token(counters: dict) -> float:
    """The measured cost of one computed prompt token: what a reused one saved."""
    computed = counters.get("prompt_tokens_total", 0) - counters.get("prompt_tokens_cached_total", 0)
    secs = counters.get("prompt_seconds_total", 0.0)
    return secs / computed if computed > 0 and secs > 0 else 0.0


class WebUIState:
    """`GET /webui/state`: what the cache view draws, for the tenant that asks."""

    def __init__(self, engine: EngineClient, board: SessionBoard, keyring: KeyRing | None,
                 show_prompts: bool):
        self.engine, self.board, self.keyring = engine, board, keyring
        self.show_prompts = show_prompts
        self._tree: dict[str | None, tuple[int, list[dict]]] = {}  # tenant -> (version, tree)

    def tree(self, sessions: list, tenant: str | None, saved_to: list[str]) -> list[dict]:
        """The prefix tree, rebuilt only when a session came or went since the last poll."""
        version = self.board.version
        cached = self._tree.get(tenant)
        if cached is not None and cached[0] == version:
            return cached[1]
        text = self._text if self.show_prompts else None
        tree = prefix_tree(sessions, self.board.block_size, saved_to, text)
        self._tree[tenant] = (version, tree)
        return tree

    def _text(self, tokens: list[int]) -> str:
        s = self.engine.detokenize(tokens)
        return s if len(s) <= 600 else s[:300] + " … " + s[-300:]

    def build(self, tenant: Tenant | None) -> dict:
        snap = self.engine.snapshot()
        tiers = snap.get("tiers") or {}
        self.board.attribute_restores({_TIER_NAMES.get(t, t): int(v.get("tokens_served", 0))
                                       for t, v in tiers.items()})
        everyone = self.keyring is None
        name = tenant.name if tenant is not None else None
        sessions = self.board.visible(name, everyone)
        saved_to = [_TIER_NAMES.get(t, t) for t in ("ram", "disk", "remote") if t in tiers]
        totals, history = self.board.savings(name, everyone)
        rate = prefill_seconds_per_token(snap.get("counters") or {})
        info = self.engine.info
        return {
            "server": {"model": info.name, "block_size": info.block_size,
                       "ctx_size": info.ctx_size, "auth": self.keyring is not None,
                       "tenant": name, "prompt_text": self.show_prompts, "time": time.time()},
            "engine": {"sequences": snap.get("sequences", 0),
                       "queued": (snap.get("faults") or {}).get("queued", 0),
                       "prefill_ms_per_token": round(rate * 1e3, 4)},
            "tiers": [_pool_view(snap["pool"])] + [_tier_view(t, v) for t, v in tiers.items()],
            "checkpoints": snap.get("checkpoints"),
            "sessions": [s.as_json() for s in reversed(sessions)],
            "tree": self.tree(sessions, name, saved_to),
            "savings": {**totals.as_json(rate), "bucket_s": BUCKET_S,
                        "history": [dict(b, seconds_saved=round(b["cached_tokens"] * rate, 3))
                                    for b in history]},
        }

    def encoded(self, tenant: Tenant | None) -> bytes:
        """`build` as the response body (JSONResponse's encoding)."""
        return json.dumps(self.build(tenant), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()

    async def endpoint(self, request: Request) -> Response:
        tenant = (request.scope.get("state") or {}).get("tenant")
        # built and encoded off the event loop, which meanwhile streams the sessions' tokens
        body = await run_in_threadpool(self.encoded, tenant)
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})


class WebUI:
    """The web UI's parts as the app mounts them: the board that follows the requests, the
    state endpoint and the page's files."""

    def __init__(self, engine: EngineClient, keyring: KeyRing | None,
                 show_prompts: bool | None = None):
        shown = prompts_shown() if show_prompts is None else show_prompts
        self.board = SessionBoard(engine.info.block_size, keep_tokens=shown)
        self.state = WebUIState(engine, self.board, keyring, shown)
        self.files = page_files()

    def observer(self, slots: RequestObserver) -> RequestObserver:
        """The pipeline's request observer: the slot table, and the board beside it."""
        return ObserverTee(slots, self.board)

    def routes(self) -> list[Route]:
        return [Route(STATE_PATH, self.state.endpoint, methods=["GET"])]

    def middleware(self) -> Middleware:
        return Middleware(WebUIPages, files=self.files)
