"""Request gates and bookkeeping: the request id and access log (outermost ASGI middleware), the
body-size limit (ASGI middleware) and the API-key checks (FastAPI dependencies for the routes that
need them)."""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from specdec.server.context import context
from specdec.server.errors import APIError, error_body

_DRAIN_FACTOR = 16  # an oversized body is drained up to this many times the limit
# JSON levels a body may nest: a bound of its own, since the parser's depends on the stack under it
# (one process and an engine replica would refuse different depths); deep schemas still fit
MAX_NESTING = 256
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
# a client's x-request-id is echoed only when it is short printable ASCII (it lands in logs and headers)
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")
access_log = logging.getLogger("specdec.access")


@dataclass
class AccessRecord:
    """What the access-log line says about one request; the routes fill in the token counts."""
    request_id: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    api_key_id: str | None = None      # the id of the key the request came with (a digest prefix)


def request_id_of(headers: dict[bytes, bytes]) -> str:
    """The client's x-request-id when it is acceptable, else a fresh one."""
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    return given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex


def access_record(request: Request) -> AccessRecord:
    """The request's record (a detached one when the app runs without RequestLog)."""
    record = request.scope.get("state", {}).get("access")
    return record if record is not None else AccessRecord(uuid.uuid4().hex)


class RequestLog:
    """ASGI middleware, outermost: every answer carries `x-request-id` (the client's, or a new one),
    and each request ends with one INFO line on `specdec.access`: id, method and route, status,
    prompt / completion tokens when known, seconds. A stream is logged when it ends. The fields are
    also on the log record (`extra`), for handlers that format their own lines."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord(request_id_of(dict(scope.get("headers") or [])))
        scope.setdefault("state", {})["access"] = record
        header = (b"x-request-id", record.request_id.encode())
        status, started = 500, time.perf_counter()   # 500: the app raised before answering

        async def send_with_id(msg) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), header]}
            await send(msg)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _log_access(scope, record, status, time.perf_counter() - started)


def _log_access(scope, record: AccessRecord, status: int, seconds: float) -> None:
    route = getattr(scope.get("route"), "path", None) or scope.get("path", "")  # the template: few distinct values
    tokens = "" if record.prompt_tokens is None else \
        f" prompt_tokens={record.prompt_tokens} completion_tokens={record.completion_tokens}"
    key = "" if record.api_key_id is None else f" key={record.api_key_id}"
    access_log.info("%s \"%s %s\" %d%s%s %.3fs", record.request_id, scope.get("method"), route, status, tokens, key,
                    seconds, extra={"request_id": record.request_id, "method": scope.get("method"), "route": route,
                                    "status": status, "prompt_tokens": record.prompt_tokens,
                                    "completion_tokens": record.completion_tokens, "api_key_id": record.api_key_id,
                                    "seconds": seconds})


def nests_deeper(body: bytes, levels: int) -> bool:
    """Whether the brackets of `body`, outside its JSON strings, nest deeper than `levels`."""
    if body.count(b"[") + body.count(b"{") <= levels:
        return False  # the usual body: decided at C speed
    depth = 0
    for bracket in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        depth += 1 if bracket in b"[{" else -1
        if depth > levels:
            return True
    return False


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes (declared or actually sent), 400 for one
    nesting deeper than MAX_NESTING. The body is read here (bounded) and replayed to the app."""

    def __init__(self, app, limit: int, on_reject: Callable[[int], None] | None = None) -> None:
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
            return await self._refuse(413, f"request body larger than {self.limit} bytes", scope, receive, send)
        body, replayed = b"".join(chunks), False
        if nests_deeper(body, MAX_NESTING):
            return await self._refuse(400, f"request body nests deeper than {MAX_NESTING} levels", scope, receive, send)

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, status: int, message: str, scope, receive, send) -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        await JSONResponse(error_body(status, message), status_code=status)(scope, receive, send)

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


async def check_auth(request: Request) -> None:
    """With API keys configured, require `Authorization: Bearer KEY` with one of them (401
    otherwise); the request's access record names the key by its id."""
    ctx = context(request)
    if not ctx.key_ids:
        return
    given = _header_digest(request)
    matched = None
    for digest, key_id in ctx.key_ids.items():   # every key compared: the time says nothing of which matched
        if hmac.compare_digest(given, digest):   # digests: equal length, so no length leak
            matched = key_id
    if matched is None:
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
    access_record(request).api_key_id = matched


def _header_digest(request: Request) -> bytes:
    """sha256 of the Authorization header, compared with the configured keys' (ServerContext)."""
    return hashlib.sha256(request.headers.get("authorization", "").encode()).digest()


async def check_metrics_auth(request: Request) -> None:
    """/metrics is open unless server.metrics_require_key asks for the API key there too."""
    if context(request).config.metrics_require_key:
        await check_auth(request)


async def check_admin(request: Request) -> None:
    """Admin routes change what the server runs: they take the operator's key (server.api_key) only,
    and without one they are off (403)."""
    ctx = context(request)
    if ctx.admin_auth is None:
        raise APIError(403, "admin endpoints are disabled: start the server with an API key (server.api_key)")
    if not hmac.compare_digest(_header_digest(request), ctx.admin_auth):
        raise APIError(401, "invalid or missing admin API key (Authorization: Bearer ...)", code="invalid_api_key")
