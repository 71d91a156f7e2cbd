"""The server-tools flags as one `ToolsConfig`: `--tools` (names or `all`), `--tools-runtime`
(only the host), `--mcp-servers-config` / `--mcp-servers-json` (Cursor's `mcpServers` JSON),
`--ui-mcp-proxy` and `-ag/--agent` (all tools and the proxy), as common/arg.cpp reads them.
A bad value is a `ToolsConfigError`, one line for the command line (exit 2)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

# llama.cpp's build_tools() order: GET /tools lists them in it
BUILTIN_TOOL_NAMES = ("read_file", "file_glob_search", "grep_search", "exec_shell_command",
                      "write_file", "edit_file", "get_info")
# server_mcp_server_config::timeout_ms: one MCP tool call's deadline unless the config sets one
MCP_DEFAULT_TIMEOUT_MS = 30000
# what --tools-runtime accepts: llama-server's default, the host
HOST_RUNTIMES = ("", "none", "host")
AGENT_FLAGS = ("-ag", "--agent", "-no-ag", "--no-agent")


class ToolsConfigError(ValueError):
    """A server-tools flag kvshare cannot start with; its text is the error line."""


@dataclass(frozen=True)
class McpServerConfig:
    """One `mcpServers` entry: the command spawned with its args, env merged over the
    server's, working directory, and one tool call's deadline."""
    name: str
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    timeout_ms: int = MCP_DEFAULT_TIMEOUT_MS


@dataclass(frozen=True)
class ToolsConfig:
    tools: tuple[str, ...] = ()  # built-in tools turned on, in BUILTIN_TOOL_NAMES order
    mcp_servers: tuple[McpServerConfig, ...] = ()
    ui_mcp_proxy: bool = False

    @property
    def tools_endpoint(self) -> bool:
        """/tools is served (else 403, as llama-server) when a tool or an MCP server is on."""
        return bool(self.tools or self.mcp_servers)


def tools_runtime(value: str) -> str:
    """--tools-runtime: the host only (llama-server's default, `none`); its container and ssh
    runtimes are refused."""
    v = value.strip()
    if v.lower() not in HOST_RUNTIMES:
        raise argparse.ArgumentTypeError(
            f"{value!r}: kvshare runs tools on the host only (no container or ssh runtime); "
            "use none")
    return "none"


def enabled_tools(value: str | None) -> tuple[str, ...]:
    """`--tools A,B` or `all` as the built-in tools it turns on (server_tools::setup)."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    for n in names:
        if n != "all" and n not in BUILTIN_TOOL_NAMES:
            raise ToolsConfigError(f'--tools: unknown tool "{n}". available tools: '
                                   + ", ".join(BUILTIN_TOOL_NAMES))
    if "all" in names:
        return BUILTIN_TOOL_NAMES
    return tuple(t for t in BUILTIN_TOOL_NAMES if t in names)


def parse_mcp_servers(text: str, source: str) -> list[McpServerConfig]:
    """Cursor's `{"mcpServers": {NAME: {command, args, env, cwd, timeout_ms}}}` (llama.cpp's
    parse_cursor_format): no `mcpServers` object is no server, an entry without a command is
    skipped; invalid JSON or a wrongly typed field is an error."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolsConfigError(f"failed to parse MCP config JSON ({source}): {e}") from None
    servers = doc.get("mcpServers") if isinstance(doc, dict) else None
    if not isinstance(servers, dict):
        return []
    out = []
    for name, cfg in servers.items():
        if not isinstance(cfg, dict):
            raise ToolsConfigError(f"MCP server {name!r} ({source}): not a JSON object")
        command = cfg.get("command") or ""
        args, env = cfg.get("args", []), cfg.get("env", {})
        timeout = cfg.get("timeout_ms", MCP_DEFAULT_TIMEOUT_MS)
        if not (isinstance(command, str) and isinstance(cfg.get("cwd", ""), str)
                and isinstance(args, list) and all(isinstance(a, str) for a in args)
                and isinstance(env, dict) and all(isinstance(v, str) for v in env.values())
                and isinstance(timeout, int) and timeout > 0):
            raise ToolsConfigError(
                f"MCP server {name!r} ({source}): command and cwd are strings, args a list of "
                "strings, env an object of strings, timeout_ms a positive integer")
        if not command:
            continue  # llama.cpp: "has no command, skipping"
        out.append(McpServerConfig(name, command, tuple(args), dict(env),
                                   cfg.get("cwd", ""), timeout))
    return out


def _agent_position(args: argparse.Namespace, written: Sequence[str],
                    environ: dict[str, str]) -> int | None:
    """Where -ag/--agent (or its off form) last took effect: its index among the written
    flags, -1 when only its environment variable set it, None when nothing did."""
    pos = max((i for i, f in enumerate(written) if f in AGENT_FLAGS), default=None)
    if pos is None and ("KVSHARE_AGENT" in environ or "LLAMA_ARG_AGENT" in environ):
        return -1
    return pos


def apply_agent(args: argparse.Namespace, written: Sequence[str],
                environ: dict[str, str]) -> None:
    """llama-server's `-ag/--agent`: every built-in tool and the MCP proxy on (`-no-ag`:
    both off), unless `--tools` or the proxy flag comes after it (llama-server applies its
    flags in order, the environment first)."""
    pos = _agent_position(args, written, environ)
    if pos is None:
        return
    after = set(written[pos + 1:])
    if not after & {"--tools"}:
        args.tools = "all" if args.agent else None
    if not after & {"--ui-mcp-proxy", "--webui-mcp-proxy", "--no-ui-mcp-proxy",
                    "--no-webui-mcp-proxy"}:
        args.ui_mcp_proxy = bool(args.agent)


def tools_config(args: argparse.Namespace) -> ToolsConfig:
    """The parsed `kvshare serve` arguments' `ToolsConfig`; reads --mcp-servers-config."""
    servers: list[McpServerConfig] = []
    path = getattr(args, "mcp_servers_config", None)
    if path:
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ToolsConfigError(
                f"failed to open MCP config file: {path} ({e.strerror or e})") from None
        servers += parse_mcp_servers(text, path)
    inline = getattr(args, "mcp_servers_json", None)
    if inline:
        servers += parse_mcp_servers(inline, "--mcp-servers-json")
    unique: dict[str, McpServerConfig] = {}
    for s in servers:  # llama.cpp: "duplicate server name, skipping" (the first one stays)
        unique.setdefault(s.name, s)
    return ToolsConfig(tools=enabled_tools(getattr(args, "tools", None)),
                       mcp_servers=tuple(unique.values()),
                       ui_mcp_proxy=bool(getattr(args, "ui_mcp_proxy", False)))


def describe(cfg: ToolsConfig) -> dict[str, Any]:
    """What the startup log says is on (llama-server's "security: ... enabled" warning)."""
    return {"tools": list(cfg.tools), "mcp_servers": [s.name for s in cfg.mcp_servers],
            "ui_mcp_proxy": cfg.ui_mcp_proxy}
