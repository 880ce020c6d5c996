"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (both with
server-sent-event streaming), /v1/models, /health, /metrics.

Every error is an OpenAI-style JSON object without a stack trace or a path; a bad request changes
nothing in the engine. A client that disconnects aborts its requests (their blocks are freed).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import ServerConfig
from specdec.core.scheduler import QueueFull
from specdec.request import RequestOutput, SpecOptions
from specdec.sampling_params import SamplingParams
from specdec.server.async_engine import AsyncEngine
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    AdminDraftRequest,
    ChatCompletionRequest,
    CompletionRequest,
)
from specdec.server.shadow import PREFIX as SHADOW_PREFIX
from specdec.server.shadow import ShadowAB

log = logging.getLogger("specdec.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


_DRAIN_FACTOR = 16  # an oversized body is drained up to this many times the limit


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes (declared or actually sent). The body is
    read here (bounded) and replayed to the app."""

    def __init__(self, app, limit: int, on_reject=None) -> None:
        self.app, self.limit, self.on_reject = app, limit, on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = declared is not None and (not declared.isdigit() or int(declared) > self.limit)
        chunks, size, more = [], 0, True
        while more and not too_large:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            too_large = size > self.limit
        if too_large:
            await self._drain(receive, more)
            if self.on_reject is not None:
                self.on_reject(413)
            response = JSONResponse(error_body(413, f"request body larger than {self.limit} bytes"), status_code=413)
            return await response(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive, more: bool) -> None:
        """Read and discard the rest of an oversized body (up to a cap), so that a client still
        writing it reads the 413 instead of a broken pipe; past the cap the connection just closes."""
        left = _DRAIN_FACTOR * self.limit
        while more and left > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            left -= len(msg.get("body", b""))
            more = msg.get("more_body", False)


@dataclass
class _Sub:
    """One engine request behind a response: which prompt and which of its n choices."""
    index: int
    prompt_index: int
    prompt_tokens: int
    prompt_text: str


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine)
    shadow = (ShadowAB(engine, config.shadow_fraction, metrics.registry, config.shadow_similarity)
              if config.shadow_fraction > 0 else None)

    def on_finished(out: RequestOutput) -> None:
        if not out.request_id.startswith(SHADOW_PREFIX):
            metrics.finished(out)
        if shadow is not None:
            shadow.finished(out)

    def on_aborted(request_id: str) -> None:
        metrics.requests.labels("abort").inc()
        if shadow is not None:
            shadow.aborted(request_id)

    engine.on_finished, engine.on_aborted = on_finished, on_aborted
    engine.on_added = shadow.select if shadow is not None else None
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, on_reject=metrics.rejected)
    served = config.served_model_name or model_name
    expected_auth = hashlib.sha256(f"Bearer {config.api_key}".encode()).digest()

    # ---- errors ------------------------------------------------------------------------------------
    def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        if status >= 400 and status != 503:
            metrics.rejected(status)
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON")
        msg = str(first.get("msg", "invalid request"))
        return _error(400, f"{'.'.join(loc) or 'body'}: {msg}", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    # ---- auth and readiness ------------------------------------------------------------------------
    async def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        given = hashlib.sha256(request.headers.get("authorization", "").encode()).digest()
        if not hmac.compare_digest(given, expected_auth):  # digests: equal length, so no length leak
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")

    def ready_engine():
        if engine.engine is None:
            raise APIError(503, "the models are still loading" if engine.error is None else "the engine failed to start")
        return engine.engine

    @app.get("/health")
    async def health():
        if engine.engine is None:
            status = "loading" if engine.error is None else "failed"
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        eng = ready_engine()
        card = {"id": served, "object": "model", "created": int(time.time()), "owned_by": "specdec",
                "max_model_len": eng.max_model_len, "precision": eng.precision,
                "speculative": {"default": eng.default_method, "router": eng.router is not None,
                                "proposers": {m: p.name for m, p in eng.proposers.items()}}}
        return {"object": "list", "data": [card]}

    # ---- admin: drafts ---------------------------------------------------------------------------
    async def check_admin(request: Request) -> None:
        if config.api_key is None:  # no key, no admin: these change what the server runs
            raise APIError(403, "admin endpoints are disabled: start the server with an API key")
        await check_auth(request)

    def drafts_report(eng) -> dict:
        return {"default": eng.default_method, "router": eng.router.snapshot() if eng.router else None,
                "drafts": [dataclasses.asdict(d) for d in eng.draft_status()]}

    @app.get("/admin/drafts", dependencies=[Depends(check_admin)])
    async def list_drafts():
        ready_engine()
        return await engine.call(drafts_report)

    @app.post("/admin/drafts", dependencies=[Depends(check_admin)])
    async def change_drafts(body: AdminDraftRequest):
        ready_engine()

        def act(eng):
            draft = eng.load_draft(body.model) if body.action == "load" else eng.unload_draft(body.model)
            return {"action": body.action, "id": draft, **drafts_report(eng)}
        try:
            result = await engine.call(act)
        except ValueError as e:
            raise APIError(400, str(e), "model") from None
        return JSONResponse(result, status_code=202 if body.action == "load" else 200)

    # ---- shared request handling -------------------------------------------------------------------
    def prepare(prompt: str | list[int], max_tokens: int | None, param: str) -> tuple[list[int], int]:
        eng = ready_engine()
        tok = eng.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", param)
            ids = tok.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < tok.vocab_size]
            if bad:
                raise APIError(400, f"token ids outside the vocabulary (0..{tok.vocab_size - 1}): {bad[:5]}", param)
        if not ids:
            raise APIError(400, "prompt is empty", param)
        room = eng.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"prompt has {len(ids)} tokens; the context holds {eng.max_model_len}", param)
        if max_tokens is None:
            max_tokens = room
        elif len(ids) + max_tokens > eng.max_model_len:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                f"({eng.max_model_len} tokens)", "max_tokens")
        return ids, max_tokens

    async def start(jobs: list[tuple[list[int], SamplingParams]], spec: SpecOptions | None
                    ) -> list[AsyncIterator[RequestOutput]]:
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for ids, params in jobs:
                streams.append(await engine.submit(ids, params, spec))
        except QueueFull as e:
            await _close_all(streams)
            raise APIError(429, str(e), code="queue_full") from None
        except ValueError as e:
            await _close_all(streams)
            raise APIError(400, str(e)) from None
        except BaseException:
            await _close_all(streams)
            raise
        return streams

    def sampling(body, max_tokens: int, logprobs: int | None, j: int) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, seed_offset=j)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def spec_options(body) -> SpecOptions | None:
        if body.speculative is None:
            return None
        try:
            return body.speculative.options()
        except ValueError as e:
            raise APIError(400, str(e), "speculative") from None

    def check_n(body) -> None:
        if body.n > config.max_n:
            raise APIError(400, f"n must be <= {config.max_n}", "n")

    # ---- /v1/completions ---------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(body: CompletionRequest, request: Request):
        ready_engine()
        check_n(body)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "prompt")
        if len(prompts) * body.n > 4 * config.max_n:
            raise APIError(400, f"at most {4 * config.max_n} choices (prompts x n) per request", "prompt")
        jobs, subs = [], []
        tok = engine.engine.tokenizer
        for i, p in enumerate(prompts):
            ids, max_tokens = prepare(p, body.max_tokens, "prompt")
            text = p if isinstance(p, str) else tok.decode(ids)
            for j in range(body.n):
                jobs.append((ids, sampling(body, max_tokens, body.logprobs, j)))
                subs.append(_Sub(i * body.n + j, i, len(ids), text))
        spec = spec_options(body)
        streams = await start(jobs, spec)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(sub: _Sub, out: RequestOutput, text: str, final: bool) -> dict:
            lp = _completion_logprobs(tok, out) if body.logprobs is not None and final else None
            return {"index": sub.index, "text": text, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None}

        if body.stream:
            echoed: set[int] = set()

            def render(sub: _Sub, out: RequestOutput) -> list[dict]:
                text = out.delta_text
                if body.echo and sub.index not in echoed:
                    echoed.add(sub.index)
                    text = sub.prompt_text + text
                return [choice(sub, out, text, False)] if text or out.finished else []

            envelope = {"id": rid, "object": "text_completion", "created": created, "model": served}
            return _event_stream(streams, subs, envelope, render, body.stream_options)

        finals = await _collect(streams, request)
        choices = [choice(sub, out, (sub.prompt_text if body.echo else "") + out.text, True)
                   for sub, out in zip(subs, finals)]
        return {"id": rid, "object": "text_completion", "created": created, "model": served,
                "choices": choices, "usage": _usage_of(subs, finals), "speculative": _spec_summary(finals)}

    # ---- /v1/chat/completions ----------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        eng = ready_engine()
        check_n(body)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception:  # a template that rejects this conversation (e.g. its role order)
            raise APIError(400, "the model's chat template rejected these messages", "messages") from None
        ids, max_tokens = prepare(eng.tokenizer.encode(prompt, add_special_tokens=False) or [],
                                  body.requested_max_tokens(), "messages")
        subs = [_Sub(j, 0, len(ids), "") for j in range(body.n)]
        jobs = [(ids, sampling(body, max_tokens, body.num_logprobs(), j)) for j in range(body.n)]
        streams = await start(jobs, spec_options(body))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tok = eng.tokenizer

        if body.stream:
            def render(sub: _Sub, out: RequestOutput) -> list[dict]:
                chunks = []
                if out.delta_text:
                    chunks.append({"index": sub.index, "delta": {"content": out.delta_text}, "logprobs": None,
                                   "finish_reason": None})
                if out.finished:
                    chunks.append({"index": sub.index, "delta": {}, "logprobs": None,
                                   "finish_reason": out.finish_reason})
                return chunks

            opening = [{"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for sub in subs]
            envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served}
            return _event_stream(streams, subs, envelope, render, body.stream_options, opening)

        finals = await _collect(streams, request)
        choices = [{"index": sub.index, "message": {"role": "assistant", "content": out.text},
                    "logprobs": _chat_logprobs(tok, out) if body.logprobs else None,
                    "finish_reason": out.finish_reason} for sub, out in zip(subs, finals)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": served,
                "choices": choices, "usage": _usage_of(subs, finals), "speculative": _spec_summary(finals)}

    return app


# ---- helpers -----------------------------------------------------------------------------------------
def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event_stream(streams: list, subs: list[_Sub], envelope: dict, render, stream_options,
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
                yield _sse({**envelope, "choices": [], "usage": _usage_of(subs, finals),
                            "speculative": _spec_summary(finals)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels us) or we are done
            await _close_all(streams)
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _close_all(streams: list) -> None:
    for s in streams:
        await s.aclose()


async def _merge(streams: list[AsyncIterator[RequestOutput]], subs: list[_Sub], last: dict[int, RequestOutput]):
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


async def _collect(streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
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
        await _close_all(streams)


def _usage_of(subs: list[_Sub], outs: list[RequestOutput]) -> dict:
    prompt = sum({s.prompt_index: s.prompt_tokens for s in subs}.values())  # once per prompt, whatever n
    completion = sum(len(o.token_ids) for o in outs)
    # extension fields: which proposer(s) drafted (none: plain decoding)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "proposer": outs[0].stats.proposer if outs else None, "proposers_used": _proposers_used(outs)}


def _proposers_used(outs: list[RequestOutput]) -> list[str]:
    return list(dict.fromkeys(name for o in outs for name in o.stats.proposers_used))


def _spec_summary(outs: list[RequestOutput]) -> dict:
    drafted = sum(o.stats.drafted_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    tokens = sum(o.stats.generated_tokens for o in outs) or 1
    mal = sum(o.stats.mean_accepted_length * o.stats.generated_tokens for o in outs) / tokens
    return {"proposer": outs[0].stats.proposer if outs else None, "method": outs[0].stats.method if outs else "none",
            "proposers_used": _proposers_used(outs),
            "domain": outs[0].stats.domain if outs else None,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "mean_accepted_length": mal}


def _completion_logprobs(tok, out: RequestOutput) -> dict | None:
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, lp in zip(out.token_ids, out.logprobs):
        piece = tok.decode([tid])
        tokens.append(piece)
        token_lps.append(lp.get(tid))
        tops.append({tok.decode([i]): v for i, v in sorted(lp.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok, out: RequestOutput) -> dict | None:
    if out.logprobs is None:
        return None
    content = []
    for tid, lp in zip(out.token_ids, out.logprobs):
        piece = tok.decode([tid])
        top = [{"token": tok.decode([i]), "logprob": v, "bytes": list(tok.decode([i]).encode())}
               for i, v in sorted(lp.items(), key=lambda kv: -kv[1])]
        content.append({"token": piece, "logprob": lp.get(tid), "bytes": list(piece.encode()), "top_logprobs": top})
    return {"content": content}
