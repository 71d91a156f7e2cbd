"""Several prompts in one request (`apis.prompt_list.PromptListRequest`), generated as
llama-server generates them: each prompt is its own sequence (prepared, submitted and
cached on its own), their events merged into one stream whose choice indices say which
prompt (prompt i's choices are i*n .. i*n+n-1), answered by each prompt's own format.

`submit_list` is the pipeline's prepare-and-submit for such a request; the rest of the
pipeline (collect, stream, slots, the request log) sees one handle and one format."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, AsyncIterator, Protocol

from starlette.requests import Request

from kvshare.apis.base import Api, ApiFormat, Choices
from kvshare.apis.prompt_list import PromptListRequest
from kvshare.engine.api import EngineHandle, FinishEvent, GenerationRequest, TokenEvent
from kvshare.server.errors import APIError

from .submission import Prepared, merge_finishes
from .request_log import RequestRecord
from .tenancy import Tenant

DONE = b"data: [DONE]\n\n"


class MergedHandle:
    """The handles of a request's prompts as one: events re-indexed (prompt i's choice j is
    i*n + j), `cancel` cancels all. A prompt its format stopped early (`stop_group`) ends at
    the limit, not cancelled."""

    def __init__(self, request_id: str, handles: list[EngineHandle], n: int):
        self.request_id = request_id
        self.handles, self.n = handles, n
        self.stopped: set[int] = set()

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def stop_group(self, i: int) -> None:
        if i not in self.stopped:
            self.stopped.add(i)
            self.handles[i].cancel()

    def __aiter__(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        queue: asyncio.Queue[tuple[int, TokenEvent | FinishEvent | None]] = asyncio.Queue()

        async def pump(i: int, h: EngineHandle) -> None:
            try:
                async for ev in h:
                    await queue.put((i, ev))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
        try:
            left = len(tasks)
            while left:
                i, ev = await queue.get()
                if ev is None:
                    left -= 1
                    continue
                ev = replace(ev, index=i * self.n + ev.index)
                if (isinstance(ev, FinishEvent) and ev.reason == "cancelled"
                        and i in self.stopped):
                    ev = replace(ev, reason="length")
                yield ev
        finally:
            for t in tasks:
                t.cancel()


class ListFormat(ApiFormat):
    """The prompts' formats as one: each event goes to its prompt's format (events keep
    their request-wide index, which the formats write); the answer is an array of one
    result per prompt, or (`merged_choices`, OpenAI) the first result with every prompt's
    choices and the usage summed."""

    def __init__(self, formats: list[ApiFormat], n: int, handle: MergedHandle,
                 merged_choices: bool):
        first = formats[0]
        super().__init__(first.rid, first.model, first.opts, first.rules, first.prompt)
        self.formats, self.n, self.handle = formats, n, handle
        self.merged = merged_choices
        self.fins: dict[int, list[FinishEvent]] = {}

    def _group(self, index: int) -> tuple[int, ApiFormat]:
        i = index // self.n
        return i, self.formats[i]

    def _stop_check(self, i: int, fmt: ApiFormat) -> None:
        if fmt.stop_requested:
            self.handle.stop_group(i)

    def _total(self, i: int) -> FinishEvent:
        return merge_finishes(self.fins[i])

    def watch(self, ev: TokenEvent) -> None:
        i, fmt = self._group(ev.index)
        fmt.watch(ev)
        self._stop_check(i, fmt)

    def stream_start(self) -> list[bytes]:
        return [c for f in self.formats for c in f.stream_start()]

    def stream_token(self, ev: TokenEvent) -> list[bytes]:
        i, fmt = self._group(ev.index)
        out = fmt.stream_token(ev)
        self._stop_check(i, fmt)
        return out

    def stream_finish(self, fin: FinishEvent) -> list[bytes]:
        i, fmt = self._group(fin.index)
        self.fins.setdefault(i, []).append(fin)
        out = fmt.stream_finish(fin)
        if not self.merged and len(self.fins[i]) == self.n:
            out += fmt.stream_end(self._total(i))  # a prompt's final object when it ends
        return out

    def stream_end(self, total: FinishEvent) -> list[bytes]:
        if not self.merged:
            return []
        out = [c for i, f in enumerate(self.formats) for c in f.stream_end(self._total(i))
               if c != DONE]
        return [*out, DONE]

    def stream_error(self, err: APIError) -> list[bytes]:
        return self.formats[0].stream_error(err)

    def response(self, choices: Choices, total: FinishEvent) -> Any:
        results = []
        for i, fmt in enumerate(self.formats):
            mine = {g: c for g, c in choices.items() if g // self.n == i}
            results.append(fmt.response(mine, merge_finishes([c[2] for c in mine.values()])))
        if not self.merged:
            return results
        out = results[0]
        out["choices"] = [c for r in results for c in r["choices"]]
        out["usage"] = _sum_usage([r["usage"] for r in results])
        return out


def _sum_usage(usages: list[dict]) -> dict:
    out = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens",
                                                   "total_tokens")}
    out["prompt_tokens_details"] = {"cached_tokens": sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return out


class Submitter(Protocol):
    """What `submit_list` uses of the pipeline (server/pipeline.py's GenerationPipeline)."""

    async def prepare(self, request: Request, api: Api, rid: str, req: Any,
                      tenant: Tenant | None, rec: RequestRecord) -> Prepared: ...

    def submit(self, greq: GenerationRequest, param: str) -> EngineHandle: ...


async def submit_list(pipeline: Submitter, request: Request, api: Api, rid: str,
                      req: PromptListRequest, tenant: Tenant | None,
                      rec: RequestRecord) -> tuple[Prepared, MergedHandle]:
    """Prepare and submit each prompt of `req` as its own engine request (the first under
    `rid`, the others `rid-i`); one submission refused cancels those already made."""
    prepared: list[Prepared] = []
    for part in req.parts:
        prepared.append(await pipeline.prepare(request, api, rid, part, tenant, rec))
    rec.prompt_tokens = sum(len(p.greq.prompt_tokens) for p in prepared)
    handles: list[EngineHandle] = []
    try:
        for i, p in enumerate(prepared):
            greq = p.greq if i == 0 else replace(p.greq, request_id=f"{rid}-{i}")
            handles.append(pipeline.submit(greq, "prompt"))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    n = req.opts.n
    merged = MergedHandle(rid, handles, n)
    fmt = ListFormat([p.fmt for p in prepared], n, merged, req.merged_choices)
    return Prepared(prepared[0].greq, fmt), merged

