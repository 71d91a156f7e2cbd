"""The seven built-in tools of llama-server's `--tools` (server-tools.cpp), with its names,
JSON schemas (as `GET /tools` lists them), results and limits. A tool's result is a JSON
object: `plain_text_response` (what a model reads) and tool-specific fields, or `error`
with a message (still HTTP 200, as llama-server). A missing or mistyped required parameter
is a `BadParams` (HTTP 400).

Every path is resolved on the host against the request's `x-tool-cwd` (else the server's
working directory), `~` expanded; nothing confines it: llama-server's tools are for a
trusted local client, which is why they are off unless `--tools` names them."""

from __future__ import annotations

import base64
import os
import platform
import re
from typing import Any, Callable

from .edit import EditError, apply_edits
from .listing import ALL, DIRS, FILES, list_entries, path_glob_match
from .runner import run_bounded

READ_FILE_MAX_SIZE = 16 * 1024
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100
EXEC_MAX_OUTPUT = 16 * 1024
EXEC_MAX_TIMEOUT_S = 60
EXEC_DEFAULT_TIMEOUT_S = 10
GET_INFO_MAX_OUTPUT = 4096
GET_INFO_TIMEOUT_S = 5

Chunk = Callable[[str], bool]


class BadParams(ValueError):
    """A required parameter missing or of the wrong type (llama-server's 400)."""


def _required(params: dict, key: str, typ: type) -> Any:
    if key not in params:
        raise BadParams(f"missing required parameter '{key}'")
    v = params[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise BadParams(f"parameter '{key}' must be {'a string' if typ is str else typ.__name__}")
    return v


def _optional(params: dict, key: str, default: Any) -> Any:
    """llama.cpp's json_value: the default when absent, null or of another type."""
    v = params.get(key)
    if v is None or type(v) is not type(default):
        return default
    return v


def _fn(name: str, description: str, properties: dict, required: list[str] | None) -> dict:
    params: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        params["required"] = required
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": params}}


def _p(typ: str, description: str) -> dict:
    return {"type": typ, "description": description}


class Tool:
    name = ""
    display_name = ""
    permission_write = False
    support_stream = False
    uses_cwd = True
    kind = "server"

    def definition(self) -> dict:
        raise NotImplementedError

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        raise NotImplementedError

    def to_json(self) -> dict:
        return {"display_name": self.display_name, "tool": self.name, "type": self.kind,
                "permissions": {"write": self.permission_write}, "uses_cwd": self.uses_cwd,
                "definition": self.definition()}


def resolve(params: dict, path: str) -> str:
    """`path` with `~` expanded, made absolute against the request's cwd (or the server's),
    `.` and `..` folded."""
    p = os.path.expanduser(path) if path.startswith("~") else path
    if not os.path.isabs(p):
        p = os.path.join(params.get("cwd") or os.getcwd(), p)
    return os.path.normpath(p)


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _utf8(text: str) -> str:
    """Text for a JSON reply: bytes that are not UTF-8 shown as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class ReadFile(Tool):
    name, display_name = "read_file", "Read file"

    def definition(self) -> dict:
        return _fn(self.name,
                   "Read the contents of a file. Optionally specify a 1-based line range. If "
                   "append_loc is true, each line is prefixed with its line number (e.g. "
                   "\"1\u2192...\").", {
                       "path": _p("string", "Path to the file"),
                       "start_line": _p("integer", "First line to read, 1-based (default: 1)"),
                       "end_line": _p("integer", "Last line to read, 1-based inclusive "
                                                 "(default: end of file)"),
                       "append_loc": _p("boolean", "Prefix each line with its line number"),
                   }, ["path"])

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        path = _required(params, "path", str)
        start, end = _optional(params, "start_line", 1), _optional(params, "end_line", -1)
        append_loc = _optional(params, "append_loc", False)
        full = resolve(params, path)
        try:
            size = os.stat(full).st_size
        except OSError:
            return {"error": "cannot stat file: " + path}
        if params.get("resp_type") == "base64":  # the x-resp-type header, not the model
            if size > READ_FILE_MAX_SIZE_BASE64:
                return {"error": f"file too large ({size} bytes, max "
                                 f"{READ_FILE_MAX_SIZE_BASE64})"}
            data = _read_bytes(full)
            if data is None:
                return {"error": "failed to open file: " + path}
            return {"base64": base64.b64encode(data).decode(), "size_bytes": len(data)}
        if size > READ_FILE_MAX_SIZE and end == -1:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE}). "
                             "Use start_line/end_line to read a portion."}
        data = _read_bytes(full)
        if data is None:
            return {"error": "failed to open file: " + path}
        out: list[str] = []
        used = 0
        lines = _text(data).split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # std::getline: no empty line after the last newline
        for n, line in enumerate(lines, 1):
            if n < start:
                continue
            if end != -1 and n > end:
                break
            piece = (f"{n}\u2192{line}\n" if append_loc else line + "\n")
            size_b = len(piece.encode("utf-8", "surrogateescape"))
            if used + size_b > READ_FILE_MAX_SIZE:
                out.append("[output truncated]")
                break
            out.append(piece)
            used += size_b
        return {"plain_text_response": _utf8("".join(out))}


class FileGlobSearch(Tool):
    name, display_name = "file_glob_search", "File search"

    def definition(self) -> dict:
        return _fn(self.name,
                   "Recursively search for files matching a glob pattern under a directory. "
                   "Automatically skips files ignored by .gitignore (when the directory is "
                   "inside a git repo) and common junk directories (.git, node_modules, build, "
                   "dist, etc.) otherwise. A pattern with no '/' (e.g. \"*.cpp\") matches the "
                   "file's basename at any depth. A pattern containing '/' matches the full "
                   "relative path; unless already anchored with \"**/\" or a leading '/', it is "
                   "automatically prefixed with \"**/\". Use type=\"dir\" or \"all\" to also "
                   "list directories; directory entries are suffixed with '/' in the output. "
                   "Note: directory listings do not apply .gitignore filtering.", {
                       "path": _p("string", "Base directory to search in"),
                       "include": _p("string", "Glob pattern for files to include (e.g. "
                                               "\"*.cpp\" or \"src/**/*.cpp\"). Default: **"),
                       "exclude": _p("string", "Glob pattern for files to exclude"),
                       "type": _p("string", "Entry type to return: \"file\" (default), "
                                            "\"dir\" or \"all\""),
                       "max_depth": _p("integer", "Maximum depth to descend into "
                                                  "subdirectories (default: 0 = unlimited; 1 = "
                                                  "direct children only)"),
                       "limit": _p("integer", "Maximum number of results to return, capped at "
                                              f"{FILE_SEARCH_MAX_RESULTS} (default "
                                              f"{FILE_SEARCH_MAX_RESULTS})"),
                   }, ["path"])

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        path = _required(params, "path", str)
        base = resolve(params, path)
        include = _optional(params, "include", "**")
        exclude = _optional(params, "exclude", "")
        kind = _optional(params, "type", FILES)
        max_depth = max(0, _optional(params, "max_depth", 0))
        limit = _optional(params, "limit", FILE_SEARCH_MAX_RESULTS)
        if limit < 1:
            return {"error": f"invalid limit: {limit} (expected 1 or more)"}
        limit = min(limit, FILE_SEARCH_MAX_RESULTS)
        if kind not in (FILES, DIRS, ALL):
            return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
        listing = list_entries(base, max_depth, kind)
        if listing.err:
            return {"error": f"{listing.err}: {path}"}
        matches = [e for e in listing.entries if path_glob_match(include, e.rel)
                   and not (exclude and path_glob_match(exclude, e.rel))]
        shown = matches[:limit]
        text = "".join(e.rel + ("/" if e.is_dir else "") + "\n" for e in shown)
        text += f"\n---\nTotal matches: {len(matches)}\n"
        if len(matches) > len(shown):
            text += (f"[{len(shown)} results limit reached ({len(matches)} total matches). "
                     "Refine the glob pattern to narrow the search.]\n")
        if listing.truncated:
            text += "[results truncated: time budget or unreadable directory]\n"
        return {"plain_text_response": _utf8(text),
                "entries": [{"path": _utf8(e.rel), "type": "dir" if e.is_dir else "file"}
                            for e in shown],
                "base": base}


class GrepSearch(Tool):
    name, display_name = "grep_search", "Grep search"

    def definition(self) -> dict:
        return _fn(self.name,
                   "Search for a pattern in files under a path. Returns matching lines with file "
                   "paths (and, unless searching a single file, paths relative to the given "
                   "directory). Automatically skips files ignored by .gitignore (when the "
                   "directory is inside a git repo) and common junk directories (.git, "
                   "node_modules, build, dist, etc.) otherwise. include/exclude: a pattern with "
                   "no '/' matches the basename at any depth; a pattern containing '/' matches "
                   "the full relative path (auto-anchored with \"**/\" unless already "
                   "anchored).", {
                       "path": _p("string", "File or directory to search in"),
                       "pattern": _p("string", "Pattern to search for (regular expression "
                                               "unless literal is true)"),
                       "include": _p("string", "Glob pattern to filter files (default: **)"),
                       "exclude": _p("string", "Glob pattern to exclude files"),
                       "return_line_numbers": _p("boolean", "If true, include line numbers in "
                                                            "results"),
                       "literal": _p("boolean", "Treat pattern as a literal string instead of a "
                                                "regular expression (default: false)"),
                       "ignore_case": _p("boolean", "Case-insensitive search (default: false)"),
                       "context_lines": _p("integer", "Number of lines of context to show "
                                                      "before and after each match (default: "
                                                      "0)"),
                   }, ["path", "pattern"])

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        path = _required(params, "path", str)
        pattern = _required(params, "pattern", str)
        include = _optional(params, "include", "**")
        exclude = _optional(params, "exclude", "")
        ctx = max(0, _optional(params, "context_lines", 0))
        show_num = _optional(params, "return_line_numbers", False) or ctx > 0
        src = re.escape(pattern) if _optional(params, "literal", False) else pattern
        try:
            rx = re.compile(src, re.IGNORECASE if _optional(params, "ignore_case", False)
                            else 0)
        except re.error as e:
            return {"error": f"invalid regex: {e}"}
        full = resolve(params, path)
        files: list[tuple[str, str]] = []
        if os.path.isfile(full):
            files.append((full, path))
        elif os.path.isdir(full):
            listing = list_entries(full, 0, FILES)
            if listing.err:
                return {"error": f"{listing.err}: {path}"}
            files = [(os.path.join(full, e.rel), e.rel) for e in listing.entries
                     if path_glob_match(include, e.rel)
                     and not (exclude and path_glob_match(exclude, e.rel))]
        else:
            return {"error": "path does not exist: " + path}
        out: list[str] = []
        total, limit_reached = 0, False
        for fpath, shown in files:
            if limit_reached:
                break
            data = _read_bytes(fpath)
            if data is None:
                continue
            lines = _text(data).split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            for i, line in enumerate(lines):
                if total >= GREP_SEARCH_MAX_RESULTS:
                    limit_reached = True
                    break
                if not rx.search(line):
                    continue
                for j in range(max(0, i - ctx), min(len(lines) - 1, i + ctx) + 1):
                    sep = ":" if j == i else "-"
                    out.append(shown + sep + (f"{j + 1}{sep}" if show_num else "")
                               + lines[j] + "\n")
                if ctx > 0:
                    out.append("--\n")
                total += 1
        text = "".join(out) + f"\n---\nTotal matches: {total}\n"
        if limit_reached:
            text += (f"[{GREP_SEARCH_MAX_RESULTS} matches limit reached. Narrow the "
                     "path/pattern/include to see more.]\n")
        return {"plain_text_response": _utf8(text)}


class ExecShellCommand(Tool):
    name, display_name = "exec_shell_command", "Execute shell command"
    permission_write, support_stream = True, True

    def definition(self) -> dict:
        return _fn(self.name,
                   "Execute a shell command and return its output (stdout and stderr "
                   "combined).", {
                       "command": _p("string", "Shell command to execute"),
                       "timeout": _p("integer", "Timeout in seconds (default 10, max "
                                                f"{EXEC_MAX_TIMEOUT_S})"),
                       "max_output_size": _p("integer", "Maximum output size in bytes "
                                                        f"(default {EXEC_MAX_OUTPUT})"),
                   }, ["command"])

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        command = _required(params, "command", str)
        timeout = min(_optional(params, "timeout", EXEC_DEFAULT_TIMEOUT_S), EXEC_MAX_TIMEOUT_S)
        max_output = max(0, min(_optional(params, "max_output_size", EXEC_MAX_OUTPUT),
                                EXEC_MAX_OUTPUT))
        res = run_bounded(["sh", "-c", command], max_output, max(0, timeout),
                          cwd=params.get("cwd") or None, on_chunk=on_chunk)
        tail = f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]"
                                                    if res.timed_out else "")
        if on_chunk is not None:
            on_chunk(tail)
            return {}
        return {"plain_text_response": res.output + tail}


class WriteFile(Tool):
    name, display_name = "write_file", "Write file"
    permission_write = True

    def definition(self) -> dict:
        return _fn(self.name,
                   "Write content to a file, creating it (including parent directories) if it "
                   "does not exist. May use with edit_file for more complex edits.", {
                       "path": _p("string", "Path of the file to write"),
                       "content": _p("string", "Content to write"),
                   }, ["path", "content"])

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        path = _required(params, "path", str)
        content = _required(params, "content", str)
        data = content.encode("utf-8", "surrogateescape")
        if not _write(resolve(params, path), data):
            return {"error": "failed to write file: " + path}
        return {"result": "file written successfully", "path": path, "bytes": len(data)}


def _write(full: str, data: bytes) -> bool:
    try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    except OSError:
        return False
    return True


class EditFile(Tool):
    name, display_name = "edit_file", "Edit file"
    permission_write = True

    def definition(self) -> dict:
        return _fn(self.name,
                   "Edit a file using exact text replacement. Each edits[].old_text must be "
                   "unique in the file and is matched against the original content, not "
                   "incrementally. Merge nearby changes into one edit instead of overlapping "
                   "edits. Use write_file to replace the whole file.", {
                       "path": _p("string", "Path to the file to edit"),
                       "edits": {
                           "type": "array",
                           "description": "One or more exact text replacements to apply",
                           "items": {"type": "object", "properties": {
                               "old_text": _p("string", "Exact text to find; must be unique "
                                                        "in the file and must not overlap with "
                                                        "other edits"),
                               "new_text": _p("string", "Text to replace old_text with"),
                           }, "required": ["old_text", "new_text"]},
                       },
                   }, ["path", "edits"])

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        path = _required(params, "path", str)
        if "edits" not in params:
            raise BadParams("missing required parameter 'edits'")
        edits_json = params["edits"]
        if not isinstance(edits_json, list) or not edits_json:
            return {"error": '"edits" must be a non-empty array'}
        edits = []
        for i, e in enumerate(edits_json):
            if not isinstance(e, dict):
                raise BadParams(f"edits[{i}] must be an object")
            old, new = _required(e, "old_text", str), _required(e, "new_text", str)
            if not old:
                return {"error": f"edits[{i}].old_text must not be empty"}
            edits.append((old, new))
        full = resolve(params, path)
        data = _read_bytes(full)
        if data is None:
            return {"error": "failed to open file: " + path}
        try:
            new_content = apply_edits(_text(data), edits, path)
        except EditError as e:
            return {"error": str(e)}
        if not _write(full, new_content.encode("utf-8", "surrogateescape")):
            return {"error": "failed to write file: " + path}
        return {"result": "file edited successfully", "path": path,
                "edits_applied": len(edits)}


class GetInfo(Tool):
    name, display_name = "get_info", "Get Runtime Info"

    def definition(self) -> dict:
        return _fn(self.name, "Returns runtime info: the OS name/version and the current "
                              "working directory", {}, None)

    def invoke(self, params: dict, on_chunk: Chunk | None = None) -> dict:
        res = run_bounded(["uname", "-a"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT_S,
                          cwd=params.get("cwd") or None)
        os_info = (res.output.strip() if res.exit_code == 0 and not res.timed_out
                   else platform.platform() or "unknown")
        return {"os": os_info, "cwd": params.get("cwd") or os.getcwd()}


def builtin_tools(names: tuple[str, ...]) -> list[Tool]:
    """The tools named, in llama.cpp's order."""
    every: list[Tool] = [ReadFile(), FileGlobSearch(), GrepSearch(), ExecShellCommand(),
                         WriteFile(), EditFile(), GetInfo()]
    return [t for t in every if t.name in names]
