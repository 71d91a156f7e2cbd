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

Slots belong to tenants (with API keys; docs/llama-server.md, "Slots and tenants"): a slot is
its last request's tenant's (`Slot.owner`, a tag derived from the tenant), and `/slots` lists,
saves, restores into and erases only the caller's own slots and slots no request has used; a
saved file carries its tenant and the cache salt its tokens were computed under, and a restore
or an overwrite of a file another tenant saved reads exactly as a file that does not exist
(404). A restore recomputes the tokens under the salt the slot's request used (the restorer's
own, since only the restorer's files restore), so it can warm only the restorer's cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import stat
import tempfile
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
from kvshare.server.tenancy import Tenant

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
    owner: str | None = None  # owner_tag of the tenant of its last request or restore
    used: bool = False  # a request or a restore has had it (unused slots are everyone's)
    salt: bytes | None = None  # the cache salt its tokens were computed under
    store: bool = True  # whether that salt's blocks go to the tiers (Tenancy.stores)

    def visible_to(self, owner: str | None) -> bool:
        return not self.used or self.owner == owner

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
        self._pending: dict[str, tuple[GenerationRequest, dict | None, str | None]] = {}
        self._tasks: dict[str | None, count] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def acquire(self, rid: str, req: GenerationRequest, params: dict | None = None,
                want: int = -1, tenant: Tenant | None = None) -> int:
        """Give the request a slot, or queue it; returns the slot id or -1. Of the idle slots
        it takes the one it wants, else the lowest, among those unused or its tenant's own;
        another tenant's idle slot (whose record it then replaces) only when no such is
        idle."""
        if not self.slots:
            return -1
        owner = owner_tag(tenant)
        self._pending[rid] = (req, params, owner)
        idle = [s for s in self.slots if s.rid is None]
        if not idle:
            self.waiting.append((rid, want, None))
            return -1
        mine = [s for s in idle if s.visible_to(owner)]
        slot = next((s for s in mine if s.id == want), (mine or idle)[0])
        self._start(slot, rid)
        return slot.id

    def _start(self, slot: Slot, rid: str) -> None:
        req, params, owner = self._pending.pop(rid)
        slot.rid = rid
        # numbered per tenant: a global count would tell one tenant how busy the others are
        slot.id_task = next(self._tasks.setdefault(owner, count()))
        slot.owner, slot.used = owner, True
        slot.salt, slot.store = req.cache_salt, req.cache_store
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

    def to_json(self, ctx_size: int, live: dict[str, list[dict]],
                owner: str | None = None) -> list[dict]:
        """llama-server's /slots array (server_slot::to_json(only_metrics), as its GET /slots
        shows it: no prompt text) with `kvshare` figures of a running slot's sequences
        (`live`: engine snapshot slots by request id); only the slots `owner` may see."""
        out = []
        for s in self.slots:
            if not s.visible_to(owner):
                continue
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
MAX_SLOT_FILE = 64 * 2**20
_OWNER_TAG = b"kvshare/slot-owner/v1\0"


def owner_tag(tenant: Tenant | None) -> str | None:
    """Who a slot and its files belong to: a tag derived from the tenant's identity (stable
    across restarts, like the tenant's cache salt; not the key's digest), None without API
    keys."""
    if tenant is None:
        return None
    return hashlib.sha256(_OWNER_TAG + tenant.ident).hexdigest()


@dataclass
class SlotFile:
    """A slot file's contents: its token ids and whose they are (see the module docstring)."""

    tokens: list[int]
    owner: str | None = None
    scope: str | None = None  # the cache scope it was saved under
    salt: bytes | None = None
    store: bool = True

    def to_json(self, model: str) -> bytes:
        return json.dumps({"format": SLOT_FILE_FORMAT, "model": model, "tenant": self.owner,
                           "scope": self.scope, "salt": self.salt.hex() if self.salt else None,
                           "store": self.store, "tokens": self.tokens},
                          separators=(",", ":")).encode()


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


def not_found(what: str) -> APIError:
    """A slot or file the caller may not see: the same answer as one that does not exist."""
    return APIError(404, what, type="not_found_error", code="not_found")


NO_FILE = "Unable to restore slot: no such slot save file"


def read_slot_file(path: str) -> bytes | None:
    """The file's bytes, None when there is no regular file at `path` (missing, a directory,
    a FIFO: opened non-blocking, so a FIFO never hangs the read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_SLOT_FILE + 1)
    if len(raw) > MAX_SLOT_FILE:
        raise bad_request("Unable to restore slot: the file is too large", "filename")
    return raw


def parse_slot_file(raw: bytes, model: str, vocab_size: int | None) -> SlotFile:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("format") != SLOT_FILE_FORMAT:
        raise bad_request("Unable to restore slot: not a kvshare slot save file", "filename")
    owner, scope, salt = data.get("tenant"), data.get("scope"), data.get("salt")
    try:
        salt_bytes = bytes.fromhex(salt) if isinstance(salt, str) else None
    except ValueError:
        salt_bytes = None
    out = SlotFile([], owner if isinstance(owner, str) else None,
                   scope if isinstance(scope, str) else None, salt_bytes,
                   data.get("store") is not False)
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
    out.tokens = tokens
    return out


def load_slot_file(path: str, owner: str | None, model: str,
                   vocab_size: int | None) -> tuple[SlotFile, int]:
    """The caller's slot file at `path` and its size; 404 when there is none or it is another
    tenant's (one answer for both: a file name tells nothing about another tenant)."""
    raw = read_slot_file(path)
    if raw is None:
        raise not_found(NO_FILE)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    # ownership first: nothing about a file of another tenant (its model, its length) shows
    if isinstance(data, dict) and data.get("tenant") != owner:
        raise not_found(NO_FILE)
    if owner is not None and not isinstance(data, dict):
        raise not_found(NO_FILE)
    return parse_slot_file(raw, model, vocab_size), len(raw)


def save_slot_file(path: str, data: SlotFile, model: str) -> int:
    """Write the file (atomically, through a temporary file beside it). A directory there is a
    400; a file there that is not the caller's own slot file (another tenant's, or anything
    else when API keys are set) a 404, as for a restore."""
    if os.path.isdir(path):
        raise bad_request("Invalid filename: it names a directory", "filename")
    if os.path.lexists(path):
        raw = read_slot_file(path)
        try:
            prev = json.loads(raw) if raw is not None else None
        except ValueError:
            prev = None
        if isinstance(prev, dict) and prev.get("format") == SLOT_FILE_FORMAT:
            mine = prev.get("tenant") == data.owner
        else:
            mine = data.owner is None and raw is not None
        if not mine:
            raise not_found("Unable to save slot: the file name is not available")
    body = data.to_json(model)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".slot-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(body)


# --------------------------------------------------------------------------- endpoints

def llama_error(status: int, message: str, type: str | None = None) -> Response:
    return JSONResponse({"error": error_object(status, message, type)}, status_code=status)


class SlotEndpoints:
    """`GET /slots` and `POST /slots/{id}?action=save|restore|erase` over a `SlotTable`, each
    seeing only the calling tenant's slots and files."""

    def __init__(self, pipeline: GenerationPipeline, table: SlotTable):
        self.pipeline, self.table = pipeline, table
        self.engine, self.settings = pipeline.engine, pipeline.settings
        self.info = pipeline.info

    def model_id(self) -> str:
        """What slot files are bound to: the weights' fingerprint (the model name without)."""
        return self.info.fingerprint or self.info.name

    def tenant(self, request: Request) -> Tenant | None:
        return self.pipeline.context(request).tenant

    async def list(self, request: Request) -> Response:
        """llama-server's `GET /slots` (the caller's slots and unused ones); 501 with
        `--no-slots`."""
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
        owner = owner_tag(self.tenant(request))
        return JSONResponse(self.table.to_json(self.info.ctx_size, live, owner))

    async def own_slot(self, slot: Slot, owner: str | None) -> Slot:
        """The slot once idle, if it is the caller's to act on (before and after the wait: a
        waiting request of another tenant may take it meanwhile); else 404."""
        if not slot.visible_to(owner):
            raise not_found("Invalid slot ID: no such slot")
        await self.table.wait_idle(slot)
        if not slot.visible_to(owner):
            raise not_found("Invalid slot ID: no such slot")
        return slot

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
            tenant = self.tenant(request)
            owner = owner_tag(tenant)
            if action == "erase":
                await self.own_slot(slot, owner)
                n = len(slot.tokens)
                slot.prompt, slot.generated = [], []
                return JSONResponse({"id_slot": slot.id, "n_erased": n})
            body = await read_json(request, self.settings)
            filename = check_filename(body.get("filename"))
            path = os.path.join(directory, filename)
            await self.own_slot(slot, owner)
            if action == "save":
                return await self.save(slot, path, filename, owner)
            return await self.restore(slot, path, filename, tenant)
        except OSError as e:
            return llama_error(500, f"Unable to access the slot file: {e.strerror or e}")

    async def save(self, slot: Slot, path: str, filename: str, owner: str | None) -> Response:
        t0 = time.perf_counter()
        tokens = slot.tokens
        data = SlotFile(tokens, owner, self.pipeline.tenancy.scope, slot.salt, slot.store)
        nbytes = await run_in_threadpool(save_slot_file, path, data, self.model_id())
        return JSONResponse({"id_slot": slot.id, "filename": filename, "n_saved": len(tokens),
                             "n_written": nbytes,
                             "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})

    async def restore(self, slot: Slot, path: str, filename: str,
                      tenant: Tenant | None) -> Response:
        t0 = time.perf_counter()
        owner = owner_tag(tenant)
        data, nread = await run_in_threadpool(load_slot_file, path, owner, self.model_id(),
                                              self.info.vocab_size)
        tokens = data.tokens
        if len(tokens) >= self.info.ctx_size:
            raise bad_request("Unable to restore slot: Restored prompt does not fit in the "
                              "slot context", "filename")
        tenancy = self.pipeline.tenancy
        if data.scope == tenancy.scope and (data.salt is not None or tenancy.scope != "key"):
            salt, store = data.salt, data.store  # the chain keys its tokens had
        else:  # saved under another scope: the restorer's default keys now
            salt, store = tenancy.salt(tenant, None), tenancy.stores(None)
        if tokens:
            await self.pipeline.warm(tokens, salt, store)
        slot.prompt, slot.generated = list(tokens), []
        slot.owner, slot.used, slot.salt, slot.store = owner, True, salt, store
        return JSONResponse({"id_slot": slot.id, "filename": filename,
                             "n_restored": len(tokens), "n_read": nread,
                             "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})
