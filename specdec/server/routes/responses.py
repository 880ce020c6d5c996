"""POST /v1/responses: the subset of OpenAI's Responses API that vLLM serves, run as a chat turn.

The request is translated into the equivalent /v1/chat/completions request (responses_protocol.py)
and goes through the chat route's machinery: the same template, tools, tool-call parsing,
structured outputs, limits and speculation. Only the shapes differ (responses_render.py,
responses_stream.py). The server is stateless: each request carries the whole conversation.
"""
from __future__ import annotations

import re

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.middleware import check_auth
from specdec.server.openapi import ResponseObject, errors, ok
from specdec.server.responses_protocol import ResponsesRequest
from specdec.server.responses_render import completed, output_items, response_shell
from specdec.server.responses_stream import response_events
from specdec.server.routes.chat import ChatRun, final_message, finish_chat, start_chat, stream_renderer

router = APIRouter()

# the chat request's field names in its errors -> this request's
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}
_FIELD_WORDS = re.compile(r"\b(max_completion_tokens|max_tokens|response_format)\b")


@router.post("/v1/responses", dependencies=[Depends(check_auth)],
             responses={**ok(ResponseObject, stream=True), **errors(400, 401, 404, 413, 429, 503)})
async def create_response(body: ResponsesRequest, request: Request, ctx: ServerContext = Depends(context)):
    run = await _start(ctx, body, request)
    shell = response_shell(body, f"resp_{run.record.request_id}", ctx.served_model)
    if body.stream:
        return response_events(run.streams, run.subs, run.record, stream_renderer(run), shell)
    (out,) = await finish_chat(run, request)
    return completed(shell, output_items(final_message(run, out), out.finish_reason), run.subs, [out])


async def _start(ctx: ServerContext, body: ResponsesRequest, request: Request) -> ChatRun:
    """The chat turn started, or a 400 in this request's field names."""
    try:
        chat = body.chat_request()
    except ValidationError as e:  # a value the chat schema refuses that ours let through
        first = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    try:
        return await start_chat(ctx, chat, request)
    except APIError as e:
        e.param = _FIELDS.get(e.param, e.param)
        e.message = _FIELD_WORDS.sub(lambda m: _FIELDS[m.group(1)], e.message)
        raise
