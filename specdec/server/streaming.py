"""Delivering engine outputs to a client: server-sent events as outputs arrive, or the final outputs
at once; either way a client that goes away aborts its requests (closing a stream aborts it)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.request import RequestOutput
from specdec.server.render import Sub, spec_summary, usage_of

Render = Callable[[Sub, RequestOutput], list[dict]]


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(streams: list, subs: list[Sub], envelope: dict, render: Render, stream_options,
                 opening: list[dict] = ()) -> StreamingResponse:
    """Server-sent events: `opening` chunks, then render(sub, output) chunks as outputs arrive, an
    optional usage chunk (with the speculative summary), and `data: [DONE]`."""
    async def events():
        last: dict[int, RequestOutput] = {}
        try:
            for c in opening:
                yield _sse({**envelope, "choices": [c]})
            async for sub, out in _merge(streams, subs, last):
                for c in render(sub, out):
                    yield _sse({**envelope, "choices": [c]})
            if stream_options is not None and stream_options.include_usage:
                finals = list(last.values())
                yield _sse({**envelope, "choices": [], "usage": usage_of(subs, finals),
                            "speculative": spec_summary(finals)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels us) or we are done
            await close_all(streams)
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def close_all(streams: list) -> None:
    for s in streams:
        await s.aclose()


async def _merge(streams: list[AsyncIterator[RequestOutput]], subs: list[Sub], last: dict[int, RequestOutput]):
    """Interleave several requests' outputs as they arrive; `last` keeps each one's latest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
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


async def collect(streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
    """Final outputs of every stream; aborts them all if the client disconnects meanwhile."""
    async def final(s: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in s:
            pass
        assert out is not None
        return out

    gather = asyncio.ensure_future(asyncio.gather(*(final(s) for s in streams)))
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
        if gather in done:
            return gather.result()
        raise asyncio.CancelledError("client disconnected")
    finally:
        watch.cancel()
        if not gather.done():
            gather.cancel()
            try:
                await gather
            except BaseException:  # noqa: BLE001 - cancelled on purpose
                pass
        await close_all(streams)
