"""llama-server's server-side tools (tools/server/server-tools.cpp, server-mcp.cpp,
server-cors-proxy.h): the built-in tools a client calls through `GET/POST /tools`
(`--tools`), the tools of MCP stdio servers (`--mcp-servers-json`, `--mcp-servers-config`)
exposed beside them as `<server>_<tool>`, and the web UI's MCP CORS proxy (`--ui-mcp-proxy`).
Nothing here runs unless those flags turn it on (docs/llama-server.md, docs/api.md).

- config.py: the flags as a `ToolsConfig` (tool names, MCP server definitions, `--agent`)
- runner.py: a bounded subprocess (output cap, deadline, process group killed)
- listing.py: directory listings (git ls-files, else a walker) and llama.cpp's glob
- edit.py: edit_file's exact and whitespace-tolerant replacement
- builtin.py: the seven built-in tools, their JSON schemas and results
- mcp.py: the MCP stdio client (JSON-RPC over NDJSON) and the server manager
- cors_proxy.py: the `/cors-proxy` forwarder
- routes.py: the `/tools` and `/cors-proxy` endpoints and the tool registry
"""
