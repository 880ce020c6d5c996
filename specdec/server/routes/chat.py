"""POST /v1/chat/completions: the model's chat template over the messages, n choices, streamed
(server-sent events) or not."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request

from specdec.request import RequestOutput
from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.middleware import check_auth
from specdec.server.openapi import ChatCompletion, errors, ok
from specdec.server.protocol import ChatCompletionRequest
from specdec.server.render import Sub, chat_logprobs, spec_summary, usage_of
from specdec.server.streaming import collect, event_stream
from specdec.server.submit import check_request, prepare, sampling, spec_options, start

router = APIRouter()


def _prompt_ids(ctx: ServerContext, body: ChatCompletionRequest) -> list[int]:
    """The templated conversation as token ids; a template that rejects it is a 400."""
    tok = ctx.ready_engine().tokenizer
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception:  # a template that rejects this conversation (e.g. its role order)
        raise APIError(400, "the model's chat template rejected these messages", "messages") from None
    return tok.encode(prompt, add_special_tokens=False) or []


def _render_delta(sub: Sub, out: RequestOutput) -> list[dict]:
    chunks = []
    if out.delta_text:
        chunks.append({"index": sub.index, "delta": {"content": out.delta_text}, "logprobs": None,
                       "finish_reason": None})
    if out.finished:
        chunks.append({"index": sub.index, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason})
    return chunks


@router.post("/v1/chat/completions", dependencies=[Depends(check_auth)],
             responses={**ok(ChatCompletion, stream=True), **errors(400, 401, 404, 413, 429, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(context)):
    eng = ctx.admit(body.model)
    check_request(ctx, body)
    ids, max_tokens = prepare(ctx, _prompt_ids(ctx, body), body.requested_max_tokens(), "messages")
    subs = [Sub(j, 0, len(ids), "") for j in range(body.n)]
    jobs = [(ids, sampling(body, max_tokens, body.num_logprobs(), j)) for j in range(body.n)]
    streams = await start(ctx, jobs, spec_options(body))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if body.stream:
        opening = [{"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for sub in subs]
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model}
        return event_stream(streams, subs, envelope, _render_delta, body.stream_options, opening)

    finals = await collect(streams, request)
    choices = [{"index": sub.index, "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(eng.tokenizer, out) if body.logprobs else None,
                "finish_reason": out.finish_reason} for sub, out in zip(subs, finals)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": ctx.served_model,
            "choices": choices, "usage": usage_of(subs, finals), "speculative": spec_summary(finals)}
