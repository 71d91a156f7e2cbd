"""llama-server's slots over kvshare's shared cache: the slot table, `GET /slots`, and
`POST /slots/{id}?action=save|restore|erase` with its slot files.

Slots (`SlotTable`): kvshare has no fixed slots — every sequence shares one block pool and
the prefix cache is global — so `--parallel` slots are emulated for llama-server's clients:
a request takes the lowest idle slot when it is submitted (the one `id_slot` names if that is
idle; beyond `--parallel` requests wait in order for one to free), and a slot remembers its
last request (settings, counts, prompt and generated token ids) as llama-server's does.
`GET /slots` lists them in llama-server's shape (as its GET /slots shows them: settings and
counts, no prompt text) plus `kvshare` figures of a running sequence (cached / computed prompt
tokens, blocks, blocks shared with other sequences). `POST /slots/{id}?action=save` writes the slot's token ids (its last
prompt plus what it generated) to a JSON file under `--slot-save-path` — not the KV bytes:
those live in kvshare's shared cache (and its disk tier with `--cache-dir`), addressed by
content; `restore` reads such a file and computes those tokens into the cache (one request
with one generated token, discarded), so the next request that starts with them reuses them
— the same effect as llama-server's restore, by recomputing or fetching from the tiers
instead of copying state; `erase` forgets the slot's record (waiting for it to go idle, as
llama-server does); the blocks stay in the shared cache, where other sequences may use them,
until evicted.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvshare.engine.api import FinishEvent, GenerationRequest, TokenEvent
from kvshare.server.body import read_json
from kvshare.server.errors import APIError, bad_request
from kvshare.server.pipeline import GenerationPipeline

from . import parsing as P
from .llama_request import error_object, metrics_only, request_settings

@dataclass
class Slot:
    id: int
    rid: str | None = None  # the request it serves now
    id_task: int = -1
    n_prompt: int = 0
    n_processed: int = 0
    n_cache: int = 0
    n_decoded: int = 0
    n_remain: int = -1
    has_new_line: bool = False
    params: dict | None = None
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    idle: asyncio.Event | None = None

    @property
    def tokens(self) -> list[int]:
        """What llama-server's slot keeps: the prompt and the generated tokens."""
        return [*self.prompt, *self.generated]


class SlotTable:
    """`--parallel` slots emulated over kvshare's shared pool (see the module docstring)."""

    def __init__(self, n: int):
        self.slots = [Slot(i) for i in range(max(0, n))]
        self.by_rid: dict[str, Slot] = {}
        self.waiting: deque[tuple[str, int, Any]] = deque()
        self._pending: dict[str, tuple[GenerationRequest, dict | None]] = {}
        self._tasks = count()

    def __len__(self) -> int:
        return len(self.slots)

    def acquire(self, rid: str, req: GenerationRequest, params: dict | None = None,
                want: int = -1) -> int:
        """Give the request a slot (the one it wants if idle, else the lowest idle one), or
        queue it; returns the slot id or -1."""
        if not self.slots:
            return -1
        self._pending[rid] = (req, params)
        idle = [s for s in self.slots if s.rid is None]
        if not idle:
            self.waiting.append((rid, want, None))
            return -1
        slot = next((s for s in idle if s.id == want), idle[0])
        self._start(slot, rid)
        return slot.id

    def _start(self, slot: Slot, rid: str) -> None:
        req, params = self._pending.pop(rid)
        slot.rid = rid
        slot.id_task = next(self._tasks)
        slot.n_prompt = len(req.prompt_tokens)
        slot.n_processed = slot.n_cache = slot.n_decoded = 0
        slot.n_remain = req.max_tokens
        slot.has_new_line = False
        slot.params = params or request_settings(req)
        slot.prompt = list(req.prompt_tokens)
        slot.generated = []
        if slot.idle is not None:
            slot.idle.clear()
        self.by_rid[rid] = slot

    def slot_of(self, rid: str) -> int:
        s = self.by_rid.get(rid)
        return s.id if s is not None else -1

    def feed(self, rid: str, ev: TokenEvent) -> None:
        s = self.by_rid.get(rid)
        if s is None or ev.index != 0:
            return
        if ev.token_id >= 0:
            s.generated.append(ev.token_id)
            s.n_decoded += 1
            if s.n_remain > 0:
                s.n_remain -= 1
        if "\n" in ev.text:
            s.has_new_line = True

    def release(self, rid: str, fin: FinishEvent | None) -> None:
        self._pending.pop(rid, None)
        self.waiting = deque(w for w in self.waiting if w[0] != rid)
        s = self.by_rid.pop(rid, None)
        if s is None:
            return
        if fin is not None:
            s.n_prompt = fin.prompt_tokens
            s.n_cache = fin.timings.cache_n
            s.n_processed = fin.timings.prompt_n
            s.n_decoded = max(s.n_decoded, fin.completion_tokens)
        s.rid = None
        if s.idle is not None:
            s.idle.set()
        while self.waiting:  # the next waiting request takes the freed slot
            nrid, _, _ = self.waiting.popleft()
            if nrid in self._pending:
                self._start(s, nrid)
                break

    async def wait_idle(self, slot: Slot) -> None:
        if slot.rid is None:
            return
        if slot.idle is None:
            slot.idle = asyncio.Event()
        slot.idle.clear()
        while slot.rid is not None:
            await slot.idle.wait()
            slot.idle.clear()

    def get(self, id_slot: int) -> Slot | None:
        return self.slots[id_slot] if 0 <= id_slot < len(self.slots) else None

    def to_json(self, ctx_size: int, live: dict[str, list[dict]]) -> list[dict]:
        """llama-server's /slots array (server_slot::to_json(only_metrics), as its GET /slots
        shows it: no prompt text) with `kvshare` figures of a running slot's sequences
        (`live`: engine snapshot slots by request id)."""
        out = []
        for s in self.slots:
            d: dict[str, Any] = {"id": s.id, "n_ctx": ctx_size, "speculative": False,
                                 "is_processing": s.rid is not None}
            seqs = live.get(s.rid, []) if s.rid is not None else []
            n_cache, n_processed = s.n_cache, s.n_processed
            if seqs:
                first = seqs[0]
                n_cache = first.get("n_cached", 0)
                n_processed = max(0, min(first.get("n_computed", 0), s.n_prompt) - n_cache)
            if s.id_task >= 0:
                d["id_task"] = s.id_task
                d["n_prompt_tokens"] = s.n_prompt
                d["n_prompt_tokens_processed"] = n_processed
                d["n_prompt_tokens_cache"] = n_cache
                d["params"] = metrics_only(s.params or {})
                d["next_token"] = [{"has_next_token": s.rid is not None,
                                    "has_new_line": s.has_new_line,
                                    "n_remain": s.n_remain if s.rid is not None else -1,
                                    "n_decoded": s.n_decoded}]
            if seqs:
                d["kvshare"] = {
                    "request_id": s.rid,
                    "sequences": [{k: q.get(k) for k in (
                        "state", "n_prompt", "n_cached", "n_computed", "n_generated",
                        "blocks", "shared_blocks", "restore_ms")} for q in seqs],
                    "cached_tokens": sum(q.get("n_cached", 0) for q in seqs),
                    "shared_blocks": sum(q.get("shared_blocks", 0) for q in seqs),
                }
            out.append(d)
        return out


# --------------------------------------------------------------------------- slot files

SLOT_FILE_FORMAT = "kvshare-slot-v1"


def check_filename(name: Any) -> str:
    """llama.cpp's fs_validate_filename, in short: a plain file name (no path separators, no
    '..', no control or reserved characters, at most 255 bytes)."""
    if not isinstance(name, str) or not name:
        raise bad_request("Invalid filename", "filename")
    bad = set('/\\:*?"<>|')
    if (len(name.encode("utf-8")) > 255 or name in (".", "..") or ".." in name
            or any(ch in bad or ord(ch) < 32 or ord(ch) == 127 for ch in name)
            or name.startswith(" ") or name.endswith((" ", "."))):
        raise bad_request("Invalid filename", "filename")
    return name


def save_slot_file(path: str, tokens: list[int], model: str) -> int:
    data = json.dumps({"format": SLOT_FILE_FORMAT, "model": model, "tokens": tokens},
                      separators=(",", ":")).encode()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def load_slot_file(path: str, model: str, vocab_size: int | None) -> tuple[list[int], int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(64 * 2**20 + 1)
    except FileNotFoundError:
        raise bad_request("Unable to restore slot: no such slot save file",
                          "filename") from None
    if len(raw) > 64 * 2**20:
        raise bad_request("Unable to restore slot: the file is too large", "filename")
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("format") != SLOT_FILE_FORMAT:
        raise bad_request("Unable to restore slot: not a kvshare slot save file", "filename")
    if data.get("model") != model:
        raise bad_request("Unable to restore slot: the file was saved with another model",
                          "filename")
    tokens = data.get("tokens")
    try:
        if not isinstance(tokens, list):
            raise bad_request("not a list", "tokens")
        P.check_token_ids(tokens, vocab_size, "tokens")
    except APIError:
        raise bad_request("Unable to restore slot: Invalid tokens in slot save file",
                          "filename") from None
    return tokens, len(raw)


# --------------------------------------------------------------------------- endpoints

def llama_error(status: int, message: str, type: str | None = None) -> Response:
    return JSONResponse({"error": error_object(status, message, type)}, status_code=status)


class SlotEndpoints:
    """`GET /slots` and `POST /slots/{id}?action=save|restore|erase` over a `SlotTable`."""

    def __init__(self, pipeline: GenerationPipeline, table: SlotTable):
        self.pipeline, self.table = pipeline, table
        self.engine, self.settings = pipeline.engine, pipeline.settings
        self.info = pipeline.info

    def model_id(self) -> str:
        """What slot files are bound to: the weights' fingerprint (the model name without)."""
        return self.info.fingerprint or self.info.name

    async def list(self, request: Request) -> Response:
        """llama-server's `GET /slots`; 501 with `--no-slots`."""
        if not self.settings.slots_endpoint:
            return llama_error(501, "This server does not support slots endpoint. Start it "
                                    "with `--slots`")
        snap = await run_in_threadpool(self.engine.snapshot)
        live: dict[str, list[dict]] = {}
        for q in snap.get("slots", []):
            live.setdefault(str(q.get("request_id", q.get("id"))), []).append(q)
        if request.query_params.get("fail_on_no_slot") and \
                all(s.rid is not None for s in self.table.slots):
            return llama_error(503, "no slot available")
        return JSONResponse(self.table.to_json(self.info.ctx_size, live))

    async def action(self, request: Request) -> Response:
        """llama-server's `POST /slots/{id}?action=save|restore|erase` (see the module
        docstring for what they mean over kvshare's shared cache)."""
        try:
            directory = self.settings.slot_save_path
            if not directory:
                return llama_error(501, "This server does not support slots action. Start it "
                                        "with `--slot-save-path`")
            try:
                slot = self.table.get(int(request.path_params["id_slot"]))
            except ValueError:
                slot = None
            if slot is None:
                raise bad_request("Invalid slot ID", "id_slot")
            action = request.query_params.get("action")
            if action not in ("save", "restore", "erase"):
                raise bad_request("Invalid action", "action")
            if action == "erase":
                await self.table.wait_idle(slot)
                n = len(slot.tokens)
                slot.prompt, slot.generated = [], []
                return JSONResponse({"id_slot": slot.id, "n_erased": n})
            body = await read_json(request, self.settings)
            filename = check_filename(body.get("filename"))
            path = os.path.join(directory, filename)
            await self.table.wait_idle(slot)
            if action == "save":
                return await self.save(slot, path, filename)
            return await self.restore(request, slot, path, filename)
        except OSError as e:
            return llama_error(500, f"Unable to access the slot file: {e.strerror or e}")

    async def save(self, slot: Slot, path: str, filename: str) -> Response:
        t0 = time.perf_counter()
        tokens = slot.tokens
        nbytes = await run_in_threadpool(save_slot_file, path, tokens, self.model_id())
        return JSONResponse({"id_slot": slot.id, "filename": filename, "n_saved": len(tokens),
                             "n_written": nbytes,
                             "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})

    async def restore(self, request: Request, slot: Slot, path: str,
                      filename: str) -> Response:
        t0 = time.perf_counter()
        tokens, nread = await run_in_threadpool(load_slot_file, path, self.model_id(),
                                                self.info.vocab_size)
        if len(tokens) >= self.info.ctx_size:
            raise bad_request("Unable to restore slot: Restored prompt does not fit in the "
                              "slot context", "filename")
        if tokens:
            await self.pipeline.warm(self.pipeline.context(request).tenant, tokens)
        slot.prompt, slot.generated = list(tokens), []
        return JSONResponse({"id_slot": slot.id, "filename": filename,
                             "n_restored": len(tokens), "n_read": nread,
                             "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})
