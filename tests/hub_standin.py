"""A loopback stand-in for the Hugging Face Hub's HTTP API, as model/hub.py uses it.

Two servers, two origins: the hub (`/api/models/{repo}/tree/{rev}` with each file's size and
LFS sha256; `/{repo}/resolve/{rev}/{path}` answering 302 to the CDN) and the CDN (the bytes,
with range requests). Knobs: `gated` repositories need `Authorization: Bearer <token>` at the
hub; `cut_once` paths close the connection half way through their first download; `bad_sha`
paths are listed with a wrong sha256. Every request is recorded (`log`: origin, method, path,
headers) so a test can check what reached which host.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self, repos: dict[str, dict[str, bytes]], *, token: str | None = None,
                 gated: set[str] = frozenset()):
        self.repos = repos  # repo -> {path: content}
        self.token = token
        self.gated = set(gated)
        self.cut_once: set[str] = set()
        self.bad_sha: set[str] = set()
        self.log: list[tuple[str, str, str, dict[str, str]]] = []
        self._hub = self._server("hub")
        self._cdn = self._server("cdn")

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        for s in (self._hub, self._cdn):
            threading.Thread(target=s.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s in (self._hub, self._cdn):
            s.shutdown()
            s.server_close()

    def requests(self, origin: str) -> list[tuple[str, str, dict[str, str]]]:
        return [(m, p, h) for o, m, p, h in self.log if o == origin]

    # ------------------------------------------------------------------ handlers
    def _server(self, origin: str) -> ThreadingHTTPServer:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                stand_in.log.append((origin, "GET", self.path, dict(self.headers)))
                if origin == "hub":
                    stand_in._hub_get(self)
                else:
                    stand_in._cdn_get(self)

        s = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        s.daemon_threads = True
        return s

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes = b"",
              headers: dict[str, str] | None = None) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _hub_get(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlparse(h.path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            repo = "/".join(parts[2:4])
            kind = "tree"
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = "/".join(parts[:2])
            kind = "resolve"
        else:
            return self._send(h, 404, b'{"error": "not found"}')
        if repo not in self.repos:
            return self._send(h, 404, b'{"error": "Repository not found"}')
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._send(h, 401, b'{"error": "Access to model is restricted"}')
        files = self.repos[repo]
        if kind == "tree":
            entries = []
            for p, data in files.items():
                sha = hashlib.sha256(data).hexdigest()
                if p in self.bad_sha:
                    sha = hashlib.sha256(data + b"x").hexdigest()
                entries.append({"type": "file", "path": p, "size": len(data),
                                "oid": hashlib.sha1(data).hexdigest(),
                                "lfs": {"oid": sha, "size": len(data), "pointerSize": 134}})
            return self._send(h, 200, json.dumps(entries).encode(),
                              {"Content-Type": "application/json"})
        file_path = "/".join(parts[4:])
        if file_path not in files:
            return self._send(h, 404, b'{"error": "Entry not found"}')
        data = files[file_path]
        return self._send(h, 302, b"", {
            "Location": f"{self.cdn}/blobs/{repo}/{file_path}",
            "X-Linked-Size": str(len(data)),
            "X-Linked-ETag": f'"{hashlib.sha256(data).hexdigest()}"'})

    def _cdn_get(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlparse(h.path).path)
        parts = path.strip("/").split("/")
        repo, file_path = "/".join(parts[1:3]), "/".join(parts[3:])
        data = self.repos.get(repo, {}).get(file_path)
        if data is None:
            return self._send(h, 404)
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if file_path in self.cut_once:
            self.cut_once.discard(file_path)
            h.wfile.write(body[:len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the connection drops half way
            return
        h.wfile.write(body)
