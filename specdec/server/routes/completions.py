"""POST /v1/completions: one or more prompts, n choices each, streamed (server-sent events) or not."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from specdec.request import RequestOutput
from specdec.sampling_params import StructuredOutput
from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.middleware import access_record, check_auth
from specdec.server.openapi import Completion, errors, ok
from specdec.server.protocol import CompletionRequest
from specdec.server.render import Sub, completion_logprobs, spec_summary, usage_of
from specdec.server.streaming import collect, event_stream, record_usage
from specdec.server.submit import (Job, check_request, prepare, request_seed, requested_structure, sampling, spec_options,
                                   start)

router = APIRouter()


def _jobs(ctx: ServerContext, body: CompletionRequest, structured: StructuredOutput | None, salt: str | None
          ) -> tuple[list[Job], list[Sub]]:
    """Every (prompt, choice) pair as an engine job, in choice-index order."""
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", "prompt")
    if len(prompts) * body.n > 4 * ctx.config.max_n:
        raise APIError(400, f"at most {4 * ctx.config.max_n} choices (prompts x n) per request", "prompt")
    jobs, subs = [], []
    tok = ctx.ready_engine().tokenizer
    seed = request_seed(ctx, body)
    for i, p in enumerate(prompts):
        ids, max_tokens = prepare(ctx, p, body.max_tokens, "prompt")
        text = p if isinstance(p, str) else tok.decode(ids)
        for j in range(body.n):
            jobs.append((ids, sampling(body, max_tokens, body.logprobs, j, seed, structured, salt)))
            subs.append(Sub(i * body.n + j, i, len(ids), text))
    return jobs, subs


@router.post("/v1/completions", dependencies=[Depends(check_auth)],
             responses={**ok(Completion, stream=True), **errors(400, 401, 404, 413, 429, 503)})
async def completions(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(context)):
    ctx.admit(body.model)
    check_request(ctx, body)
    record = access_record(request)
    salt = ctx.cache_salt(record.api_key_id, body.cache_salt)
    jobs, subs = _jobs(ctx, body, await requested_structure(ctx, body), salt)
    streams = await start(ctx, jobs, spec_options(body))
    rid, created = f"cmpl-{record.request_id}", int(time.time())  # vLLM's: the x-request-id in the id
    tok = ctx.ready_engine().tokenizer

    def choice(sub: Sub, out: RequestOutput, text: str, final: bool) -> dict:
        lp = completion_logprobs(tok, out) if body.logprobs is not None and final else None
        return {"index": sub.index, "text": text, "logprobs": lp,
                "finish_reason": out.finish_reason if out.finished else None}

    if body.stream:
        echoed: set[int] = set()

        def render(sub: Sub, out: RequestOutput) -> list[dict]:
            text = out.delta_text
            if body.echo and sub.index not in echoed:
                echoed.add(sub.index)
                text = sub.prompt_text + text
            return [choice(sub, out, text, False)] if text or out.finished else []

        envelope = {"id": rid, "object": "text_completion", "created": created, "model": ctx.served_model}
        return event_stream(streams, subs, envelope, render, body.stream_options, record=record)

    finals = await collect(streams, request)
    record_usage(record, subs, finals)
    choices = [choice(sub, out, (sub.prompt_text if body.echo else "") + out.text, True)
               for sub, out in zip(subs, finals)]
    return {"id": rid, "object": "text_completion", "created": created, "model": ctx.served_model,
            "choices": choices, "usage": usage_of(subs, finals), "speculative": spec_summary(finals)}
