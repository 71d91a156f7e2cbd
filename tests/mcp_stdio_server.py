"""A small MCP server for tests/test_server_tools_mcp.py: JSON-RPC 2.0 over stdio, one JSON
message a line, as llama.cpp's tests/fixtures/mcp_echo_server.py. Tools: echo, add,
fail_once (an error the first call), crash (the process exits without answering),
is_error (an isError result); before each tools/call reply it sends a notification (which
the client must skip) and writes a line to stderr (which the client must drain).
`--tools echo,...` lists only those tools; `--rename OLD=NEW` lists one under another name."""

from __future__ import annotations

import json
import sys

ALL_TOOLS = [
    {"name": "echo", "description": "Echo back the input message",
     "inputSchema": {"type": "object", "properties": {
         "message": {"type": "string", "description": "Message to echo"}},
         "required": ["message"]}},
    {"name": "add", "description": "Add two numbers",
     "inputSchema": {"type": "object", "properties": {"a": {"type": "number"},
                                                      "b": {"type": "number"}},
                     "required": ["a", "b"]}},
    {"name": "fail_once", "description": "Fails on the first call",
     "inputSchema": {"type": "object", "properties": {}}},
    {"name": "crash", "description": "Exits without answering",
     "inputSchema": {"type": "object", "properties": {}}},
    {"name": "is_error", "description": "Returns an isError result",
     "inputSchema": {"type": "object", "properties": {}}},
]


def main() -> None:
    only = None
    if "--tools" in sys.argv:
        only = set(sys.argv[sys.argv.index("--tools") + 1].split(","))
    tools = [t for t in ALL_TOOLS if only is None or t["name"] in only]
    if "--rename" in sys.argv:  # OLD=NEW: one tool listed under another name
        old, new = sys.argv[sys.argv.index("--rename") + 1].split("=")
        tools = [{**t, "name": new} if t["name"] == old else t for t in tools]
    failed_once = False
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            continue
        method, rid, params = req.get("method"), req.get("id"), req.get("params") or {}
        if rid is None:
            continue  # notifications/initialized
        result = None
        error = None
        if method == "initialize":
            result = {"protocolVersion": "2024-11-05", "capabilities": {"tools": {}},
                      "serverInfo": {"name": "kvshare-test", "version": "1.0"}}
        elif method == "tools/list":
            result = {"tools": tools}
        elif method == "tools/call":
            name, args = params.get("name"), params.get("arguments") or {}
            print(f"calling {name}", file=sys.stderr, flush=True)
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "method": "notifications/progress",
                                         "params": {"progress": 0}}) + "\n")
            if name == "echo":
                result = {"content": [{"type": "text", "text": f"echo: {args.get('message')}"}]}
            elif name == "add":
                result = {"content": [{"type": "text", "text": str(args["a"] + args["b"])}]}
            elif name == "fail_once" and not failed_once:
                failed_once = True
                error = {"code": -32000, "message": "transient error"}
            elif name == "fail_once":
                result = {"content": [{"type": "text", "text": "ok"}]}
            elif name == "crash":
                sys.exit(3)
            elif name == "is_error":
                result = {"content": [{"type": "text", "text": "it went wrong"}],
                          "isError": True}
            else:
                error = {"code": -32602, "message": f"Unknown tool: {name}"}
        else:
            error = {"code": -32601, "message": "Method not found"}
        reply = {"jsonrpc": "2.0", "id": rid}
        reply.update({"error": error} if error is not None else {"result": result})
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
