"""MCP stdio servers as llama-server runs them (server-mcp.cpp): each configured server is
spawned at startup, asked for its tools (`initialize`, `notifications/initialized`,
`tools/list`, at most 10 s each) and stopped; a call spawns it again on demand and keeps it
for later calls, respawning it when it has died (a server that fails to start is not retried
for 5 s). JSON-RPC 2.0, one JSON message a line on the child's stdin/stdout; its stderr is
drained into the debug log (an undrained pipe blocks the child), a 4 KiB tail kept for the
error message. A call's reply is matched by id (notifications and stale replies skipped)
within the server's `timeout_ms`; a line over 8 MiB is dropped."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .config import McpServerConfig

log = logging.getLogger("kvshare.server.mcp")

PROTOCOL_VERSION = "2024-11-05"
WARMUP_TIMEOUT_S = 10.0
COOLDOWN_S = 5.0
MAX_LINE = 8 * 1024 * 1024
MAX_QUEUED = 65536
ERR_TAIL = 4096


@dataclass(frozen=True)
class McpToolDef:
    server: str
    name: str  # the server's own name for it, without "<server>_"
    description: str
    input_schema: Any


def _rpc_error(resp: dict) -> str:
    e = resp.get("error")
    if isinstance(e, dict):
        return str(e.get("message", "unknown error"))
    return e if isinstance(e, str) else "unknown error"


def result_to_response(result: Any) -> dict:
    """A `tools/call` result as a /tools reply: its text parts joined by newlines, as
    `plain_text_response`, or `error` when it says isError."""
    parts = result.get("content") if isinstance(result, dict) else None
    text = "\n".join(str(p.get("text", "")) for p in parts or []
                     if isinstance(p, dict) and p.get("type") == "text")
    if isinstance(result, dict) and result.get("isError") is True:
        return {"error": text or "MCP tool returned an error"}
    return {"plain_text_response": text}


class McpStdioSession:
    """One running MCP server process and its JSON-RPC session."""

    def __init__(self, cfg: McpServerConfig):
        self.cfg = cfg
        self.replies: queue.Queue[str | None] = queue.Queue(MAX_QUEUED)
        self.rpc_lock = threading.Lock()  # one request in flight per server
        self.next_id = 1
        self.initialized = False
        self.tools: list[McpToolDef] = []
        self.last_error = ""
        self.err_tail = ""
        self.proc: subprocess.Popen | None = None
        self.running = False

    def start(self) -> bool:
        env = {**os.environ, **self.cfg.env} if self.cfg.env else None
        try:
            self.proc = subprocess.Popen(
                [self.cfg.command, *self.cfg.args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                cwd=self.cfg.cwd or None, start_new_session=True)
        except OSError as e:
            self.last_error = f"failed to spawn '{self.cfg.command}': {e.strerror or e}"
            return False
        self.running = True
        threading.Thread(target=self._read_stdout, daemon=True,
                         name=f"mcp-{self.cfg.name}-out").start()
        threading.Thread(target=self._read_stderr, daemon=True,
                         name=f"mcp-{self.cfg.name}-err").start()
        return True

    def alive(self) -> bool:
        return self.running and self.proc is not None and self.proc.poll() is None

    def diagnostics(self) -> str:
        return "; ".join(s for s in (self.last_error, self.err_tail and
                                     "last stderr: " + self.err_tail.strip()) if s)

    def close(self) -> None:
        self.running = False
        if self.proc is None:
            return
        # the group: a grandchild holding the pipes open goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def _lines(self, f) -> Any:
        skipping = False
        while True:
            try:
                line = f.readline(MAX_LINE + 1)
            except (OSError, ValueError):
                return
            if not line:
                return
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                if not skipping:
                    log.warning("MCP '%s': dropping a line over %d bytes", self.cfg.name,
                                MAX_LINE)
                skipping = True
                continue
            if skipping:
                skipping = False
                continue
            text = line.decode("utf-8", "replace").strip()
            if text:
                yield text

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for text in self._lines(self.proc.stdout):
            # a full queue: unsolicited notifications nobody drains
            with contextlib.suppress(queue.Full):
                self.replies.put_nowait(text)
        self.running = False
        with contextlib.suppress(queue.Full):
            self.replies.put_nowait(None)  # EOF to a waiting caller

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for text in self._lines(self.proc.stderr):
            log.debug("MCP '%s' stderr: %s", self.cfg.name, text)
            self.err_tail = (self.err_tail + text + "\n")[-ERR_TAIL:]

    def _write(self, msg: dict) -> bool:
        proc = self.proc
        if proc is None or proc.stdin is None or not self.alive():
            return False
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def _rpc(self, method: str, params: dict | None, timeout_s: float,
             should_stop: Callable[[], bool]) -> dict:
        """The reply to one request, or {"error": {...}} (transport closed, timed out,
        cancelled)."""
        rid = self.next_id
        self.next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        if not self._write(msg):
            return {"error": {"code": -32603, "message": "transport closed"}}
        deadline = time.monotonic() + timeout_s
        while True:
            if should_stop():
                return {"error": {"code": -32603, "message": "cancelled"}}
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": {"code": -32603, "message": "request timed out"}}
            try:
                frame = self.replies.get(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            if frame is None:
                self.replies.put_nowait(None)  # stays closed for the next caller
                return {"error": {"code": -32603, "message": "transport closed"}}
            try:
                reply = json.loads(frame)
            except json.JSONDecodeError:
                continue  # a malformed line
            # no id: a notification; another id: the late reply of a timed-out request
            if isinstance(reply, dict) and reply.get("id") == rid:
                return reply

    def _ensure_init(self, timeout_s: float, should_stop: Callable[[], bool]) -> bool:
        if self.initialized:
            return True
        resp = self._rpc("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                        "clientInfo": {"name": "kvshare", "version": "1.0"}},
                         timeout_s, should_stop)
        if "result" not in resp:
            self.last_error = "initialize failed: " + _rpc_error(resp)
            return False
        self._write({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.initialized = True
        return True

    def list_tools(self, timeout_s: float, should_stop: Callable[[], bool]) -> list[McpToolDef]:
        with self.rpc_lock:
            if not self._ensure_init(timeout_s, should_stop):
                return []
            if self.tools:
                return self.tools
            resp = self._rpc("tools/list", None, timeout_s, should_stop)
            if "result" not in resp:
                self.last_error = "tools/list failed: " + _rpc_error(resp)
                return []
            listed = resp["result"].get("tools") if isinstance(resp["result"], dict) else None
            for t in listed if isinstance(listed, list) else []:
                if isinstance(t, dict):
                    self.tools.append(McpToolDef(self.cfg.name, str(t.get("name", "")),
                                                 str(t.get("description", "")),
                                                 t.get("inputSchema")))
            return self.tools

    def call_tool(self, name: str, arguments: dict,
                  should_stop: Callable[[], bool]) -> dict:
        timeout_s = self.cfg.timeout_ms / 1000
        with self.rpc_lock:
            if not self._ensure_init(timeout_s, should_stop):
                return {"error": self.last_error}
            resp = self._rpc("tools/call", {"name": name, "arguments": arguments},
                             timeout_s, should_stop)
        if "error" in resp:
            return {"error": _rpc_error(resp)}
        if "result" in resp:
            return result_to_response(resp["result"])
        return {"error": "invalid response from MCP server"}


class McpManager:
    """The configured MCP servers: their tools (listed at startup) and their sessions."""

    def __init__(self, configs: tuple[McpServerConfig, ...]):
        self.configs = {c.name: c for c in configs}
        self.registry: list[McpToolDef] = []
        self.sessions: dict[str, McpStdioSession] = {}
        self.dead_until: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def start(self) -> None:
        """Spawns each server once to list its tools, then stops it; a server that fails is
        logged and has no tools."""
        found: list[McpToolDef] = []
        for cfg in self.configs.values():
            s = McpStdioSession(cfg)
            if not s.start():
                log.warning("MCP warmup: failed to spawn '%s': %s", cfg.name, s.diagnostics())
                continue
            deadline = time.monotonic() + WARMUP_TIMEOUT_S

            def over(deadline: float = deadline) -> bool:
                return self.stopping.is_set() or time.monotonic() >= deadline

            tools = s.list_tools(WARMUP_TIMEOUT_S, over)
            if not tools and s.diagnostics():
                log.warning("MCP warmup: '%s': %s", cfg.name, s.diagnostics())
            log.info("MCP warmup: '%s' discovered %d tools", cfg.name, len(tools))
            found += tools
            s.close()
        with self.lock:
            self.registry = found

    def _session(self, name: str) -> McpStdioSession | None:
        stale = None
        with self.lock:
            if self.stopping.is_set():
                return None
            if time.monotonic() < self.dead_until.get(name, 0):
                return None
            s = self.sessions.get(name)
            if s is not None and s.alive():
                return s
            if s is not None:
                log.warning("MCP '%s' is no longer alive: %s", name, s.diagnostics())
                stale = self.sessions.pop(name)
            cfg = self.configs.get(name)
            fresh = None
            if cfg is not None:
                fresh = McpStdioSession(cfg)
                if fresh.start():
                    self.sessions[name] = fresh
                else:
                    log.warning("MCP '%s': failed to start: %s", name, fresh.diagnostics())
                    self.dead_until[name] = time.monotonic() + COOLDOWN_S
                    fresh = None
        if stale is not None:
            stale.close()
        return fresh

    def call_tool(self, server: str, tool: str, arguments: dict,
                  should_stop: Callable[[], bool] = lambda: False) -> dict:
        s = self._session(server)
        if s is None:
            return {"error": "MCP server unavailable: " + server}
        return s.call_tool(tool, arguments, lambda: self.stopping.is_set() or should_stop())

    def shutdown(self) -> None:
        """In-flight calls return ("cancelled"), every server process is killed."""
        self.stopping.set()
        with self.lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            s.close()
