"""Delivering engine outputs to a client: server-sent events as outputs arrive, or the final outputs
at once. A client that goes away aborts its requests (logged at INFO: disconnects are normal
traffic); a request the server ends (drain, queue timeout, engine failure) ends a stream with an
error event and `[DONE]`, and a non-streamed response with an error body."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.request import RequestOutput
from specdec.server.async_engine import RequestFailed, RequestStream
from specdec.server.errors import APIError, ClientDisconnected, error_body
from specdec.server.middleware import AccessRecord
from specdec.server.render import Sub, spec_summary, usage_of

Render = Callable[[Sub, RequestOutput], list[dict]]


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(streams: list[RequestStream], subs: list[Sub], envelope: dict, render: Render, stream_options,
                 opening: list[dict] = (), record: AccessRecord | None = None) -> StreamingResponse:
    """Server-sent events: `opening` chunks, then render(sub, output) chunks as outputs arrive, an
    optional usage chunk (with the speculative summary), and `data: [DONE]`; an error event in place
    of the rest when the server ends a request. `record` gets the token counts as the stream ends."""
    async def events():
        last: dict[int, RequestOutput] = {}
        try:
            for c in opening:
                yield _sse({**envelope, "choices": [c]})
            async for sub, out in _merge(streams, subs, last):
                for c in render(sub, out):
                    yield _sse({**envelope, "choices": [c]})
            if stream_options is not None and stream_options.include_usage:
                finals = [last[i] for i in sorted(last)]
                yield _sse({**envelope, "choices": [], "usage": usage_of(subs, finals),
                            "speculative": spec_summary(finals)})
        except RequestFailed as e:
            yield _sse(error_body(e.status, e.message, code=e.code))
        finally:  # the client went away (Starlette cancels us), a request failed, or we are done
            close_all(streams)
            if record is not None:
                record_usage(record, subs, [last[i] for i in sorted(last)])
        yield "data: [DONE]\n\n"
    return sse_response(events())


def sse_response(events) -> StreamingResponse:
    """Server-sent events from an async iterator of encoded events, unbuffered by proxies."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def record_usage(record: AccessRecord, subs: list[Sub], outs: list[RequestOutput]) -> None:
    """The access log's token counts: prompts once each, and the tokens generated so far."""
    usage = usage_of(subs, outs)
    record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]


def close_all(streams: list[RequestStream], reason: str = "the client went away") -> None:
    for s in streams:
        s.close(reason)


async def _merge(streams: list[RequestStream], subs: list[Sub], last: dict[int, RequestOutput]):
    """Interleave several requests' outputs as they arrive; `last` keeps each one's latest. The
    first RequestFailed of any of them is raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except RequestFailed as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
                continue
            if isinstance(out, RequestFailed):
                raise out
            last[i] = out
            yield subs[i], out
    finally:
        for t in tasks:
            t.cancel()


async def _disconnect(request: Request) -> None:
    """Returns as soon as the client closes the connection: once the body is read, the server's next
    message is `http.disconnect` (polling `is_disconnected` every half second let a fast model finish
    a request its client had abandoned)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)


async def collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Final outputs of every stream. Raises ClientDisconnected (after aborting them all) if the client
    disconnects meanwhile, APIError if the server ends one of them."""
    async def final(s: RequestStream) -> RequestOutput:
        out = None
        async for out in s:
            pass
        assert out is not None
        return out

    tasks = [asyncio.ensure_future(final(s)) for s in streams]
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                raise ClientDisconnected()
            for t in done:
                t.result()  # a RequestFailed ends them all
            pending -= done
        return [t.result() for t in tasks]
    except RequestFailed as e:
        raise APIError(e.status, e.message, code=e.code, retry=e.retry) from None
    finally:
        for t in (watch, *tasks):
            t.cancel()
        close_all(streams)
