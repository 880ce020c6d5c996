"""A streamed Responses API answer: server-sent events (`event: <type>` and `data: <json>`, each
with its `sequence_number`) built from the chat route's chunk deltas.

The order is OpenAI's: response.created, response.in_progress; per output item
output_item.added, then for a message content_part.added, output_text.delta..., output_text.done,
content_part.done, and for a function call function_call_arguments.delta..., .done; then
output_item.done; finally response.completed with the whole response, whose items (ids, texts,
arguments) are exactly what was streamed. A truncated response still ends with response.completed
(its status "incomplete"): the openai client's `get_final_response()` waits for that event alone.
When the server ends the request (drain, engine failure, a structured-output bound) an `error`
event ends the stream instead. A client that goes away aborts the engine request.
"""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from specdec.request import RequestOutput
from specdec.server.async_engine import RequestFailed, RequestStream
from specdec.server.middleware import AccessRecord
from specdec.server.render import Sub
from specdec.server.responses_render import call_item, completed, item_id, message_item, text_part
from specdec.server.streaming import Render, close_all, record_usage, sse_response


class ResponseEvents:
    """The event sequence of one response, fed chat-chunk deltas ({"content"?, "tool_calls"?})."""

    def __init__(self, shell: dict) -> None:
        self.shell = shell
        self.output: list[dict] = []     # the finished items
        self._seq = 0
        self._open: dict | None = None   # the item being streamed
        self._parts: list[str] = []      # its text or arguments so far

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        return [self.event("response.created", response=self.shell),
                self.event("response.in_progress", response=self.shell)]

    def delta(self, delta: dict) -> list[str]:
        events = self._text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, subs: list[Sub], out: RequestOutput) -> list[str]:
        """Close the open item (an empty message when nothing was said) and complete the response."""
        status = "incomplete" if out.finish_reason == "length" else "completed"
        events = [] if self.output or self._open else self._open_message()
        events += self._close(status)
        return events + [self.event("response.completed", response=completed(self.shell, self.output, subs, [out]))]

    def error(self, e: RequestFailed) -> str:
        return self.event("error", code=e.code, message=e.message, param=None)

    def _text(self, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events = self._close() + self._open_message()
        self._parts.append(text)
        return events + [self.event("response.output_text.delta", item_id=self._open["id"],
                                    output_index=len(self.output), content_index=0, delta=text, logprobs=[])]

    def _call(self, call: dict) -> list[str]:
        fn = call.get("function") or {}
        events = []
        if call.get("id"):  # a new call: its first delta names it
            events = self._close()
            self._open, self._parts = call_item(call["id"], fn.get("name") or "", "", "in_progress"), []
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=self._open))
        if fn.get("arguments") and self._open is not None and self._open["type"] == "function_call":
            self._parts.append(fn["arguments"])
            events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                     output_index=len(self.output), delta=fn["arguments"]))
        return events

    def _open_message(self) -> list[str]:
        self._open, self._parts = {**message_item("", "in_progress", item_id("msg")), "content": []}, []
        at = {"item_id": self._open["id"], "output_index": len(self.output)}
        return [self.event("response.output_item.added", output_index=len(self.output), item=self._open),
                self.event("response.content_part.added", **at, content_index=0, part=text_part(""))]

    def _close(self, status: str = "completed") -> list[str]:
        item, index, joined = self._open, len(self.output), "".join(self._parts)
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            done = message_item(joined, status, item["id"])
            events = [self.event("response.output_text.done", **at, content_index=0, text=joined, logprobs=[]),
                      self.event("response.content_part.done", **at, content_index=0, part=text_part(joined))]
        else:
            done = call_item(item["call_id"], item["name"], joined, status, item["id"])
            events = [self.event("response.function_call_arguments.done", **at, arguments=joined)]
        self.output.append(done)
        self._open, self._parts = None, []
        return events + [self.event("response.output_item.done", output_index=index, item=done)]


def response_events(streams: list[RequestStream], subs: list[Sub], record: AccessRecord, render: Render,
                    shell: dict) -> StreamingResponse:
    """The streamed answer of a started chat turn (one choice: `streams` and `subs` hold one each),
    `render` turning its outputs into chat chunks. Its usage goes to `record` (the access log) as
    the stream ends, however it ends."""
    events = ResponseEvents(shell)
    (sub,), (stream,) = subs, streams

    async def sse():
        last: RequestOutput | None = None
        try:
            for e in events.opening():
                yield e
            async for out in stream:
                last = out
                for chunk in render(sub, out):
                    for e in events.delta(chunk["delta"]):
                        yield e
            assert last is not None   # a stream ends with its finished output
            for e in events.finish(subs, last):
                yield e
        except RequestFailed as e:
            yield events.error(e)
        finally:  # the client went away (Starlette cancels us), a request failed, or we are done
            close_all(streams)
            record_usage(record, subs, [] if last is None else [last])
    return sse_response(sse())
